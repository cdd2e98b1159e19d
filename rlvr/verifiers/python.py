"""Reward plug-ins (`verifier.kind: python`): a user function scores responses, named as
`"package.module:fn"` or, from Python, passed as the function itself.

`fn(prompts, responses, golds, metadata)` gets a batch (lists of equal length; `metadata` holds one
dict per item, the problem's) and returns one entry per item: a reward (a finite number; status
"correct" when it is >= 1.0, else "wrong", as `accuracy` counts it) or a `(reward, status)` pair.
As in TRL's `reward_funcs`, the function sees a batch at a time: `verify_batch` splits its batch
into one call per worker process (rlvr.verifiers.worker), and `verifier.timeout_s` bounds each
call as a whole. A call that raises, or returns the wrong number of entries, scores every item of
it (0.0, "error"); a call past the timeout scores them (0.0, "timeout") and its worker is killed
and replaced; an entry that is not a finite number (or a pair of one and a str) scores that item
(0.0, "error"). Each case logs a line naming the function; none stops the run.

A function passed as an object reaches the workers pickled by cloudpickle (by value when it was
defined in a notebook or a script, by reference when it lives in a module), on each worker's input
as it starts.

What a plug-in's author can rely on: its function runs in a worker process of its own (not the
actor's), under the timeout above and an address-space limit (`memory_limit_mb`), and gets the
responses as strings; nothing of a response is executed unless the function executes it. What it
cannot: the worker is no sandbox. It runs with the user's privileges, files, network and
environment, as any trusted code of the run does, so a plug-in that runs model-written code must
not `exec` it there (the response would then hold the reward in its hands, and the host with
it): it runs it through `rlvr.verifiers.sandbox.run_python` / `Sandbox` (bounded time, memory and
output, no network, no host files) or scores it with `rlvr.verifiers.code.CodeVerifier`, which
keeps the verdict out of the solution's reach, and gets their guarantees. Agent tools are to run
model-written code through the same sandbox.
"""

from __future__ import annotations

import logging
import math
import numbers
import pickle
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle

from rlvr.verifiers.base import ClosingVerifier
from rlvr.verifiers.worker import (
    WorkerLost,
    WorkerPool,
    import_object,
    plugin_name,
    read_payload,
)

__all__ = ["PythonVerifier", "check_function", "check_rewards"]

Scored = tuple[float, str]
ERROR: Scored = (0.0, "error")

log = logging.getLogger(__name__)


def check_function(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The callable `spec` names ("package.module:fn") or is; ValueError saying why it cannot be
    used (a name that does not import, an object that is not callable or does not pickle)."""
    if not isinstance(spec, str):
        if not callable(spec):
            raise ValueError(f"{spec!r:.80} is not callable")
        try:
            cloudpickle.dumps(spec)
        except Exception as err:
            raise ValueError(
                f"{plugin_name(spec)} cannot be sent to the verifier processes: cloudpickle "
                f"fails on it ({type(err).__name__}: {err})"
            ) from None
        return spec
    try:
        fn = import_object(spec)
    except Exception as err:
        raise ValueError(f"cannot import {spec!r}: {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return fn


def _entry(value: Any) -> Scored | None:
    """One returned entry as (reward, status), or None when it is not a valid one."""
    reward, status = (
        value if isinstance(value, (tuple, list)) and len(value) == 2 else (value, None)
    )
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):  # numpy's too
        return None
    if not math.isfinite(reward) or not (status is None or isinstance(status, str)):
        return None
    reward = float(reward)
    return reward, status if status is not None else ("correct" if reward >= 1.0 else "wrong")


def check_rewards(name: str, returned: Any, n: int) -> list[Scored]:
    """A function's return for `n` items (a list, tuple or array) as (reward, status) pairs; what
    is wrong with it is logged naming the function `name` and scores (0.0, "error"): all items for
    a wrong length or type, one item for a bad entry."""
    if hasattr(returned, "tolist"):  # a numpy array
        returned = returned.tolist()
    if not isinstance(returned, (list, tuple)):
        wrong = f"a {type(returned).__name__!r} object, not a list,"
    elif len(returned) != n:
        wrong = f"a list of {len(returned)}"
    else:
        wrong = ""
    if wrong:
        _complain(f"reward function {name} returned {wrong} for {n} items; all score {ERROR}")
        return [ERROR] * n
    out = []
    for i, value in enumerate(returned):
        entry = _entry(value)
        if entry is None:
            _complain(
                f"reward function {name} returned {value!r:.80} for item {i}, not a finite number "
                f"or a (number, status) pair; it scores {ERROR}"
            )
        out.append(entry or ERROR)
    return out


def _complain(line: str) -> None:
    # The worker's stderr reaches the actor's log (and the terminal of an in-process run).
    print(line, file=sys.stderr, flush=True)


def _handler(spec: str) -> Callable[..., list[Scored]]:
    """The worker's call (rlvr.verifiers.worker) of the function `spec` names."""
    return _guarded(check_function(spec), spec)


def _pickled_handler(name: str) -> Callable[..., list[Scored]]:
    """The worker's call of the function its pool sent pickled (`name`: its plugin name)."""
    return _guarded(pickle.loads(read_payload()), name)


def _guarded(fn: Callable[..., Any], spec: str) -> Callable[..., list[Scored]]:
    """The user function `fn` (named `spec` in messages), guarded and its return checked."""

    def score(
        prompts: list[str], responses: list[str], golds: list[str], metadata: list[dict]
    ) -> list[Scored]:
        try:
            returned = fn(prompts, responses, golds, metadata)
        except Exception:
            _complain(f"reward function {spec} raised:\n{traceback.format_exc()}")
            return [ERROR] * len(responses)
        return check_rewards(spec, returned, len(responses))

    return score


class PythonVerifier(ClosingVerifier):
    """Scores batches with the reward function `function` (its name, or the function itself) in
    `num_workers` worker processes, each call within `timeout` seconds; MathVerifier's interface
    (`verify_batch`, `wait_ready`, `close`, context manager), so the VerifierActor pool runs it
    alike."""

    def __init__(
        self,
        function: str | Callable[..., Any],
        num_workers: int = 1,
        timeout: float = 5.0,
        memory_limit_mb: int | None = 4096,
    ):
        if num_workers < 1 or timeout <= 0:
            raise ValueError("num_workers must be >= 1 and timeout > 0")
        self.function = plugin_name(function)
        self.num_workers = num_workers
        self.timeout = timeout
        if isinstance(function, str):
            factory, payload = "rlvr.verifiers.python:_handler", None
        else:  # every worker, replacements too, gets the function on its input
            factory, payload = "rlvr.verifiers.python:_pickled_handler", cloudpickle.dumps(function)
        self._workers = WorkerPool(
            factory,
            self.function,
            num_workers=num_workers,
            memory_limit_mb=memory_limit_mb,
            name=f"reward function {self.function}",
            payload=payload,
        )
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="python-verify")

    def wait_ready(self) -> None:
        """Block until every worker has imported the function (raises if one cannot)."""
        self._workers.wait_ready()

    def _call(self, args: list[list[Any]], timeout: float) -> list[Scored]:
        n = len(args[0])
        try:
            result = self._workers.call(args, timeout)
        except WorkerLost as lost:
            status = "timeout" if lost.timed_out else "error"
            log.warning(
                "reward function %s: %s on a call of %d items (timeout %gs); they score %s",
                self.function,
                lost,
                n,
                timeout,
                (0.0, status),
            )
            return [(0.0, status)] * n
        if result is None:  # the result could not be sent back (not JSON)
            return [ERROR] * n
        return [(float(r), str(s)) for r, s in result]

    def verify_batch(
        self,
        responses: list[str],
        golds: list[str],
        timeout: float | None = None,
        prompts: list[str] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[Scored]:
        """(reward, status) per item in input order: one call per worker on a contiguous share of
        the batch, each within `timeout` (default: the verifier's). Missing prompts are "", missing
        metadata {}."""
        n = len(responses)
        prompts = [""] * n if prompts is None else prompts
        metadata = [{} for _ in range(n)] if metadata is None else metadata
        if not len(golds) == len(prompts) == len(metadata) == n:
            raise ValueError(
                f"{n} responses, {len(golds)} golds, {len(prompts)} prompts, "
                f"{len(metadata)} metadata"
            )
        if n == 0:
            return []
        size = -(-n // self.num_workers)
        calls = [
            [
                prompts[a : a + size],
                responses[a : a + size],
                golds[a : a + size],
                metadata[a : a + size],
            ]
            for a in range(0, n, size)
        ]
        limit = self.timeout if timeout is None else timeout
        return [
            s for part in self._threads.map(lambda c: self._call(c, limit), calls) for s in part
        ]

    def close(self) -> None:
        """Kill the workers: calls in flight score (0.0, "error"), calls still waiting raise."""
        self._workers.close()
        self._threads.shutdown(wait=True)
