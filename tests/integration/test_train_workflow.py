"""The training spine end to end on the tiny model: actors, run directory, resume, bad input."""

from __future__ import annotations

import json
import math
import signal
import time

import pytest
from safetensors.torch import load_file

from workflows.cli import main as cli_main

TIMING_KEYS = ("time_", "tokens_per_s", "eval_seconds")


def _deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_KEYS)}


def test_run_directory_contents(tiny_run_dir):
    run = tiny_run_dir
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:
        assert m["rollouts"] == 16  # 4 prompts x 4 samples
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["time_step"] >= m["time_generate"] > 0
        assert "train_loss" in m and "train_grad_norm" in m
        assert m["train_optimizer_steps"] == 2 and len(m["train_updates"]) == 2
        # vLLM and the trainer compute the same tempered fp32 log-probs to ~1e-5
        assert m["train_engine_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    # cosine to 0 over 4 steps x 2 optimizer steps after 1 warm-up step, from training.lr
    lrs = [u["lr"] for m in metrics for u in m["train_updates"]]
    want = [0.5 * (1 + math.cos(math.pi * max(k - 1, 0) / 7)) for k in range(8)]
    assert lrs == pytest.approx([lrs[0] * w for w in want], rel=1e-9)
    # LACONIC (budget 12, eta 0.05): lambda steps by the signed violation, read once per step
    assert metrics[0]["laconic_lambda"] == 0.0
    for prev, m in zip(metrics, metrics[1:], strict=False):
        assert m["laconic_lambda"] == prev["laconic_lambda_next"]
    for m in metrics:
        expected = m["laconic_lambda"] + 0.05 * (m["laconic_length_mean"] / 12 - 1)
        assert m["laconic_lambda_next"] == pytest.approx(min(max(expected, 0.0), 0.3), abs=1e-12)
        assert m["laconic_length_mean"] == pytest.approx(m["length_mean"])
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [-1, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert (run / "final" / "model.safetensors").is_file()
    assert list((run / "tb").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_before"]["step"] == -1


def test_interrupted_and_resumed_equals_uninterrupted(
    tiny_run_dir, tmp_path, run_cli, tiny_train_args
):
    """Kill the driver after step 1 commits; resuming must end bit-identical to the full run."""
    uninterrupted = tiny_run_dir
    proc = run_cli(tiny_train_args(tmp_path, "run.steps=4"))
    _kill_after_commit(proc, tmp_path / "full" / "checkpoints" / "step_000001")
    resumed = run_cli(["train", "--resume", str(tmp_path / "full")])
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


def _kill_after_commit(proc, ckpt) -> None:
    deadline = time.monotonic() + 900
    while not ckpt.is_dir():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_off_policy_run_resumes_exactly(tmp_path, run_cli, tiny_train_args):
    """run.off_policy_steps=1: each later step trains on rollouts collected while the step before
    it trained. Killed once step 0 commits (its checkpoint holds step 1's rollouts), the resumed
    run ends bit-identical to the uninterrupted one."""
    extra = ("run.steps=3", "run.off_policy_steps=1")
    full = run_cli(tiny_train_args(tmp_path / "a", *extra))
    log, _ = full.communicate(timeout=900)
    assert full.returncode == 0, log[-4000:]
    proc = run_cli(tiny_train_args(tmp_path / "b", *extra))
    ckpt = tmp_path / "b" / "full" / "checkpoints" / "step_000000"
    _kill_after_commit(proc, ckpt)
    assert (ckpt / "ahead.pkl").is_file()
    resumed = run_cli(["train", "--resume", str(tmp_path / "b" / "full")])
    log, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, log[-4000:]

    a, b = (
        [json.loads(x) for x in (tmp_path / d / "full" / "metrics.jsonl").read_text().splitlines()]
        for d in ("a", "b")
    )
    assert [m["rollouts_collected_ahead"] for m in a] == [0, 1, 1]
    for m in a[1:]:
        # collected during the step before: not part of this step's time
        assert m["time_generate"] > 0 and m["time_wait_ahead"] >= 0
    assert [_deterministic(m) for m in a] == [_deterministic(m) for m in b]
    last = tmp_path / "a" / "full" / "checkpoints" / "step_000002"
    assert not (last / "ahead.pkl").exists()  # the last step collects nothing ahead
    wa = load_file(tmp_path / "a" / "full" / "final" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "full" / "final" / "model.safetensors")
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
def test_bad_input_fails_before_any_actor(tmp_path, capsys, tiny_config, overrides, message):
    args = ["train", "--config", str(tiny_config), f"--set=run.output_dir={tmp_path}"]
    args += [f"--set={o}" for o in overrides]
    assert cli_main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


def test_empty_dataset_is_named(tmp_path, capsys, tiny_config):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [
        "train",
        "--config",
        str(tiny_config),
        f"--set=run.output_dir={tmp_path}",
        "--set=task.name=file",
        f"--set=task.train_path={empty}",
    ]
    assert cli_main(args) == 2
    assert "empty" in capsys.readouterr().err
