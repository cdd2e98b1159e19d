"""Math answer verification: extract the final answer, compare it to the gold with math-verify.

math-verify's own timeout uses `signal.alarm`, which silently does nothing outside the main thread
(Ray actors call from a thread pool), and sympy can hang on inputs such as 9^{9^{9^9}}. So every
comparison runs in a persistent worker process with math-verify's timeouts off, and the calling
thread enforces a hard deadline: a worker that misses it is killed and replaced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from types import TracebackType

from rlvr.verifiers.extract import extract_answer

__all__ = ["STATUSES", "MathVerifier", "extract_answer", "verify_math"]

STATUSES = ("correct", "wrong", "no_answer", "timeout", "error")
# Starting a worker imports sympy and warms the LaTeX parser: about a second, longer on a busy CPU.
_STARTUP_TIMEOUT_S = 120.0
# Integers math-verify compares exactly (checked against it in the tests); int() stays cheap.
_PLAIN_INT = re.compile(r"[+-]?\d{1,18}")
_WORKER_CMD = "from rlvr.verifiers.math import _worker_main; _worker_main()"
_READY = "ready"

log = logging.getLogger(__name__)


def _gold_answer(gold: str) -> str:
    """The answer part of a gold: a bare answer, or a reference solution with a boxed/#### answer."""
    if "####" in gold or "\\boxed" in gold or "\\fbox" in gold:
        return extract_answer(gold) or ""
    return gold.strip()


def _plain_int_result(answer: str, gold: str) -> tuple[float, str] | None:
    """The verdict for two plain integers without a worker round trip (same as math-verify's)."""
    if _PLAIN_INT.fullmatch(answer) and _PLAIN_INT.fullmatch(gold):
        return (1.0, "correct") if int(answer) == int(gold) else (0.0, "wrong")
    return None


def _compare(answer: str, gold: str) -> tuple[float, str]:
    """math-verify's verdict on an extracted answer against a gold answer (worker side)."""
    from math_verify import parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    if not gold_parsed:
        return 0.0, "error"
    pred = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if verify(gold_parsed, pred, timeout_seconds=None):
        return 1.0, "correct"
    return 0.0, "wrong"


def _worker_main() -> None:
    """Worker process loop: one JSON `[answer, gold]` line in, one `[reward, status]` line out."""
    # Keep the protocol on a private copy of stdout; stray prints from libraries go to stderr.
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    limit_mb = int(os.environ.get("RLVR_MATH_WORKER_MEMORY_MB", "0"))
    if limit_mb > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    # math-verify warns once that its timeout is off: here that is the design.
    logging.disable(logging.WARNING)
    _compare("\\frac{1}{2}", "0.5")  # import sympy and build the parser before reporting ready
    proto.write(json.dumps(_READY) + "\n")
    proto.flush()
    for line in sys.stdin.buffer:
        try:
            answer, gold = json.loads(line)
            result = _compare(answer, gold)
        except Exception as err:
            # Type only: str() of a sympy object can itself hang or explode.
            print(f"math verifier worker: {type(err).__name__}", file=sys.stderr, flush=True)
            result = (0.0, "error")
        proto.write(json.dumps(result) + "\n")
        proto.flush()


class _WorkerLost(Exception):
    """The worker missed its deadline (`timed_out`) or died; it must be killed and replaced."""

    def __init__(self, timed_out: bool):
        super().__init__("timeout" if timed_out else "worker died")
        self.timed_out = timed_out


class _Worker:
    """One verifier subprocess and the line-buffered pipe protocol to it."""

    def __init__(self, memory_limit_mb: int | None):
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env["RLVR_MATH_WORKER_MEMORY_MB"] = str(memory_limit_mb or 0)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.ready = False
        self._buffer = bytearray()

    def _read_line(self, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        # poll, unlike select, works for fds above 1024 (long-lived actors open many).
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise _WorkerLost(timed_out=True)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerLost(timed_out=False)
            self._buffer += chunk
        line, _, rest = self._buffer.partition(b"\n")
        self._buffer = bytearray(rest)
        return bytes(line)

    def wait_ready(self) -> None:
        """Block until the worker has imported math-verify; fail loudly if it cannot start."""
        if self.ready:
            return
        try:
            line = self._read_line(time.monotonic() + _STARTUP_TIMEOUT_S)
        except _WorkerLost as err:
            self.kill()
            raise RuntimeError(f"math verifier worker failed to start ({err})") from err
        if json.loads(line) != _READY:
            self.kill()
            raise RuntimeError(f"math verifier worker sent {line[:200]!r} instead of ready")
        self.ready = True

    def compare(self, answer: str, gold: str, timeout: float) -> tuple[float, str]:
        """The worker's verdict, or `_WorkerLost` once `timeout` seconds pass without one."""
        deadline = time.monotonic() + timeout
        try:
            self.proc.stdin.write((json.dumps([answer, gold]) + "\n").encode("ascii"))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise _WorkerLost(timed_out=False) from err
        reward, status = json.loads(self._read_line(deadline))
        return float(reward), str(status)

    def kill(self) -> None:
        """SIGKILL the process and close its pipes (only from the thread that owns the worker).

        Closing stdin flushes whatever a failed `compare` left buffered into a pipe whose reader
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


class MathVerifier:
    """A pool of math-verify worker processes with a hard per-item timeout.

    `verify` is thread-safe: each call takes an idle worker, so up to `num_workers` comparisons
    run at once; `verify_batch` spreads a batch over all of them. A worker that misses the
    deadline is SIGKILLed and replaced, and the item scores (0.0, "timeout"). Use as a context
    manager or call `close()`; workers left over are killed at garbage collection or exit.
    `memory_limit_mb` caps each worker's address space so a runaway sympy result cannot take
    the machine's memory.
    """

    def __init__(
        self, num_workers: int = 2, timeout: float = 5.0, memory_limit_mb: int | None = 4096
    ):
        if num_workers < 1 or timeout <= 0:
            raise ValueError("num_workers must be >= 1 and timeout > 0")
        self.num_workers = num_workers
        self.timeout = timeout
        self.memory_limit_mb = memory_limit_mb
        self._closed = False
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        # None is the closed sentinel: it wakes callers waiting for a worker after close().
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(self._spawn())
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="math-verify")
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    def _spawn(self) -> _Worker:
        worker = _Worker(self.memory_limit_mb)
        with self._lock:
            self._procs.add(worker.proc)
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._procs.discard(worker.proc)

    def _release(self, worker: _Worker) -> None:
        if self._closed:
            self._retire(worker)
        else:
            self._idle.put(worker)

    def _acquire(self) -> _Worker:
        if self._closed:
            raise RuntimeError("MathVerifier is closed")
        worker = self._idle.get()
        if worker is None:
            self._idle.put(None)
            raise RuntimeError("MathVerifier is closed")
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
            raise RuntimeError("MathVerifier is closed")
        try:
            for w in workers:
                w.wait_ready()
        finally:
            for w in workers:
                self._release(w if w.proc.poll() is None else self._spawn())

    def _compare(self, answer: str, gold: str, timeout: float) -> tuple[float, str]:
        worker = self._acquire()
        try:
            return worker.compare(answer, gold, timeout)
        except _WorkerLost as lost:
            self._retire(worker)
            worker = None if self._closed else self._spawn()
            if lost.timed_out:
                return 0.0, "timeout"
            if worker is not None:
                log.warning("math verifier worker died; replaced it")
            return 0.0, "error"
        finally:
            if worker is not None:
                self._release(worker)

    def verify(self, response: str, gold: str, timeout: float | None = None) -> tuple[float, str]:
        """Reward in {0.0, 1.0} and a status in STATUSES for one response against its gold.

        The answer is the last `\\boxed{}` of the response, else its last answer line
        (`#### 42`, `The answer is 42`); `gold` is a bare answer or a solution ending in one.
        `timeout` (default: the pool's) bounds the comparison, not the wait for a free worker.
        """
        answer = extract_answer(response)
        if answer is None:
            return 0.0, "no_answer"
        gold_answer = _gold_answer(gold)
        if not gold_answer:
            return 0.0, "error"
        quick = _plain_int_result(answer, gold_answer)
        if quick is not None:
            return quick
        return self._compare(answer, gold_answer, self.timeout if timeout is None else timeout)

    def verify_batch(
        self, responses: list[str], golds: list[str], timeout: float | None = None
    ) -> list[tuple[float, str]]:
        """`verify` for each pair, in input order, run in parallel across the workers."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        return list(self._threads.map(partial(self.verify, timeout=timeout), responses, golds))

    def close(self) -> None:
        """Kill the workers: calls in flight score (0.0, "error"), calls still waiting raise."""
        self._closed = True
        self._finalizer()
        self._idle.put(None)
        self._threads.shutdown(wait=True)

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_default_verifier: MathVerifier | None = None
_default_lock = threading.Lock()


def verify_math(response: str, gold: str, timeout: float = 5.0) -> tuple[float, str]:
    """`MathVerifier.verify` on a lazily created module-wide pool (2 workers)."""
    global _default_verifier
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier()
    return _default_verifier.verify(response, gold, timeout=timeout)
