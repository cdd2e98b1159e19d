"""Takes an in-process Ray cluster down with the driver that started it, however the driver ends.

Ray fate-shares its GCS and raylet with the driver (PR_SET_PDEATHSIG), and a worker leaves once
its raylet is gone; but the raylet's DashboardAgent and RuntimeEnvAgent first report the loss to
the dead GCS and linger for its one-minute timeout, and what an actor started (an engine core, a
verifier subprocess) may outlive it. A process of the cluster is known by either of two marks:
the environment it inherited from the driver, which `mark_environment` tags before `ray.init`
(Ray's agents overwrite theirs with their process titles), or a file it writes in the cluster's
session directory (its logs; what an actor's child writes goes to the run's engine log instead).
`start_reaper` starts, in a session of its own (a terminal's Ctrl-C does not reach it), a reaper
that waits for the driver to end and then stops every process still carrying a mark, naming each.

    python -m workflows.reaper DRIVER_PID MARK SESSION_DIR
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

MARK_ENV = "RLVR_CLUSTER_OF"
"""Environment variable whose value marks the processes of one driver's cluster."""
POLL_S = 0.2
GRACE_S = 2.0
"""How long processes may take to leave on their own once the driver has ended."""


def mark_environment() -> None:
    """Tag this process's environment, which every process it starts from now on inherits; call
    it before `ray.init` starts the cluster."""
    os.environ[MARK_ENV] = f"{os.getpid()}-{time.time_ns()}"


def start_reaper(session_dir: str) -> subprocess.Popen:
    """Start the reaper of this driver's cluster: the processes with this driver's environment
    mark, or writing in `session_dir` (the cluster's, as `ray.init` returns it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "workflows.reaper", str(os.getpid()), os.environ[MARK_ENV]]
        + [str(session_dir)],
        env={k: v for k, v in os.environ.items() if k != MARK_ENV},
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def marked(mark: str, session_dir: str) -> list[psutil.Process]:
    """The live processes (this one excepted) started with `mark` in their environment, or
    holding a file under `session_dir` open for writing (a reader, a `tail -f`, is not one)."""
    inside = os.path.join(session_dir, "")
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARK_ENV) == mark or any(
                f.path.startswith(inside) and f.mode != "r" for f in proc.open_files()
            ):
                found.append(proc)
        except psutil.Error:  # gone, a zombie, or another user's
            continue
    return found


def program(proc: psutil.Process) -> str:
    """What a process runs: a Ray process by its title (`PolicyActor`, `raylet`), a Python one by
    its script or module, any other by its program; "" once it is gone."""
    try:
        argv = proc.cmdline() or [proc.name()]
    except psutil.Error:
        return ""
    if argv[0].startswith("ray::"):
        return argv[0].split()[0].removeprefix("ray::").split(".")[0]
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    scripts = [a for a in argv if a.endswith(".py")]
    return os.path.basename(scripts[0] if scripts else argv[0])


def reap(mark: str, session_dir: str, grace_s: float = GRACE_S) -> list[str]:
    """Stop every `marked` process that has not left within `grace_s`; returns their names.
    Looks again after each round, for what a dying process started meanwhile."""
    psutil.wait_procs(marked(mark, session_dir), timeout=grace_s)
    stopped: list[str] = []
    for _ in range(5):
        left = marked(mark, session_dir)
        if not left:
            break
        stopped += [f"{program(p) or '?'} (pid {p.pid})" for p in left]
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=10)
    return stopped


def main(argv: list[str]) -> int:
    driver, mark, session_dir = int(argv[0]), argv[1], argv[2]
    while os.getppid() == driver:  # reparented once the driver has ended
        time.sleep(POLL_S)
    stopped = reap(mark, session_dir)
    if stopped:
        with contextlib.suppress(OSError):  # the driver's console may be gone with it
            print(
                f"rlvr: the driver (pid {driver}) has ended; stopped what was left of its Ray "
                f"cluster: {', '.join(stopped)}",
                file=sys.stderr,
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
