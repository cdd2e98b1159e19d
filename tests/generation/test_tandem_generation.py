"""Tandem co-generation in both engines against the two-model segment-loop oracle: the vLLM
combined model (senior + junior in lockstep in one engine) and the transformers lockstep loop give
the oracle's exact ids, authorship, finish reasons and counters for the same seeds, greedy and
sampled, also across preemptions and turn by turn in multi-turn rollouts; vLLM's request loop
co-writes exactly what its batch path does; the vocabulary check and the refused combinations;
and a GeneratorActor whose junior stays bit-identical while the senior is synced."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.generator import GeneratorActor
from rlvr.algorithms.tandem import (
    SENIOR,
    WordSwitchSchedule,
    tandem_generate_reference,
    word_boundary_ids,
)
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.tandem_support import counters_from_flags
from rlvr.generation.trajectories import Continue, Finish, Trajectory, turn_seed
from rlvr.models.tiny import build_tiny_model

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 7]]
SEEDS = [11, 2024, 7]
MAX_TOKENS = 24
ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "kv_cache_gib": 0.25}
JUST = (("junior", 0.0), ("senior", 1.0))
"""Schedules under which one model writes every token."""


@pytest.fixture(scope="module")
def hf(tiny_model_dir, junior_dir):
    return make_backend("hf", tiny_model_dir, dtype="float32", junior_path=junior_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, junior_dir):
    backend = make_backend("vllm", tiny_model_dir, junior_path=junior_dir, **ENGINE)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def schedule(hf):
    # K = 4 so cap-triggered redraws happen as well as boundary ones.
    return WordSwitchSchedule(word_boundary_ids(hf.tokenizer.get_vocab()), p=0.5, cap=4)


def _requests():
    return [
        GenerationRequest(prompt, n=2, request_id=str(i), seed=seed)
        for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True))
    ]


def _oracle(hf, schedule, prompt, seed, params):
    def logits_of(model):
        return lambda ids: model(torch.tensor([ids])).logits[0, -1]

    with torch.no_grad():
        return tandem_generate_reference(
            prompt,
            logits_of(hf.model),
            logits_of(hf.junior),
            schedule,
            seed,
            params.max_tokens,
            hf.stop_token_ids,
            temperature=params.temperature,
            top_p=params.top_p,
        )


@pytest.mark.parametrize("backend", ["vllm", "hf"])
@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_engines_equal_the_segment_loop_oracle(backend, temperature, top_p, engine, hf, schedule):
    gen = engine if backend == "vllm" else hf
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=MAX_TOKENS)
    results = gen.generate(_requests(), params, schedule=schedule)
    authors, cap_redraws = [], 0
    for result, prompt, seed in zip(results, PROMPTS, SEEDS, strict=True):
        for j, sample in enumerate(result.samples):
            want = _oracle(hf, schedule, prompt, seed + j, params)
            assert sample.token_ids == want.response_ids
            assert sample.authorship == want.authorship
            assert len(sample.authorship) == len(sample.token_ids)
            assert sample.finish_reason == want.finish_reason
            assert counters_from_flags(sample.flags) == want.counters
            assert sample.flags["tandem"]["redraws"] == want.counters.redraws
            authors += sample.authorship
            cap_redraws += want.counters.cap_redraws
    # Not a vacuous match: both models wrote, and the cap fired as well as word starts.
    assert 0 < sum(authors) < len(authors)
    assert cap_redraws > 0


def test_the_request_loop_co_writes_what_the_batch_path_co_writes(engine, schedule):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS)

    def rollouts(loop):
        results = engine.generate(_requests(), params, schedule=schedule, loop=loop)
        return [
            (s.token_ids, s.logprobs, s.authorship, s.flags) for r in results for s in r.samples
        ]

    assert rollouts("requests") == rollouts("batch")


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_every_turn_of_a_trajectory_is_co_written_from_its_own_seed(backend, engine, hf, schedule):
    """Turn t starts a fresh author state from turn_seed(seed, t): it is the oracle's rollout
    of that turn's prompt and seed."""
    gen = engine if backend == "vllm" else hf
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)

    def observe(trajectory):
        done = len(trajectory.turns) == 2
        return Finish() if done else Continue([7, 8, 9])

    trajectories = [
        Trajectory(prompt, seed=seed, next_turn=observe)
        for prompt, seed in zip(PROMPTS, SEEDS, strict=True)
    ]
    results = gen.generate_trajectories(trajectories, params, schedule=schedule)
    for trajectory, result in zip(trajectories, results, strict=True):
        assert [t.seed for t in result.turns] == [turn_seed(trajectory.seed, k) for k in (0, 1)]
        for turn in result.turns:
            want = _oracle(hf, schedule, turn.prompt_ids, turn.seed, params)
            assert turn.sample.token_ids == want.response_ids
            assert turn.sample.authorship == want.authorship
            assert counters_from_flags(turn.sample.flags) == want.counters


def test_sampled_log_probs_are_each_authors_processed_distribution(engine, hf, schedule):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS)
    request = [GenerationRequest(PROMPTS[0], n=1, seed=SEEDS[0])]
    sample = engine.generate(request, params, schedule=schedule)[0].samples[0]
    reference = hf.generate(request, params, schedule=schedule)[0].samples[0]
    assert sample.token_ids == reference.token_ids
    # vLLM saw each drawn token forced; the reported log-probs are the author's own.
    assert all(lp < 0 for lp in sample.logprobs)
    torch.testing.assert_close(
        torch.tensor(sample.logprobs), torch.tensor(reference.logprobs), atol=1e-4, rtol=0
    )


def test_an_all_senior_schedule_decodes_like_the_senior_alone(engine, schedule):
    all_senior = WordSwitchSchedule(schedule.boundary_ids, p=1.0, cap=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    tandem = engine.generate(_requests(), params, schedule=all_senior)
    solo = engine.generate(_requests(), params)
    for t, s in zip(tandem, solo, strict=True):
        for ts, ss in zip(t.samples, s.samples, strict=True):
            assert ts.token_ids == ss.token_ids
            assert ts.authorship == [SENIOR] * len(ts.token_ids)
            assert ss.authorship is None and "tandem" not in ss.flags


def test_a_junior_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", seed=0, corpus=["zebra quokka yak"] * 20)
    for backend, kwargs in (("hf", {"dtype": "float32"}), ("vllm", ENGINE)):
        with pytest.raises(ValueError, match="tokenizers differ"):
            make_backend(backend, tiny_model_dir, junior_path=other, **kwargs)


def test_tandem_needs_a_junior_and_excludes_stop_rules(
    tiny_model_dir, engine, schedule, stop_after
):
    solo = make_backend("hf", tiny_model_dir, dtype="float32")
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="needs a junior"):
        solo.generate(_requests(), params, schedule=schedule)
    with pytest.raises(ValueError, match="cannot be combined"):
        engine.generate(_requests(), params, lambda i, j: stop_after(2), schedule=schedule)


def test_preempted_requests_resume_their_author_state(tiny_model_dir, junior_dir, hf, schedule):
    # Room for 4 KV blocks of 128 tokens in both models: 8 samples of 4 + 200 tokens outgrow it,
    # so vLLM preempts running requests and recomputes them later from their emitted ids.
    small = make_backend(
        "vllm", tiny_model_dir, junior_path=junior_dir, **{**ENGINE, "kv_cache_gib": 0.002}
    )
    try:
        scheduler = small.llm.llm_engine.engine_core.engine_core.scheduler
        preempt = scheduler._preempt_request
        preempted = []

        def counting_preempt(request, *args, **kwargs):
            preempted.append(request.request_id)
            return preempt(request, *args, **kwargs)

        scheduler._preempt_request = counting_preempt
        requests = [
            GenerationRequest([5 + i, 6, 7, 8], n=2, request_id=str(i), seed=11 + i)
            for i in range(4)
        ]
        params = SamplingParams(temperature=1.0, max_tokens=200)
        got = small.generate(requests, params, schedule=schedule)
    finally:
        small.close()
    assert preempted
    want = hf.generate(requests, params, schedule=schedule)
    for g, w in zip(got, want, strict=True):
        for gs, ws in zip(g.samples, w.samples, strict=True):
            assert (gs.token_ids, gs.authorship, gs.flags) == (
                ws.token_ids,
                ws.authorship,
                ws.flags,
            )


def test_the_vllm_junior_stays_bit_identical_over_syncs(tiny_model_dir, schedule):
    # The junior is the senior's own base, as in TRL; syncs bring new senior weights each step.
    generator = GeneratorActor(
        "vllm",
        str(tiny_model_dir),
        threads=1,
        tandem={"junior_path": str(tiny_model_dir), "p": 0.5, "cap": 8},
        **{**ENGINE, "kv_cache_gib": 0.125},
    )
    backend = generator.backend
    only = {who: WordSwitchSchedule(schedule.boundary_ids, p=p, cap=8) for who, p in JUST}
    probe = [GenerationRequest([5, 6, 7], seed=3), GenerationRequest([40, 41], seed=4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def behaviour(who):
        """Token ids and log-probs of greedy rollouts written by one model alone."""
        results = backend.generate(probe, greedy, schedule=only[who])
        return [(s.token_ids, s.logprobs) for r in results for s in r.samples]

    def junior_tensors():
        # vLLM on CPU packs linear weights into oneDNN handles (empty parameters); the
        # embedding, norms and biases stay plain tensors.
        return backend.llm.apply_model(
            lambda m: {n: p.detach().clone() for n, p in m.tandem_junior.named_parameters()}
        )[0]

    try:
        before = {who: behaviour(who) for who, _ in JUST}
        junior_before = junior_tensors()
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        noise = torch.Generator().manual_seed(0)
        for step in range(3):
            rollouts = generator.generate(_requests(), SamplingParams(max_tokens=8), tandem=True)
            assert all(s.authorship is not None for r in rollouts for s in r.samples)
            weights = {
                name: p.detach() + 0.05 * torch.randn(p.shape, generator=noise)
                for name, p in base.named_parameters()
            }
            assert generator.update_weights(weights) == step + 1
        assert behaviour("junior") == before["junior"]
        assert behaviour("senior") != before["senior"]
        junior_after = junior_tensors()
        assert junior_after.keys() == junior_before.keys()
        assert all(torch.equal(junior_after[n], junior_before[n]) for n in junior_before)
        assert any(t.numel() for t in junior_after.values())
    finally:
        backend.close()
