"""Tandem's separate junior through Ray actors: GeneratorActors started from a config with
`algorithm.tandem.junior: separate` (each senior engine handed its own junior engine, as
`workflows.components` starts them) write, one engine or two, exactly the rollouts the shared
engine writes; a weight sync moves the seniors only, and the frozen juniors keep writing their
share, on transformers and on vLLM engines. Log-probs within LOGPROB_ATOL as in
tests/generation/test_tandem_separate.py."""

import numpy as np
import pytest
import ray
from transformers import AutoModelForCausalLM

from actors.generator import GeneratorActor
from rlvr.config import load_config
from rlvr.generation.base import GenerationRequest, SamplingParams
from workflows.components import companion_kwargs, generator_kwargs
from workflows.generator_pool import GeneratorPool
from workflows.workers import ActorFailure, Worker

LOGPROB_ATOL = 1e-4
ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _config(junior_dir, form: str, backend: str = "hf"):
    return load_config(
        "configs/tiny-tandem.yaml",
        [
            f"generation.backend={backend}",
            "resources.generator_engines=2",
            "resources.torch_threads=1",
            f"algorithm.tandem.junior={form}",
            f"algorithm.tandem.junior_path={junior_dir}",
            "algorithm.tandem.cap=4",
        ],
    )


@pytest.fixture(scope="module", params=["hf", "vllm"])
def separate(request, ray_cluster, tiny_model_dir, junior_dir):
    """Two senior engines, each with its junior engine, started from the separate config, on
    transformers engines (hand-over in rounds) or vLLM engines (continuous hand-over)."""
    cfg = _config(junior_dir, "separate", request.param)

    def actor(**kwargs):
        return (
            ray.remote(GeneratorActor)
            .options(num_cpus=0.1, runtime_env={"env_vars": ENGINE_ENV})
            .remote(**kwargs)
        )

    juniors = [actor(**companion_kwargs(cfg, tiny_model_dir, i)) for i in range(2)]
    seniors = [
        actor(**generator_kwargs(cfg, tiny_model_dir, slot=i), companion=junior)
        for i, junior in enumerate(juniors)
    ]
    workers = [Worker(a, f"GeneratorActor {i}") for i, a in enumerate(seniors)]
    GeneratorPool(workers).run("ready")
    yield workers, juniors
    for a in seniors + juniors:
        ray.kill(a, no_restart=True)


def _requests() -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    return [
        GenerationRequest(rng.integers(5, 250, k).tolist(), n=3, request_id=f"q{i}", seed=1000 * i)
        for i, k in enumerate([9, 3, 12, 5, 7])
    ]


def _assert_same(got, want) -> None:
    def fields(results):
        return [
            (r.request_id, s.token_ids, s.finish_reason, s.flags, s.authorship)
            for r in results
            for s in r.samples
        ]

    assert fields(got) == fields(want)
    for g, w in zip(got, want, strict=True):
        for gs, ws in zip(g.samples, w.samples, strict=True):
            np.testing.assert_allclose(gs.logprobs, ws.logprobs, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.ray
def test_separate_engines_dispatch_seed_exactly_and_sync_the_senior_only(
    separate, tiny_model_dir, junior_dir
):
    workers, juniors = separate
    shared_kwargs = generator_kwargs(_config(junior_dir, "shared"), tiny_model_dir)
    shared = GeneratorActor(**shared_kwargs)
    params = SamplingParams(temperature=1.0, max_tokens=24)
    want = shared.generate(_requests(), params, tandem=True)
    authors = [a for r in want for s in r.samples for a in s.authorship]
    assert 0 < sum(authors) < len(authors)
    pool = GeneratorPool(workers)
    _assert_same(pool.generate(_requests(), params, tandem=True, step=0), want)
    _assert_same(GeneratorPool(workers[:1]).generate(_requests(), params, tandem=True), want)
    junior_tokens = [ray.get(j.stats.remote())["tokens"] for j in juniors]
    assert all(t > 0 for t in junior_tokens)  # each junior engine wrote its shard's share

    # A weight sync reaches the seniors; the juniors stay frozen at their starting weights.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = {name: p.detach() * 1.5 for name, p in model.named_parameters()}
    assert pool.run("update_weights", weights) == 1
    shared.update_weights(weights)
    assert [ray.get(j.stats.remote())["weight_version"] for j in juniors] == [0, 0]
    _assert_same(
        pool.generate(_requests(), params, tandem=True, step=1),
        shared.generate(_requests(), params, tandem=True),
    )


@pytest.mark.ray
def test_a_lost_junior_engine_is_a_lost_actor_for_recovery(separate, kill_actor):
    """Runs last: it kills a junior. Its senior's call fails as lost, so the run restarts its
    actors (`run.max_failures`) instead of failing as on an error in the call."""
    workers, juniors = separate
    kill_actor(juniors[0])
    with pytest.raises(ActorFailure, match="GeneratorActor 0 failed at step 2") as failure:
        params = SamplingParams(max_tokens=4)
        workers[0].run("generate", _requests(), params, tandem=True, step=2)
    assert failure.value.lost
