"""The two programs of an assert-style code test, each run in its own sandbox, and the plain-data
codec they share (standard library only, Python 3.10+: the source of this file is what each
sandbox runs).

`serve_solution` runs in the solution's process: it executes the solution, reports the names it
defined, then answers calls (`f(1)`) with their values, encoded by `encode`, which accepts only
plain data (None, bool, int, float, complex, str, bytes, and list, tuple, dict, set, frozenset
of those, by exact type: objects of the solution's own classes, subclasses of builtins included,
are refused). It computes values and nothing else; whatever the solution does to this process
(frames, gc, builtins, stdout, exit paths) can change only the values it sends.

`run_tests` runs in a second process, which never executes the solution's code: the tests (and
their expected values) reach only it. Each name the solution defined becomes a proxy that asks
the solution's process for a value; the value is decoded by `decode` into builtin types, so the
tests' own comparisons (`==`, `math.isclose`, `sorted(...)`) are Python's, on plain data. It
reports one verdict line; the caller reads verdicts from this process only.

The caller (rlvr.verifiers.code) relays lines between the two: tests -> "call <json>" ->
solution -> one reply line -> tests, until "verdict <pass|wrong|error> ...".
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
import keyword
import os
import sys
import types
from typing import Any

MAX_DEPTH = 100
"""Deepest nesting `encode` and `decode` accept (a value is data, not a recursion bomb)."""
_CONTAINERS = {tuple: "tuple", set: "set", frozenset: "frozenset"}
_SCALARS = (bool, int, float, str)


def encode(value: Any, depth: int = 0) -> Any:
    """`value` as JSON-ready data; TypeError for anything that is not plain data by exact type."""
    kind = type(value)
    if value is None or kind in _SCALARS:
        return value
    if depth >= MAX_DEPTH:
        raise TypeError("a value nested too deep")
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind in _CONTAINERS:
        return {_CONTAINERS[kind]: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise TypeError(f"a {kind.__name__!r} object is not plain data")


def decode(data: Any, depth: int = 0) -> Any:
    """The value `encode` gave `data` for, of builtin types only; ValueError for anything else."""
    kind = type(data)
    if data is None or kind in _SCALARS:
        return data
    if depth >= MAX_DEPTH:
        raise ValueError("a value nested too deep")
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise ValueError("not an encoded value")
    ((tag, payload),) = data.items()
    try:
        if tag == "bytes" and type(payload) is str:
            return bytes.fromhex(payload)
        if tag == "complex" and type(payload) is list and len(payload) == 2:
            real, imag = payload
            if type(real) in (int, float) and type(imag) in (int, float):
                return complex(real, imag)
        if type(payload) is list:
            items = [decode(v, depth + 1) for v in payload]
            if tag == "dict" and all(type(i) is list and len(i) == 2 for i in items):
                return dict(items)
            for container, name in _CONTAINERS.items():
                if tag == name:
                    return container(items)
    except TypeError as err:  # an unhashable key or member
        raise ValueError(str(err)) from None
    raise ValueError(f"not an encoded value: {tag!r}")


def _channel() -> tuple[Any, Any]:
    """(inbox, outbox): the caller's lines in and ours out, on private copies of fds 0 and 1.
    What the code run here prints goes to stderr, and its stdin is empty."""
    inbox = os.fdopen(os.dup(0), "r", encoding="utf-8")
    outbox = os.fdopen(os.dup(1), "w", encoding="utf-8")
    empty, closed = os.pipe()
    os.close(closed)
    os.dup2(empty, 0)
    os.dup2(2, 1)
    return inbox, outbox


def _say(outbox: Any, line: str) -> None:
    outbox.write(line + "\n")
    outbox.flush()


def serve_solution() -> None:
    """The solution's process: in, {"solution", "setup"} then one call per line; out, the names
    it defined ({"names": {name: "function" | "module"}} or {"failed": exception type}), then one
    {"value": ...} or {"raised": type, "message": str} per call."""
    inbox, outbox = _channel()
    spec = json.loads(inbox.readline())
    namespace: dict[str, Any] = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(compile(spec["solution"], "solution.py", "exec"), namespace)
        if spec["setup"]:
            exec(compile(spec["setup"], "setup.py", "exec"), namespace)
    except BaseException as err:
        _say(outbox, json.dumps({"failed": type(err).__name__}))
        return
    names = {}
    for name, obj in list(namespace.items()):
        if isinstance(obj, types.ModuleType):
            names[name] = "module"
        elif callable(obj):
            names[name] = "function"
    _say(outbox, json.dumps({"names": names}))
    for line in inbox:
        try:
            call = json.loads(line)
            args, kwargs = decode(call["args"]), decode(call["kwargs"])
            reply = {"value": encode(namespace[call["call"]](*args, **kwargs))}
        except BaseException as err:
            reply = {"raised": type(err).__name__, "message": str(err)[:1000]}
        _say(outbox, json.dumps(reply))


class SolutionError(Exception):
    """A call into the solution gave no value: it raised (a type that is not a builtin
    Exception), returned what is not plain data, or its process is gone."""


def _raised(name: Any, message: Any) -> Exception:
    """The exception a test sees for a solution's: the builtin Exception of that name (so a test
    may expect a ValueError), else a SolutionError; never a BaseException such as SystemExit."""
    kind = getattr(builtins, name, None) if type(name) is str else None
    text = message if type(message) is str else ""
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(text)
        except TypeError:  # an exception type that wants other arguments
            pass
    return SolutionError(f"the solution raised {name}: {text}")


def _proxy(name: str, inbox: Any, outbox: Any) -> Any:
    """A stand-in for the solution's `name`: each call is a round trip to its process."""

    def call(*args: Any, **kwargs: Any) -> Any:
        request = {"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
        _say(outbox, "call " + json.dumps(request))
        line = inbox.readline()
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            raise SolutionError(f"no usable reply from the solution for {name}()") from None
        if type(reply) is dict and list(reply) == ["value"]:
            try:
                return decode(reply["value"])
            except (ValueError, RecursionError):
                raise SolutionError(f"{name}() returned what is not plain data") from None
        if type(reply) is dict and sorted(reply) == ["message", "raised"]:
            raise _raised(reply["raised"], reply["message"])
        raise SolutionError(f"no usable reply from the solution for {name}()")

    call.__name__ = call.__qualname__ = name
    return call


def _solution_names(line: str) -> dict[str, str] | None:
    """The solution's report of its names, checked; None when it failed (or sent nonsense)."""
    try:
        report = json.loads(line)
    except (ValueError, RecursionError):
        return None
    names = report.get("names") if type(report) is dict else None
    if type(names) is not dict:
        return None
    return {k: v for k, v in names.items() if type(k) is str and v in ("function", "module")}


def run_tests() -> None:
    """The tests' process: in, {"setup", "tests"}, the solution's names, then one reply per call;
    out, "call <json>" per call and finally "verdict pass", "verdict wrong <i>" (test i's assert
    failed) or "verdict error <why>"."""
    inbox, outbox = _channel()
    spec = json.loads(inbox.readline())
    names = _solution_names(inbox.readline())
    if names is None:
        _say(outbox, "verdict error the solution did not run")
        return
    namespace: dict[str, Any] = {"__name__": "__tests__", "__builtins__": builtins}
    for name, kind in names.items():
        # The tests' own builtins stay theirs: a solution cannot redefine abs() for them.
        if not name.isidentifier() or keyword.iskeyword(name) or hasattr(builtins, name):
            continue
        if name.startswith("__"):
            continue
        if kind == "function":
            namespace[name] = _proxy(name, inbox, outbox)
        elif name in sys.stdlib_module_names:  # `import math` in the solution: our own math
            with contextlib.suppress(ImportError):
                namespace[name] = importlib.import_module(name)
    try:
        if spec["setup"]:
            exec(compile(spec["setup"], "setup.py", "exec"), namespace)
    except BaseException as err:
        _say(outbox, f"verdict error the setup raised {type(err).__name__}")
        return
    for i, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), namespace)
        except AssertionError:
            _say(outbox, f"verdict wrong {i}")
            return
        except BaseException as err:
            _say(outbox, f"verdict error test {i} raised {type(err).__name__}")
            return
    _say(outbox, "verdict pass")
