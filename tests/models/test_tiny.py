"""Tiny model builder: deterministic, cached, loadable, head size vLLM's CPU kernels accept."""

import hashlib

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr.models import resolve_model_path
from rlvr.models.tiny import build_tiny_model
from rlvr.tasks import ArithmeticTask
from rlvr.tasks.prompts import render_prompt

CORPUS = list(ArithmeticTask(seed=0).corpus(200))


def _digest(d):
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(d.iterdir())
        if f.is_file()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, corpus=CORPUS)


def test_deterministic_for_a_seed(tiny, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0, corpus=CORPUS)
    assert _digest(again) == _digest(tiny)
    other = build_tiny_model(tmp_path / "other", seed=1, corpus=CORPUS)
    assert _digest(other)["model.safetensors"] != _digest(tiny)["model.safetensors"]


def test_cached_build_returns_without_rewriting(tiny):
    before = (tiny / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(tiny, seed=0, corpus=CORPUS)
    assert (tiny / "model.safetensors").stat().st_mtime_ns == before


def test_loads_with_transformers_and_chat_template(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.head_dim == 64
    assert model.config.vocab_size >= len(tok)
    problem = ArithmeticTask(seed=0).problems("test", 1)[0]
    ids = render_prompt(tok, problem, "Put your final answer in \\boxed{}.")
    text = tok.decode(ids)
    assert text.startswith("<|user|>\n") and text.endswith("<|assistant|>\n")
    assert problem.prompt in text
    # byte-level BPE round-trips task text exactly
    assert tok.decode(tok(problem.solution)["input_ids"]) == problem.solution
    out = model(input_ids=__import__("torch").tensor([ids]))
    assert out.logits.shape == (1, len(ids), model.config.vocab_size)


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
