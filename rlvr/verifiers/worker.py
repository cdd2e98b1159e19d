"""Persistent verifier worker processes with a hard deadline per call, shared by the verifiers whose
checks can hang (math-verify's sympy, a user's reward function).

A worker is a subprocess that builds a handler once (`"module:factory"` called with one string
argument; a factory may read bytes its pool gives every worker, `read_payload`) and then answers
one JSON line per call. The calling thread enforces the deadline: a
worker that misses it (or dies) is SIGKILLed and replaced, and the call raises `WorkerLost`.
Python-level timeouts (signal.alarm) do not work here: Ray actors call from a thread pool.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

__all__ = [
    "Worker",
    "WorkerLost",
    "WorkerPool",
    "import_object",
    "names_an_object",
    "plugin_name",
]

# Starting a worker may import heavy libraries (sympy and its LaTeX parser: about a second, longer
# on a busy CPU).
STARTUP_TIMEOUT_S = 120.0
_WORKER_CMD = "from rlvr.verifiers.worker import _worker_main; _worker_main()"
_MEMORY_ENV = "RLVR_VERIFIER_WORKER_MEMORY_MB"
_READY = "ready"

log = logging.getLogger(__name__)


def import_object(spec: str) -> Any:
    """The object a `"package.module:name"` spec names; ValueError/ImportError/AttributeError."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{spec!r} is not of the form 'package.module:name'")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def plugin_name(plugin: str | Any) -> str:
    """A plug-in as `package.module:name`: the string itself, or where a Python object was
    defined (a function defined in a notebook or a script reads `__main__:fn`)."""
    if isinstance(plugin, str):
        return plugin
    module = getattr(plugin, "__module__", None) or "?"
    return f"{module}:{getattr(plugin, '__qualname__', type(plugin).__qualname__)}"


def names_an_object(name: str) -> bool:
    """Whether `plugin_name` gave `name` for an object that no other process can import by it
    (defined in a notebook or a script's `__main__`, or inside a function)."""
    return name.startswith("__main__:") or ".<locals>." in name


def read_payload() -> bytes:
    """In a worker's handler factory: the bytes its pool was given (`WorkerPool(payload=)`),
    sent as the first line of the worker's input."""
    return base64.b64decode(sys.stdin.buffer.readline())


def _worker_main() -> None:
    """Worker process loop: argv is (factory spec, its argument); one JSON list of arguments in per
    line, one JSON result out (null when the handler raised)."""
    factory, arg = sys.argv[1], sys.argv[2]
    # Keep the protocol on a private copy of stdout; stray prints from libraries go to stderr.
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    limit_mb = int(os.environ.get(_MEMORY_ENV, "0"))
    if limit_mb > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    handle = import_object(factory)(arg)
    proto.write(json.dumps(_READY) + "\n")
    proto.flush()
    for line in sys.stdin.buffer:
        try:
            result = handle(*json.loads(line))
        except Exception as err:
            # Type only: str() of a sympy object can itself hang or explode.
            print(f"verifier worker {factory}: {type(err).__name__}", file=sys.stderr, flush=True)
            result = None
        proto.write(json.dumps(result) + "\n")
        proto.flush()


class WorkerLost(Exception):
    """The worker missed its deadline (`timed_out`) or died; it must be killed and replaced."""

    def __init__(self, timed_out: bool):
        super().__init__("timeout" if timed_out else "worker died")
        self.timed_out = timed_out


class Worker:
    """One worker subprocess running the handler `factory(arg)` (`payload`: bytes for the
    factory's `read_payload`), and the line-buffered pipe protocol to it; `memory_limit_mb` caps
    its address space."""

    def __init__(
        self, factory: str, arg: str, memory_limit_mb: int | None, payload: bytes | None = None
    ):
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env[_MEMORY_ENV] = str(memory_limit_mb or 0)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD, factory, arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.ready = False
        self._buffer = bytearray()
        if payload is not None:
            try:
                self.proc.stdin.write(base64.b64encode(payload) + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # it died before reading: wait_ready says it could not start

    def _read_line(self, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        # poll, unlike select, works for fds above 1024 (long-lived actors open many).
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise WorkerLost(timed_out=True)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise WorkerLost(timed_out=False)
            self._buffer += chunk
        line, _, rest = self._buffer.partition(b"\n")
        self._buffer = bytearray(rest)
        return bytes(line)

    def wait_ready(self) -> None:
        """Block until the worker has built its handler; fail loudly if it cannot start."""
        if self.ready:
            return
        try:
            line = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        except WorkerLost as err:
            self.kill()
            raise RuntimeError(f"verifier worker failed to start ({err})") from err
        if json.loads(line) != _READY:
            self.kill()
            raise RuntimeError(f"verifier worker sent {line[:200]!r} instead of ready")
        self.ready = True

    def call(self, args: list[Any], timeout: float) -> Any:
        """The handler's result for `args`, or `WorkerLost` once `timeout` seconds pass without."""
        deadline = time.monotonic() + timeout
        try:
            # default=str: a value JSON cannot carry (a date in metadata) arrives as its text
            line = json.dumps(args, default=str) + "\n"
            self.proc.stdin.write(line.encode("ascii"))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise WorkerLost(timed_out=False) from err
        return json.loads(self._read_line(deadline))

    def kill(self) -> None:
        """SIGKILL the process and close its pipes (only from the thread that owns the worker).

        Closing stdin flushes whatever a failed `call` left buffered into a pipe whose reader
        is gone; that BrokenPipeError is expected and the descriptor is closed regardless.
        """
        _kill(self.proc)
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        self.proc.stdout.close()


def _kill(proc: subprocess.Popen) -> None:
    # Pipes stay open here: another thread may still be reading them, and sees EOF instead.
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _kill_all(procs: set[subprocess.Popen]) -> None:
    for proc in list(procs):
        _kill(proc)
    procs.clear()


class WorkerPool:
    """`num_workers` Workers of one handler; `call` is thread-safe and takes an idle worker, so up
    to `num_workers` calls run at once. A worker that misses a call's deadline or dies is replaced
    and the call raises `WorkerLost`. `close()` kills them; leftovers die at garbage collection or
    exit. `name` names the owner in errors and logs; `payload` goes to every worker it starts."""

    def __init__(
        self,
        factory: str,
        arg: str = "",
        num_workers: int = 1,
        memory_limit_mb: int | None = None,
        name: str = "verifier",
        payload: bytes | None = None,
    ):
        self.factory = factory
        self.arg = arg
        self.payload = payload
        self.memory_limit_mb = memory_limit_mb
        self.name = name
        self._closed = False
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        # None is the closed sentinel: it wakes callers waiting for a worker after close().
        self._idle: queue.Queue[Worker | None] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(self._spawn())
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    def _spawn(self) -> Worker:
        worker = Worker(self.factory, self.arg, self.memory_limit_mb, self.payload)
        with self._lock:
            self._procs.add(worker.proc)
        return worker

    def _retire(self, worker: Worker) -> None:
        worker.kill()
        with self._lock:
            self._procs.discard(worker.proc)

    def _release(self, worker: Worker) -> None:
        if self._closed:
            self._retire(worker)
        else:
            self._idle.put(worker)

    def _acquire(self) -> Worker:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        worker = self._idle.get()
        if worker is None:
            self._idle.put(None)
            raise RuntimeError(f"{self.name} is closed")
        try:
            worker.wait_ready()
        except RuntimeError:
            self._retire(worker)
            self._release(self._spawn())
            raise
        return worker

    def wait_ready(self) -> None:
        """Block until every idle worker has started; call before latency-sensitive work."""
        workers = []
        try:
            while True:
                workers.append(self._idle.get_nowait())
        except queue.Empty:
            pass
        if None in workers:
            self._idle.put(None)
            raise RuntimeError(f"{self.name} is closed")
        try:
            for w in workers:
                w.wait_ready()
        finally:
            for w in workers:
                self._release(w if w.proc.poll() is None else self._spawn())

    def call(self, args: list[Any], timeout: float) -> Any:
        """The handler's result for `args` on an idle worker (None: the handler raised);
        `WorkerLost` after replacing a worker that missed `timeout` or died."""
        worker = self._acquire()
        try:
            return worker.call(args, timeout)
        except WorkerLost as lost:
            self._retire(worker)
            worker = None if self._closed else self._spawn()
            if worker is not None and not lost.timed_out:
                log.warning("%s worker died; replaced it", self.name)
            raise
        finally:
            if worker is not None:
                self._release(worker)

    def close(self) -> None:
        """Kill the workers: calls in flight lose theirs, calls still waiting raise."""
        self._closed = True
        self._finalizer()
        self._idle.put(None)
