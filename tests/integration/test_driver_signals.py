"""`rlvr train` ended by a signal, as a user or a supervisor ends it: Ctrl-C stops the run after
the step in progress commits, and a SIGKILLed driver leaves no process of its cluster behind."""

from __future__ import annotations

import json
import signal
import time

import psutil

from rlvr.run.rundir import RunDir
from workflows.reaper import program

ACTORS = {"PolicyActor", "GeneratorActor", "VerifierActor", "ControllerActor"}
CLUSTER = ACTORS | {"gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent"}


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


def cluster_of(driver: psutil.Process) -> tuple[list[psutil.Process], psutil.Process]:
    """The driver's cluster (every process it started but the reaper) and its reaper."""
    procs = driver.children(recursive=True)
    [reaper] = [p for p in procs if program(p) == "workflows.reaper"]
    return [p for p in procs if p != reaper], reaper


def test_ctrl_c_stops_the_run_after_its_step_and_leaves_nothing_running(
    tmp_path, run_cli, tiny_train_args, run_control
):
    run = tmp_path / "full"
    proc = run_cli(tiny_train_args(tmp_path, "run.steps=200"))
    run_control.wait_for_commit(proc, run / "checkpoints" / "step_000000")
    cluster, _ = cluster_of(psutil.Process(proc.pid))
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=600)  # the reaper holds the pipe until it is done
    assert proc.returncode == 130, out[-4000:]
    assert "rlvr: Ctrl-C: stopping after the current step (Ctrl-C again to stop now)" in out
    last = RunDir(run).last_completed_step()
    assert (
        f"rlvr: stopped by SIGINT after the current step; its last committed step is {last}: "
        f"`rlvr train --resume {run}` continues from there" in out
    )
    # Every step that ran was committed whole: its log lines and its checkpoint, nothing after.
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(last + 1))
    assert not list((run / "checkpoints").glob(".staging_*"))
    assert alive(cluster) == []


def test_a_killed_driver_takes_its_cluster_with_it(tmp_path, run_cli, tiny_train_args):
    """SIGKILL leaves the driver no way to clean up: Ray's GCS and raylet end with it, its
    workers with the raylet, and the reaper stops the rest (Ray's agents would linger a minute
    reporting the loss to the dead GCS)."""
    proc = run_cli(tiny_train_args(tmp_path, "run.steps=200"))
    driver = psutil.Process(proc.pid)
    deadline = time.monotonic() + 600
    while not {program(p) for p in driver.children(recursive=True)} >= ACTORS:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the run's actors never started"
        time.sleep(0.5)
    cluster, reaper = cluster_of(driver)
    assert {program(p) for p in cluster} >= CLUSTER
    proc.kill()
    proc.wait()
    reaper.wait(timeout=120)
    assert alive(cluster) == []
