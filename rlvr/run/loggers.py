"""Step metrics to TensorBoard, Weights & Biases and MLflow (`run.loggers`), beside the run's own
metrics.jsonl and eval.jsonl, which are always written.

Every store lives in the run directory by default (tb/, wandb/, mlruns/). The W&B and MLflow run
ids are kept in loggers.json, so a resumed run (or one recovering from a lost actor) continues the
same run in each. wandb and mlflow are imported only when chosen.
"""

from __future__ import annotations

import json
import math
import netrc
import numbers
import os
import time
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlparse

from rlvr.config import ConfigError, RunConfig
from rlvr.files import atomic_write_text

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
"""The pip package each logger needs (the import name is the logger's name)."""
IDS_FILE = "loggers.json"
MLFLOW_PARAM_CHARS = 6000  # MLflow refuses longer parameter values
MLFLOW_PARAMS_PER_BATCH = 100  # and more parameters in one call


class Logger(Protocol):
    """One metric store: the run's config once, then numeric scalars per step."""

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


def check_loggers(names: Sequence[str]) -> None:
    """ConfigError naming `run.loggers` and the pip command when a chosen logger's package is
    missing (checked before any actor starts)."""
    for name in names:
        if find_spec(name) is None:
            raise ConfigError(
                f"invalid config: run.loggers: {name} needs the {PACKAGES[name]} package: "
                f"pip install {PACKAGES[name]} (or pip install 'rlvr[loggers]')"
            )


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record, without its `step` (booleans and text skipped)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k != "step"
        and isinstance(v, numbers.Real)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as dotted keys with text values (MLflow's params)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, str) else json.dumps(v)
    return out


class TensorBoardLogger:
    """Event files in tb/; events at or after the first step of this attempt are dropped from
    earlier attempts' files (purge_step)."""

    def __init__(self, log_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=first_step)

    def log_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=1).replace("\n", "\n    ")
        self.writer.add_text("config", "    " + text)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


def wandb_mode() -> str:
    """WANDB_MODE when set, else online only with an API key configured (WANDB_API_KEY or a
    .netrc entry for the W&B host): without one a run never waits on the network or prompts."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc().authenticators(host or "") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandbLogger:
    """A W&B run named after the rlvr run (project and name), its files under wandb/; metrics are
    plotted against our `step` (W&B's own step only increases, and the first eval is step -1)."""

    def __init__(self, run_dir: Path, name: str, run_id: str | None):
        import wandb

        self.run = wandb.init(
            project=name,
            name=name,
            dir=str(run_dir),
            id=run_id,
            resume="allow" if run_id else None,
            mode=wandb_mode(),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("*", step_metric="step")
        self.id = self.run.id

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "step": step})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflowLogger:
    """An MLflow run in the experiment named after the rlvr run; the tracking URI is
    `run.mlflow_uri` or a file store in mlruns/."""

    def __init__(self, uri: str, name: str, run_id: str | None):
        from mlflow.tracking import MlflowClient

        if uri.startswith("file:"):
            # MLflow 3 keeps its file store (no database packages) behind this opt-in
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.client = MlflowClient(tracking_uri=uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(name)
            eid = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(eid, run_name=name).info.run_id
        self.id = run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:MLFLOW_PARAM_CHARS]) for k, v in flatten(config).items()]
        for i in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.id, params=params[i : i + MLFLOW_PARAMS_PER_BATCH])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.id, metrics=metrics)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.id, status="FAILED" if failed else "FINISHED")


class Loggers:
    """Every chosen logger; each call goes to all of them. As a context manager it closes them,
    marking the W&B and MLflow runs failed when the block raised."""

    def __init__(self, loggers: list[Logger]):
        self.loggers = loggers

    def log_config(self, config: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_config(config)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = scalars(metrics)
        for logger in self.loggers:
            logger.log(values, step)

    def close(self, failed: bool = False) -> None:
        for logger in self.loggers:
            logger.close(failed)

    def __enter__(self) -> Loggers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(failed=kind is not None)


def _open(name: str, run: RunConfig, run_dir: Path, first_step: int, run_id: str | None) -> Logger:
    if name == "tensorboard":
        return TensorBoardLogger(run_dir / "tb", first_step)
    if name == "wandb":
        return WandbLogger(run_dir, run.name, run_id)
    return MLflowLogger(run.mlflow_uri or (run_dir / "mlruns").resolve().as_uri(), run.name, run_id)


def open_loggers(run: RunConfig, run_dir: Path, config: dict[str, Any], first_step: int) -> Loggers:
    """The loggers of `run.loggers` for the run directory `run_dir`, continuing the W&B and MLflow
    runs named in its loggers.json; `first_step` is the first step this attempt logs (-1, the
    evaluation before training, for a run logging from its start: it logs `config` too)."""
    ids_file = run_dir / IDS_FILE
    ids = json.loads(ids_file.read_text()) if ids_file.is_file() else {}
    opened = Loggers([])
    try:
        for name in run.loggers:
            logger = _open(name, run, run_dir, first_step, ids.get(name))
            opened.loggers.append(logger)
            if isinstance(logger, WandbLogger | MLflowLogger) and ids.get(name) != logger.id:
                ids[name] = logger.id
                atomic_write_text(ids_file, json.dumps(ids))
        if first_step < 0:
            opened.log_config(config)
    except BaseException:
        opened.close(failed=True)
        raise
    return opened
