"""GeneratorPool: two vLLM GeneratorActors write the rollouts of one (plain sampling, DUET's
stop rule, Tandem; single-turn and multi-turn), in request order for any split, and one engine's
request loop writes exactly its batch path's; a step refuses engines at another weight version;
a crashed engine is named.

Each engine computes with two threads, and with two or more vLLM's CPU attention may split a
decode row's KV range into chunks merged afterwards, at points set by the whole batch's KV lengths
(VLLM_CPU_ATTN_SPLIT_KV, on by default). The same request among other neighbours then gets logits
that differ in the last bit: with the split on, 8 of these 32 rollouts differ by up to 1e-6 in
log-probs. VLLM_CPU_ATTN_SPLIT_KV=0 computes every row alone. What remains is the matmul: on some
CPUs its kernel blocks the sum by the batch's row count (the rollouts matched bit for bit on one
machine and differed by about 1e-6 on another), so a request batched with other neighbours may
get log-probs a few ulps apart.
Tokens, finish reasons, flags and authorship must match exactly; log-probs within LOGPROB_ATOL.
OMP_WAIT_POLICY=PASSIVE only keeps the engines' idle threads from spinning on the shared cores.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import ray
from ray import cloudpickle

from actors.generator import GeneratorActor
from rlvr.algorithms.duet.stop import coin, rollout_seed
from rlvr.config import ConfigError, load_config
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.trajectories import (
    Continue,
    Finish,
    Trajectory,
    TrajectoryLimits,
    TrajectoryResult,
    turn_seed,
)
from rlvr.generation.vllm_backend import engine_cores
from rlvr.models.tiny import build_tiny_model
from workflows.components import companion_kwargs, generator_kwargs, sleep_level
from workflows.generator_pool import GeneratorPool, contiguous_shards
from workflows.workers import ActorFailure, Worker

ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "kv_cache_gib": 0.125}
ENGINE_ENV = {"VLLM_CPU_ATTN_SPLIT_KV": "0", "OMP_WAIT_POLICY": "PASSIVE"}
DUET = {
    "k1": 4,
    "k2": 8,
    "base_seed": 7,
    "step": 3,
    "domain": "math",
    "grace": 2,
    "eps_abort": 0.5,
    "poll_every": 1,
    "window": 256,
}
"""The tiny model seldom writes a marker: most rollouts reach t = 10 and draw the coin."""
LOGPROB_ATOL = 1e-4
"""Log-probs of about -7 in fp32 summed in another order differ by a few ulps (~1e-6): 100x room,
far below any difference a wrong token, position or weight version would make (> 1e-2)."""


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_model_dir, tmp_path_factory):
    """Two Tandem-capable engines (the senior also samples alone)."""
    junior = build_tiny_model(tmp_path_factory.mktemp("junior") / "tiny1", seed=1)
    actors = [
        ray.remote(GeneratorActor)
        .options(num_cpus=0.1, runtime_env={"env_vars": ENGINE_ENV})
        .remote(
            "vllm",
            str(tiny_model_dir),
            threads=2,
            tandem={"junior_path": str(junior), "p": 0.5, "cap": 4},
            **ENGINE,
        )
        for _ in range(2)
    ]
    workers = [Worker(actor, f"GeneratorActor {i}") for i, actor in enumerate(actors)]
    GeneratorPool(workers).run("ready")
    yield workers
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _requests(lengths: list[int], n: int) -> list[GenerationRequest]:
    """Prompts sharing a 140-token prefix, seeded per request as the trainer seeds them."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(5, 250, 140).tolist()
    return [
        GenerationRequest(
            prefix + rng.integers(5, 250, k).tolist(), n=n, request_id=f"q{i}", seed=1000 * i
        )
        for i, k in enumerate(lengths)
    ]


def _rollouts(results) -> list[tuple]:
    return [
        (r.request_id, s.token_ids, s.logprobs, s.finish_reason, s.flags, s.authorship)
        for r in results
        for s in r.samples
    ]


def _assert_same_rollouts(got: list[tuple], want: list[tuple]) -> None:
    """Everything equal, log-probs (index 2) within LOGPROB_ATOL."""
    assert [r[:2] + r[3:] for r in got] == [r[:2] + r[3:] for r in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g[2], w[2], rtol=0, atol=LOGPROB_ATOL, err_msg=g[0])


def test_shards_are_contiguous_and_balanced():
    assert contiguous_shards([10, 1, 1, 1, 1], 2) == [slice(0, 1), slice(1, 5)]
    assert contiguous_shards([1] * 5, 2) == [slice(0, 2), slice(2, 5)]
    assert contiguous_shards([3, 3, 3, 3], 1) == [slice(0, 4)]
    assert contiguous_shards([5, 5], 3) == [slice(0, 1), slice(1, 1), slice(1, 2)]
    assert contiguous_shards([], 2) == [slice(0, 0), slice(0, 0)]


@pytest.mark.ray
@pytest.mark.parametrize("method", ["grpo", "duet", "tandem"])
def test_two_engines_write_the_rollouts_of_one(engines, method):
    requests = _requests([19, 3, 12, 8, 16, 1, 10, 5], n=4)
    params = SamplingParams(temperature=1.0, max_tokens=64)
    extra = {"duet": {"duet_stop": DUET}, "tandem": {"tandem": True}}.get(method, {})
    one = engines[0].run("generate", requests, params, **extra)
    # the request loop (the default) adds the batch path's requests in its order: bit for bit
    assert _rollouts(one) == _rollouts(
        engines[0].run("generate", requests, params, loop="batch", **extra)
    )
    pool = GeneratorPool(engines)
    before = pool.run("stats")["engines"][1]["tokens"]
    two = pool.run("generate", requests, params, step=3, **extra)
    assert pool.run("stats")["engines"][1]["tokens"] > before  # engine 1 wrote a shard
    _assert_same_rollouts(_rollouts(two), _rollouts(one))
    samples = [s for r in two for s in r.samples]
    if method == "duet":
        # Every coin follows the rollout's step-wide row, in engine 1's shard too.
        drawn = [
            (s.flags["eps_kept"], coin(rollout_seed(7, 3, row)) < DUET["eps_abort"])
            for row, s in enumerate(samples)
            if s.flags["aborted"] or s.flags["eps_kept"]
        ]
        assert all(kept == expected for kept, expected in drawn)
        assert {kept for kept, _ in drawn} == {True, False}
    if method == "tandem":
        assert {a for s in samples for a in s.authorship} == {0, 1}


@pytest.mark.ray
@pytest.mark.parametrize("lengths", [[30, 2, 9, 14, 5], [7]], ids=["5-on-2", "1-on-2"])
def test_results_come_back_in_request_order(engines, lengths):
    requests = _requests(lengths, n=2)
    params = SamplingParams(temperature=1.0, max_tokens=6)
    one = _rollouts(engines[0].run("generate", requests, params))
    two = GeneratorPool(engines).run("generate", requests, params)
    assert [r.request_id for r in two] == [r.request_id for r in requests]
    _assert_same_rollouts(_rollouts(two), one)
    _assert_same_rollouts(
        _rollouts(GeneratorPool(engines[:1]).run("generate", requests, params)), one
    )


class Observe:
    """Answers a turn with fixed observation tokens until the third turn (runs in the actors)."""

    def __call__(self, trajectory: TrajectoryResult):
        if len(trajectory.turns) == 3:
            return Finish()
        return Continue([7, 8, 9], {"after": len(trajectory.turns) - 1})


# The actors unpickle the callback: ship this module's code along, it is not importable there.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.ray
def test_two_engines_write_the_trajectories_of_one(engines):
    requests = _requests([19, 3, 12, 8, 1], n=1)
    trajectories = [
        Trajectory(r.prompt_ids, seed=r.seed, next_turn=Observe(), trajectory_id=r.request_id)
        for r in requests
    ]
    params = SamplingParams(temperature=1.0, max_tokens=16)
    limits = TrajectoryLimits(max_context=220)
    one = engines[0].run("generate_trajectories", trajectories, params, limits)
    two = GeneratorPool(engines).generate_trajectories(trajectories, params, limits, step=3)
    assert [r.trajectory_id for r in two] == [r.request_id for r in requests]
    for a, b, trajectory in zip(one, two, trajectories, strict=True):
        assert (a.status, b.status, len(b.turns)) == ("done", "done", 3)
        assert [t.seed for t in b.turns] == [turn_seed(trajectory.seed, k) for k in range(3)]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.turns, b.turns, strict=True):
            assert (x.prompt_ids, x.observation_ids, x.info) == (
                y.prompt_ids,
                y.observation_ids,
                y.info,
            )
            np.testing.assert_allclose(
                x.sample.logprobs, y.sample.logprobs, rtol=0, atol=LOGPROB_ATOL
            )


@pytest.mark.ray
def test_scores_split_over_engines_in_order(engines):
    sequences = [r.prompt_ids for r in _requests([30, 2, 9, 14, 5], n=1)]
    positions = [list(range(130, len(s))) for s in sequences]
    two = GeneratorPool(engines).run("score_logprobs", sequences, positions)
    one = engines[0].run("score_logprobs", sequences, positions)
    assert [len(s) for s in two] == [len(s) for s in one]
    for got, want in zip(two, one, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.ray
def test_an_engine_failure_names_the_engine(engines):
    broken = ray.remote(GeneratorActor).options(num_cpus=0.1).remote("no-such-backend", "x", 1)
    pool = GeneratorPool([engines[0], Worker(broken, "GeneratorActor 1")])
    requests = _requests([5, 5], n=1)
    with pytest.raises(ActorFailure, match=r"^GeneratorActor 1 failed at step 3: "):
        pool.run("generate", requests, SamplingParams(max_tokens=4), step=3)


@pytest.mark.ray
def test_a_step_never_mixes_weight_versions(engines, tiny_model_dir):
    """Runs last: it moves the engines' weight versions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = {name: p.detach() for name, p in model.named_parameters()}
    pool = GeneratorPool(engines)
    requests = _requests([5, 5], n=1)
    params = SamplingParams(max_tokens=4)
    assert engines[1].run("update_weights", weights) == 1  # engine 1 alone moves on
    with pytest.raises(ActorFailure, match=r"GeneratorActor 1 failed at step 3: .*version 1"):
        pool.run("generate", requests, params, step=3)
    with pytest.raises(RuntimeError, match="GeneratorActor 0: 1, GeneratorActor 1: 2"):
        pool.run("update_weights", weights)
    assert engines[0].run("update_weights", ray.put(weights)) == 2
    assert pool.run("update_weights", weights) == pool.weight_version == 3
    stats = pool.run("stats")
    assert stats["weight_version"] == 3
    assert stats["tokens"] == sum(e["tokens"] for e in stats["engines"])
    assert len(pool.run("generate", requests, params)) == 2


class SleepRecorder:
    """Stands in for a GPU engine's sleep mode, which vLLM offers only on GPUs: records calls."""

    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))


def test_colocated_engines_sleep_once_and_wake_weights_before_kv_cache():
    calls: list[tuple] = []
    pool = GeneratorPool(
        [Worker(SleepRecorder(calls), f"GeneratorActor {i}") for i in range(2)], sleep_level=1
    )
    pool.wake("weights")  # awake: nothing to take back
    pool.sleep()
    pool.sleep()  # already asleep (an update skipped its sync): one sleep
    pool.wake("weights")
    pool.wake("kv_cache")
    pool.wake("kv_cache")
    assert (
        calls
        == [("sleep", 1)] * 2 + [("wake_up", ["weights"])] * 2 + [("wake_up", ["kv_cache"])] * 2
    )
    never = GeneratorPool([Worker(SleepRecorder(calls := []), "GeneratorActor")])
    never.sleep()
    never.wake("weights")
    assert calls == []


@pytest.mark.parametrize(
    "overrides,level",
    [
        ([], 1),  # CPU engines free their KV cache while the policy updates
        (["resources.engine_sleep=discard"], 2),
        (["resources.engine_sleep=off"], None),
        (["run.max_staleness=1"], None),  # they sample during the update
        (["generation.backend=hf"], None),
    ],
)
def test_cpu_engines_sleep_unless_they_sample_during_the_update(overrides, level):
    cfg = load_config(None, overrides)
    assert sleep_level(cfg) == level
    # vLLM's own sleep mode is for GPUs: a CPU engine starts without it, whatever the level
    assert "enable_sleep_mode" not in generator_kwargs(cfg, Path("model"))


def test_generation_dtype_sets_the_engines_and_the_sync_wire():
    cfg = load_config(None, [])
    assert cfg.engine_dtype == "float32" and generator_kwargs(cfg, Path("m"))["dtype"] == "float32"
    cfg = load_config(None, ["generation.dtype=bfloat16"])
    assert (
        cfg.engine_dtype == "bfloat16" and generator_kwargs(cfg, Path("m"))["dtype"] == "bfloat16"
    )
    assert cfg.model.dtype == "float32"  # the trainer keeps its own
    with pytest.warns(UserWarning, match=r"generation.dtype=bfloat16 .* training.engine_is=off"):
        load_config(None, ["generation.dtype=bfloat16", "training.engine_is=off"])
    with pytest.raises(ConfigError, match="generation.dtype"):
        load_config(None, ["generation.dtype=float16"])


def test_cpu_engines_of_a_node_bind_disjoint_cores():
    """Engine i binds the i-th share of the cores, its companion the (engines + i)-th: two
    engines and their juniors on four cores take one core each, none shared."""
    cfg = load_config(
        None,
        [
            "algorithm.name=tandem",
            "algorithm.tandem.junior=separate",
            "resources.generator_engines=2",
            "resources.torch_threads=1",
        ],
    )
    engines = [generator_kwargs(cfg, Path("m"), slot=i) for i in range(2)]
    juniors = [companion_kwargs(cfg, Path("m"), i) for i in range(2)]
    shares = [
        engine_cores(range(4), kw["cpu_threads"], kw["cpu_offset"]) for kw in engines + juniors
    ]
    assert shares == [[0], [1], [2], [3]]
    assert engine_cores([4, 5, 6], 2, 2) == [6, 4]  # wraps around
    assert engine_cores([4, 5, 6], None, 4) == [5, 6, 4]  # all cores, from the offset modulo 3
