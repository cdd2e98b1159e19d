"""The weight broadcast's pure part: bucket plans, packing, a gloo group of threads, and the
trainer's streamed export against its manifest."""

from __future__ import annotations

import threading

import pytest
import torch

from rlvr.models.tiny import build_tiny_model
from rlvr.training import weight_sync
from rlvr.training.policy_trainer import PolicyTrainer
from rlvr.training.settings import LoraSettings
from rlvr.training.weight_sync import Bucket, TensorSpec, pack, plan_buckets, unpack

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")


def spec(name: str, *shape: int, dtype: torch.dtype = F32) -> TensorSpec:
    return TensorSpec(name, shape, dtype)


def names(buckets: list[Bucket]) -> list[list[str]]:
    return [[s.name for s in b.specs] for b in buckets]


def test_plan_of_nothing_is_empty():
    assert plan_buckets([], F32, 64) == []


def test_exact_fits_share_a_bucket_and_the_next_weight_starts_one():
    specs = [spec("a", 4), spec("b", 2, 6), spec("c", 1), spec("d", 16)]  # 16 + 48 + 4 + 64 bytes
    buckets = plan_buckets(specs, F32, 64)
    assert names(buckets) == [["a", "b"], ["c"], ["d"]]
    assert [b.nbytes for b in buckets] == [64, 4, 64]
    assert buckets[0].offsets == [0, 4]


def test_a_weight_larger_than_a_bucket_travels_alone():
    specs = [spec("small", 3), spec("huge", 10, 10), spec("after", 2)]
    buckets = plan_buckets(specs, F32, 32)
    assert names(buckets) == [["small"], ["huge"], ["after"]]
    assert buckets[1].nbytes == 400


def test_buckets_are_sized_in_the_target_dtype():
    specs = [spec(f"w{i}", 8) for i in range(4)]  # 32 bytes each in fp32, 16 in bf16
    assert names(plan_buckets(specs, F32, 64)) == [["w0", "w1"], ["w2", "w3"]]
    bf16 = plan_buckets(specs, BF16, 64)
    assert names(bf16) == [["w0", "w1", "w2", "w3"]]
    assert bf16[0].dtype == BF16 and bf16[0].nbytes == 64
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, F32, 0)


def test_pack_unpack_round_trip_casts_and_checks_the_stream():
    tensors = {"a": torch.randn(2, 3), "b": torch.randn(5), "c": torch.randn(1, 1, 4)}
    specs = [spec(n, *t.shape) for n, t in tensors.items()]
    (bucket,) = plan_buckets(specs, BF16, 1024)
    stream = iter(tensors.items())
    buffer = pack(bucket, stream, CPU)
    assert buffer.shape == (15,) and buffer.dtype == BF16
    assert next(stream, None) is None
    for (name, got), (want_name, want) in zip(unpack(bucket, buffer), tensors.items(), strict=True):
        assert name == want_name
        assert torch.equal(got, want.to(BF16))
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()

    with pytest.raises(ValueError, match="expected TensorSpec\\(name='a'"):
        pack(bucket, iter([("b", tensors["b"])]), CPU)
    with pytest.raises(ValueError, match="got a \\(3, 2\\)"):
        pack(bucket, iter([("a", torch.zeros(3, 2))]), CPU)
    with pytest.raises(ValueError, match="got nothing"):
        pack(bucket, iter(list(tensors.items())[:2]), CPU)


def _gloo_group(world_size: int, target) -> list:
    """Run ``target(rank, group)`` on ``world_size`` threads joined in one weight group."""
    store = weight_sync.serve_store("127.0.0.1", world_size, timeout_s=30)
    results: list = [None] * world_size

    def run(rank: int) -> None:
        try:
            joined = store
            if rank > 0:
                joined = weight_sync.join_store("127.0.0.1", store.port, world_size, 30)
            results[rank] = target(rank, weight_sync.open_group(rank, world_size, CPU, joined))
        except Exception as err:  # noqa: BLE001 - reported to the test thread
            results[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_broadcast_reaches_every_engine_even_one_that_stops_reading():
    gen = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(i + 1, 7, generator=gen) for i in range(6)}
    tensors["embed"] = torch.randn(40, 16, generator=gen)
    buckets = plan_buckets([spec(n, *t.shape) for n, t in tensors.items()], BF16, 128)
    assert len(buckets) > 3 and max(b.nbytes for b in buckets) > 128

    def member(rank: int, group) -> object:
        if rank == 0:
            return weight_sync.send_weights(group, buckets, tensors.items(), CPU)
        with weight_sync.BucketReceiver(group, buckets, CPU) as received:
            assert received.names == list(tensors)
            got = {}
            for name, tensor in received:
                got[name] = tensor.clone()
                if rank == 2 and len(got) == 2:
                    break  # a failed load: leaving the block still takes part in every broadcast
        return got

    sent, full, partial = _gloo_group(3, member)
    assert sent.bytes == sum(b.nbytes for b in buckets) and sent.buckets == len(buckets)
    assert list(full) == list(tensors)
    assert all(torch.equal(full[n], t.to(BF16)) for n, t in tensors.items())
    assert list(partial) == ["w0", "w1"]


def test_members_on_different_backends_all_refuse():
    store = weight_sync.serve_store("127.0.0.1", 2, timeout_s=30)
    errors: list = []

    def engine() -> None:
        joined = weight_sync.join_store("127.0.0.1", store.port, 2, 30)
        try:
            weight_sync.open_group(1, 2, torch.device("cuda"), joined)
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=engine)
    thread.start()
    with pytest.raises(RuntimeError, match="disagree on the backend \\(gloo, nccl"):
        weight_sync.open_group(0, 2, CPU, store)
    thread.join(timeout=60)
    assert len(errors) == 1 and "disagree" in str(errors[0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.parametrize(
    ("zero_stage", "lora"),
    [(0, None), (3, LoraSettings(r=4, alpha=8))],
    ids=["full-zero0", "lora-zero3"],
)
def test_streamed_export_follows_the_manifest(model_dir, zero_stage, lora):
    trainer = PolicyTrainer(model_dir, zero_stage=zero_stage, lora=lora, micro_batch_size=2)
    manifest = trainer.export_manifest()
    streamed = [(n, tuple(t.shape), t.dtype) for n, t in trainer.iter_export_weights()]
    assert streamed == [(s.name, s.shape, s.dtype) for s in manifest]
    assert list(trainer.export_weights()) == [s.name for s in manifest]
