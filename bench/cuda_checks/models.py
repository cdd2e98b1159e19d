"""The models and batches of the check: the tiny model's tokenizer under a randomly initialised
Qwen2 of a real size, and token batches drawn from fixed seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from rlvr.training.batch import build_batch


@dataclass(frozen=True)
class Scale:
    """The large model and the shapes of the sections that run it. ``0.5b`` is the check;
    ``small`` runs the same code on a 2-layer model in seconds (tests, ``--all-on-cpu``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    throughput_rows: int
    prompt_len: int
    response_len: int
    budgets: tuple[int, ...]
    head_chunk: int
    groups: int
    group_size: int
    bucket_bytes: int

    @property
    def params(self) -> int:
        """Parameters of the Qwen2 built from it (tied head, biased q/k/v)."""
        h, kv = self.hidden, self.kv_heads * (self.hidden // self.heads)
        attention = h * h + h + 2 * (h * kv + kv) + h * h
        layer = attention + 3 * h * self.intermediate + 2 * h
        return self.vocab * h + self.layers * layer + h


SCALES = {
    "0.5b": Scale(
        hidden=1024,
        layers=24,
        heads=16,
        kv_heads=4,
        intermediate=5120,
        vocab=49152,
        throughput_rows=32,
        prompt_len=256,
        response_len=768,
        budgets=(4096, 8192, 16384),
        head_chunk=1024,
        groups=2,
        group_size=8,
        bucket_bytes=256 << 20,
    ),
    "small": Scale(
        hidden=128,
        layers=2,
        heads=2,
        kv_heads=1,
        intermediate=256,
        vocab=2048,
        throughput_rows=4,
        prompt_len=32,
        response_len=96,
        budgets=(256, 512),
        head_chunk=64,
        groups=2,
        group_size=4,
        bucket_bytes=64 << 10,
    ),
}


def build_large_model(out: Path, scale: Scale, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised Qwen2 of ``scale`` (fp32 safetensors) with the tiny model's
    tokenizer (its ids are a subset of the vocabulary), for a model of a real size without a
    download."""

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=scale.vocab,
        hidden_size=scale.hidden,
        intermediate_size=scale.intermediate,
        num_hidden_layers=scale.layers,
        num_attention_heads=scale.heads,
        num_key_value_heads=scale.kv_heads,
        head_dim=scale.hidden // scale.heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    if params != scale.params:
        raise RuntimeError(f"built {params} parameters, Scale.params says {scale.params}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def check_batch(vocab: int, seed: int = 0) -> Any:
    """Eight ragged rows (prompts of 3-12 tokens, responses of 2-16) of random ids and
    advantages in [-2, 2]: padding and two micro-batches of `MICRO_BATCH` rows."""

    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(3, 12))] for _ in range(8)]
    responses = [[rng.randrange(5, vocab) for _ in range(rng.randint(2, 16))] for _ in range(8)]
    batch = build_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.tensor([rng.uniform(-2.0, 2.0) for _ in range(8)])
    return batch


def group_batch(
    vocab: int,
    groups: int,
    group_size: int,
    prompt_len: int,
    response_len: int,
    whole: bool = False,
) -> Any:
    """GRPO-shaped rows: ``groups`` prompts of ``prompt_len`` tokens, each with ``group_size``
    responses of 1/4 to all of ``response_len`` tokens (all of it when ``whole``), and +-1
    advantages."""

    rng = random.Random(1)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        for _ in range(group_size):
            length = response_len if whole else rng.randint(response_len // 4, response_len)
            prompts.append(prompt)
            responses.append([rng.randrange(5, vocab) for _ in range(length)])
    batch = build_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.tensor([(-1.0) ** i for i in range(len(prompts))])
    return batch
