"""Model FLOPs utilisation (MFU) of a decoder-only transformer, per phase, as verl and prime-rl
report it: the model's FLOPs for the tokens a phase processed, per second, over the machine's peak.

FLOPs per token follow Kaplan et al. 2020 (arXiv 2001.08361, section 2.1: C_forward = 2N +
2 n_layer n_ctx d_attn) and PaLM (arXiv 2204.02311, appendix B: 6N + 12 L H Q T for training,
the convention of verl's FlopsCounter and torchtitan/prime-rl). N counts the weight matrices that
each token multiplies through: every layer's attention and MLP projections and the LM head (once,
tied or not); the embedding lookup multiplies nothing and norms and biases are negligible.

- train (forward + backward): 6N + 12 L H Q T per token of a sequence of T tokens (PaLM: no
  causal halving).
- forward (log-prob passes): 2N + 4 L H Q T per token, one third of the above.
- generate: prefill and decode count each position's real attention context (an engine's
  KV cache and causal kernels skip the masked half): 2N + 4 L H Q (i + 1) for the token at
  position i, over positions 0 .. P + R - 2 of a prompt of P and a response of R tokens (the last
  sampled token is never fed back).

The peak is a datasheet figure on CUDA devices (dense bf16, no sparsity) and, on CPUs or an
unknown device, a GEMM measured once per machine and cached.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rlvr.files import atomic_write_text
from rlvr.models import cache_dir

Phase = Literal["train", "forward", "generate"]
PHASES: tuple[Phase, ...] = ("train", "forward", "generate")
GATED_MLP_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2"})
"""Model types whose MLP has three projections (gate, up, down); others are refused rather than
counted wrongly."""

DATASHEET_BF16_DENSE: tuple[tuple[str, float], ...] = (
    # (substring of torch.cuda.get_device_name(), dense bf16 FLOP/s). Longer names first: "H200"
    # must not match "H20", "H100 PCIe" must not match "H100".
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
)
"""NVIDIA datasheet tensor-core bf16 throughput without sparsity (SXM figures where a part has
several; A10G: AWS's published 70 TFLOPS)."""


@dataclass(frozen=True)
class TransformerShape:
    """The sizes of a decoder-only transformer that its FLOPs depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> TransformerShape:
        """From a Hugging Face config (a `PretrainedConfig` or the dict of a config.json).

        Raises ValueError for a model type whose MLP layout is not known (mixture-of-experts and
        non-gated MLPs would be counted wrongly)."""
        c = config if isinstance(config, Mapping) else config.to_dict()
        model_type = c.get("model_type")
        if model_type not in GATED_MLP_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r}: FLOPs are counted for dense gated-MLP decoders only "
                f"({', '.join(sorted(GATED_MLP_MODEL_TYPES))})"
            )
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return cls(
            layers=int(c["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            intermediate=int(c["intermediate_size"]),
            vocab=int(c["vocab_size"]),
        )

    @property
    def attention_width(self) -> int:
        """H * Q: the width of the queries (and of the attention output)."""
        return self.heads * self.head_dim

    @property
    def matmul_params(self) -> int:
        """N: the weights each token multiplies through (projections of every layer + LM head)."""
        q_and_o = 2 * self.hidden * self.attention_width
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (q_and_o + k_and_v + mlp) + self.vocab * self.hidden


def phase_flops(
    phase: Phase,
    shape: TransformerShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
) -> float:
    """Model FLOPs of one `phase` over sequences of `prompt_lens[i] + response_lens[i]` tokens.

    `train` is one forward + backward pass, `forward` one forward pass (both over the whole
    sequences), `generate` the engine's prefill + decode of the responses (see the module doc)."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
    p = np.asarray(prompt_lens, dtype=np.float64)
    r = np.asarray(response_lens, dtype=np.float64)
    if p.shape != r.shape or p.ndim != 1:
        raise ValueError(f"prompt_lens {p.shape} and response_lens {r.shape} must be equal 1-D")
    if (p < 0).any() or (r < 0).any():
        raise ValueError("sequence lengths must be >= 0")
    n, attn = float(shape.matmul_params), float(shape.layers * shape.attention_width)
    if phase == "generate":
        fed = np.maximum(p + r - 1, 0)  # positions run through the model
        context = fed * (fed + 1) / 2  # sum over positions i of (i + 1) keys
        return float((2 * n * fed + 4 * attn * context).sum())
    t = p + r
    per_sequence = 2 * n * t + 4 * attn * t * t
    return float((3 if phase == "train" else 1) * per_sequence.sum())


def mfu(
    phase: Phase,
    shape: TransformerShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    seconds: float,
    peak_flops: float,
) -> float:
    """The share of `peak_flops` (FLOP/s of the devices that ran the phase, summed) that the
    phase's model FLOPs reached in `seconds`."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"seconds ({seconds}) and peak_flops ({peak_flops}) must be > 0")
    return phase_flops(phase, shape, prompt_lens, response_lens) / seconds / peak_flops


def datasheet_peak(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of a known CUDA device by its name; None if the table lacks it."""
    for part, flops in DATASHEET_BF16_DENSE:
        if part in device_name:
            return flops
    return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else `platform.processor()`)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def measure_gemm_flops(
    dtype: Any, device: str = "cpu", size: int = 2048, seconds: float = 1.0
) -> float:
    """FLOP/s of the best of repeated `size`-square matmuls in `dtype` on `device` (at least three
    after a warm-up, and at least `seconds` in all): the attainable peak of dense math there."""
    import torch

    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.matmul(a, b)
    sync()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or spent < seconds:
        start = time.perf_counter()
        torch.matmul(a, b)
        sync()
        took = time.perf_counter() - start
        best, spent, reps = min(best, took), spent + took, reps + 1
    return 2.0 * size**3 / best


def peak_flops(dtype: str = "bfloat16", device: str = "cpu", cache: Path | None = None) -> float:
    """The peak FLOP/s that MFU divides by, for one device (`cpu` or `cuda[:i]`).

    A CUDA device in the datasheet table gives its figure (dense bf16, whatever `dtype`). A CPU or
    an unknown device gives a GEMM measured in `dtype` ('float32' or 'bfloat16') once and cached
    under `cache` (default: the cache dir's `mfu/`), keyed by device model, torch thread count and
    torch version, so every run on the machine divides by the same number."""
    import torch

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}: the peak is measured for 'float32' or 'bfloat16'")
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        listed = datasheet_peak(name)
        if listed is not None:
            return listed
    else:
        name = cpu_model()
    key = {
        "device": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": dtype,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache or cache_dir() / "mfu") / f"peak-{digest}.json"
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored["key"] == key:
            return float(stored["flops"])
    flops = measure_gemm_flops(getattr(torch, dtype), device=device)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "flops": flops}))
    return flops


def step_utilisation(
    shape: TransformerShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    seconds: Mapping[str, float],
    train_passes: int,
    peak: float | None,
) -> dict[str, float]:
    """A training step's model FLOP/s per phase and, given the `peak` of the devices that ran it,
    its MFU: `generate` over `seconds["time_generate"]`, `train` (each of `train_passes` updates
    over the batch, as verl's actor MFU counts them) over `seconds["time_train"]`."""
    out: dict[str, float] = {}
    work = {
        "generate": ("time_generate", 1),
        "train": ("time_train", train_passes),
    }
    for phase, (key, passes) in work.items():
        spent = seconds.get(key, 0.0)
        if spent <= 0 or passes <= 0:
            continue
        rate = passes * phase_flops(phase, shape, prompt_lens, response_lens) / spent
        out[f"flops_per_s_{phase}"] = rate
        if peak:
            out[f"mfu_{phase}"] = rate / peak
    return out
