"""Tiny model builder: deterministic, cached, loadable, head size vLLM's CPU kernels accept, in
two architectures (Qwen2 and Llama) sharing one tokenizer."""

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr.models import resolve_model_path
from rlvr.models.tiny import EOS, FINGERPRINT, PAD, ROLE_TOKENS, build_tiny_model
from rlvr.tasks import ArithmeticDifficulty, ArithmeticTask

CORPUS = list(ArithmeticTask(seed=0).corpus(200))


def _digest(d):
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(d.iterdir())
        if f.is_file()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model `model.path: tiny` resolves to (default corpus), in a private cache."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLVR_CACHE", str(cache))
        path = resolve_model_path("tiny", seed=0)
    assert path == cache / "models" / "tiny-seed0"
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The model `model.path: tiny-llama` resolves to, in a private cache."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLVR_CACHE", str(cache))
        path = resolve_model_path("tiny-llama", seed=0)
    assert path == cache / "models" / "tiny-llama-seed0"
    return path


def test_deterministic_for_a_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0, corpus=CORPUS)
    b = build_tiny_model(tmp_path / "b", seed=0, corpus=CORPUS)
    assert _digest(a) == _digest(b)
    other = build_tiny_model(tmp_path / "other", seed=1, corpus=CORPUS)
    assert _digest(other)["model.safetensors"] != _digest(a)["model.safetensors"]
    assert _digest(other)["tokenizer.json"] == _digest(a)["tokenizer.json"]


def test_fingerprint_cache(tmp_path):
    path = build_tiny_model(tmp_path / "m", seed=0, corpus=CORPUS)
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(path, seed=0, corpus=CORPUS) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    # another corpus is another tokenizer: the cached build must not be reused
    build_tiny_model(path, seed=0, corpus=CORPUS[:100])
    assert (path / "model.safetensors").stat().st_mtime_ns != before
    assert not list(tmp_path.glob(".*building*"))  # no staging directory left behind
    assert (path / FINGERPRINT).is_file()


def test_architecture_is_part_of_the_build(tmp_path):
    """A Llama build is deterministic too, and is not the Qwen2 build cached in its directory."""
    path = build_tiny_model(tmp_path / "m", seed=0, corpus=CORPUS)
    qwen2 = _digest(path)
    assert build_tiny_model(path, seed=0, corpus=CORPUS, arch="llama") == path
    llama = _digest(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert llama["model.safetensors"] != qwen2["model.safetensors"]
    assert llama["tokenizer.json"] == qwen2["tokenizer.json"]
    again = build_tiny_model(tmp_path / "again", seed=0, corpus=CORPUS, arch="llama")
    assert _digest(again) == llama
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt2'"):
        build_tiny_model(tmp_path / "x", corpus=CORPUS, arch="gpt2")


def test_architecture(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny)
    cfg = model.config
    assert (cfg.model_type, cfg.head_dim, cfg.hidden_size, cfg.num_hidden_layers) == (
        "qwen2",
        64,
        256,
        2,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.tie_word_embeddings and model.dtype == torch.float32
    assert (tiny / "model.safetensors").is_file()
    ids = torch.tensor([[3, 10, 11, 12]])
    assert model(input_ids=ids).logits.shape == (1, 4, cfg.vocab_size)


@torch.no_grad()
def test_llama_architecture_loads_and_generates(tiny_llama, tiny):
    """'tiny-llama': the tiny model's size and tokenizer in Llama's layout (bias-free attention,
    an untied LM head, Llama 3 rope scaling); greedy generation with the KV cache picks what a
    full forward over the result ranks first."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    cfg = model.config
    assert (cfg.model_type, cfg.head_dim, cfg.hidden_size, cfg.num_hidden_layers) == (
        "llama",
        64,
        256,
        2,
    )
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert cfg.rope_parameters["rope_type"] == "llama3" and model.dtype == torch.float32
    assert _digest(tiny_llama)["tokenizer.json"] == _digest(tiny)["tokenizer.json"]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=False,
    )
    out = model.generate(
        prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
    )
    assert out.shape == (1, prompt.shape[1] + 8)
    ranked_first = model(out).logits[0, prompt.shape[1] - 1 : -1].argmax(-1)
    assert ranked_first.tolist() == out[0, prompt.shape[1] :].tolist()


def test_tokenizer_special_tokens_and_chat_template(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    model_cfg = AutoModelForCausalLM.from_pretrained(tiny).config
    assert len(tok) <= model_cfg.vocab_size <= 1024
    assert tok.eos_token == EOS and tok.pad_token == PAD
    assert tok.eos_token_id == model_cfg.eos_token_id != tok.pad_token_id
    for special in (EOS, PAD, *ROLE_TOKENS):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|system|>\nS<|endoftext|>\n<|user|>\nQ<|endoftext|>\n<|assistant|>\n"


@pytest.mark.parametrize("style", ["expression", "words"])
def test_tokenizer_round_trips_task_text(tiny, style):
    tok = AutoTokenizer.from_pretrained(tiny)
    task = ArithmeticTask(ArithmeticDifficulty(1, 4, 200, "+-*", style), seed=3)
    for p in task.problems("test", 20):
        for text in (p.prompt, p.solution, f"  odd spacing\t{p.answer} \\boxed{{}} é"):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == text
    # the BPE was trained on this text: its words are whole tokens
    words = ArithmeticTask(ArithmeticDifficulty(style="words"), seed=0).problems("test", 1)[0]
    assert words.prompt.startswith("Ana has 11 shells. She uses up 7, then buys 17 more.")
    pieces = [tok.decode([i]) for i in tok(words.prompt)["input_ids"]]
    assert pieces[:8] == ["Ana", " has", " ", "1", "1", " shells", ".", " She"]


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_builders_of_one_entry_at_once_build_it_once(tmp_path, monkeypatch):
    """Two processes resolving one cache entry at once (two runs, two test workers): the later
    waits on the entry's lock and finds it built, rather than replacing it under a reader."""
    import threading

    from rlvr.models import tiny as tiny_module

    publish = tiny_module.publish_dir
    published = []

    def counted(staging, out):
        published.append(out)
        return publish(staging, out)

    monkeypatch.setattr(tiny_module, "publish_dir", counted)
    out = tmp_path / "tiny"
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(build_tiny_model(out, seed=0)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out, out] and published == [out]
    assert (out / FINGERPRINT).is_file()
