"""Fixtures shared by the integration tests: one finished tiny run through the actors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from workflows.reaper import program

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
    # One torch thread per actor: the suite runs beside another test worker, and a 2-thread
    # OpenMP team on a shared 2-core machine waits at every barrier for its descheduled half.
    "resources.torch_threads=1",
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


@pytest.fixture
def driver_env(monkeypatch) -> None:
    """This process's environment as a fresh driver's (a run started in-process, or a notebook
    kernel it starts): no leftovers of in-process DeepSpeed tests, no cluster address to join."""
    for key in (*DISTRIBUTED_ENV, "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)


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
    """A finished 4-step tiny run (actors, vLLM, DeepSpeed, verifier pool), logging to every
    store of `run.loggers` (W&B offline)."""
    out = tmp_path_factory.mktemp("runs")
    proc = cli(train_args(out, "run.steps=4", "run.loggers=[tensorboard,mlflow,wandb]"))
    log, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, log[-4000:]
    return out / "full"


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1: each socket stays bound until all are picked, since a
    port just released can be handed out again at once (two servers then ask for one port)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="session")
def pick_free_ports() -> Callable[[int], list[int]]:
    """`pick_free_ports(n)`: `n` distinct free ports on 127.0.0.1."""
    return free_ports


@pytest.fixture(scope="session")
def run_cli():
    """Start `rlvr ARGS` as a subprocess: `run_cli(args) -> Popen`."""
    return cli


@pytest.fixture(scope="session")
def tiny_train_args():
    """`tiny_train_args(output_dir, *overrides)`: argv of a small tiny-preset `rlvr train`."""
    return train_args


@pytest.fixture(scope="session")
def tiny_config() -> Path:
    return TINY


TIMING_KEYS = (
    "time_",
    "tokens_per_s",
    "eval_seconds",
    "busy_share_",
    "pipeline_ready_batches",
    "flops_per_s_",
    "mfu_",
)


def deterministic(record: dict) -> dict:
    """A log record without its wall-clock fields (what must match across equivalent runs)."""
    return {k: v for k, v in record.items() if not k.startswith(TIMING_KEYS)}


@pytest.fixture
def run_records() -> Callable[[Path, str], list[dict]]:
    """`run_records(run_dir, "metrics.jsonl")`: the file's records without wall-clock fields."""

    def read(run_dir: Path, name: str) -> list[dict]:
        lines = (run_dir / name).read_text().splitlines()
        return [deterministic(json.loads(line)) for line in lines]

    return read


@pytest.fixture
def assert_same_weights() -> Callable[[Path, Path], None]:
    """`assert_same_weights(run_a, run_b)`: the final models are bit-identical."""
    from safetensors.torch import load_file

    def check(a: Path, b: Path) -> None:
        wa = load_file(a / "final" / "model.safetensors")
        wb = load_file(b / "final" / "model.safetensors")
        assert wa.keys() == wb.keys()
        for k in wa:
            assert (wa[k] == wb[k]).all(), k  # exact: a resumed run must redo the same floats

    return check


class RunControl:
    """Drive a `rlvr train` subprocess from a test: wait for its commits, SIGKILL its actors (as
    the OOM killer or a lost node would) or the driver itself, and see what of its cluster is
    left."""

    ACTORS = frozenset({"PolicyActor", "GeneratorActor", "VerifierActor", "ControllerActor"})
    """The actor kinds every `rlvr train` run starts."""
    CLUSTER = ACTORS | {"gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent"}
    """What a driver's cluster runs: those actors and Ray's own processes."""

    @staticmethod
    def wait_for_commit(
        proc: subprocess.Popen, ckpt: Path, poll_s: float = 0.5, timeout_s: float = 900
    ) -> None:
        """Until the run commits checkpoint `ckpt` (it must not exit before)."""
        deadline = time.monotonic() + timeout_s
        while not ckpt.is_dir():
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, f"{ckpt.name} never committed"
            time.sleep(poll_s)

    @staticmethod
    def actor_processes(driver: psutil.Process, kind: str) -> list[psutil.Process]:
        """Live worker processes of actor class `kind` under `driver` (Ray titles them
        `ray::Class.method`)."""
        found = []
        for p in driver.children(recursive=True):
            try:
                if p.cmdline()[:1] and p.cmdline()[0].startswith(f"ray::{kind}"):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    @staticmethod
    def alive(procs: list[psutil.Process]) -> list[str]:
        """`program (pid)` of those still running (a zombie has ended)."""
        left = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{program(proc)} ({proc.pid})")
            except psutil.NoSuchProcess:
                continue
        return left

    @staticmethod
    def cluster_of(driver: psutil.Process) -> tuple[list[psutil.Process], psutil.Process]:
        """The driver's cluster (every process it started but the reaper) and its reaper."""
        procs = driver.children(recursive=True)
        [reaper] = [p for p in procs if program(p) == "workflows.reaper"]
        return [p for p in procs if p != reaper], reaper

    @staticmethod
    def programs(procs: list[psutil.Process]) -> set[str]:
        """What each process runs (`workflows.reaper.program`)."""
        return {program(p) for p in procs}

    @staticmethod
    def in_background(proc: subprocess.Popen) -> Future[str]:
        """`proc`'s output once it ends, read in a thread while the test drives another run
        beside it (an unread pipe would stall the run)."""
        reader = ThreadPoolExecutor(max_workers=1)
        try:
            return reader.submit(lambda: proc.communicate(timeout=900)[0])
        finally:
            reader.shutdown(wait=False)

    def wait_for_actors(self, proc: subprocess.Popen, timeout_s: float = 600) -> None:
        """Until every kind of `ACTORS` runs under the driver (it must not exit before)."""
        driver = psutil.Process(proc.pid)
        deadline = time.monotonic() + timeout_s
        while not self.programs(driver.children(recursive=True)) >= self.ACTORS:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the run's actors never started"
            time.sleep(0.5)

    def kill_actor(self, proc: subprocess.Popen, kind: str, timeout_s: float = 120) -> int:
        """SIGKILL one `kind` actor of the run, holding the driver still meanwhile (a tiny step
        takes well under a second: the driver meets the loss at its next call on that actor);
        returns the killed pid."""
        driver = psutil.Process(proc.pid)
        deadline = time.monotonic() + timeout_s
        driver.suspend()
        try:
            while not (victims := self.actor_processes(driver, kind)):
                assert time.monotonic() < deadline, f"no {kind} to kill"
                time.sleep(0.05)
            victims[0].kill()
            victims[0].wait(timeout=30)
            return victims[0].pid
        finally:
            driver.resume()

    def kill_driver_after_commit(self, proc: subprocess.Popen, ckpt: Path) -> int:
        """SIGKILL the driver as soon as it commits `ckpt`; returns its last committed step (a
        later one may have committed in between)."""
        self.wait_for_commit(proc, ckpt, poll_s=0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return max(int(p.name.removeprefix("step_")) for p in ckpt.parent.glob("step_*"))


@pytest.fixture
def run_control() -> RunControl:
    return RunControl()


@pytest.fixture(scope="session")
def sft_model() -> Path:
    """The SFT-warmed tiny model of configs/tiny.yaml (cached after the first build)."""
    from rlvr.config import load_config
    from workflows.train import prepare

    return prepare(load_config(TINY))[0]


@pytest.fixture(scope="session")
def problems():
    """The tiny task's held-out problems and its instruction."""
    from rlvr.config import load_config
    from rlvr.tasks import load_task

    cfg = load_config(TINY)
    return load_task(cfg.task)[1], cfg.task.instruction


@pytest.fixture(scope="session")
def fixed_calibration():
    """A served score map raw -> 0.05 + 0.25 raw (K 4, T 0.7, 16 tokens): every score lies under
    the top threshold of a grid ending at 0.3."""
    from rlvr.algorithms.csa import Calibrator
    from rlvr.serving.api import Calibration

    return Calibration(
        calibrator=Calibrator([0.0, 1.0], [0.05, 0.3]),
        raw_scores=[0.0] * 10 + [1.0] * 10,
        passed=[True] * 10 + [False] * 10,
        k=4,
        temperature=0.7,
        top_p=1.0,
        max_tokens=16,
    )
