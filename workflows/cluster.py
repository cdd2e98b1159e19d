"""Starting or joining the Ray cluster a run's actors live in: the environment every worker
inherits, where the workers' output goes (the run's engine log, through a worker setup hook),
the check that the config's actors fit the cluster's nodes before any starts, the plug-ins passed as
objects sent to the actors by value, and the reaper that takes a local cluster with its driver
however the driver ends (`workflows.reaper`)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rlvr.config import Config, ConfigError
from rlvr.run.placement import check_cluster
from rlvr.serving.config import ServeConfig
from workflows.reaper import mark_environment, start_reaper

ENGINE_LOG = "engine.log"
"""File in the run directory that receives every actor's stdout and stderr."""
ENGINE_LOG_ENV = "RLVR_ENGINE_LOG"
ENGINE_LOGS_HELP = (
    f"show the engines' output (vLLM, DeepSpeed, Ray, transformers) on this console instead of "
    f"in <run>/{ENGINE_LOG}"
)


def ray_env() -> None:
    """Defaults for a local, offline cluster on 127.0.0.1 (kept when the caller set its own)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def send_plugins_by_value(cfg: Config) -> None:
    """Have Ray pickle the config's plug-ins passed as objects (reward functions, tools, an
    environment class) by value, as cloudpickle does for those defined in `__main__`: a module the
    driver imported them from (a notebook's helper file, a test module, a script's folder) need
    not be importable in the actors. Their module stays registered with Ray's pickler for this
    process: what else of it crosses to an actor crosses by value too."""
    from ray import cloudpickle as ray_pickle

    for plugin in _objects(cfg.model_dump()):
        module = sys.modules.get(getattr(plugin, "__module__", None) or "")
        if module is None or module.__name__ == "__main__":
            continue  # by value already
        if module.__name__ not in ray_pickle.list_registry_pickle_by_value():
            ray_pickle.register_pickle_by_value(module)


def _objects(tree: Any) -> list[Any]:
    """The callables (functions, classes) in nested config data."""
    if callable(tree):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else []
    return [o for value in values for o in _objects(value)]


def redirect_worker_output() -> None:
    """Ray worker setup hook: append this process's stdout and stderr (file descriptors 1 and 2,
    so C++ and subprocess output too) to the file named by RLVR_ENGINE_LOG."""
    path = Path(os.environ[ENGINE_LOG_ENV])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def quiet_driver() -> None:
    """Keep library chatter of this process off the console: it loads models with transformers
    (progress bars) and imports DeepSpeed only for the actor classes (an accelerator note on
    stdout). Call before either is imported; `--engine-logs` skips it."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("DeepSpeed").disabled = True


def worker_output_options(engine_log: Path | None) -> dict[str, Any]:
    """`ray.init` options that send every worker's output to `engine_log` and keep Ray's own
    notes off the driver's console; with None, Ray's default: worker lines on the console."""
    if engine_log is None:
        return {"log_to_driver": True}
    return {
        "log_to_driver": False,
        "logging_level": logging.WARNING,
        "runtime_env": {
            "env_vars": {ENGINE_LOG_ENV: str(engine_log.resolve())},
            "worker_process_setup_hook": "workflows.cluster.redirect_worker_output",
        },
    }


def init_ray(cfg: Config | ServeConfig, engine_log: Path | None = None) -> None:
    """Join RAY_ADDRESS when set; otherwise start an in-process cluster on 127.0.0.1, failing
    with a ConfigError, before any actor starts, where the config's actors cannot fit its nodes.

    `engine_log`: the file that receives the actors' output (None: the console, as Ray does).
    """
    import ray

    from actors.controller import NAMESPACE

    output = worker_output_options(engine_log)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=NAMESPACE, **output)
        try:
            check_fits(cfg)
        except ConfigError:
            ray.shutdown()
            raise
    else:
        cpus = os.cpu_count() or 1
        import torch

        _fits(cfg)([{"CPU": float(cpus), "GPU": float(torch.cuda.device_count())}])
        mark_environment()  # before the cluster starts: its processes inherit the mark
        context = ray.init(
            address="local",  # a cluster of its own, never one another process started
            num_cpus=cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            **output,
        )
        start_reaper(context.address_info["session_dir"])


def check_fits(cfg: Config | ServeConfig) -> None:
    """ConfigError, before any actor starts, where the config's actors cannot fit the nodes of the
    cluster this driver has joined."""
    import ray

    _fits(cfg)([n["Resources"] for n in ray.nodes() if n["Alive"]])


def _fits(cfg: Config | ServeConfig) -> Callable[[list[dict[str, float]]], None]:
    """The check that the config's actors fit a cluster's nodes (given their resources)."""
    return cfg.check_cluster if isinstance(cfg, ServeConfig) else partial(check_cluster, cfg)


def announce_engine_log(run_path: Path) -> Path:
    """The run's engine log, named on the console so that the user knows where to look."""
    path = run_path / ENGINE_LOG
    print(f"rlvr: engine logs (vLLM, DeepSpeed, Ray workers) go to {path}", file=sys.stderr)
    return path
