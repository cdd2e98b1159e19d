"""The engine loop: single-turn sampling on the request loop equals vLLM's batch path bit for bit
(with DUET's stop rule too); multi-turn trajectories on vLLM and transformers chain their prompts
token for token, sample each turn from its documented seed, reuse the prefix cache, apply a stop
rule per turn, end on their limits with the reason, survive callbacks that fail, answer garbage
or hang, and never wait for each other (vLLM). Partial rollouts (`rlvr.generation.segments`): a
trajectory's first tokens come from one policy version and the rest from the next, loaded while
every trajectory waits at the boundary; each part is what its own version samples from the same
prefix and seed, single- and multi-turn, and every token's version is recorded."""

import hashlib
import itertools
import threading

import pytest
import torch

from rlvr.algorithms.duet.stop import StopControllerFactory
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.segments import (
    POLICY_VERSIONS,
    Segments,
    joined_runs,
    segment_seed,
    version_runs,
)
from rlvr.generation.trajectories import (
    Continue,
    Finish,
    Trajectory,
    TrajectoryBackend,
    TrajectoryLimits,
    TrajectoryResult,
    turn_seed,
)
from rlvr.generation.vllm_backend import _ACTIVE_TRACKERS, VLLMBackend
from rlvr.run.metrics import token_staleness

ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "kv_cache_gib": 0.25}
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100], [3, 9, 27, 81, 243, 17]]
LONG = [(17 * i) % 900 + 5 for i in range(140)]
"""Longer than one KV block (128 tokens on CPU): its later turns can come from the prefix cache."""
OBSERVATION = [7, 8, 9]
LOGPROB_ATOL = 1e-4
"""A turn sampled among other batch neighbours than its single-turn replay gets log-probs a few
fp32 ulps apart (~1e-6, see tests/actors/test_generator_pool.py); tokens must match exactly."""
DUET = {"k1": 4, "k2": 8, "base_seed": 7, "step": 3, "grace": 2, "eps_abort": 0.5, "poll_every": 1}
"""The tiny model seldom writes a marker: most rollouts reach t = 10 and draw the eps coin."""


@pytest.fixture(scope="module")
def vllm(tiny_model_dir):
    backend = make_backend("vllm", tiny_model_dir, **ENGINE)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return make_backend("hf", tiny_model_dir, dtype="float32")


@pytest.fixture(params=["vllm", "hf"])
def backend(request):
    return request.getfixturevalue(request.param)


class Observe:
    """Answers every turn with OBSERVATION until the trajectory has `turns` turns."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def __call__(self, trajectory: TrajectoryResult):
        done = len(trajectory.turns)
        if done >= self.turns:
            return Finish({"turns": done})
        return Continue(OBSERVATION, {"after": done - 1})


def _samples(results):
    return [
        (s.token_ids, s.logprobs, s.finish_reason, s.flags, s.text, s.authorship)
        for r in results
        for s in r.samples
    ]


def test_turn_seeds_follow_the_documented_rule():
    assert turn_seed(41, 0) == 41 and turn_seed(None, 3) is None
    digest = hashlib.blake2b(b"41:turn:2", digest_size=8).digest()
    assert turn_seed(41, 2) == int.from_bytes(digest, "little") % 2**63
    seeds = {turn_seed(s, t) for s in range(40, 44) for t in range(4)}
    assert len(seeds) == 16  # no turn shares a stream with another turn or a neighbour sample
    with pytest.raises(ValueError, match="max_turns"):
        TrajectoryLimits(max_turns=0)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_the_request_loop_samples_what_the_batch_path_samples(vllm, temperature, top_p):
    """Same requests, same order: the same tokens, log-probs (bit for bit), reasons and flags."""
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=40, seed=3)
    requests = [GenerationRequest(p, n=3, request_id=str(i)) for i, p in enumerate(PROMPTS)]
    requests[2].seed = 200  # a request's own seed overrides the params' one
    loop = vllm.generate(requests, params)
    assert _samples(loop) == _samples(vllm.generate(requests, params, loop="batch"))
    assert [r.request_id for r in loop] == ["0", "1", "2", "3"]
    assert {s.finish_reason for r in loop for s in r.samples} == {"stop", "length"}

    def duet():
        return StopControllerFactory(vllm.tokenizer.decode, [3, 3, 3, 3], **DUET)

    loop = vllm.generate(requests, params, duet())
    assert _samples(loop) == _samples(vllm.generate(requests, params, duet(), loop="batch"))
    flags = [s.flags for r in loop for s in r.samples]
    assert {f["eps_kept"] for f in flags} == {True, False}  # the coin went both ways


def test_multi_turn_prompts_chain_and_each_turn_samples_from_its_seed(backend):
    params = SamplingParams(temperature=1.0, max_tokens=24)
    trajectories = [
        Trajectory(p, seed=1000 * i + 1, next_turn=Observe(3), trajectory_id=f"t{i}")
        for i, p in enumerate([LONG, *PROMPTS[:2]])
    ]
    assert isinstance(backend, TrajectoryBackend)
    results = backend.generate_trajectories(trajectories, params)
    assert [r.trajectory_id for r in results] == ["t0", "t1", "t2"]
    for trajectory, result in zip(trajectories, results, strict=True):
        assert (result.status, result.error, len(result.turns)) == ("done", "", 3)
        turns = result.turns
        assert turns[0].prompt_ids == trajectory.prompt_ids
        for before, turn in itertools.pairwise(turns):
            assert turn.prompt_ids == before.prompt_ids + before.sample.token_ids + OBSERVATION
            assert before.observation_ids == OBSERVATION
        assert turns[-1].observation_ids == []
        assert [t.info for t in turns] == [{"after": 0}, {"after": 1}, {"turns": 3}]
        assert [t.seed for t in turns] == [turn_seed(trajectory.seed, k) for k in range(3)]
        assert result.model_tokens == sum(len(t.sample.token_ids) for t in turns)
        assert result.observation_tokens == 2 * len(OBSERVATION)
        assert result.token_ids == turns[-1].prompt_ids + turns[-1].sample.token_ids
    # each turn is the single-turn sample of its prompt and seed
    turns = [turn for result in results for turn in result.turns]
    alone = backend.generate([GenerationRequest(t.prompt_ids, seed=t.seed) for t in turns], params)
    for turn, replay in zip(turns, alone, strict=True):
        assert replay.samples[0].token_ids == turn.sample.token_ids
        assert replay.samples[0].logprobs == pytest.approx(turn.sample.logprobs, abs=LOGPROB_ATOL)
    if isinstance(backend, VLLMBackend):  # later turns take the earlier ones from the cache
        assert all(t.cached_tokens >= 128 for t in results[0].turns[1:])
    again = backend.generate_trajectories(trajectories, params)
    assert [[t.sample.token_ids for t in r.turns] for r in again] == [
        [t.sample.token_ids for t in r.turns] for r in results
    ]


def test_both_backends_write_the_same_greedy_conversation(vllm, hf):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    trajectories = [Trajectory(p, next_turn=Observe(3)) for p in PROMPTS]
    from_vllm = vllm.generate_trajectories(trajectories, params)
    from_hf = hf.generate_trajectories(trajectories, params)
    assert [r.token_ids for r in from_vllm] == [r.token_ids for r in from_hf]


def test_stop_rules_are_fresh_for_every_turn(backend, stop_after):
    """Turn t's rule forces EOS after 2 + t tokens; the EOS stays in the next prompt."""
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    trajectory = Trajectory(
        PROMPTS[0], seed=5, next_turn=Observe(3), stop_rule=lambda t: stop_after(2 + t)
    )
    [result] = backend.generate_trajectories([trajectory], params)
    eos = backend.eos_token_id
    for k, turn in enumerate(result.turns):
        assert len(turn.sample.token_ids) == 3 + k and turn.sample.token_ids[-1] == eos
        assert turn.sample.finish_reason == "stop"
        # the forced EOS's position in the turn, for the trainer to leave it unweighted
        assert turn.sample.flags == {"shown": list(range(1, 3 + k)), "forced_eos_at": 2 + k}
    assert result.turns[1].prompt_ids[len(PROMPTS[0]) + 2] == eos


class ContinueForever:
    def __call__(self, trajectory: TrajectoryResult):
        return Continue(OBSERVATION, {"turn": len(trajectory.turns)})


@pytest.mark.parametrize(
    ("limits", "status"),
    [
        (TrajectoryLimits(max_turns=2), "max_turns"),
        (TrajectoryLimits(max_tokens=12), "token_budget"),
        (TrajectoryLimits(max_context=len(PROMPTS[1]) + 20), "context_length"),
    ],
    ids=["turns", "tokens", "context"],
)
def test_limits_end_trajectories_with_their_reason(backend, limits, status):
    params = SamplingParams(temperature=1.0, max_tokens=8)
    trajectory = Trajectory(PROMPTS[1], seed=11, next_turn=ContinueForever())
    [result] = backend.generate_trajectories([trajectory], params, limits)
    assert result.status == status
    turns = result.turns
    assert [t.info for t in turns] == [{"turn": k + 1} for k in range(len(turns))]
    assert turns[-1].observation_ids == []  # the last observation went into no prompt
    if status == "max_turns":
        assert len(turns) == 2
    if status == "token_budget":  # turn 0 drew 8, the last one what was left of 12
        assert result.model_tokens == 12 and turns[-1].sample.finish_reason == "length"
    if status == "context_length":
        assert all(len(t.prompt_ids) + len(t.sample.token_ids) <= 27 for t in turns)
        assert len(result.token_ids) + len(OBSERVATION) >= 27
        assert len(turns) == 2


class Scripted:
    """A callback that misbehaves as told once the first turn has ended."""

    def __init__(self, how: str, release: threading.Event) -> None:
        self.how = how
        self.release = release

    def __call__(self, trajectory: TrajectoryResult):
        if self.how == "raise":
            raise RuntimeError("tool crashed")
        if self.how == "hang":
            self.release.wait(30)
            return Finish()
        return {
            "text": "not a reply",
            "negative": Continue([5, -1]),
            "past_vocab": Continue([10**6]),
            "not_ids": Continue("abc"),
            "info": Continue(OBSERVATION, info=["x"]),
        }[self.how]


FAILURES = {
    "raise": ("callback_error", "raised RuntimeError: tool crashed"),
    "hang": ("callback_timeout", "did not answer within 0.5 s"),
    "text": ("callback_error", "returned str, not Continue or Finish"),
    "negative": ("callback_error", "observation_ids hold [-1]"),
    "past_vocab": ("callback_error", "observation_ids hold [1000000]"),
    "not_ids": ("callback_error", "observation_ids is a str"),
    "info": ("callback_error", "info is a list"),
}


def test_a_failing_callback_ends_only_its_own_trajectory(backend):
    release = threading.Event()
    trajectories = [
        Trajectory(PROMPTS[0], seed=i, next_turn=Scripted(how, release), trajectory_id=how)
        for i, how in enumerate(FAILURES)
    ] + [Trajectory(PROMPTS[1], seed=99, next_turn=Observe(3), trajectory_id="fine")]
    limits = TrajectoryLimits(callback_timeout_s=0.5)
    try:
        results = backend.generate_trajectories(trajectories, SamplingParams(max_tokens=6), limits)
    finally:
        release.set()
    for result in results[:-1]:
        status, error = FAILURES[result.trajectory_id]
        assert (result.status, len(result.turns)) == (status, 1)
        assert error in result.error
    assert (results[-1].status, len(results[-1].turns)) == ("done", 3)


def test_trajectories_do_not_wait_for_each_other(vllm):
    """A trajectory whose callback waits until another trajectory has ended: on the request
    loop the other one goes on through its turns and ends first (a lock-step loop would wait
    for the stalled callback; the 30 s cap only keeps such a loop from hanging the test)."""
    other_ended = threading.Event()

    def stalled(trajectory):
        return Finish({"other_ended_first": other_ended.wait(30)})

    trajectories = [
        Trajectory(PROMPTS[0], seed=1, next_turn=stalled),
        Trajectory(PROMPTS[1], seed=2, next_turn=Observe(3)),
    ]
    ended = {}
    for index, result in vllm.iter_trajectories(trajectories, SamplingParams(max_tokens=8)):
        ended[index] = result
        other_ended.set()
    assert list(ended) == [1, 0]
    assert len(ended[1].turns) == 3
    assert ended[0].turns[0].info == {"other_ended_first": True}


def test_leaving_the_loop_early_aborts_what_is_in_flight(vllm, stop_after):
    trajectories = [
        Trajectory(PROMPTS[0], seed=1, stop_rule=lambda t: stop_after(2)),
        Trajectory(PROMPTS[1], seed=2, next_turn=Observe(3), stop_rule=lambda t: stop_after(150)),
    ]
    ended = vllm.iter_trajectories(trajectories, SamplingParams(max_tokens=200))
    index, _ = next(ended)
    assert index == 0 and vllm.llm.llm_engine.has_unfinished_requests()
    ended.close()
    assert not vllm.llm.llm_engine.has_unfinished_requests()
    assert not _ACTIVE_TRACKERS


def test_bad_first_prompts_are_refused_before_anything_runs(backend):
    params = SamplingParams(max_tokens=4)
    for prompt, match in (([], "empty"), ([5, 10**6], "outside"), ([5] * 300, "no room")):
        with pytest.raises(ValueError, match=match):
            backend.generate_trajectories(
                [Trajectory(prompt)], params, TrajectoryLimits(max_context=256)
            )


# --- partial rollouts (rlvr.generation.segments) ------------------------------------------------

PARTIAL = SamplingParams(temperature=1.0, max_tokens=12, seed=11)
BOUNDARY = 5


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
def versioned(request, weights):
    """A backend holding version 0, given back with it."""
    backend = request.getfixturevalue(request.param)
    backend.load_weights(weights[0].items())
    yield backend
    backend.load_weights(weights[0].items())


def _requests(n: int = 2) -> list[GenerationRequest]:
    return [GenerationRequest(p, n=n, seed=100 * i) for i, p in enumerate(PROMPTS)]


def test_each_part_is_what_its_own_version_samples(versioned, weights):
    versions = Versions(versioned, weights)
    partial = versioned.generate(
        _requests(), PARTIAL, segments=Segments(BOUNDARY, (0, 1), versions)
    )
    assert versions.held == [0, 1]

    versioned.load_weights(weights[0].items())
    heads = [s for r in versioned.generate(_requests(), PARTIAL) for s in r.samples]  # version 0
    versioned.load_weights(weights[1].items())
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
        (tail,) = versioned.generate(
            [GenerationRequest(request.prompt_ids + sample.token_ids[:BOUNDARY], seed=seed)],
            SamplingParams(temperature=1.0, max_tokens=PARTIAL.max_tokens - BOUNDARY),
        )[0].samples
        assert sample.token_ids[BOUNDARY:] == tail.token_ids
        assert sample.logprobs[BOUNDARY:] == pytest.approx(tail.logprobs, abs=LOGPROB_ATOL)
        assert sample.finish_reason == tail.finish_reason
        assert sample.flags[POLICY_VERSIONS] == [[0, BOUNDARY], [1, n - BOUNDARY]]
        assert sample.text == versioned.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    assert continued >= len(samples) // 2  # the tiny model seldom stops within 5 tokens


def test_no_pause_when_every_sample_ends_before_the_boundary(versioned, weights):
    versions = Versions(versioned, weights)
    short = SamplingParams(temperature=1.0, max_tokens=BOUNDARY, seed=3)
    out = versioned.generate(_requests(1), short, segments=Segments(BOUNDARY, (0, 1), versions))
    assert versions.held == [0]
    assert all(s.flags[POLICY_VERSIONS] == [[0, len(s.token_ids)]] for r in out for s in r.samples)
    # what the same call samples without segments, token for token (partial rollouts that never
    # pause are the plain ones)
    plain = versioned.generate(_requests(1), short)
    for r, q in zip(out, plain, strict=True):
        for s, t in zip(r.samples, q.samples, strict=True):
            assert (s.token_ids, s.finish_reason, s.text) == (t.token_ids, t.finish_reason, t.text)
            assert s.logprobs == pytest.approx(t.logprobs, abs=LOGPROB_ATOL)


def test_the_boundary_counts_model_tokens_over_all_turns(versioned, weights):
    versions = Versions(versioned, weights)
    boundary = 8  # inside the second turn of three, at 5 tokens each
    params = SamplingParams(temperature=1.0, max_tokens=5)
    trajectories = [Trajectory(p, seed=9 + i, next_turn=Observe()) for i, p in enumerate(PROMPTS)]
    results = versioned.generate_trajectories(
        trajectories, params, segments=Segments(boundary, (0, 1), versions)
    )
    assert versions.held == [0, 1]
    for result in results:
        assert result.status == "done" and len(result.turns) == 3  # a pause is not a turn
        for before, after in zip(result.turns, result.turns[1:], strict=False):
            assert after.prompt_ids == before.prompt_ids + before.sample.token_ids + OBSERVATION
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
