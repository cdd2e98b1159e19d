"""Tandem with the junior on an engine of its own (`rlvr.generation.tandem_separate`): senior and
junior transformers engines handing samples over by token ids write exactly the tokens, authorship,
finish reasons and counters of the shared engine (the junior inside the senior's) for the same
seeds, greedy and sampled, with stop strings and at the length limit; a GeneratorActor with a
companion junior does the same; a segment ends where the schedule hands over.

Log-probs: the engine taking over prefills the whole context where the shared engine decoded it
token by token, so a few fp32 ulps may differ (~1e-6); LOGPROB_ATOL gives 100x room, far below
what a wrong token or author would change (> 1e-2).
"""

import numpy as np
import pytest
import torch

from actors.generator import GeneratorActor
from rlvr.algorithms.tandem import JUNIOR, SENIOR, WordSwitchSchedule, word_boundary_ids
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.tandem_separate import (
    Handoff,
    cowrite,
    cowrite_continuous,
    ready,
    start_handoffs,
)

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 7]]
SEEDS = [11, 2024, 7]
MAX_TOKENS = 24
LOGPROB_ATOL = 1e-4
VLLM_ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "enforce_eager": True,
    "kv_cache_gib": 0.25,
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the engines' batches are tiny, and spinning threads on shared cores cost
    far more than they compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shared(tiny_model_dir, junior_dir):
    return make_backend("hf", tiny_model_dir, dtype="float32", junior_path=junior_dir)


@pytest.fixture(scope="module")
def senior(tiny_model_dir):
    return make_backend("hf", tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def junior(junior_dir):
    return make_backend("hf", junior_dir, dtype="float32")


@pytest.fixture(scope="module")
def vllm_pair(tiny_model_dir, junior_dir):
    """Senior and junior each on a vLLM engine of its own."""
    senior = make_backend("vllm", tiny_model_dir, tandem_segments=True, **VLLM_ENGINE)
    junior = make_backend("vllm", junior_dir, tandem_segments=True, **VLLM_ENGINE)
    yield senior, junior
    junior.close()
    senior.close()


@pytest.fixture(params=["hf", "vllm"])
def pair(request, senior, junior):
    """(senior, junior) engines of one kind."""
    return (senior, junior) if request.param == "hf" else request.getfixturevalue("vllm_pair")


@pytest.fixture(scope="module")
def schedule(shared):
    # K = 4 so cap-triggered redraws happen as well as boundary ones.
    return WordSwitchSchedule(word_boundary_ids(shared.tokenizer.get_vocab()), p=0.5, cap=4)


def _requests(n: int = 2) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt, n=n, request_id=str(i), seed=seed)
        for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True))
    ]


def _separate(senior, junior, requests, params, schedule):
    """`cowrite` over the two in-process engines; also returns each round's segment count."""
    stop = sorted(senior.stop_token_ids)
    rounds: list[tuple[int, int]] = []

    def writer(engine, author):
        def start(handoffs):
            rounds.append((author, len(handoffs)))
            return ready(engine.write_segments(handoffs, params, schedule, author, stop))

        return start

    results = cowrite(
        requests,
        params,
        schedule,
        writer(senior, SENIOR),
        writer(junior, JUNIOR),
        lambda ids: senior.tokenizer.decode(ids, skip_special_tokens=True),
        senior.context_limit,
    )
    return results, rounds


def _rollouts(results) -> list[tuple]:
    return [
        (r.request_id, s.token_ids, s.text, s.finish_reason, s.flags, s.authorship)
        for r in results
        for s in r.samples
    ]


def _assert_same(got, want) -> None:
    assert _rollouts(got) == _rollouts(want)
    for g, w in zip(got, want, strict=True):
        for gs, ws in zip(g.samples, w.samples, strict=True):
            np.testing.assert_allclose(gs.logprobs, ws.logprobs, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize(
    ("temperature", "top_p", "stop"),
    [(0.0, 1.0, ()), (1.0, 1.0, ()), (0.8, 0.9, ("7",))],
    ids=["greedy", "sampled", "top-p+stop"],
)
def test_separate_engines_write_what_the_shared_engine_writes(
    shared, pair, schedule, temperature, top_p, stop
):
    params = SamplingParams(temperature, top_p, max_tokens=MAX_TOKENS, stop=stop)
    want = shared.generate(_requests(), params, schedule=schedule)
    got, rounds = _separate(*pair, _requests(), params, schedule)
    _assert_same(got, want)
    authors = [a for r in got for s in r.samples for a in s.authorship]
    # Not a vacuous match: both models wrote, samples changed hands between rounds.
    assert 0 < sum(authors) < len(authors)
    assert {a for a, count in rounds if count} == {SENIOR, JUNIOR} and len(rounds) > 4


@pytest.mark.parametrize(
    ("temperature", "top_p", "stop"),
    [(1.0, 1.0, ()), (0.8, 0.9, ("7",))],
    ids=["sampled", "top-p+stop"],
)
def test_a_continuous_hand_over_writes_what_the_shared_engine_writes(
    shared, vllm_pair, schedule, temperature, top_p, stop
):
    """`cowrite_continuous` on two vLLM streams: segments join the other engine's running batch
    as they end, yet every sample is the shared engine's. The streams never ran in lockstep
    rounds: some step ended a segment while the other engine was writing."""
    senior, junior = vllm_pair
    params = SamplingParams(temperature, top_p, max_tokens=MAX_TOKENS, stop=stop)
    want = shared.generate(_requests(), params, schedule=schedule)
    stop_ids = sorted(senior.stop_token_ids)
    streams = [
        engine.segment_stream(params, schedule, author, stop_ids)
        for engine, author in ((senior, SENIOR), (junior, JUNIOR))
    ]
    overlapped = []

    class Watched:
        """A stream that records, at each step that ends segments, whether the other stream
        had segments running meanwhile."""

        def __init__(self, stream, other):
            self.stream, self.other = stream, other

        def __len__(self):
            return len(self.stream)

        def add(self, handoffs):
            self.stream.add(handoffs)

        def step(self, wait=True):
            written = self.stream.step(wait)
            if written:
                overlapped.append(len(self.other) > 0)
            return written

    try:
        got = cowrite_continuous(
            _requests(),
            params,
            schedule,
            Watched(streams[0], streams[1]),
            Watched(streams[1], streams[0]),
            lambda ids: senior.tokenizer.decode(ids, skip_special_tokens=True),
            senior.context_limit,
        )
    finally:
        for stream in streams:
            stream.close()
    _assert_same(got, want)
    assert any(overlapped) and len(overlapped) > 4


def test_a_segment_ends_where_the_schedule_hands_over(pair, schedule):
    senior, junior = pair
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    handoffs = start_handoffs(_requests(1), params, senior.context_limit)
    for h in handoffs:
        author = schedule.start(h.seed).author
        engine = senior if author == SENIOR else junior
        (out,) = engine.write_segments([h], params, schedule, author, senior.stop_token_ids)
        state = schedule.replay(h.seed, out.response_ids)
        whole = schedule.authorship(h.seed, out.response_ids)
        assert whole == [author] * len(out.response_ids)  # only the author's own tokens
        if out.finish_reason is None:
            assert state.author != author  # ...up to the hand-over
        assert out.generator_state is not None
        with pytest.raises(ValueError, match="not this engine's"):
            engine.write_segments([h], params, schedule, 1 - author, senior.stop_token_ids)


def test_the_length_limit_ends_a_sample_on_either_engine(shared, pair, schedule):
    params = SamplingParams(temperature=1.0, max_tokens=3)
    want = shared.generate(_requests(3), params, schedule=schedule)
    got, _ = _separate(*pair, _requests(3), params, schedule)
    _assert_same(got, want)
    assert {s.finish_reason for r in got for s in r.samples} == {"length"}


def test_a_stop_string_the_last_allowed_token_completes_stops_the_sample(shared, pair, schedule):
    """The token that completes a stop string is the sample's last allowed one: the sample ends
    'stop', not 'length', on either engine kind (vLLM's engine ends it on its length before a
    step could see the string, so the segment's end reads it afterwards)."""
    params = SamplingParams(temperature=1.0, max_tokens=6)
    decode = shared.tokenizer.decode
    stop = None
    for result in shared.generate(_requests(1), params, schedule=schedule):
        for sample in result.samples:
            head = decode(sample.token_ids[:-1], skip_special_tokens=True)
            text = decode(sample.token_ids, skip_special_tokens=True)
            if len(text) > len(head) and text[len(head) :] not in head:
                stop = text[len(head) :]  # first completed by the last token
                break
        if stop is not None:
            break
    assert stop is not None
    params = SamplingParams(temperature=1.0, max_tokens=6, stop=(stop,))
    want = shared.generate(_requests(1), params, schedule=schedule)
    got, _ = _separate(*pair, _requests(1), params, schedule)
    _assert_same(got, want)
    assert any(s.finish_reason == "stop" and len(s.token_ids) == 6 for r in got for s in r.samples)


def test_one_sided_schedules_never_hand_over(senior, junior, schedule):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for p, author, engine in ((1.0, SENIOR, senior), (0.0, JUNIOR, junior)):
        one_sided = WordSwitchSchedule(schedule.boundary_ids, p=p, cap=4)
        got, rounds = _separate(senior, junior, _requests(1), params, one_sided)
        assert rounds == [(JUNIOR, 3 * (author == JUNIOR)), (SENIOR, 3 * (author == SENIOR))]
        alone = engine.generate(_requests(1), params)
        for g, a in zip(got, alone, strict=True):
            assert [s.token_ids for s in g.samples] == [s.token_ids for s in a.samples]
            assert all(s.authorship == [author] * len(s.token_ids) for s in g.samples)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_generator_actor_with_a_companion_junior_writes_the_shared_rollouts(
    tiny_model_dir, junior_dir, backend
):
    """The companion and the separate senior run on `backend`; the reference is the shared
    transformers engine (vLLM's shared engine writes its tokens, tests/generation/
    test_tandem_generation.py)."""
    tandem = {"junior_path": str(junior_dir), "p": 0.5, "cap": 4}
    engine = {"dtype": "float32"} if backend == "hf" else VLLM_ENGINE
    shared = GeneratorActor("hf", str(tiny_model_dir), threads=1, tandem=tandem, dtype="float32")
    companion = GeneratorActor(
        backend, str(junior_dir), threads=1, tandem={"p": 0.5, "cap": 4, "role": "junior"}, **engine
    )
    separate = GeneratorActor(
        backend,
        str(tiny_model_dir),
        threads=1,
        tandem={**tandem, "junior": "separate"},
        companion=companion,
        **engine,
    )
    params = SamplingParams(temperature=1.0, max_tokens=16)
    _assert_same(
        separate.generate(_requests(), params, tandem=True),
        shared.generate(_requests(), params, tandem=True),
    )
    tokens = separate.stats()["tokens"]
    assert 0 < companion.stats()["tokens"] < tokens  # the junior wrote its share, no more
    # plain sampling stays the senior's alone; the companion writes no rollout of its own
    solo = separate.generate(_requests(), params)
    assert all(s.authorship is None for r in solo for s in r.samples)
    with pytest.raises(ValueError, match="needs a GeneratorActor started with a junior"):
        companion.generate(_requests(), params, tandem=True)
    with pytest.raises(ValueError, match="junior's own engine only"):
        separate.write_segments([Handoff(0, [5], 1, 4)], params, [0])
    with pytest.raises(ValueError, match="needs its engine"):
        GeneratorActor(
            "hf", str(tiny_model_dir), threads=1, tandem={**tandem, "junior": "separate"}
        )
    for actor in (separate, companion):
        actor.backend.close()
