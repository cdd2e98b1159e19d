"""A run directory: resolved config, one committed checkpoint per step, append-only metrics.

Durability contract: a step counts as completed only once its checkpoint directory has been renamed
into place (atomic on POSIX), its files synced and listed with their sizes in a manifest first.
Resume takes the newest checkpoint that matches its manifest (a damaged one, e.g. after a machine
lost unsynced writes, is moved aside with a warning). Metrics of steps past the resumed checkpoint
are dropped, so an interrupted-and-resumed run logs exactly what an uninterrupted one does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from rlvr.files import atomic_write_text, fsync_dir

STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
"""Every file of a checkpoint with its size, written (and synced) last before the commit."""
DAMAGED_PREFIX = "damaged_"

log = logging.getLogger(__name__)


class RunDir:
    """Layout: config.yaml, metrics.jsonl, eval.jsonl, rollouts.jsonl, final/ (model and
    tokenizer after the last step), summary.json, the stores of `run.loggers` (tb/, wandb/,
    mlruns/ and loggers.json, `rlvr.run.loggers`), and checkpoints/step_NNNNNN/ holding the step's
    policy/, controller.json and progress.json (the step, the best step so far and the metric
    that picked it), which the training workflow writes; the best step's checkpoint survives
    pruning."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.metrics_file = self.path / "metrics.jsonl"
        self.eval_file = self.path / "eval.jsonl"
        self.rollouts_file = self.path / "rollouts.jsonl"
        self.recoveries_file = self.path / "recoveries.jsonl"
        self.final_model = self.path / "final"

    # --- config -------------------------------------------------------------------------------
    def create(self, config: dict[str, Any]) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def load_config_dict(self) -> dict[str, Any]:
        file = self.path / "config.yaml"
        if not file.is_file():
            raise FileNotFoundError(f"{self.path} is not a run directory (no config.yaml)")
        return yaml.safe_load(file.read_text())

    # --- checkpoints --------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.checkpoints / f"{STEP_PREFIX}{step:06d}"

    def completed_steps(self) -> list[int]:
        if not self.checkpoints.is_dir():
            return []
        steps = []
        for p in self.checkpoints.iterdir():
            if (
                p.is_dir()
                and p.name.startswith(STEP_PREFIX)
                and p.name[len(STEP_PREFIX) :].isdigit()
            ):
                steps.append(int(p.name[len(STEP_PREFIX) :]))
        return sorted(steps)

    def last_completed_step(self) -> int | None:
        steps = self.completed_steps()
        return steps[-1] if steps else None

    @contextmanager
    def writing_checkpoint(self, step: int) -> Iterator[Path]:
        """Yield a staging directory; it becomes step `step`'s checkpoint only if the block
        succeeds, with its files synced and listed in the manifest before the rename."""
        staging = self.checkpoints / f".staging_{step:06d}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        yield staging
        sizes = {}
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            sizes[str(path.relative_to(staging))] = path.stat().st_size
        atomic_write_text(staging / MANIFEST, json.dumps({"step": step, "files": sizes}))
        for d in sorted({p.parent for p in staging.rglob("*")}, reverse=True):
            fsync_dir(d)
        final = self.step_dir(step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        fsync_dir(self.checkpoints)

    def checkpoint_damage(self, step: int) -> str | None:
        """Why step `step`'s checkpoint does not match its manifest, or None if it does (or
        predates manifests)."""
        d = self.step_dir(step)
        manifest = d / MANIFEST
        if not manifest.exists():
            return None
        try:
            sizes = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"unreadable manifest ({err})"
        for name, size in sizes.items():
            path = d / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} holds {path.stat().st_size} bytes, the manifest says {size}"
        return None

    def last_intact_step(self) -> int | None:
        """The newest step whose checkpoint matches its manifest; newer damaged ones are moved
        aside (checkpoints/damaged_step_N) with a warning, so the run resumes before them."""
        for step in reversed(self.completed_steps()):
            damage = self.checkpoint_damage(step)
            if damage is None:
                return step
            aside = self.checkpoints / f"{DAMAGED_PREFIX}{self.step_dir(step).name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(self.step_dir(step), aside)
            log.warning(
                "checkpoint of step %d is damaged (%s); moved to %s, resuming from an earlier one",
                step,
                damage,
                aside,
            )
        return None

    def prune(self, keep_last: int, keep: set[int] = frozenset()) -> None:
        """Delete step checkpoints except the newest `keep_last` and those in `keep` (e.g. the best)."""
        steps = self.completed_steps()
        for step in steps[:-keep_last] if keep_last > 0 else steps:
            if step not in keep:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
        for p in self.checkpoints.glob(".staging_*"):
            shutil.rmtree(p, ignore_errors=True)

    # --- append-only logs ---------------------------------------------------------------------
    @staticmethod
    def _append(file: Path, record: dict[str, Any]) -> None:
        with open(file, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _read(file: Path) -> list[dict[str, Any]]:
        if not file.is_file():
            return []
        records = []
        for line in file.read_text().splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a crash mid-write
        return records

    def append_metrics(self, record: dict[str, Any]) -> None:
        self._append(self.metrics_file, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        return self._read(self.metrics_file)

    def append_eval(self, record: dict[str, Any]) -> None:
        self._append(self.eval_file, record)

    def read_eval(self) -> list[dict[str, Any]]:
        return self._read(self.eval_file)

    def append_rollouts(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self._append(self.rollouts_file, r)

    def read_rollouts(self) -> list[dict[str, Any]]:
        return self._read(self.rollouts_file)

    def append_recovery(self, record: dict[str, Any]) -> None:
        """One line per recovery from a lost actor (never truncated: the run's history)."""
        self._append(self.recoveries_file, record)

    def truncate_logs_after(self, step: int) -> None:
        """Drop log records of steps after `step` (they belong to an uncommitted step)."""
        for file in (self.metrics_file, self.eval_file, self.rollouts_file):
            kept = [r for r in self._read(file) if r.get("step", 0) <= step]
            atomic_write_text(file, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
