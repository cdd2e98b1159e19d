"""The Python API: train, evaluate and serve from a notebook or a script. `rlvr` exposes these
names (`rlvr.train`, `rlvr.evaluate`, `rlvr.serve`, `rlvr.TrainingRun`, `rlvr.Deployment`), and
the `rlvr` command is a thin layer over them.

A run started here is the run `rlvr train` starts: the same checks before any actor starts (the
same `ConfigError`s), the same run directory, metrics and resume. A call that needs Ray starts an
in-process cluster on 127.0.0.1 for its run and shuts it down when the run ends, joins the cluster
named by RAY_ADDRESS, or uses the one this process has already initialised (then the actors'
output goes to Ray's console, not the run's engine log). One training run at a time per process:
a stop request, like Ctrl-C, is the process's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from rlvr.config import Config, ConfigError, Overrides, load_config, override_config
from rlvr.run.rundir import RunDir
from rlvr.run.views import metrics_frame
from rlvr.serving.config import ServeConfig, load_serve_config
from workflows.cluster import (
    announce_engine_log,
    check_fits,
    init_ray,
    quiet_driver,
    ray_env,
    send_plugins_by_value,
)
from workflows.stopping import (
    RunStopped,
    request_stop,
    stopping_on_request,
    stopping_on_signals,
)

__all__ = ["Deployment", "TrainingRun", "evaluate", "serve", "train"]

POLL_S = 0.5
"""How often a background run's metrics are looked for, and its actors."""

_active: list[TrainingRun] = []
"""The background run of this process, while it goes on."""


def as_config(config: Config | str | Path | None, overrides: Overrides | None = None) -> Config:
    """A training config from a `Config` (overrides applied to a copy) or a YAML file or shipped
    preset name (None: the defaults)."""
    if isinstance(config, Config):
        return override_config(config, overrides) if overrides else config
    return load_config(config, overrides)


def train(
    config: Config | str | Path | None = None,
    overrides: Overrides | None = None,
    *,
    resume: bool | str | Path = False,
    background: bool = False,
    engine_logs: bool = False,
    in_process: bool = False,
) -> dict[str, Any] | TrainingRun:
    """Train a policy, as `rlvr train` does.

    Args:
        config: a `Config`, or a YAML file or shipped preset name (`"tiny"`) to load.
        overrides: keys to change, `{"run.steps": 4, "verifier.function": my_reward}` or
            `--set` strings (`["run.steps=4"]`). A reward function, the tools
            (`{"env.kind": "tools", "env.tools": [my_tool]}`) and an environment class
            (`{"env.kind": "python", "env.class": MyEnv}`) may be the objects themselves.
        resume: continue a run after its last committed step: `True` resumes the run directory
            the config names (`run.output_dir`/`run.name`), a path resumes that one (its
            config.yaml is the config unless `config` is given, which must match it). A run
            started with Python objects resumes with the `Config` that holds them.
        background: start the run in a thread of this process and return its `TrainingRun` at
            once; otherwise train here until the run ends.
        engine_logs: the actors' output (vLLM, DeepSpeed, Ray) on this console instead of the
            run's engine.log.
        in_process: run the workers in this process instead of Ray actors (debugging).

    Returns:
        The run's summary as its summary.json holds it (run_dir, steps, eval_before, eval_after,
        best_step, final_model); with `background`, the `TrainingRun`.

    Raises:
        ConfigError: the config, model, data or cluster cannot make this run, found before any
            actor starts (as `rlvr train` exits with status 2).
        RunStopped: in the foreground, Ctrl-C stopped the run (after the current step, or at
            once when pressed twice); its `run_path` is the run to resume.
    """
    if _active and _active[0].status == "running":
        raise RuntimeError(
            f"{_active[0]!r} is training in this process; wait() for it or stop() it first"
        )
    ray_env()
    cfg, run_path, resuming = _run_to_train(config, overrides, resume)
    quiet = not (engine_logs or in_process)  # in-process, the engines run right here
    if quiet:
        quiet_driver()
    from workflows.train import prepare_training
    from workflows.train import train as train_run

    prepared = prepare_training(cfg)  # bad input fails here, before Ray or any actor starts
    send_plugins_by_value(cfg)
    cluster = RayForRun.start(cfg, announce_engine_log(run_path) if quiet else None)
    go = partial(
        train_run,
        cfg,
        run_path,
        resume=resuming,
        use_actors=not in_process,
        prepared=prepared,
        progress=not background,
    )
    if background:
        run = TrainingRun(cfg, run_path, go, cluster, engine_logs=engine_logs)
        _active[:] = [run]
        return run
    in_main = threading.current_thread() is threading.main_thread()
    try:
        with stopping_on_signals() if in_main else stopping_on_request():
            return go()
    except RunStopped as stop:
        stop.run_path = run_path
        raise
    finally:
        cluster.close()


def _run_to_train(
    config: Config | str | Path | None, overrides: Overrides | None, resume: bool | str | Path
) -> tuple[Config, Path, bool]:
    """(config, run directory, whether it resumes) of a `train` call."""
    from workflows.checkpoints import load_run_config
    from workflows.train import run_path_for

    if resume is False:
        cfg = as_config(config, overrides)
        return cfg, run_path_for(cfg), False
    if resume is True:
        if config is None:
            raise ConfigError(
                "resume=True continues the run its config names: give the config too, or "
                "resume=RUN_DIR"
            )
        cfg = as_config(config, overrides)
        return cfg, run_path_for(cfg), True
    run_path = Path(resume).expanduser()
    if config is None:
        if overrides:
            raise ConfigError("overrides cannot change a run being resumed; start a new run")
        return load_run_config(run_path), run_path, True
    cfg = as_config(config, overrides)
    same_run(cfg, run_path)
    return cfg, run_path, True


def same_run(cfg: Config, run_path: Path) -> None:
    """ConfigError unless `cfg` is the config the run at `run_path` was started with (a reward
    function, tool or environment class passed as an object compares by its
    `package.module:name`)."""
    try:
        saved = _flat(RunDir(run_path).load_config_dict())
    except FileNotFoundError as err:
        raise ConfigError(f"invalid resume: {err}") from None
    given = _flat(cfg.to_dict())
    differ = sorted(k for k, v in saved.items() if k in given and given[k] != v)
    if differ:
        shown = ", ".join(f"{k} ({given[k]!r} here, {saved[k]!r} there)" for k in differ[:4])
        raise ConfigError(
            f"invalid resume: the config differs from {run_path / 'config.yaml'} at {shown}; a "
            "resumed run keeps its config (start a new run instead)"
        )


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: value}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


class RayForRun:
    """The Ray cluster a call runs on: started here (and shut down by `close`), joined at
    RAY_ADDRESS, or the one this process had initialised already (left as it was)."""

    def __init__(self, owned: bool) -> None:
        self.owned = owned

    @classmethod
    def start(cls, cfg: Config | ServeConfig, engine_log: Path | None = None) -> RayForRun:
        """Ready for `cfg`'s actors; ConfigError where they cannot fit the cluster's nodes."""
        import ray

        if ray.is_initialized():
            check_fits(cfg)
            return cls(owned=False)
        init_ray(cfg, engine_log)
        return cls(owned=True)

    def close(self) -> None:
        """Shut down a cluster started for the call (the reaper started with it stays until this
        process ends, for what might outlive it)."""
        if self.owned:
            import ray

            ray.shutdown()
            self.owned = False


class TrainingRun:
    """A training run going on in a background thread of this process, as `train(...,
    background=True)` returns it.

    Iterating it yields each step's metrics as the step commits, until the run ends. `stop()`
    ends it after the current step, as a first Ctrl-C ends `rlvr train`, and `resume()`
    continues it after its last committed step. While it runs, its actors live in this process's
    Ray cluster: `controller()` is its ControllerActor, found by name.
    """

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        run: Callable[[], dict[str, Any]],
        cluster: RayForRun,
        engine_logs: bool = False,
    ) -> None:
        self.config = config
        """The run's config."""
        self.run_dir = run_dir
        """The run directory (config.yaml, metrics.jsonl, checkpoints/, final/, ...)."""
        self._engine_logs = engine_logs
        self._cluster = cluster
        self._summary: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._status = "running"
        entered = threading.Event()
        self._thread = threading.Thread(
            target=self._train, args=(run, entered), name=f"rlvr-train-{config.run.name}"
        )
        self._thread.daemon = True  # a kernel that exits takes it along; its reaper ends Ray
        self._first_step = self.last_step
        self._thread.start()
        entered.wait()  # a stop asked from now on reaches the run

    def _train(self, run: Callable[[], dict[str, Any]], entered: threading.Event) -> None:
        try:
            with stopping_on_request():
                entered.set()
                self._summary = run()
            self._status = "finished"
        except RunStopped:
            self._status = "stopped"
        except BaseException as err:  # handed to wait(), in the caller's thread
            self._error = err
            self._status = "failed"
        finally:
            entered.set()
            self._cluster.close()

    @property
    def status(self) -> str:
        """'running', 'finished', 'stopped' (by `stop()`) or 'failed' (`wait()` raises why)."""
        return self._status

    @property
    def last_step(self) -> int | None:
        """The last committed step (None: none yet)."""
        return RunDir(self.run_dir).last_completed_step() if self.run_dir.is_dir() else None

    def metrics(self) -> pd.DataFrame:
        """Every committed step's metrics (metrics.jsonl), one row per step."""
        return metrics_frame(RunDir(self.run_dir).read_metrics())

    def evals(self) -> pd.DataFrame:
        """The held-out evaluations so far (eval.jsonl; step -1 is before training)."""
        return metrics_frame(RunDir(self.run_dir).read_eval())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Each step's metrics once the step has committed, in order, until the run ends (then
        the run's error, if it failed, is raised)."""
        after = -1 if self._first_step is None else self._first_step
        while True:
            done = not self._thread.is_alive()  # read before the file: nothing is missed
            for record in RunDir(self.run_dir).read_metrics():
                if record["step"] > after:
                    after = record["step"]
                    yield record
            if done:
                break
            time.sleep(POLL_S)
        if self._error is not None:
            raise self._error

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the run to end; its summary (as `train` returns it), or None when `stop()`
        ended it first. Raises the run's error when it failed, TimeoutError past `timeout`."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self!r} is still training after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._summary

    def stop(self, timeout: float | None = None, *, after_step: int | None = None) -> int | None:
        """Stop the run after its current step (it commits), or once step `after_step` has
        committed, and wait for it up to `timeout` s (0: ask and return at once); returns the
        last committed step, from which `resume()` continues."""
        if self._thread.is_alive():
            request_stop(after_step)
        self._thread.join(timeout)
        return self.last_step

    def resume(self, background: bool = True) -> dict[str, Any] | TrainingRun:
        """Continue the run after its last committed step (`train(config, resume=run_dir)`)."""
        if self._thread.is_alive():
            raise RuntimeError(f"{self!r} is still training; stop() it first")
        return train(
            self.config, resume=self.run_dir, background=background, engine_logs=self._engine_logs
        )

    def controller(self, timeout: float = 300.0) -> Any:
        """The run's live ControllerActor (`rlvr-controller-<run.name>` in Ray namespace `rlvr`),
        once it has started; RuntimeError when the run ends first."""
        import ray

        from actors.controller import NAMESPACE, controller_name

        name = controller_name(self.config.run.name)
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                return ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # not started yet
                time.sleep(POLL_S)
        raise RuntimeError(f"no live actor {name!r}: {self!r}")

    def __repr__(self) -> str:
        last = self.last_step
        done = 0 if last is None else last + 1
        at = f"{done}/{self.config.run.steps} steps committed"
        return f"TrainingRun({self.config.run.name!r}, {self.status}, {at}, {self.run_dir})"


def evaluate(
    checkpoint: str | Path,
    *,
    data: str | Path | None = None,
    config: Config | str | Path | None = None,
    n: int = 4,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_tokens: int | None = None,
    seed: int = 0,
    backend: str = "vllm",
    use_env: bool = True,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """Accuracy, unbiased pass@k, mean length and truncated share of a checkpoint, as
    `rlvr evaluate` measures them, in this process (no Ray).

    Args:
        checkpoint: a run directory (its final model), a step checkpoint, an HF model directory
            or a PEFT adapter.
        data: a preset (its held-out split) or a dataset file; default the run's held-out split.
        config: the run's config (a `Config` or a YAML file; default the run's config.yaml); give
            the `Config` when its reward function, tools or environment class were passed as
            objects.
        n: samples per problem, at `temperature` and `top_p`, from `seed` on.
        max_tokens: the longest answer (default: the config's generation.max_tokens).
        backend: "vllm", or "hf" (transformers).
        use_env: play the run's tools or environment (its `env` section) as training does;
            False scores single-turn answers with the verifier.
        out: the output folder (default `<run>/eval-<checkpoint>`).

    Returns:
        The summary written to evaluation.json (problems, accuracy, pass_at_k, mean_length,
        truncated_frac, uncomputed: the samples whose trajectory failed on the environment's
        side, left out of accuracy and pass@k, ...) with `out`, the folder that also holds items.jsonl and
        evaluation.png.
    """
    from workflows.evaluate import run_evaluate

    sampling: dict[str, Any] = {"n": n, "temperature": temperature, "top_p": top_p, "seed": seed}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    target, summary = run_evaluate(
        str(checkpoint),
        data=None if data is None else str(data),
        config=config,
        out=None if out is None else str(out),
        backend=backend,
        use_env=use_env,
        **sampling,
    )
    return {"out": str(target), **summary}


def serve(
    config: ServeConfig | str | Path | None = None,
    overrides: Overrides | None = None,
    *,
    background: bool = False,
) -> Deployment | None:
    """Serve a checkpoint behind the CSA release gate, as `rlvr serve` does.

    Args:
        config: a `ServeConfig`, or a serve YAML file or preset name (`"serve-tiny"`).
        overrides: keys to change (`{"http.port": 8001}` or `["http.port=8001"]`).
        background: start serving and return its `Deployment` once it answers; otherwise serve
            here until Ctrl-C.

    Raises:
        ConfigError: a bad checkpoint, calibration, stream grid or access setting, before Ray.
    """
    ray_env()
    cfg = config if isinstance(config, ServeConfig) else load_serve_config(config, overrides)
    from workflows.serve import prepare_serve, serve_forever

    prepared = prepare_serve(cfg)  # bad checkpoint, calibration or grid fail here, before Ray
    cluster = RayForRun.start(cfg)
    if background:
        return Deployment(cfg, prepared, cluster)
    try:
        serve_forever(cfg, prepared)
    finally:
        cluster.close()
    return None


class Deployment:
    """A deployment serving from this process (`serve(..., background=True)`): its OpenAI
    compatible API at `url`, every answer gated by its CSA streams, until `stop()`."""

    def __init__(self, cfg: ServeConfig, prepared: Any, cluster: RayForRun) -> None:
        from workflows.serve import announce, live_updates, start_serving, stop_serving

        self.config = cfg
        """The deployment's config."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(cfg.http.host, cfg.http.host)
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{cfg.http.port}/v1"
        """The base URL of its OpenAI-compatible API (an OpenAI client's base_url)."""
        self._cluster = cluster
        self._stop = threading.Event()
        self._updates: threading.Thread | None = None
        try:
            self.streams = start_serving(cfg, prepared)
            """The StreamsActor owning the deployment's CSA streams."""
        except BaseException:
            stop_serving(None)
            cluster.close()
            raise
        announce(cfg, prepared)
        if cfg.live.enabled:
            self._updates = threading.Thread(
                target=live_updates,
                args=(cfg, prepared, self.streams, self._stop),
                name="rlvr-live-updates",
                daemon=True,
            )
            self._updates.start()

    def stop(self) -> None:
        """Stop serving (the streams' state stays on disk, for the next deployment)."""
        if self._stop.is_set():
            return
        self._stop.set()
        from workflows.serve import stop_serving

        if self._updates is not None:
            self._updates.join()
        stop_serving(self.streams)
        self._cluster.close()

    def __repr__(self) -> str:
        state = "stopped" if self._stop.is_set() else "serving"
        return f"Deployment({self.config.name!r}, {state} at {self.url})"
