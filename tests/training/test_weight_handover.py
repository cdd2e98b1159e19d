"""The colocated hand-over: a rank's buckets shared and copied out by the engine's stream, on CPU
(the tensor itself) and, where a GPU is visible, by CUDA IPC between processes, up to a trained
policy loaded into an engine on the same GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Listener
from pathlib import Path

import pytest
import torch

from rlvr.models.tiny import build_tiny_model
from rlvr.training.batch import build_batch
from rlvr.training.policy_trainer import PolicyTrainer
from rlvr.training.weight_sync import (
    SharedBucketReceiver,
    SharedBuffer,
    TensorSpec,
    pack,
    plan_buckets,
    share_buffer,
)

CPU = torch.device("cpu")
WEIGHTS = {
    "embed": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "norm": torch.ones(4),
    "head": torch.arange(8, dtype=torch.float32).reshape(2, 4) / 7,
}


def _specs() -> list[TensorSpec]:
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in WEIGHTS.items()]


class Rank:
    """What a PolicyActor does for its engine: pack the stream's next bucket into one reused
    buffer and share it."""

    def __init__(self, device: torch.device) -> None:
        self.stream = iter((n, t.to(device)) for n, t in WEIGHTS.items())
        self.device = device
        self.fetches = 0

    def share(self, bucket) -> SharedBuffer:
        self.fetches += 1
        self.buffer = pack(bucket, self.stream, self.device)
        return share_buffer(self.buffer)


def test_engine_copies_each_bucket_out_before_the_rank_reuses_its_memory():
    buckets = plan_buckets(_specs(), torch.float32, 48)  # embed alone (oversize), norm + head
    assert len(buckets) == 2
    rank = Rank(CPU)
    with SharedBucketReceiver(buckets, rank.share, CPU) as received:
        assert received.names == list(WEIGHTS)
        got = dict(received)
    rank.buffer.fill_(-1.0)  # the rank's memory changes after hand-over; the engine's copy not
    for name, tensor in WEIGHTS.items():
        assert torch.equal(got[name], tensor)


def test_leaving_early_still_fetches_every_bucket():
    """Under ZeRO-3 every rank's export joins collective gathers, so a failed load still runs
    its rank's stream to the end."""
    buckets = plan_buckets(_specs(), torch.float32, 16)
    rank = Rank(CPU)
    with (
        pytest.raises(RuntimeError, match="loader failed"),
        SharedBucketReceiver(buckets, rank.share, CPU) as received,
    ):
        next(iter(received))
        raise RuntimeError("loader failed")
    assert rank.fetches == len(buckets) == 3


def test_a_bucket_that_does_not_match_the_plan_is_refused():
    buckets = plan_buckets(_specs(), torch.float32, 1 << 20)
    wrong = SharedBuffer(tensor=torch.zeros(3))
    with pytest.raises(ValueError, match="does not match the plan"):
        list(SharedBucketReceiver(buckets, lambda bucket: wrong, CPU))


SEQUENCES = [[1, 5, 9, 11, 12, 13], [2, 6, 14], [3, 7, 8, 15, 16, 17, 18]]
POSITIONS = [[3, 4, 5], [2], [4, 5, 6]]
LOGPROB_ATOL = 1e-4
"""fp32 on one GPU with TF32 off (torch's default for matmuls): the DeepSpeed module and the
engine's model run the same weights through kernels picked for different batch shapes, which
moves log-probs by about 1e-6; a weight that did not arrive moves them by far more (asserted)."""


@pytest.mark.gpu
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_an_engine_on_the_same_gpu_loads_the_trained_policy_by_cuda_ipc(tmp_path, zero_stage):
    """The colocated sync end to end: a rank trained on the GPU hands its export over bucket by
    bucket to an engine process on the same GPU, which then scores as the policy does."""
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    trainer = PolicyTrainer(model_dir, zero_stage=zero_stage, lr=5e-3, micro_batch_size=2, seed=0)
    assert trainer.device.type == "cuda"
    batch = build_batch([[1, 2, 3], [4, 5]], [[11, 12, 13], [14, 15]], pad_id=0)
    batch.advantages = torch.tensor([1.0, -1.0])
    for _ in range(2):
        trainer.train_step(batch)
    # buckets far smaller than the model: many hand-overs, each reusing the rank's buffer
    buckets = plan_buckets(trainer.export_manifest(), torch.float32, 64 << 10)
    assert len(buckets) > 4
    authkey = os.urandom(16)
    worker = Path(__file__).with_name("colocated_engine_worker.py")
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        host, port = listener.address
        engine = subprocess.Popen([sys.executable, str(worker), host, str(port), authkey.hex()])
        with listener.accept() as conn:
            conn.send((str(model_dir), buckets, SEQUENCES, POSITIONS))
            stream = trainer.iter_export_weights()
            handed = 0
            while (message := conn.recv()) == "next":
                shared = pack(buckets[handed], stream, trainer.device)  # alive until the next ask
                conn.send(share_buffer(shared))
                handed += 1
    assert engine.wait(timeout=60) == 0 and handed == len(buckets)
    before, after = message
    want = trainer.sequence_logprobs(SEQUENCES, POSITIONS)
    for got, policy in zip(after, want, strict=True):
        assert got == pytest.approx(policy, abs=LOGPROB_ATOL)
    moved = [
        abs(a - b)
        for new, old in zip(after, before, strict=True)
        for a, b in zip(new, old, strict=True)
    ]
    assert max(moved) > 100 * LOGPROB_ATOL
