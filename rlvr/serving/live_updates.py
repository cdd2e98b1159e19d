"""Live learning under the certificate: Expert-Iteration rounds from served, verified traffic.

arXiv:2605.20270 Sec. 6.2 and Assumption 4.2 (P): the policy is constant within a round of `round_size`
requests; between rounds a LoRA update is trained on that round's verifier-correct (prompt,
answer) pairs only, and published to serve later seqs (rule R2). This module holds the pure parts:
the updater's durable progress, a published version's name and the mini-batches; replicas switch
to the served base weights with the version's adapter merged in (`rlvr.models.checkpoints`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlvr.files import atomic_write_text
from rlvr.models.checkpoints import ADAPTER_CONFIG, ADAPTER_WEIGHTS

UPDATER_FILE = "updater.json"
"""The updater's progress (`UpdaterState`) in the live directory."""


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
