"""PolicyActor: owns the DeepSpeed-wrapped policy (`rlvr.training.PolicyTrainer`).

A thin shell: it sets the process's threads and its rank's distributed environment, builds the
trainer once and forwards calls. A run with `resources.policy_ranks: N` starts N of them in its
placement group (`workflows.policy_group`), gloo between them on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
import torch

from rlvr.memory import pin_mmap_threshold, release_free_heap
from rlvr.training import weight_sync
from rlvr.training.batch import TrainBatch
from rlvr.training.rendezvous import LAUNCHER_VARIABLES, bind_collectives
from rlvr.training.settings import TrainerSettings


class PolicyActor:
    def __init__(
        self,
        model_path: str,
        threads: int,
        settings: TrainerSettings | None = None,
        distributed: dict[str, str] | None = None,
        address: str | None = None,
        mmap_threshold_kib: int = 0,
        **overrides: Any,
    ):
        """`distributed`: this rank's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK,
        set before DeepSpeed starts (None: a one-process group). `address`: where this rank's
        gloo / NCCL groups and, on rank 0, the weight sync's store listen (None: the groups
        choose, the store takes the node's IP). `mmap_threshold_kib`: see `pin_mmap_threshold`
        (0: glibc's default). `overrides`: fields of `settings` (`TrainerSettings`)."""
        if mmap_threshold_kib:
            pin_mmap_threshold(mmap_threshold_kib << 10)
        torch.set_num_threads(threads)
        # A worker inherits the environment of whatever started Ray: a process that trained
        # in-process as rank 0 of 1 left its store's MASTER_PORT there, which is not this rank's.
        for key in LAUNCHER_VARIABLES:
            os.environ.pop(key, None)
        os.environ.update(distributed or {})
        if address is not None:
            bind_collectives(address)
        self.address = address
        from rlvr.training.policy_trainer import PolicyTrainer

        self.trainer = PolicyTrainer(model_path, settings, **overrides)

    def ready(self) -> bool:
        return True

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        logprobs = self.trainer.logprobs(batch)
        release_free_heap()
        return logprobs

    def score_logprobs(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float]]:
        return self.trainer.sequence_logprobs(sequences, positions)

    def train_step(self, batch: TrainBatch, logprob_sums: bool = False) -> dict[str, Any]:
        """One PPO update of the batch (`PolicyTrainer.train_step`)."""
        stats = self.trainer.train_step(batch, logprob_sums=logprob_sums)
        # Activations and logits are free now; the rank idles while the engines sample.
        release_free_heap()
        return stats

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The merged weights from rank 0; every rank joins the ZeRO-3 gathers and the others
        return nothing, so the object store holds one copy."""
        weights = self.trainer.export_weights()
        return weights if self.trainer.rank == 0 else {}

    def save_state(self, directory: str) -> None:
        self.trainer.save_state(directory)

    def load_state(self, directory: str) -> None:
        self.trainer.load_state(directory)

    def save_model(self, directory: str) -> str:
        """HF-format checkpoint (merged weights, plus the PEFT adapter when LoRA is on)."""
        self.trainer.save_checkpoint(directory)
        return str(Path(directory))

    def save_adapter(self, directory: str) -> str:
        """The PEFT LoRA adapter alone (live updates publish it)."""
        self.trainer.save_adapter(directory)
        return str(Path(directory))

    def weight_sync_address(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Policy rank 0: serve the weight group's rendezvous on this rank's address; returns the
        (address, port) the engines join (`rlvr.training.weight_sync`)."""
        if self.trainer.rank != 0:
            raise RuntimeError(f"policy rank 0 sends the weights, not rank {self.trainer.rank}")
        host = self.address or ray.util.get_node_ip_address()
        self._weight_store = weight_sync.serve_store(host, world_size, timeout_s)
        return host, self._weight_store.port

    def open_weight_group(self, world_size: int) -> None:
        """Policy rank 0 joins the weight group as its rank 0 (after `weight_sync_address`);
        returns once every engine has joined."""
        self._weight_group = weight_sync.open_group(
            weight_sync.ROOT, world_size, self.trainer.device, self._weight_store
        )

    def weight_manifest(self) -> list[weight_sync.TensorSpec]:
        return self.trainer.export_manifest()

    def broadcast_weights(self, buckets: list[weight_sync.Bucket]) -> dict[str, float]:
        """Stream the merged weights into ``buckets`` and broadcast each to the engines.

        Every rank calls it: under ZeRO-3 all of them join each parameter's gather, and only rank
        0 sends. Returns rank 0's `weight_sync.SendStats` (the other ranks: {}). A failed send
        drops the group, so engines still waiting on it see the connection close.
        """
        weights = self.trainer.iter_export_weights()
        if self.trainer.rank != 0:
            for _ in weights:
                pass
            return {}
        try:
            stats = weight_sync.send_weights(
                self._weight_group, buckets, weights, self.trainer.device
            )
        except BaseException:
            self.close_weight_group()
            raise
        release_free_heap()  # the packed buckets
        return dict(vars(stats))

    def close_weight_group(self) -> None:
        self._weight_group = self._weight_store = None

    def start_share(self) -> None:
        """Open this rank's export stream for its colocated engine's `share_bucket` calls."""
        self._share_stream = iter(self.trainer.iter_export_weights())
        self._shared: torch.Tensor | None = None

    def share_bucket(self, bucket: weight_sync.Bucket) -> weight_sync.SharedBuffer:
        """Pack the stream's next ``bucket`` on this rank's device and share it with the engine
        beside it (`weight_sync.SharedBucketReceiver`); the previous bucket's memory is released,
        the engine having copied it out before asking for this one."""
        self._shared = None
        self._shared = weight_sync.pack(bucket, self._share_stream, self.trainer.device)
        return weight_sync.share_buffer(self._shared)

    def end_share(self) -> None:
        """Close the stream; every weight must have been shared."""
        extra = next(self._share_stream, None)
        self._share_stream = iter(())
        self._shared = None
        if extra is not None:
            raise ValueError(f"weight stream longer than the plan: {extra[0]} was not shared")
