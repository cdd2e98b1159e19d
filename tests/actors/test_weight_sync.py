"""Weight sync over real actors: a trained PolicyActor and two vLLM GeneratorActors on the tiny model.

The collective broadcast (buckets smaller than the largest tensor, 1 rank and 2 ZeRO-3 LoRA ranks),
the colocated hand-over (each of 2 ranks to its own engine) and the object store leave the engines
in the same state, the policy's; a dead engine is named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import ray
import torch

from actors.generator import GeneratorActor
from actors.policy import PolicyActor
from rlvr.config import load_config
from rlvr.models.tiny import build_tiny_model
from rlvr.training.batch import build_batch
from rlvr.training.rendezvous import LOOPBACK
from rlvr.training.settings import LoraSettings
from workflows.policy_group import PolicyGroup, rank_environments
from workflows.weight_sync import CollectiveSync, ColocatedSync, ObjectStoreSync, make_weight_sync
from workflows.workers import ActorFailure, Worker

pytestmark = pytest.mark.ray

ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "kv_cache_gib": 0.25}
BUCKET_MB = 0.25
"""Below the 1 MiB embedding, which travels in an oversize bucket of its own."""
BUCKET_BYTES = int(BUCKET_MB * 2**20)
TIMEOUT_S = 60.0
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15], [200, 300, 400, 500, 600, 700]]
POSITIONS = [list(range(1, len(s))) for s in SEQUENCES]
# Engine (vLLM's CPU kernels, fused q/k/v and gate/up GEMMs) and trainer (transformers) compute
# the same fp32 log-probs with differently ordered sums: they agree to ~1e-5 over two layers.
# One training step moves them by far more than the tolerance (checked before every sync).
ATOL = 1e-4


@dataclass
class Members:
    """Stand-in for a PolicyGroup / GeneratorPool: what the syncs use of them."""

    workers: list[Worker]
    weight_version: int = 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engines(ray_cluster, model_dir):
    actor = ray.remote(GeneratorActor).options(num_cpus=0.1)
    handles = [
        actor.remote("vllm", str(model_dir), threads=1, address=LOOPBACK, **ENGINE)
        for _ in range(2)
    ]
    pool = Members([Worker(h, f"GeneratorActor {i}") for i, h in enumerate(handles)])
    for worker in pool.workers:
        worker.run("ready")
    yield pool
    for h in handles:
        ray.kill(h, no_restart=True)


def _policy(model_dir, ranks: int, **overrides) -> tuple[PolicyGroup, list]:
    kwargs = {"zero_stage": 0, "lr": 5e-3, "micro_batch_size": 2, "seed": 0, **overrides}
    actor = ray.remote(PolicyActor).options(num_cpus=0.1)
    handles = [
        actor.remote(str(model_dir), threads=1, distributed=env, address=LOOPBACK, **kwargs)
        for env in rank_environments(ranks, LOOPBACK)
    ]
    group = PolicyGroup([Worker(h, f"PolicyActor {r}") for r, h in enumerate(handles)])
    group.run("ready")
    return group, handles


@pytest.fixture(scope="module")
def policy(ray_cluster, model_dir):
    group, handles = _policy(model_dir, 1)
    yield group
    for h in handles:
        ray.kill(h, no_restart=True)


def _train(policy: PolicyGroup) -> None:
    batch = build_batch([[3, 4, 5], [6, 7], [8, 9, 10]], [[11, 12], [13, 14, 15], [16]], pad_id=0)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5])
    policy.run("train_step", batch)


def _engine_scores(engines: Members) -> list[torch.Tensor]:
    return [_flat(w.run("score_logprobs", SEQUENCES, POSITIONS)) for w in engines.workers]


def _flat(scores: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for row in scores for x in row], dtype=torch.float64)


def _assert_engines_follow(policy: PolicyGroup, engines: Members, push) -> list[torch.Tensor]:
    """Train a step, check the engines lag behind, push, check they hold the policy's weights."""
    _train(policy)
    want = _flat(policy.run("score_logprobs", SEQUENCES, POSITIONS))
    assert all((got - want).abs().max() > 100 * ATOL for got in _engine_scores(engines))
    version = push()
    assert version == engines.weight_version
    scores = _engine_scores(engines)
    for got in scores:
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    return scores


def test_collective_and_object_store_sync_load_the_same_weights(policy, engines):
    collective = make_weight_sync(
        load_config(None, [f"sync.bucket_mb={BUCKET_MB}"]), policy, engines
    )
    assert isinstance(collective, CollectiveSync)  # "auto" with two engines
    try:
        assert max(b.nbytes for b in collective.buckets) > BUCKET_BYTES > 0
        assert len(collective.buckets) > 2
        start = engines.weight_version
        by_broadcast = _assert_engines_follow(policy, engines, lambda: collective.push(step=1))
        assert engines.weight_version == start + 1
        by_store = ObjectStoreSync(policy, engines)
        assert by_store.push(step=1) == start + 2
        for got, want in zip(_engine_scores(engines), by_broadcast, strict=True):
            assert torch.equal(got, want)  # the same fp32 weights, loaded either way
        _assert_engines_follow(policy, engines, lambda: collective.push(step=2))
        assert engines.weight_version == start + 3
    finally:
        collective.close()


def test_no_member_of_a_weight_group_listens_beyond_the_loopback(
    policy, engines, listening, loopback
):
    """Policy rank 0 (DeepSpeed's group, the weight store) and two vLLM engines started on one
    node as a run starts them: every listener of theirs (Ray's own included) is on the loopback."""
    collective = CollectiveSync(policy, engines, torch.float32, BUCKET_BYTES, TIMEOUT_S)
    try:
        members = [*policy.workers, *engines.workers]
        pids = ray.get([w.target.__ray_call__.remote(lambda _: os.getpid()) for w in members])
        found = {pid: listening(pid) for pid in pids}
        assert all(found.values())
        assert {pid: [x for x in got if not loopback(x[0])] for pid, got in found.items()} == {
            pid: [] for pid in pids
        }
    finally:
        collective.close()


def test_zero3_lora_ranks_all_join_the_broadcast_or_hand_over_to_their_engine(model_dir, engines):
    """Two ZeRO-3 LoRA ranks: the broadcast from rank 0, then each rank handing its own engine
    the buckets (colocated), leave the engines holding the policy's weights; the hand-over
    loads exactly what the object store loads."""
    lora = LoraSettings(r=4, alpha=8)
    group, handles = _policy(model_dir, 2, zero_stage=3, lora=lora, lr=2e-2)
    collective = CollectiveSync(group, engines, torch.float32, BUCKET_BYTES, TIMEOUT_S)
    colocated_cfg = load_config(
        None,
        [
            "resources.colocate=true",
            "resources.policy_ranks=2",
            "resources.generator_engines=2",
            f"sync.bucket_mb={BUCKET_MB}",
        ],
    )
    try:
        _assert_engines_follow(group, engines, collective.push)
        handover = make_weight_sync(colocated_cfg, group, engines)
        assert isinstance(handover, ColocatedSync)  # "auto" when colocated
        assert max(b.nbytes for b in handover.buckets) > BUCKET_BYTES
        by_handover = _assert_engines_follow(group, engines, lambda: handover.push(step=3))
        ObjectStoreSync(group, engines).push(step=3)
        for got, want in zip(_engine_scores(engines), by_handover, strict=True):
            assert torch.equal(got, want)
    finally:
        collective.close()
        for h in handles:
            ray.kill(h, no_restart=True)


def test_auto_is_collective_for_actors_and_the_object_store_for_in_process_workers(policy, engines):
    cfg = load_config(None, [f"sync.bucket_mb={BUCKET_MB}"])
    one_engine = make_weight_sync(cfg, policy, Members(engines.workers[:1]))
    try:
        assert isinstance(one_engine, CollectiveSync)
    finally:
        one_engine.close()
    in_process = Members([Worker(object(), "GeneratorActor")])
    assert isinstance(make_weight_sync(cfg, policy, in_process), ObjectStoreSync)
    collective = load_config(None, ["sync.transport=collective"])
    with pytest.raises(ValueError, match="needs the policy and engines as Ray actors"):
        make_weight_sync(collective, policy, in_process)


def test_a_sync_whose_engine_died_names_it(policy, engines, kill_actor):
    collective = CollectiveSync(policy, engines, torch.float32, BUCKET_BYTES, TIMEOUT_S)
    kill_actor(engines.workers[1].target)
    with pytest.raises(ActorFailure, match="GeneratorActor 1 failed at step 7"):
        ObjectStoreSync(policy, engines).push(step=7)
    with pytest.raises(
        ActorFailure, match="^weight sync failed: GeneratorActor 1 failed at step 8"
    ):
        collective.push(step=8)
    with pytest.raises(RuntimeError, match="broke in an earlier push"):
        collective.push(step=9)
    collective.close()
