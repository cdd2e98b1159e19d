"""PolicyGroup: two data-parallel PolicyActor ranks take the one-rank update (ZeRO-2 and ZeRO-3):
same losses, gradient norms, DUET sums and weights, the same export, the same scores."""

from __future__ import annotations

import socket

import pytest
import ray
import torch

from actors.policy import PolicyActor
from rlvr.training.batch import build_batch
from rlvr.training.rendezvous import LOOPBACK
from workflows.policy_group import PolicyGroup, rank_environments
from workflows.workers import ActorFailure, Worker

pytestmark = pytest.mark.ray

MINI_BATCHES = 2
LR = 1e-3
# Seven rows: with two ranks every mini-batch slice is uneven, so fillers are exercised.
LENGTHS = [(3, 5), (2, 9), (4, 1), (3, 7), (5, 4), (2, 2), (3, 11)]
ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 0.75, 0.5, -0.25]


def _batch():
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200, (p,), generator=gen).tolist() for p, _ in LENGTHS]
    responses = [torch.randint(10, 200, (r,), generator=gen).tolist() for _, r in LENGTHS]
    batch = build_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.tensor(ADVANTAGES)
    return batch


def _group(
    model_dir, ranks: int, zero_stage: int, loss_agg: str, micro_batch_tokens: int = 0
) -> tuple[PolicyGroup, list]:
    kwargs = {
        "model_path": str(model_dir),
        "threads": 1,
        "zero_stage": zero_stage,
        "lr": LR,
        "micro_batch_size": 2,
        "micro_batch_tokens": micro_batch_tokens,
        "lm_head_chunk": 4 if micro_batch_tokens else 0,
        "mini_batches": MINI_BATCHES,
        "kl_coef": 0.05,
        "loss_agg": loss_agg,
        "temperature": 0.7,
        "seed": 3,
    }
    actor = ray.remote(PolicyActor).options(num_cpus=0.1)
    handles = [
        actor.remote(**kwargs, distributed=env, address=LOOPBACK)
        for env in rank_environments(ranks, LOOPBACK)
    ]
    names = ["PolicyActor"] if ranks == 1 else [f"PolicyActor {r}" for r in range(ranks)]
    group = PolicyGroup([Worker(h, n) for h, n in zip(handles, names, strict=True)], MINI_BATCHES)
    group.run("ready")
    return group, handles


def _kill(handles) -> None:
    for h in handles:
        ray.kill(h, no_restart=True)


@pytest.mark.parametrize(
    ("zero_stage", "loss_agg", "micro_batch_tokens"),
    # ZeRO-3 under a 20-token budget: in each mini-batch rank 0's share (lengths 11 + 5, then
    # 14 + 4) needs two micro-batches and rank 1's (8 + 10, then 9 + 4) one, so rank 1 splits.
    # With it the LM head runs at loss tokens only (in chunks of 4), fillers included.
    [(2, "token-mean", 0), (3, "seq-mean-token-sum-norm", 20)],
)
def test_two_ranks_take_the_one_rank_update(
    ray_cluster, tiny_model_dir, zero_stage, loss_agg, micro_batch_tokens
):
    results = {}
    for ranks in (1, 2):
        group, handles = _group(tiny_model_dir, ranks, zero_stage, loss_agg, micro_batch_tokens)
        try:
            stats = group.run("train_step", _batch(), logprob_sums=True)
            weights = group.run("export_weights")
            scores = group.run(
                "score_logprobs", [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [[2, 3], [1], []]
            )
        finally:
            _kill(handles)
        results[ranks] = stats, weights, scores
    (one, w1, s1), (two, w2, s2) = results[1], results[2]
    assert one["optimizer_steps"] == two["optimizer_steps"] == MINI_BATCHES
    assert one["tokens"] == two["tokens"] == sum(r for _, r in LENGTHS)
    # fp32 sums over two ranks and one differ in order only: ~1e-7 relative on the first update.
    # The second starts from weights one Adam step apart by that rounding, and Adam's m/sqrt(v)
    # turns a near-zero gradient's rounding into a visible step, so its figures agree to ~1e-5.
    # approx_kl and kl are the exception: on the second update they measure the first update's
    # step itself, whose noise-gradient elements differ by up to ~1% of lr (see the weights
    # below); approx_kl agreed to 1.0e-4 relative on one machine, so both get 1e-3.
    tolerance = {"approx_kl": 1e-3, "kl": 1e-3}
    for u1, u2 in zip(one["updates"], two["updates"], strict=True):
        for key in ("loss", "pg_loss", "kl", "clip_frac", "approx_kl", "grad_norm", "entropy"):
            rel = tolerance.get(key, 1e-4)
            assert u2[key] == pytest.approx(u1[key], rel=rel, abs=1e-7), key
    assert two["logprob_sums"] == pytest.approx(one["logprob_sums"], rel=1e-5)
    assert w1.keys() == w2.keys()
    # An Adam step moves a parameter by up to ~lr whatever its gradient's size, so an element
    # whose gradient is rounding noise moves by a different fraction of lr on one rank and two:
    # 1.2% of lr at most with row micro-batches, 7.1% under the token budget (its micro-batches
    # group rows differently on one and two ranks, so more sums change order).
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=0.1 * LR, msg=name)
    assert [len(x) for x in s2] == [2, 1, 0]
    # Scores under those weights: a log-prob of -7.7 moved by 1.0e-5 (1.4e-6 relative).
    for a, b in zip(s1, s2, strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-5)


def test_one_rank_ignores_launcher_variables_its_worker_inherited(ray_cluster, tiny_model_dir):
    """A process that trained in-process as rank 0 of 1 keeps its store's MASTER_PORT in its
    environment, and Ray workers started from it inherit it (here through the runtime env): a
    one-rank actor starts its own group instead of binding that taken port."""
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        inherited = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(taken.getsockname()[1])}
        actor = ray.remote(PolicyActor).options(
            num_cpus=0.1, runtime_env={"env_vars": {**inherited, "RANK": "0", "WORLD_SIZE": "1"}}
        )
        handle = actor.remote(model_path=str(tiny_model_dir), threads=1, zero_stage=0)
        try:
            assert ray.get(handle.ready.remote())
        finally:
            _kill([handle])


def test_a_failing_rank_is_named(ray_cluster, tiny_model_dir, kill_actor):
    group, handles = _group(tiny_model_dir, 2, 2, "token-mean")
    try:
        kill_actor(handles[1])
        with pytest.raises(ActorFailure, match=r"PolicyActor 1 failed at step 4"):
            group.run("ready", step=4)
    finally:
        _kill(handles)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_state_saved_by_two_ranks_resumes_on_one_and_back(
    ray_cluster, tiny_model_dir, tmp_path, zero_stage
):
    """ZeRO-2 optimizer partitions depend on the rank count: the state goes through DeepSpeed's
    universal checkpoint. Three steps on 2, 1, then 2 ranks, each resumed from the last one's
    saved state, equal three uninterrupted steps on one rank (fp32 rounding of the partitioned vs
    whole Adam state: same bound as above). Each rank count's group is started once (an actor's
    start costs seconds): the one-rank group takes the three uninterrupted steps first, so its
    resume must replace a state two steps further on, and the two-rank group resumes over the
    state of its own first step."""
    handles = []
    try:
        one, started = _group(tiny_model_dir, 1, zero_stage, "token-mean")
        handles += started
        two, started = _group(tiny_model_dir, 2, zero_stage, "token-mean")
        handles += started
        uninterrupted = [one.run("train_step", _batch())["loss"] for _ in range(3)]
        losses, state = [], None
        for i, group in enumerate([two, one, two]):
            if state is not None:
                group.run("load_state", state)
            losses.append(group.run("train_step", _batch())["loss"])
            state = str(tmp_path / f"{zero_stage}-{i}")
            group.run("save_state", state)
    finally:
        _kill(handles)
    assert losses == pytest.approx(uninterrupted, rel=1e-4)
