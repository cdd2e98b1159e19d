"""Partial rollouts on the engine loop (`rlvr.generation.segments`): a trajectory's first tokens
come from one policy version and the rest from the next, loaded while every trajectory waits at
the boundary; each part equals what its own version samples from the same prefix and seed, on
vLLM and transformers, single- and multi-turn; every token's version is recorded."""

import pytest
import torch

from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.segments import (
    POLICY_VERSIONS,
    Segments,
    joined_runs,
    segment_seed,
    version_runs,
)
from rlvr.generation.trajectories import Continue, Finish, Trajectory
from rlvr.run.metrics import token_staleness

ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "kv_cache_gib": 0.25}
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100], [3, 9, 27, 81, 243, 17]]
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=11)
BOUNDARY = 5
LOGPROB_ATOL = 1e-4
"""A token sampled among other batch neighbours than its replay's gets a log-prob a few fp32 ulps
apart (~1e-6; tests/generation/test_engine_loop.py); tokens must match exactly."""


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    """Version 0: the tiny model's weights; version 1: a perturbation of them."""
    hf = make_backend("hf", tiny_model_dir, dtype="float32")
    original = {name: p.detach().clone() for name, p in hf.model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        name: p + 0.5 * torch.randn(p.shape, generator=generator) for name, p in original.items()
    }
    return {0: original, 1: perturbed}


@pytest.fixture(scope="module")
def vllm(tiny_model_dir):
    backend = make_backend("vllm", tiny_model_dir, **ENGINE)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return make_backend("hf", tiny_model_dir, dtype="float32")


class Versions:
    """The `hold` of a `Segments`: loads a version's weights into the backend, recording it."""

    def __init__(self, backend, weights) -> None:
        self.backend, self.weights = backend, weights
        self.held: list[int] = []

    def __call__(self, version: int) -> None:
        if not self.held or self.held[-1] != version:
            self.backend.load_weights(self.weights[version].items())
        self.held.append(version)


@pytest.fixture(params=["vllm", "hf"])
def backend(request, weights):
    backend = request.getfixturevalue(request.param)
    backend.load_weights(weights[0].items())
    return backend


def _requests(n: int = 2) -> list[GenerationRequest]:
    return [GenerationRequest(p, n=n, seed=100 * i) for i, p in enumerate(PROMPTS)]


def test_each_part_is_what_its_own_version_samples(backend, weights):
    versions = Versions(backend, weights)
    partial = backend.generate(_requests(), PARAMS, segments=Segments(BOUNDARY, (0, 1), versions))
    assert versions.held == [0, 1]

    backend.load_weights(weights[0].items())
    heads = [s for r in backend.generate(_requests(), PARAMS) for s in r.samples]  # version 0
    backend.load_weights(weights[1].items())
    samples = [
        (request, j, sample)
        for request, result in zip(_requests(), partial, strict=True)
        for j, sample in enumerate(result.samples)
    ]
    continued = 0
    for (request, j, sample), head in zip(samples, heads, strict=True):
        n = len(sample.token_ids)
        assert sample.token_ids[:BOUNDARY] == head.token_ids[:BOUNDARY]
        assert sample.logprobs[:BOUNDARY] == pytest.approx(
            head.logprobs[:BOUNDARY], abs=LOGPROB_ATOL
        )
        if n <= BOUNDARY:  # it ended before the pause: version 0's sample outright
            assert sample.token_ids == head.token_ids
            assert sample.flags[POLICY_VERSIONS] == [[0, n]]
            continue
        continued += 1
        seed = segment_seed(request.seed + j, 1)
        (tail,) = backend.generate(
            [GenerationRequest(request.prompt_ids + sample.token_ids[:BOUNDARY], seed=seed)],
            SamplingParams(temperature=1.0, max_tokens=PARAMS.max_tokens - BOUNDARY),
        )[0].samples
        assert sample.token_ids[BOUNDARY:] == tail.token_ids
        assert sample.logprobs[BOUNDARY:] == pytest.approx(tail.logprobs, abs=LOGPROB_ATOL)
        assert sample.finish_reason == tail.finish_reason
        assert sample.flags[POLICY_VERSIONS] == [[0, BOUNDARY], [1, n - BOUNDARY]]
        assert sample.text == backend.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    assert continued >= len(samples) // 2  # the tiny model seldom stops within 5 tokens


def test_no_pause_when_every_sample_ends_before_the_boundary(backend, weights):
    versions = Versions(backend, weights)
    short = SamplingParams(temperature=1.0, max_tokens=BOUNDARY, seed=3)
    out = backend.generate(_requests(1), short, segments=Segments(BOUNDARY, (0, 1), versions))
    assert versions.held == [0]
    assert all(s.flags[POLICY_VERSIONS] == [[0, len(s.token_ids)]] for r in out for s in r.samples)
    # what the same call samples without segments, token for token (partial rollouts that never
    # pause are the plain ones)
    plain = backend.generate(_requests(1), short)
    for r, q in zip(out, plain, strict=True):
        for s, t in zip(r.samples, q.samples, strict=True):
            assert (s.token_ids, s.finish_reason, s.text) == (t.token_ids, t.finish_reason, t.text)
            assert s.logprobs == pytest.approx(t.logprobs, abs=LOGPROB_ATOL)


class Observe:
    """Answers every turn with three observation tokens until the trajectory has three turns."""

    def __call__(self, trajectory):
        if len(trajectory.turns) >= 3:
            return Finish()
        return Continue([7, 8, 9])


def test_the_boundary_counts_model_tokens_over_all_turns(backend, weights):
    versions = Versions(backend, weights)
    boundary = 8  # inside the second turn of three, at 5 tokens each
    params = SamplingParams(temperature=1.0, max_tokens=5)
    trajectories = [Trajectory(p, seed=9 + i, next_turn=Observe()) for i, p in enumerate(PROMPTS)]
    results = backend.generate_trajectories(
        trajectories, params, segments=Segments(boundary, (0, 1), versions)
    )
    assert versions.held == [0, 1]
    for result in results:
        assert result.status == "done" and len(result.turns) == 3  # a pause is not a turn
        for before, after in zip(result.turns, result.turns[1:], strict=False):
            assert after.prompt_ids == before.prompt_ids + before.sample.token_ids + [7, 8, 9]
        runs = joined_runs(*(t.sample.flags[POLICY_VERSIONS] for t in result.turns))
        total = result.model_tokens
        assert runs == version_runs([0] * min(total, boundary) + [1] * max(total - boundary, 0))


def test_stop_strings_and_rules_cannot_be_continued(hf, weights):
    segments = Segments(BOUNDARY, (0, 1), Versions(hf, weights))
    with pytest.raises(ValueError, match="stop rules or strings"):
        hf.generate(_requests(1), SamplingParams(max_tokens=8, stop=("x",)), segments=segments)


def test_seeds_and_runs_follow_their_rules():
    assert segment_seed(41, 0) == 41 and segment_seed(None, 1) is None
    assert segment_seed(41, 1) != 41 and 0 <= segment_seed(41, 1) < 2**63
    assert version_runs([3, 3, 4, 4, 4]) == [[3, 2], [4, 3]]
    assert joined_runs([[3, 2]], [[3, 1], [4, 2]], [[4, 0]]) == [[3, 3], [4, 2]]
    with pytest.raises(ValueError, match="tokens >= 1"):
        Segments(0, (0, 1), lambda v: None)


def test_token_staleness_by_hand():
    flags = [{POLICY_VERSIONS: [[2, 6], [3, 2]]}, {POLICY_VERSIONS: [[3, 2]]}, {}]
    # step 4: 6 tokens at staleness 2, 4 at staleness 1
    assert token_staleness(flags, 4) == {
        "token_staleness_mean": pytest.approx((6 * 2 + 4 * 1) / 10),
        "token_staleness_max": 2.0,
        "token_staleness_share_1": pytest.approx(0.4),
        "token_staleness_share_2": pytest.approx(0.6),
    }
    assert token_staleness([{}, {}], 4) == {}
