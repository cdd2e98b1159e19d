"""PolicyGroup: N data-parallel PolicyActor ranks behind the one call surface the step code uses.

Every call goes to every rank (DeepSpeed's collectives need them all) and the answer is rank 0's.
A training batch is split so that the N ranks take exactly the 1-rank update
(`rlvr.training.data_parallel`); teacher-forced scoring is split in equal shares and merged back
in order. The rendezvous (rank 0's listening address and a port free there) is fixed before any
rank starts DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlvr.training.batch import TrainBatch
from rlvr.training.data_parallel import shard_batch, shard_sequences
from rlvr.training.rendezvous import free_port
from workflows.workers import FanOut, Worker


class PolicyGroup:
    """The policy's ranks, rank 0 first; `call` / `get` / `run` as on a single `Worker`."""

    name = "PolicyActor"

    def __init__(self, workers: Sequence[Worker], mini_batches: int = 1):
        if not workers:
            raise ValueError("a PolicyGroup needs at least one rank")
        if len({w.name for w in workers}) != len(workers):
            raise ValueError(f"rank names must differ: {[w.name for w in workers]}")
        self.workers = list(workers)
        self.mini_batches = mini_batches

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def call(self, method: str, *args: Any, **kwargs: Any) -> FanOut:
        if self.world_size > 1 and method == "train_step":
            return self._train_step(*args, **kwargs)
        if self.world_size > 1 and method == "score_logprobs":
            return self._score_logprobs(*args, **kwargs)
        return FanOut([(w, w.call(method, *args, **kwargs)) for w in self.workers])

    def get(self, pending: FanOut, step: int | None = None) -> Any:
        """Every rank's answer merged; a crashed rank raises under its Worker's name, so the
        names must differ ("PolicyActor 0", "PolicyActor 1", ...)."""
        return pending.result(step)

    def run(self, method: str, *args: Any, step: int | None = None, **kwargs: Any) -> Any:
        return self.get(self.call(method, *args, **kwargs), step=step)

    # --- typed calls ----------------------------------------------------------------------------
    def ready(self) -> bool:
        """Wait until every rank has loaded the model (a bad model fails here, named)."""
        return self.run("ready")

    def train_step(
        self, batch: TrainBatch, logprob_sums: bool = False, step: int | None = None
    ) -> dict[str, Any]:
        """One rollout batch's update (`training.mini_batches` optimizer steps) on every rank."""
        return self.run("train_step", batch, logprob_sums=logprob_sums, step=step)

    def score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> FanOut:
        """Teacher-forced log-probs at `positions` under the current policy (in flight)."""
        return self.call("score_logprobs", sequences, positions)

    def save_state(self, path: str, step: int | None = None) -> None:
        """Weights, optimizer and scheduler, every rank's ZeRO shard."""
        self.run("save_state", path, step=step)

    def load_state(self, path: str) -> None:
        """Load a `save_state` checkpoint (written by any number of ranks)."""
        self.run("load_state", path)

    def save_model(self, path: str) -> None:
        """The trained policy as a Hugging Face model directory (LoRA merged)."""
        self.run("save_model", path)

    def _train_step(self, batch: TrainBatch, logprob_sums: bool = False) -> FanOut:
        """Each rank trains on its share; metrics are global (all-reduced in the trainer), and
        DUET's per-row sums come back in the batch's row order."""
        shards, rows = shard_batch(batch, self.world_size, self.mini_batches)
        futures = [
            w.call("train_step", shard, logprob_sums=logprob_sums)
            for w, shard in zip(self.workers, shards, strict=True)
        ]

        def merge(answers: list[dict[str, Any]]) -> dict[str, Any]:
            out = dict(answers[0])
            if logprob_sums:
                sums = [0.0] * len(batch)
                for rank_rows, answer in zip(rows, answers, strict=True):
                    for row, value in zip(rank_rows, answer["logprob_sums"], strict=True):
                        if row is not None:
                            sums[row] = value
                out["logprob_sums"] = sums
            return out

        return FanOut(list(zip(self.workers, futures, strict=True)), merge)

    def _score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> FanOut:
        """Equal shares of the sequences (fillers: the shortest, scoring nothing), merged back."""
        shortest = min(range(len(sequences)), key=lambda i: len(sequences[i]), default=0)
        shares = shard_sequences(len(sequences), self.world_size)
        futures = []
        for worker, share in zip(self.workers, shares, strict=True):
            seqs = [sequences[shortest if i is None else i] for i in share]
            pos = [[] if i is None else positions[i] for i in share]
            futures.append(worker.call("score_logprobs", seqs, pos))

        def merge(answers: list[list[list[float]]]) -> list[list[float]]:
            out: list[list[float]] = [[] for _ in sequences]
            for share, answer in zip(shares, answers, strict=True):
                for i, values in zip(share, answer, strict=True):
                    if i is not None:
                        out[i] = values
            return out

        return FanOut(list(zip(self.workers, futures, strict=True)), merge)


@ray.remote(num_cpus=0)
def _free_port(address: str) -> int:
    """A port free on ``address`` of the node this runs on, for rank 0's process group."""
    return free_port(address)


def rank_environments(
    world_size: int, address: str, pg: PlacementGroup | None = None, bundle: int = 0
) -> list[dict[str, str] | None]:
    """Per rank, the distributed environment its PolicyActor sets before DeepSpeed starts; one
    rank needs none (it starts a one-process group). Rank 0 serves the rendezvous on ``address``
    (its listening address: `rlvr.training.rendezvous.run_addresses`) from bundle ``bundle``'s
    node, where it runs."""
    if world_size == 1:
        return [None]
    strategy = (
        PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        if pg is not None
        else None
    )
    port = ray.get(_free_port.options(scheduling_strategy=strategy).remote(address))
    return [
        {
            "MASTER_ADDR": address,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            # Ray gives each GPU actor only its own device, which it sees as device 0.
            "LOCAL_RANK": "0",
        }
        for rank in range(world_size)
    ]
