"""Fixtures shared by the integration tests: one finished tiny run through the actors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
# Small and fast, but the same model and SFT warm-up as configs/tiny.yaml (built once, cached).
FAST = [
    "task.n_test=16",
    "generation.prompts_per_step=4",
    "generation.group_size=4",
    "generation.max_tokens=24",
    "run.eval_every=0",
    "resources.num_verifiers=1",
    # LACONIC's dual rides along, so the resume test also covers it surviving a restart.
    "algorithm.name=laconic",
    "algorithm.laconic.budget=12",
    "algorithm.laconic.eta=0.05",
    # Two PPO mini-batches per step under a cosine schedule: the resume test covers the schedule
    # continuing and pi_old being recomputed exactly after a restart.
    "training.mini_batches=2",
    "training.lr_schedule=cosine",
    "training.warmup_steps=1",
]


# In-process DeepSpeed tests leave these behind; a driver inheriting them would reuse a bound port.
DISTRIBUTED_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)


def cli(args: list[str]) -> subprocess.Popen:
    """`rlvr ARGS` in its own driver process, as a user runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "workflows.cli", *args],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def train_args(output_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(TINY),
        *[f"--set={s}" for s in (*FAST, *extra)],
        f"--set=run.output_dir={output_dir}",
        "--set=run.name=full",
    ]


@pytest.fixture(scope="session")
def tiny_run_dir(tmp_path_factory) -> Path:
    """A finished 4-step tiny run (actors, vLLM, DeepSpeed, verifier pool)."""
    out = tmp_path_factory.mktemp("runs")
    proc = cli(train_args(out, "run.steps=4"))
    log, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, log[-4000:]
    return out / "full"


@pytest.fixture
def run_cli():
    """Start `rlvr ARGS` as a subprocess: `run_cli(args) -> Popen`."""
    return cli


@pytest.fixture
def tiny_train_args():
    """`tiny_train_args(output_dir, *overrides)`: argv of a small tiny-preset `rlvr train`."""
    return train_args


@pytest.fixture(scope="session")
def tiny_config() -> Path:
    return TINY
