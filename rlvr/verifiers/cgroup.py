"""A memory cgroup per sandbox run: the memory of all of a run's processes together stays under
one limit, however many processes it forks (rlvr.verifiers.sandbox).

Found once per process: cgroup v2 where the verifier's own cgroup hands the memory controller to
its children (its `cgroup.subtree_control` lists `memory`, or accepts `+memory`: say, a systemd
unit with `Delegate=yes` whose processes sit in a leaf), else cgroup v1's memory controller where
this process may make a child of its own cgroup there (root in most containers). Elsewhere
`hierarchy()` is None and the sandbox bounds memory with rlimits instead. A run removes its
cgroup when it ends; those of a process killed mid-run go at the next process's first look.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass

__all__ = ["Hierarchy", "MemoryCgroup", "hierarchy", "sweep"]

log = logging.getLogger(__name__)

PREFIX = "rlvr-sandbox-"
"""A run's cgroup is PREFIX + the pid of the process that made it + a random suffix."""
REMOVE_WAIT_S = 2.0
"""How long `remove` waits for a run's killed processes to leave before it gives up."""


@dataclass(frozen=True)
class Hierarchy:
    """Where runs' cgroups are made: `path`, a directory of cgroup `version` 1 or 2."""

    version: int
    path: str


_lock = threading.Lock()
_found: list[Hierarchy | None] = []


def hierarchy() -> Hierarchy | None:
    """The cgroup under which runs' memory cgroups are made here, or None (probed once)."""
    with _lock:
        if not _found:
            _found.append(_probe())
            where = _found[0]
            if where is not None:
                sweep(where)
            if where is None:
                log.info("code sandbox: no memory cgroup can be made here; rlimits bound memory")
            else:
                log.info(
                    "code sandbox: memory bounded by cgroup v%d under %s", where.version, where.path
                )
        return _found[0]


def sweep(where: Hierarchy) -> None:
    """Delete the cgroups left under `where` by processes that died before removing them (a
    verifier killed mid-run); those of live processes, and any still holding one, stay."""
    for name in os.listdir(where.path):
        pid = name[len(PREFIX) :].partition("-")[0]
        if not name.startswith(PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(where.path, name))
        except PermissionError:  # alive, another user's
            pass


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, filesystem type, super options) of every mount this process sees."""
    out = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            point = fields[4].encode().decode("unicode_escape")
            out.append((point, tail[0], tail[2].split(",")))
    return out


def _candidates() -> list[Hierarchy]:
    """The v2, then v1, cgroup directory of this process that could hold memory-limited children."""
    own = {}
    for line in _read("/proc/self/cgroup").splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0":
            own[2] = path
        elif "memory" in controllers.split(","):
            own[1] = path
    out = []
    for point, fstype, options in _mounts():
        if fstype == "cgroup2" and 2 in own:
            base = point + own[2]
            if "memory" not in _read(os.path.join(base, "cgroup.controllers")).split():
                continue
            control = os.path.join(base, "cgroup.subtree_control")
            if "memory" not in _read(control).split():
                try:
                    _write(control, "+memory")
                except OSError:  # the cgroup holds processes itself, or is not ours
                    continue
            out.append(Hierarchy(2, base))
        elif fstype == "cgroup" and "memory" in options and 1 in own:
            out.append(Hierarchy(1, point + own[1]))
    return sorted(out, key=lambda h: -h.version)


def _probe() -> Hierarchy | None:
    try:
        candidates = _candidates()
    except (OSError, ValueError):
        return None
    for where in candidates:
        try:
            MemoryCgroup(where, 64 << 20).remove()
        except OSError:
            continue
        return where
    return None


class MemoryCgroup:
    """A fresh cgroup under `where` limited to `limit_bytes` of memory, swap included (no swap
    where the kernel accounts it); a process joins it by writing its pid to `procs`."""

    def __init__(self, where: Hierarchy, limit_bytes: int):
        self.where = where
        self.path = os.path.join(where.path, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        try:
            if where.version == 2:
                _write(self._file("memory.max"), str(limit_bytes))
                self._write_if_present("memory.swap.max", "0")
            else:
                _write(self._file("memory.limit_in_bytes"), str(limit_bytes))
                self._write_if_present("memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError:
            os.rmdir(self.path)
            raise

    @property
    def procs(self) -> str:
        return self._file("cgroup.procs")

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _write_if_present(self, name: str, value: str) -> None:
        if os.path.exists(self._file(name)):
            _write(self._file(name), value)

    def _pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(self.procs).split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (also those that left the run's process group)."""
        if os.path.exists(self._file("cgroup.kill")):
            with contextlib.suppress(OSError):
                _write(self._file("cgroup.kill"), "1")
                return
        for _ in range(100):  # a process forking while it is killed adds one more round
            pids = self._pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        """Kill what is left and delete the cgroup, once its processes are gone (logged when
        they are not within REMOVE_WAIT_S)."""
        self.kill()
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    log.warning("code sandbox: could not remove the cgroup %s", self.path)
                    return
                time.sleep(0.01)
