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
