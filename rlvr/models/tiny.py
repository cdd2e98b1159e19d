"""A tiny Qwen2 causal LM with a locally trained byte-level BPE tokenizer, for tests and quick runs.

head_dim is 64 because vLLM's CPU attention kernels accept only 32/64/128. Building is
deterministic for a seed and cached: a directory holding the same fingerprint is reused as is.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

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
FINGERPRINT = "rlvr_tiny.json"


def _train_tokenizer(corpus: Iterable[str]):
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
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=ARCH["max_position_embeddings"],
    )


def default_corpus() -> list[str]:
    from rlvr.tasks.arithmetic import ArithmeticDifficulty, ArithmeticTask

    task = ArithmeticTask(ArithmeticDifficulty(1, 4, 100, "+-*", "mixed"), seed=0)
    texts = list(task.corpus(1500))
    texts.append("Put your final answer in \\boxed{}. The answer is")
    return texts


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, corpus: Iterable[str] | None = None
) -> Path:
    """Build (or reuse) the tiny model + tokenizer in `out_dir`; returns the directory."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    texts = list(corpus) if corpus is not None else default_corpus()
    fingerprint = {
        "seed": seed,
        "arch": ARCH,
        "vocab": VOCAB_SIZE,
        "corpus_size": len(texts),
        "corpus_hash": _hash_texts(texts),
    }
    marker = out / FINGERPRINT
    if marker.is_file() and json.loads(marker.read_text()) == fingerprint:
        return out

    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tokenizer = _train_tokenizer(texts)
    vocab = ((len(tokenizer) + 63) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab,
        **ARCH,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / FINGERPRINT).write_text(json.dumps(fingerprint))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def _hash_texts(texts: list[str]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]
