"""The training spine end to end on the tiny model: actors, run directory, resume, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from workflows.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
FAST = [
    "model.sft_warmup_steps=100",
    "task.n_train=64",
    "task.n_test=16",
    "generation.prompts_per_step=4",
    "generation.group_size=4",
    "generation.max_tokens=24",
    "run.eval_every=0",
    "resources.num_verifiers=1",
]
TIMING_KEYS = ("time_", "tokens_per_s", "eval_seconds")


def _deterministic(record: dict) -> dict:
    return {
        k: v for k, v in record.items() if not k.startswith(TIMING_KEYS) and k not in TIMING_KEYS
    }


def _cli(args: list[str], env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "workflows.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 4-step tiny run through the actors, in its own driver process."""
    out = tmp_path_factory.mktemp("runs")
    proc = _cli(
        [
            "train",
            "--config",
            str(TINY),
            *[f"--set={s}" for s in FAST],
            "--set=run.steps=4",
            f"--set=run.output_dir={out}",
            "--set=run.name=full",
        ]
    )
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    return out / "full"


def test_run_directory_contents(uninterrupted):
    run = uninterrupted
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:
        assert m["rollouts"] == 16
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["time_step"] >= m["time_generate"] > 0
        assert "train_loss" in m and "train_grad_norm" in m
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [-1, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert (run / "final" / "model.safetensors").is_file()
    assert list((run / "tb").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_before"]["step"] == -1


def test_interrupted_and_resumed_equals_uninterrupted(uninterrupted, tmp_path):
    """Kill the driver after step 1 commits; resuming must end bit-identical to the full run."""
    args = [
        "train",
        "--config",
        str(TINY),
        *[f"--set={s}" for s in FAST],
        "--set=run.steps=4",
        f"--set=run.output_dir={tmp_path}",
        "--set=run.name=full",
    ]
    proc = _cli(args)
    ckpt = tmp_path / "full" / "checkpoints" / "step_000001"
    deadline = time.monotonic() + 900
    while not ckpt.is_dir():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = _cli(["train", "--resume", str(tmp_path / "full")])
    log, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, log[-4000:]

    a = [
        _deterministic(json.loads(x))
        for x in (uninterrupted / "metrics.jsonl").read_text().splitlines()
    ]
    b = [
        _deterministic(json.loads(x))
        for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    assert a == b
    wa = load_file(uninterrupted / "final" / "model.safetensors")
    wb = load_file(tmp_path / "full" / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] == wb[k]).all(), k


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.path=/nonexistent/model"], "model.path"),
        (["generation.group_size=1"], "generation.group_size"),
        (["resources.num_verifiers=64", "resources.verifier_cpus=1"], "resources: the actors need"),
        (["task.name=file", "task.train_path=/nonexistent.jsonl"], "task:"),
    ],
)
def test_bad_input_fails_before_any_actor(tmp_path, capsys, overrides, message):
    args = ["train", "--config", str(TINY), f"--set=run.output_dir={tmp_path}"]
    args += [f"--set={o}" for o in overrides]
    assert cli_main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


def test_empty_dataset_is_named(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [
        "train",
        "--config",
        str(TINY),
        f"--set=run.output_dir={tmp_path}",
        "--set=task.name=file",
        f"--set=task.train_path={empty}",
    ]
    assert cli_main(args) == 2
    assert "empty" in capsys.readouterr().err
