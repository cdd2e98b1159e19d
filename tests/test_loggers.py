"""`run.loggers`: a short synthetic run logged to TensorBoard, W&B (offline) and MLflow (file
store) and read back from disk, a crashed attempt resumed into the same runs; config checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlvr.config import ConfigError, RunConfig, load_config
from rlvr.run import loggers
from rlvr.run.loggers import check_loggers, open_loggers, scalars, wandb_mode
from workflows.train import prepare_training

CONFIG = {"run": {"name": "synthetic", "seed": 3}, "training": {"lr": 1e-5, "stop": []}}


def record(step: int, attempt: int) -> dict:
    """A step's metrics as the trainer makes them: numbers (numpy's too), flags, text, NaN."""
    return {
        "step": step,
        "reward_mean": step / 10 + attempt,
        "tokens": np.int64(100 + step),
        "skipped": True,
        "best_metric": "eval_accuracy",
        "train_loss": float("nan"),
    }


def assert_series(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, by_step in want.items():
        assert got[name] == pytest.approx(by_step), name  # TensorBoard keeps float32


def test_only_finite_numbers_are_logged():
    assert scalars(record(2, 0)) == {"reward_mean": 0.2, "tokens": 102.0}


def test_every_store_holds_the_run_and_a_resume_continues_it(tmp_path, monkeypatch, logger_stores):
    """Attempt 1 logs the evaluation before training (-1) and steps 0-2, then crashes with step 1
    committed; attempt 2 redoes step 2 and logs step 3 into the same W&B and MLflow runs."""
    monkeypatch.delenv("WANDB_MODE")  # the default: no API key configured, so offline
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wandb_mode() == "offline"
    run = RunConfig(name="synthetic", loggers=["tensorboard", "wandb", "mlflow"])
    with pytest.raises(RuntimeError), open_loggers(run, tmp_path, CONFIG, -1) as opened:
        for step in range(-1, 3):
            opened.log(record(step, 0), step)
        raise RuntimeError("lost the driver after step 2's metrics, before its checkpoint")
    [(mlflow_run, _)] = logger_stores.mlflow(tmp_path, "synthetic")
    assert mlflow_run.info.status == "FAILED"
    with open_loggers(run, tmp_path, CONFIG, 2) as opened:
        for step in (2, 3):
            opened.log(record(step, 1), step)

    want = {
        "reward_mean": {s: s / 10 + (s >= 2) for s in range(-1, 4)},
        "tokens": {s: 100.0 + s for s in range(-1, 4)},
    }
    assert_series(logger_stores.tensorboard(tmp_path), want)
    ids = json.loads((tmp_path / "loggers.json").read_text())
    [first, second] = logger_stores.wandb(tmp_path)
    assert first[0] == second[0] == ids["wandb"]
    assert first[1]["reward_mean"] == pytest.approx({s: s / 10 for s in range(-1, 3)})
    assert second[1]["reward_mean"] == pytest.approx({2: 1.2, 3: 1.3})
    assert second[1]["tokens"] == {2: 102.0, 3: 103.0}
    [(mlflow_run, series)] = logger_stores.mlflow(tmp_path, "synthetic")
    assert mlflow_run.info.run_id == ids["mlflow"] and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params == {
        "run.name": "synthetic",
        "run.seed": "3",
        "training.lr": "1e-05",
        "training.stop": "[]",
    }
    assert_series(series, want)


@pytest.mark.parametrize(
    ("env", "netrc_host", "mode"),
    [
        ({}, None, "offline"),
        ({}, "example.org", "offline"),
        ({}, "api.wandb.ai", "online"),
        ({"WANDB_API_KEY": "k" * 40}, None, "online"),
        ({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k" * 40}, None, "disabled"),
    ],
)
def test_wandb_goes_online_only_with_a_key(tmp_path, monkeypatch, env, netrc_host, mode):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(tmp_path))
    if netrc_host:
        (tmp_path / ".netrc").write_text(f"machine {netrc_host} login user password {'k' * 40}\n")
        (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode() == mode


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.loggers=[tensorboard,neptune]", "run.loggers.1: Input should be 'tensorboard'"),
        ("run.loggers=[wandb,mlflow,wandb]", "run.loggers: lists wandb more than once"),
        ("run.loggers=wandb", "run.loggers: Input should be a valid list"),
    ],
)
def test_bad_loggers_fail_at_config_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_missing_package_is_named_before_any_actor(monkeypatch):
    assert load_config(None).run.loggers == ["tensorboard"]  # the JSONL record needs no entry
    check_loggers(["tensorboard", "wandb", "mlflow"])
    monkeypatch.setattr(loggers, "find_spec", lambda name: None if name == "mlflow" else name)
    cfg = load_config(None, ["run.loggers=[wandb,mlflow]"])
    # what `rlvr train` and `rlvr demo` run before Ray starts; the logger check comes first
    with pytest.raises(ConfigError, match=r"run\.loggers: mlflow .*pip install mlflow-skinny"):
        prepare_training(cfg)
