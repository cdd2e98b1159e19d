"""The colocated hand-over's pure part: a rank's buckets shared and copied out by the engine's
stream, on CPU (the tensor itself) and, where a GPU is visible, by CUDA IPC between processes."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rlvr.training.weight_sync import (
    SharedBucketReceiver,
    SharedBuffer,
    TensorSpec,
    open_shared,
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


def _open_in_child(shared: SharedBuffer, queue) -> None:
    tensor = open_shared(shared, torch.device("cuda", 0))
    queue.put(tensor.cpu().tolist())


@pytest.mark.gpu
def test_cuda_ipc_hands_a_bucket_to_another_process_on_the_same_device():
    buffer = torch.arange(1024, dtype=torch.float32, device="cuda") / 3
    shared = share_buffer(buffer)
    assert shared.tensor is None and shared.device_uuid
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(shared, queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert torch.equal(torch.tensor(got), buffer.cpu())
