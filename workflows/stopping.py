"""How a run ends on a signal: the first Ctrl-C lets the step in progress commit and stops the run
there (saying so at once), a second Ctrl-C or a SIGTERM stops it at once. Either way the step
loop's cleanup stops the actors, Ray's exit takes the cluster down, and `--resume` continues after
the last committed step. A run outside the main thread, where no signal handler can be set (the
Python API's background runs), stops after its current step when `request_stop` asks, as a first
Ctrl-C would. A server (`rlvr serve`) stops its loop at the flag `stop_event_on_signals` sets.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_asked: list[str] = []
"""The signal that asked for a stop at the next step boundary (signals are process-wide)."""
_now: list[str] = []
"""The signal that stopped the run at once."""
_after: list[int] = []
"""The step whose commit a `request_stop(after_step=...)` waits for (empty: the current one)."""


class RunStopped(KeyboardInterrupt):
    """A run stopped by a signal. A KeyboardInterrupt: raised in the main thread wherever it
    waits, it passes every `except Exception` and runs every `finally`, and it is the one
    exception that `ray.get` passes on from a signal handler (as a bare KeyboardInterrupt; any
    other it prints and drops, waiting on)."""

    def __init__(self, signal_name: str, at_boundary: bool) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.at_boundary = at_boundary
        self.exit_code = 128 + signal.Signals[signal_name].value
        self.run_path: Path | None = None
        """The stopped run's directory, where the caller that raised it knows it."""


def stop_if_asked(step: int) -> None:
    """At the boundary before `step`: stop the run here if a Ctrl-C asked for it, or a
    `request_stop` whose step has committed."""
    if _asked and (not _after or step > _after[0]):
        raise RunStopped(_asked[0], at_boundary=True)


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Answer Ctrl-C and SIGTERM as this module says while the block runs (in the main thread,
    after `ray.init`, whose own handlers abort the process on SIGTERM); the previous handlers
    come back after it."""
    _clear()
    try:
        with _handling({signal.SIGINT: _on_interrupt, signal.SIGTERM: _on_terminate}):
            yield
    except RunStopped:
        raise
    except KeyboardInterrupt:  # the stop, as `ray.get` raises it again
        raise RunStopped(_now[0] if _now else "SIGINT", at_boundary=False) from None
    finally:
        _clear()


@contextmanager
def stop_event_on_signals() -> Iterator[threading.Event]:
    """An event that Ctrl-C or SIGTERM sets while the block runs, for a loop that waits on it: a
    KeyboardInterrupt raised while the main thread is inside a Ray call can be dropped there (a
    `rlvr serve` driver outlived its SIGINT, looping on), a flag stays set. A second Ctrl-C
    raises KeyboardInterrupt as before. Outside the main thread no handler can be set: the
    event is then set by nothing but its owner. The previous handlers come back after it."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        # From another thread: the handler may run while this one holds the event's lock.
        threading.Thread(target=stop.set, daemon=True).start()

    with _handling({signal.SIGINT: on_signal, signal.SIGTERM: on_signal}):
        yield stop


@contextmanager
def _handling(handlers: dict[signal.Signals, Callable[[int, object], None]]) -> Iterator[None]:
    """`handlers` answer their signals while the block runs; the previous ones come back after."""
    previous = {signum: signal.getsignal(signum) for signum in handlers}
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def request_stop(after_step: int | None = None) -> None:
    """Ask the run in progress to stop after its current step, as a first Ctrl-C does, or once
    step `after_step` has committed (after its current step, if that is later). The earliest
    of several requests wins."""
    if _asked and not _after:
        return
    if after_step is None:
        _after.clear()
    else:
        _after[:] = [min([after_step, *_after])]
    _asked[:] = ["SIGINT"]


@contextmanager
def stopping_on_request() -> Iterator[None]:
    """While the block runs, `request_stop` alone stops the run (after its current step); for a
    run outside the main thread, which signals never reach."""
    _clear()
    try:
        yield
    finally:
        _clear()


def _clear() -> None:
    _asked.clear()
    _now.clear()
    _after.clear()


def _on_interrupt(signum: int, frame: object) -> None:
    if _asked:
        _stop_now("SIGINT")
    request_stop()
    print(
        "\nrlvr: Ctrl-C: stopping after the current step (Ctrl-C again to stop now)",
        file=sys.stderr,
        flush=True,
    )


def _on_terminate(signum: int, frame: object) -> None:
    _stop_now("SIGTERM")


def _stop_now(signal_name: str) -> None:
    # Once: a signal while the actors are being stopped takes the default way out, and Ray's
    # exit (or, for SIGTERM, the reaper) still takes the cluster down.
    _now.append(signal_name)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise RunStopped(signal_name, at_boundary=False)
