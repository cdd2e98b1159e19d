"""Teacher-forced scoring (DRO's R3 input) on both generation backends: the batched pass equals a
naive prefix-by-prefix loop (no off-by-one), and vLLM prompt log-probs agree with transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.generation import make_backend

# Ragged rows; positions are each row's last tokens (where a reference answer would sit).
SEQUENCES = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 300, 12, 55, 81, 243, 17, 2]]
POSITIONS = [[3, 4, 5], [1, 2], [6, 7, 8]]
ENGINE = {"dtype": "float32", "max_model_len": 64, "enforce_eager": True, "kv_cache_gib": 0.25}


@pytest.fixture(scope="module")
def naive(tiny_model_dir) -> list[list[float]]:
    """log softmax(model(seq[:t]))[seq[t]], one forward per scored position."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq, pos in zip(SEQUENCES, POSITIONS, strict=True):
            row = []
            for t in pos:
                logits = model(torch.tensor([seq[:t]])).logits[0, -1]
                row.append(torch.log_softmax(logits, dim=-1)[seq[t]].item())
            out.append(row)
    return out


def test_hf_batched_scoring_equals_the_naive_loop(tiny_model_dir, naive):
    hf = make_backend("hf", tiny_model_dir, dtype="float32", max_batch_size=2)
    got = hf.score_logprobs(SEQUENCES, POSITIONS)
    assert [len(r) for r in got] == [3, 2, 3]
    for row, ref in zip(got, naive, strict=True):
        assert row == pytest.approx(ref, abs=1e-5)
    with pytest.raises(ValueError, match="outside 1..2"):
        hf.score_logprobs([[1, 2, 3]], [[0, 1]])


def test_vllm_prompt_logprobs_agree_with_transformers(tiny_model_dir, naive):
    engine = make_backend("vllm", tiny_model_dir, **ENGINE)
    try:
        got = engine.score_logprobs(SEQUENCES, POSITIONS)
        for row, ref in zip(got, naive, strict=True):
            assert row == pytest.approx(ref, abs=1e-4)
        # Scoring after a prefill of the same prefix must not read another request's cache.
        again = engine.score_logprobs(SEQUENCES[:1], POSITIONS[:1])
        assert again[0] == pytest.approx(got[0], abs=1e-6)
        with pytest.raises(ValueError, match="max_model_len"):
            engine.score_logprobs([list(range(1, 65))], [[5]])
    finally:
        engine.close()
