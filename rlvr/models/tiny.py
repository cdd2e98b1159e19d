"""A tiny causal LM with a locally trained byte-level BPE tokenizer, for tests and quick runs.

Two architectures of one size and tokenizer: Qwen2 (biased q/k/v, tied embeddings) and Llama
(bias-free, untied LM head, Llama 3 rope scaling), so the spine is exercised on more than one
model family. head_dim is 64 because vLLM's CPU attention kernels accept only 32/64/128. Building
is deterministic for a seed (same files bit for bit) and cached: a directory holding the same
fingerprint is reused as is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, get_args

import torch

EOS = "<|endoftext|>"
PAD = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}" + EOS + "\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ARCH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}
VOCAB_SIZE = 1024
TinyArch = Literal["qwen2", "llama"]
TINY_ARCHS: tuple[TinyArch, ...] = get_args(TinyArch)
LLAMA_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
"""Llama 3's frequency-dependent rope scaling, stretched from 256 to the 1024 positions."""
FINGERPRINT = "rlvr_tiny.json"
# Bump when the build itself changes, so cached models from an older builder are rebuilt.
BUILDER_VERSION = 2


def _train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=ARCH["max_position_embeddings"],
    )


def default_corpus() -> list[str]:
    """Tokenizer training text: arithmetic prompts and solutions of every style, and the
    default instruction, so the task's text tokenizes compactly."""
    from rlvr.tasks.arithmetic import ArithmeticDifficulty, ArithmeticTask
    from rlvr.tasks.prompts import DEFAULT_INSTRUCTION

    task = ArithmeticTask(ArithmeticDifficulty(1, 4, 100, "+-*", "mixed"), seed=0)
    return [*task.corpus(1500), DEFAULT_INSTRUCTION]


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold `out`'s build lock (a file beside it): processes that build one cache entry at once
    build it once, the later ones waiting and then finding it built."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def staging_dir(out: Path) -> Path:
    """A fresh private directory beside `out` to build into before `publish_dir`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.building-"))
    staging.chmod(0o755)  # mkdtemp makes it private; the published model is an ordinary directory
    return staging


def publish_dir(staging: Path, out: Path) -> Path:
    """Move a finished build into place, so readers never see a half-written model directory.

    When a concurrent builder published first, its result (built from the same inputs) is kept.
    """
    shutil.rmtree(out, ignore_errors=True)
    try:
        staging.rename(out)
    except OSError:
        if not out.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _hash_texts(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode() + b"\0")
    return h.hexdigest()[:16]


def _model(arch: TinyArch, tokenizer: Any) -> Any:
    """The untrained causal LM of `arch` for `tokenizer`, its weights drawn from torch's RNG."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = {
        "vocab_size": ((len(tokenizer) + 63) // 64) * 64,
        **ARCH,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.eos_token_id,
        "dtype": "float32",
    }
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0))
    config = LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=LLAMA_ROPE)
    return LlamaForCausalLM(config)


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    arch: TinyArch = "qwen2",
) -> Path:
    """Build the tiny `arch` model + tokenizer in `out_dir` (HF format, safetensors); returns
    `out_dir`.

    The tokenizer is trained on `corpus` (default: arithmetic task text) and the weights are
    initialised from `seed`. If `out_dir` already holds a build with the same fingerprint
    (seed, architecture, corpus hash, builder version) it is returned without rebuilding.
    """
    from transformers import GenerationConfig

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r} (one of {', '.join(TINY_ARCHS)})")
    out = Path(out_dir)
    texts = list(corpus) if corpus is not None else default_corpus()
    if not texts:
        raise ValueError("the tokenizer corpus is empty")
    fingerprint: dict[str, Any] = {
        "builder": BUILDER_VERSION,
        "seed": seed,
        "arch": ARCH,
        "vocab": VOCAB_SIZE,
        "corpus_hash": _hash_texts(texts),
    }
    if arch != "qwen2":
        # Qwen2 builds keep the fingerprint they had before there was a choice (caches stay valid).
        fingerprint["model_type"] = arch
    with build_lock(out):
        marker = out / FINGERPRINT
        if marker.is_file() and json.loads(marker.read_text()) == fingerprint:
            return out

        tokenizer = _train_tokenizer(texts)
        torch.manual_seed(seed)
        model = _model(arch, tokenizer)
        staging = staging_dir(out)
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / FINGERPRINT).write_text(json.dumps(fingerprint))
        return publish_dir(staging, out)
