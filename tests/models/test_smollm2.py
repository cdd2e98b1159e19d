"""Bundled SmolLM2: the GGUF becomes a plain HF directory that loads offline and still answers."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr.models.smollm2 import MARKER, materialize_smollm2, smollm2_gguf
from rlvr.tasks import Problem
from rlvr.tasks.prompts import render_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return materialize_smollm2(tmp_path_factory.mktemp("m") / "smollm2")


def test_gguf_is_found_without_importing_the_package():
    path = smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6


def test_plain_safetensors_without_quantization(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["head_dim"], config["num_hidden_layers"]) == (
        "llama",
        64,
        30,
    )
    assert (smollm2 / "model.safetensors").is_file()
    assert not list(smollm2.glob("*.gguf"))


def test_cached_by_marker(smollm2):
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert materialize_smollm2(smollm2) == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads((smollm2 / MARKER).read_text())["gguf"] == smollm2_gguf().name


def test_loads_offline_with_chat_template_and_answers(smollm2, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert (tok.eos_token, tok.model_max_length) == ("<|im_end|>", 8192)
    ids = render_prompt(tok, Problem(id="p", prompt="What is 2 + 3?", answer="5"), "")
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    reply = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "5" in reply


def test_trainer_logprobs_match_vllm_at_the_sampling_temperature(smollm2):
    """The trainer's tempered log-probs of vLLM's sampled tokens equal the engine's own.

    30 fp32 layers through two kernel sets: up to ~1e-4 apart (9.5e-5 over 6,266 tokens in
    bench/engine_mismatch.py), checked at 5e-4; at temperature 1 the gap is over 1 nat.
    """
    from rlvr.generation import make_backend
    from rlvr.generation.base import GenerationRequest, SamplingParams
    from rlvr.training.engine_mismatch import mismatch, results_batch, trainer_logprobs

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        render_prompt(tok, Problem(id=str(a), prompt=f"What is {a} + {a + 3}?", answer=""))
        for a in (2, 7, 11, 19)
    ]
    engine = make_backend(
        "vllm", smollm2, dtype="float32", max_model_len=256, kv_cache_gib=0.25, enforce_eager=True
    )
    try:
        params = SamplingParams(temperature=0.7, max_tokens=32, seed=3)
        results = engine.generate([GenerationRequest(p, n=4) for p in prompts], params)
    finally:
        engine.close()
    batch = results_batch(results, tok.pad_token_id or 0)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tempered = mismatch(batch, *trainer_logprobs(model, batch, temperature=0.7))
    assert tempered["engine_tokens"] > 200
    assert tempered["max_abs_logp_diff"] < 5e-4
    assert mismatch(batch, *trainer_logprobs(model, batch, 1.0))["max_abs_logp_diff"] > 1.0
