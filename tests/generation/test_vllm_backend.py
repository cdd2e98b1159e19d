"""VLLMBackend against the transformers reference: greedy agreement, log-probs, seeds, stop rules
inside the engine, in-place weight loading; and the logits processor's row bookkeeping."""

import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.generation import make_backend
from rlvr.generation.base import GenerationBackend, GenerationRequest, SamplingParams
from rlvr.generation.hf_backend import HFBackend, processed_logprobs
from rlvr.generation.stop_rules import StopRuleTracker
from rlvr.generation.vllm_backend import (
    _ACTIVE_TRACKERS,
    _STOP_RULE_KEY,
    ForcedEOSLogitsProcessor,
    VLLMBackend,
)
from rlvr.training.engine_mismatch import mismatch, results_batch, trainer_logprobs

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100], [3, 9, 27, 81, 243, 17]]
ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "kv_cache_gib": 0.25}


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> VLLMBackend:
    backend = make_backend("vllm", tiny_model_dir, **ENGINE)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir) -> HFBackend:
    return make_backend("hf", tiny_model_dir, dtype="float32")


def _token_ids(results):
    return [[s.token_ids for s in r.samples] for r in results]


def test_logits_processor_follows_added_removed_moved_rows(stop_after):
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    eos = 3
    trackers = {key: StopRuleTracker(stop_after(2), eos) for key in ("a", "c")}
    _ACTIVE_TRACKERS.update(trackers)
    try:

        def params(key):
            return VLLMSamplingParams(extra_args={_STOP_RULE_KEY: key} if key else None)

        outputs = {"a": [11], "b": [12, 13], "c": [14]}
        proc = ForcedEOSLogitsProcessor(None, torch.device("cpu"), False)
        proc.update_state(
            BatchUpdate(
                batch_size=3,
                removed=[],
                added=[
                    (i, params(k if k != "b" else None), None, outputs[k])
                    for i, k in enumerate("abc")
                ],
                moved=[],
            )
        )
        logits = proc.apply(torch.zeros(3, 5))
        assert torch.equal(logits, torch.zeros(3, 5))  # each rule saw one token: no stop yet
        outputs["a"].append(21)  # 'a' (row 0) reaches 2 tokens -> forced EOS
        logits = proc.apply(torch.zeros(3, 5))
        forced = torch.full((5,), float("-inf"))
        forced[eos] = 0.0
        assert torch.equal(logits[0], forced)
        assert torch.equal(logits[1:], torch.zeros(2, 5))

        # 'b' (row 1) leaves, 'a' and 'c' swap, then 'c' (now row 0) moves into row 1.
        proc.update_state(
            BatchUpdate(
                batch_size=2,
                removed=[1],
                added=[],
                moved=[(0, 2, MoveDirectionality.SWAP), (0, 1, MoveDirectionality.UNIDIRECTIONAL)],
            )
        )
        logits = proc.apply(torch.zeros(3, 5))
        assert torch.equal(logits[2], forced)  # 'a' followed its row
        assert torch.equal(logits[:2], torch.zeros(2, 5))
        outputs["c"].append(22)
        logits = proc.apply(torch.zeros(3, 5))
        assert torch.equal(logits[1], forced)  # 'c' lives in row 1 now
        assert torch.equal(logits[0], torch.zeros(5))
        assert trackers["a"].rule.shown == [1, 2]
        assert trackers["c"].rule.shown == [1, 2]
    finally:
        for key in trackers:
            del _ACTIVE_TRACKERS[key]


def test_is_a_generation_backend(engine):
    assert isinstance(engine, GenerationBackend)


def test_greedy_agrees_with_transformers(engine, hf):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    requests = [GenerationRequest(p, request_id=str(i)) for i, p in enumerate(PROMPTS)]
    from_vllm = engine.generate(requests, params)
    from_hf = hf.generate(requests, params)
    assert [r.request_id for r in from_vllm] == ["0", "1", "2", "3"]
    assert _token_ids(from_vllm) == _token_ids(from_hf)
    for a, b in zip(from_vllm, from_hf, strict=True):
        assert a.samples[0].text == b.samples[0].text
        assert a.samples[0].logprobs == pytest.approx(b.samples[0].logprobs, abs=1e-3)


@pytest.mark.parametrize("temperature,top_p", [(0.8, 1.0), (1.3, 0.9)])
def test_sampled_logprobs_are_the_processed_distribution(engine, hf, temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=12, seed=5)
    results = engine.generate([GenerationRequest(p, n=2) for p in PROMPTS], params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        for sample in result.samples:
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = hf.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            want = processed_logprobs(logits, temperature, top_p)
            want = want.gather(1, torch.tensor(sample.token_ids).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor(sample.logprobs), want, atol=1e-3)


def test_seeded_sampling_replays_and_sample_j_uses_seed_plus_j(engine):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    first = engine.generate([GenerationRequest(PROMPTS[0], n=3)], params)
    again = engine.generate([GenerationRequest(PROMPTS[0], n=3)], params)
    assert _token_ids(first) == _token_ids(again)
    assert len({tuple(ids) for ids in _token_ids(first)[0]}) == 3
    alone = engine.generate(
        [GenerationRequest(PROMPTS[0])], SamplingParams(temperature=1.0, max_tokens=10, seed=9)
    )
    assert _token_ids(alone)[0][0] == _token_ids(first)[0][2]


def test_n_samples_max_tokens_length_and_empty_request(engine):
    results = engine.generate(
        [GenerationRequest(PROMPTS[1], n=3, request_id="a"), GenerationRequest(PROMPTS[2], n=0)],
        SamplingParams(temperature=1.0, max_tokens=5, seed=0),
    )
    assert [r.request_id for r in results] == ["a", ""]
    assert results[0].prompt_ids == PROMPTS[1]
    assert results[1].samples == []
    for sample in results[0].samples:
        assert len(sample.token_ids) == len(sample.logprobs) == 5
        assert sample.finish_reason == "length"
        assert sample.flags == {}


def test_stop_strings_end_samples_where_transformers_ends_them(engine, hf):
    """A stop string ends a sample with the token that completes it: that token stays in the ids
    and log-probs, the text stops before the string, the finish reason is 'stop'; both backends
    agree token for token (greedy, so the draws are the same)."""
    requests = [GenerationRequest(p, request_id=str(i)) for i, p in enumerate(PROMPTS)]
    free = engine.generate(requests, SamplingParams(temperature=0.0, max_tokens=24))
    tokens = free[0].samples[0].token_ids
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    completes = next(
        k
        for k in range(1, len(tokens) + 1)
        if stop in engine.tokenizer.decode(tokens[:k], skip_special_tokens=True)
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=(stop, "never-seen"))
    from_vllm, from_hf = engine.generate(requests, params), hf.generate(requests, params)
    first = from_vllm[0].samples[0]
    assert first.token_ids == tokens[:completes]
    assert len(first.logprobs) == completes
    assert first.finish_reason == "stop"
    assert first.text == text[: text.index(stop)]
    assert _token_ids(from_vllm) == _token_ids(from_hf)
    for a, b in zip(from_vllm, from_hf, strict=True):
        assert (a.samples[0].text, a.samples[0].finish_reason) == (
            b.samples[0].text,
            b.samples[0].finish_reason,
        )
        assert stop not in a.samples[0].text


def test_stop_rules_force_eos_inside_the_engine(engine, hf, stop_after, stop_on_token):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    free = engine.generate([GenerationRequest(PROMPTS[0])], params)[0].samples[0]
    assert engine.eos_token_id not in free.token_ids[:6]
    after5 = engine.generate([GenerationRequest(PROMPTS[0])], params, lambda i, j: stop_after(5))
    sample = after5[0].samples[0]
    assert sample.token_ids == free.token_ids[:5] + [engine.eos_token_id]
    assert sample.logprobs[5] == 0.0
    assert sample.finish_reason == "stop"
    assert sample.flags == {"shown": [1, 2, 3, 4, 5], "forced_eos_at": 5}

    token = free.token_ids[2]
    first = free.token_ids.index(token)
    on_token = engine.generate(
        [GenerationRequest(PROMPTS[0])], params, lambda i, j: stop_on_token(token)
    )
    sample = on_token[0].samples[0]
    assert sample.token_ids == free.token_ids[: first + 1] + [engine.eos_token_id]
    assert sample.finish_reason == "stop"
    assert sample.flags == {"aborted": True, "at": first + 1, "forced_eos_at": first + 1}

    # Per-sample rules in a mixed batch, greedy, in both backends: rule k stops sample k at k+1.
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    requests = [GenerationRequest(p, n=2) for p in PROMPTS[:2]]
    factory = lambda i, j: stop_after(1 + 2 * i + j)  # noqa: E731
    from_vllm = engine.generate(requests, greedy, factory)
    from_hf = hf.generate(requests, greedy, factory)
    assert _token_ids(from_vllm) == _token_ids(from_hf)
    assert [[len(s.token_ids) for s in r.samples] for r in from_vllm] == [[2, 3], [4, 5]]
    assert [[s.flags for s in r.samples] for r in from_vllm] == [
        [{"shown": list(range(1, k + 1)), "forced_eos_at": k} for k in (1 + 2 * i, 2 + 2 * i)]
        for i in range(2)
    ]


def test_load_weights_matches_a_fresh_engine_on_saved_weights(engine, hf, tiny_model_dir, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    requests = [GenerationRequest(p) for p in PROMPTS]
    before = _token_ids(engine.generate(requests, params))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        name: p + 0.5 * torch.randn(p.shape, generator=generator) for name, p in original.items()
    }
    model.load_state_dict(perturbed, strict=False)
    saved = shutil.copytree(tiny_model_dir, tmp_path / "perturbed")  # tokenizer and all
    model.save_pretrained(saved)

    engine.load_weights(perturbed.items())
    after = _token_ids(engine.generate(requests, params))
    assert after != before
    fresh = VLLMBackend(saved, **ENGINE)
    try:
        assert _token_ids(fresh.generate(requests, params)) == after
    finally:
        fresh.close()
    hf.load_weights(perturbed.items())
    assert _token_ids(hf.generate(requests, params)) == after

    engine.load_weights(original.items())  # a second reload restores the start exactly
    assert _token_ids(engine.generate(requests, params)) == before
    hf.load_weights(original.items())
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        engine.load_weights((n, t) for n, t in original.items() if n != "model.norm.weight")


def test_seeded_sampling_survives_prompts_beyond_one_step_budget(engine):
    """More prompt tokens than one engine step takes: seeded requests must not crash on CPU."""
    long_prompt = (PROMPTS[0] * 40)[:200]
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    n_requests = budget // len(long_prompt) + 8
    requests = [GenerationRequest(long_prompt, n=1, seed=1000 + i) for i in range(n_requests)]
    results = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=2))
    assert len(results) == n_requests
    again = engine.generate(requests[:3], SamplingParams(temperature=1.0, max_tokens=2))
    assert [r.samples[0].token_ids for r in again] == [r.samples[0].token_ids for r in results[:3]]


def test_cpu_sleep_frees_the_kv_cache_and_waking_samples_as_before(engine):
    """On CPU `sleep` releases the KV cache's memory (its tensors stay, as views of empty
    storages) and `wake_up` gives it back: the same seeds then sample the same tokens."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    requests = [GenerationRequest(p, n=2) for p in PROMPTS]
    before = engine.generate(requests, params)

    def kv_bytes(worker) -> int:  # the layers' caches are views of shared storages
        storages = [t.untyped_storage() for t in worker.model_runner.kv_caches]
        return sum({s.data_ptr(): s.nbytes() for s in storages}.values())

    held = engine.llm.collective_rpc(kv_bytes)[0]
    assert held >= ENGINE["kv_cache_gib"] * 2**30 * 0.9  # vLLM rounds to whole blocks
    engine.sleep(1)
    engine.sleep(1)  # already asleep: nothing more to free, nothing lost
    assert engine.llm.collective_rpc(kv_bytes) == [0]
    engine.wake_up(["weights"])  # the weights never left: the KV cache stays free
    assert engine.llm.collective_rpc(kv_bytes) == [0]
    engine.wake_up(["kv_cache"])
    assert engine.llm.collective_rpc(kv_bytes) == [held]
    assert _token_ids(engine.generate(requests, params)) == _token_ids(before)


def test_request_seed_overrides_params_seed(engine):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    same = engine.generate([GenerationRequest(PROMPTS[0], seed=123)] * 2, params)
    other = engine.generate([GenerationRequest(PROMPTS[0], seed=124)], params)
    assert same[0].samples[0].token_ids == same[1].samples[0].token_ids
    assert same[0].samples[0].token_ids != other[0].samples[0].token_ids


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_trainer_logprobs_at_the_sampling_temperature_match_the_engine(engine, hf, top_p):
    """The trainer's log-probs of vLLM's sampled tokens (softmax(logits / T), truncated to the
    same top-p nucleus) equal vLLM's own, so the importance ratio of identical weights is 1.

    fp32 on CPU, different kernels for the same math: agreement to ~1e-5, checked at 1e-4, and so
    the mean ratio within 1e-4 of 1. Over the full tempered softmax instead, the ratio is each
    position's nucleus mass (engine >= trainer token by token); without the temperature the gap
    is over 0.1 nat even at T 0.9.
    """
    params = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=24, seed=11)
    results = engine.generate([GenerationRequest(p, n=4) for p in PROMPTS], params)
    batch = results_batch(results, pad_id=0)
    stats = mismatch(batch, *trainer_logprobs(hf.model, batch, 0.9, top_p))
    assert stats["engine_tokens"] > 300
    assert stats["max_abs_logp_diff"] < 1e-4
    assert stats["engine_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert abs(stats["engine_kl"]) < 1e-4
    if top_p == 1.0:
        raw = mismatch(batch, *trainer_logprobs(hf.model, batch, temperature=1.0))
        assert raw["max_abs_logp_diff"] > 0.05
    else:
        full, _ = trainer_logprobs(hf.model, batch, temperature=0.9)
        compared = batch.response_mask & (batch.rollout_logp != 0)
        assert (batch.rollout_logp - full)[compared].min() > -1e-4
        assert mismatch(batch, full)["engine_ratio_mean"] < 0.99


def test_tensor_parallel_engine_samples_and_loads_what_one_worker_does(engine, tiny_model_dir):
    """Two tensor-parallel workers (processes of their own, one core each) sample the same tokens
    and score the same log-probs as the one-worker engine, before and after a weight load."""
    tp = make_backend("vllm", tiny_model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=0)
        requests = [GenerationRequest(p, n=2, request_id=str(i)) for i, p in enumerate(PROMPTS)]
        assert _token_ids(tp.generate(requests, params)) == _token_ids(
            engine.generate(requests, params)
        )
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        scaled = {name: p.detach() * 1.01 for name, p in model.named_parameters()}
        sequences, positions = [PROMPTS[1]], [[2, 3, 4, 5, 6]]
        before = engine.score_logprobs(sequences, positions)
        try:
            tp.load_weights(scaled.items())
            engine.load_weights(scaled.items())
            after = tp.score_logprobs(sequences, positions)
            # row-parallel layers (o_proj, down_proj) add two partial sums: fp32 rounding only
            np.testing.assert_allclose(
                after, engine.score_logprobs(sequences, positions), atol=1e-5
            )
            assert not np.allclose(after, before, atol=1e-3)
        finally:
            engine.load_weights(model.named_parameters())
    finally:
        tp.close()
