"""Live learning under the certificate: Expert-Iteration rounds from served, verified traffic.

arXiv:2605.20270 Sec. 6.2 and Assumption 4.2 (P): the policy is constant within a round of `round_size`
requests; between rounds a LoRA update is trained on that round's verifier-correct (prompt,
answer) pairs only, and published to serve later seqs (rule R2). This module holds the pure parts:
the updater's durable progress, a published version's name, the mini-batches, and the merge of
a saved adapter into the served base weights that replicas switch to.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rlvr.files import atomic_write_text

UPDATER_FILE = "updater.json"
"""The updater's progress (`UpdaterState`) in the live directory."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


@dataclass
class UpdaterState:
    """What a restarted updater continues from: the next EI round to consume and every version
    it published (round, policy version, last training seq, pairs, adapter directory)."""

    next_round: int = 0
    published: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    """Rounds consumed without an update (nothing to learn from: no verifier-correct pair, or
    under GRPO no group holding both outcomes)."""

    @classmethod
    def load(cls, path: Path) -> UpdaterState:
        """The saved state, or a fresh one where none was saved yet."""
        if not path.exists():
            return cls()
        return cls(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        """Atomically and durably (a crash leaves the old state or the new one)."""
        atomic_write_text(path, json.dumps(asdict(self), sort_keys=True))

    @property
    def latest(self) -> dict[str, Any] | None:
        """The newest published version, None before the first."""
        return self.published[-1] if self.published else None


def round_seqs(index: int, size: int) -> tuple[int, int]:
    """Seqs [first, end) of EI round `index` (rounds of `size` consecutive requests)."""
    return index * size, (index + 1) * size


def adapter_version(index: int, adapter_dir: Path) -> str:
    """Policy version of round `index`'s adapter: `live-N@` and a digest of its files' content."""
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        h.update(name.encode() + b"\0" + (adapter_dir / name).read_bytes())
    return f"live-{index}@{h.hexdigest()[:12]}"


def adapter_dir(live_dir: str | Path, version: str) -> Path:
    """Where the adapter of a published `version` lies under the live directory."""
    return Path(live_dir) / "versions" / version.replace("@", "-")


def shuffled_batches(n: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """Indices of the items (SFT pairs, GRPO prompts) of each optimizer step: `epochs` seeded
    shuffles of range(n), each cut into ceil(n / batch_size) mini-batches as even as possible."""
    if n < 1 or batch_size < 1 or epochs < 1:
        raise ValueError(f"need n, batch_size, epochs >= 1, got {n}, {batch_size}, {epochs}")
    rng = random.Random(seed)
    parts = math.ceil(n / batch_size)
    out = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        out += [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return out


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


def merged_lora_weights(
    base_dir: str | Path, adapter_dir: str | Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights (HF names, as saved) with a PEFT LoRA adapter merged in:
    W + s * B @ A per adapted linear layer, s = lora_alpha / r (/ sqrt(r) with rsLoRA), what
    `merge_and_unload` computes, read from the two directories without building a model."""
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: a {config['peft_type']} adapter, not LoRA")
    r = int(config["r"])
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    lora: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(adapter_dir / ADAPTER_WEIGHTS, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module, _, part = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
            lora.setdefault(f"{module}.weight", {})[part.split(".")[0]] = f.get_tensor(key)
    files = _weight_files(base_dir)
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    missing = set(lora) - names
    if missing:
        raise ValueError(f"{adapter_dir}: adapted layers not in {base_dir}: {sorted(missing)[:3]}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                weight = f.get_tensor(name)
                ab = lora.get(name)
                if ab is not None:
                    delta = (ab["B"].double() @ ab["A"].double()) * scale
                    if config.get("fan_in_fan_out"):
                        delta = delta.T
                    weight = (weight.double() + delta).to(weight.dtype)
                yield name, weight
