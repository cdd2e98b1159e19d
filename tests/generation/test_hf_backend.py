"""HFBackend: vLLM-equivalent sampling math, KV-cached left-padded loop, seeds, stop rules, weights."""

import math

import pytest
import torch

from rlvr.generation import make_backend
from rlvr.generation.base import GenerationBackend, GenerationRequest, SamplingParams
from rlvr.generation.hf_backend import HFBackend, processed_logprobs

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100]]


@pytest.fixture(scope="module")
def hf(tiny_model_dir) -> HFBackend:
    return make_backend("hf", tiny_model_dir, dtype="float32")


def test_processed_logprobs_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    # Greedy reports the raw distribution.
    assert torch.allclose(processed_logprobs(logits, 0.0, 0.5).exp(), logits.exp())
    # T=2 on logits [0, ln 4] gives [0, ln 2]: probabilities 1/3, 2/3.
    two = torch.tensor([[0.0, math.log(4.0)]])
    assert torch.allclose(processed_logprobs(two, 2.0, 1.0).exp(), torch.tensor([[1 / 3, 2 / 3]]))
    # top_p=0.5: mass below 0.3 is 0.3 <= 0.5, below 0.4 is 0.6 > 0.5 -> keep {0.3, 0.4}.
    kept = processed_logprobs(logits, 1.0, 0.5).exp()
    assert torch.allclose(kept, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]))
    # top_p=0.85: only 0.1 lies in the bottom 0.15 -> keep {0.2, 0.3, 0.4} renormalised by 0.9.
    kept = processed_logprobs(logits, 1.0, 0.85).exp()
    assert torch.allclose(kept, torch.tensor([[0.0, 2 / 9, 3 / 9, 4 / 9]]))
    # A top_p below the top token's mass still keeps the top token.
    assert torch.allclose(
        processed_logprobs(logits, 1.0, 0.01).exp(), torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    )


def test_is_a_generation_backend(hf):
    assert isinstance(hf, GenerationBackend)


def test_logprobs_match_a_teacher_forced_pass(hf):
    """Left padding, positions and the KV cache are right iff each sample's log-probs equal an
    unpadded full forward pass over prompt + response."""
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, seed=1)
    results = hf.generate([GenerationRequest(p, n=2) for p in PROMPTS], params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        for sample in result.samples:
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = hf.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            want = processed_logprobs(logits, 0.7, 0.9)
            want = want.gather(1, torch.tensor(sample.token_ids).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor(sample.logprobs), want, atol=1e-4)


def test_seeded_sampling_replays_and_sample_j_uses_seed_plus_j(hf):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    first = hf.generate([GenerationRequest(PROMPTS[0], n=3)], params)[0].samples
    again = hf.generate([GenerationRequest(PROMPTS[0], n=3)], params)[0].samples
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert len({tuple(s.token_ids) for s in first}) == 3
    alone = hf.generate(
        [GenerationRequest(PROMPTS[0], n=1)], SamplingParams(temperature=1.0, max_tokens=10, seed=9)
    )[0].samples[0]
    assert alone.token_ids == first[2].token_ids


def test_max_tokens_gives_length_and_n_zero_gives_no_samples(hf):
    results = hf.generate(
        [GenerationRequest(PROMPTS[1], n=2, request_id="a"), GenerationRequest(PROMPTS[2], n=0)],
        SamplingParams(temperature=0.0, max_tokens=4),
    )
    assert [r.request_id for r in results] == ["a", ""]
    assert results[1].samples == []
    for sample in results[0].samples:
        assert len(sample.token_ids) == len(sample.logprobs) == 4
        assert sample.finish_reason == "length"
        assert sample.flags == {}
        assert sample.text == hf.tokenizer.decode(sample.token_ids, skip_special_tokens=True)


def test_stop_rules_force_eos_exactly_there(hf, stop_after, stop_on_token):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    free = hf.generate([GenerationRequest(PROMPTS[0], n=1)], params)[0].samples[0]
    assert hf.eos_token_id not in free.token_ids[:6]
    after5 = hf.generate([GenerationRequest(PROMPTS[0])], params, lambda i, j: stop_after(5))
    sample = after5[0].samples[0]
    assert sample.token_ids == free.token_ids[:5] + [hf.eos_token_id]
    assert sample.logprobs[:5] == pytest.approx(free.logprobs[:5], abs=1e-5)
    assert sample.logprobs[5] == 0.0  # the forced EOS had probability 1
    assert sample.finish_reason == "stop"
    assert sample.flags == {"shown": [1, 2, 3, 4, 5], "forced_eos_at": 5}

    token = free.token_ids[2]
    first = free.token_ids.index(token)
    on_token = hf.generate(
        [GenerationRequest(PROMPTS[0])], params, lambda i, j: stop_on_token(token)
    )
    sample = on_token[0].samples[0]
    assert sample.token_ids == free.token_ids[: first + 1] + [hf.eos_token_id]
    assert sample.flags == {"aborted": True, "at": first + 1, "forced_eos_at": first + 1}


def test_load_weights_in_place_and_strict_names(tiny_model_dir):
    hf = HFBackend(tiny_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = hf.generate([GenerationRequest(p) for p in PROMPTS], params)
    original = {name: p.detach().clone() for name, p in hf.model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        name: p + 0.5 * torch.randn(p.shape, generator=generator) for name, p in original.items()
    }
    hf.load_weights(perturbed.items())
    assert hf.model.lm_head.weight is hf.model.model.embed_tokens.weight  # tie survives
    after = hf.generate([GenerationRequest(p) for p in PROMPTS], params)
    assert [r.samples[0].token_ids for r in after] != [r.samples[0].token_ids for r in before]
    # state_dict() naming (with the tied lm_head alias) is accepted too.
    hf.load_weights({**original, "lm_head.weight": original["model.embed_tokens.weight"]}.items())
    restored = hf.generate([GenerationRequest(p) for p in PROMPTS], params)
    assert [r.samples[0].token_ids for r in restored] == [r.samples[0].token_ids for r in before]

    missing = dict(original)
    del missing["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        hf.load_weights(missing.items())
    with pytest.raises(ValueError, match=r"unknown \['model.extra'\]"):
        hf.load_weights({**original, "model.extra": torch.zeros(1)}.items())
