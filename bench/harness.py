"""What the benches share: a Ray cluster whose actors write to the bench's engine log, markdown
tables, and a result written as a table beside its data."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlvr.config import Config


def start_cluster(cfg: Config, out: Path) -> None:
    """A local cluster for the bench's actors (or the one RAY_ADDRESS names), their output in
    `out/engine.log` as `rlvr train` sends a run's."""
    from workflows.cluster import announce_engine_log, init_ray

    out.mkdir(parents=True, exist_ok=True)
    init_ray(cfg, announce_engine_log(out))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table of `rows` (cells as they print) under `header`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out: Path, stem: str, text: str, data: Any) -> None:
    """`out/<stem>.md` (the text, as printed) and `out/<stem>.json` (the data behind it)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text.rstrip("\n") + "\n")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))


ROOT = Path(__file__).resolve().parents[1]
RLVR = [sys.executable, "-m", "workflows.cli"]


def run_rlvr(argv: list[str], log: Path) -> None:
    """`rlvr ARGV` from the repository root, its output appended to `log`; fails loudly."""
    with open(log, "a") as f:
        f.write(f"\n$ rlvr {' '.join(argv)}\n")
        f.flush()
        done = subprocess.run([*RLVR, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"rlvr {argv[0]} failed ({done.returncode}); see {log}")
