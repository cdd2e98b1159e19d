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
tests' own comparisons (`==`, `math.isclose`, `sorted(...)`) are Python's, on plain data, with
two exceptions. A solution's exception is raised in the test as its nearest builtin error,
marked (SolutionRaised), or, when it is one a test could mistake for control flow or no error
at all, as a SolutionError recorded against the test; and the tests' ordering comparisons pass
their operands through a guard that records a NaN. A recorded fault fails its test however the
test ends. It reports one verdict line; the caller reads verdicts from this process only.

The caller (rlvr.verifiers.code) relays lines between the two: the solution's "names" message,
then tests -> "call" -> solution -> "reply" -> tests, until "verdict <pass|wrong|error> ...". A
message longer than FRAME_PIECE goes as "more <piece>" lines before its last "<word> <piece>".
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib
import json
import keyword
import math
import os
import sys
import types
from typing import Any

MAX_DEPTH = 100
"""Deepest nesting `encode` and `decode` accept (a value is data, not a recursion bomb)."""
FRAME_PIECE = 1 << 16
"""Longest piece of a message on one line of the relay: a value of any size crosses in pieces,
and no line the caller reads is longer."""
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


def _send(outbox: Any, word: str, text: str) -> None:
    """`text` (ASCII: JSON) as one message of the relay: lines of at most FRAME_PIECE characters
    after their word, each but the last "more <piece>", the last "<word> <piece>"."""
    pieces = [text[i : i + FRAME_PIECE] for i in range(0, len(text), FRAME_PIECE)] or [""]
    for piece in pieces[:-1]:
        outbox.write("more " + piece + "\n")
    _say(outbox, word + " " + pieces[-1])


def _receive(inbox: Any) -> tuple[str, str]:
    """(word, text) of the next message `_send` wrote; ("", "") at the end of the input."""
    pieces = []
    while True:
        line = inbox.readline()
        word, _, piece = line.rstrip("\n").partition(" ")
        if word != "more" or not line:
            return word, "".join(pieces) + piece
        pieces.append(piece)


def _builtin_kind(err: BaseException) -> str:
    """The name of the nearest builtin class of `err` (ValueError for a ValueError subclass)."""
    kinds = (k for k in type(err).__mro__ if getattr(builtins, k.__name__, None) is k)
    return next(kinds, type(err)).__name__


def serve_solution() -> None:
    """The solution's process: in, {"solution", "setup"} then one call message per call; out, a
    "names" message ({"names": {name: "function" | "module"}} or {"failed": exception type}),
    then per call one "reply" message, {"value": ...} or {"raised": the nearest builtin class of
    what it raised, "message": str}."""
    inbox, outbox = _channel()
    spec = json.loads(inbox.readline())
    namespace: dict[str, Any] = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(compile(spec["solution"], "solution.py", "exec"), namespace)
        if spec["setup"]:
            exec(compile(spec["setup"], "setup.py", "exec"), namespace)
    except BaseException as err:
        _send(outbox, "names", json.dumps({"failed": type(err).__name__}))
        return
    names = {}
    for name, obj in list(namespace.items()):
        if isinstance(obj, types.ModuleType):
            names[name] = "module"
        elif callable(obj):
            names[name] = "function"
    _send(outbox, "names", json.dumps({"names": names}))
    while True:
        word, text = _receive(inbox)
        if word != "call":
            return
        try:
            call = json.loads(text)
            args, kwargs = decode(call["args"]), decode(call["kwargs"])
            reply = {"value": encode(namespace[call["call"]](*args, **kwargs))}
        except BaseException as err:
            reply = {"raised": _builtin_kind(err), "message": str(err)[:1000]}
        _send(outbox, "reply", json.dumps(reply))


class SolutionRaised(Exception):
    """The mark of every exception a test sees for a call into the solution."""


class SolutionError(SolutionRaised):
    """A call into the solution gave nothing a test may expect: it raised what ends an iteration
    or is no error (StopIteration, StopAsyncIteration, GeneratorExit, SystemExit, ...), returned
    what is not plain data, or its process is gone. It fails its test, caught there or not."""


class Unordered(ArithmeticError):
    """A test's ordering comparison (<, <=, >, >=) met a NaN; it fails its test, caught or not."""


_CONTROL_FLOW = (StopIteration, StopAsyncIteration)
"""Errors that end an iteration (map, filter, iter(f, sentinel)) rather than propagate."""
_MARKED: dict[type, type] = {}


def _marked(kind: type) -> type:
    """`kind` marked as the solution's: a subclass of it and of SolutionRaised (cached)."""
    if kind not in _MARKED:
        _MARKED[kind] = type(kind.__name__, (SolutionRaised, kind), {})
    return _MARKED[kind]


def _raised(name: Any, message: Any) -> Exception:
    """The exception a test sees for a solution's: its builtin Exception of that name, marked
    (so a test may expect a ValueError); a SolutionError for anything else, StopIteration and
    StopAsyncIteration included, so no solution exception is ever the tests' control flow."""
    kind = getattr(builtins, name, None) if type(name) is str else None
    text = message if type(message) is str else ""
    is_error = isinstance(kind, type) and issubclass(kind, Exception)
    if is_error and not issubclass(kind, _CONTROL_FLOW):
        for base in kind.__mro__:  # a type that wants other arguments: its nearest base
            try:
                return _marked(base)(text)
            except TypeError:
                continue
    return SolutionError(f"the solution raised {name}: {text}")


def _proxy(name: str, inbox: Any, outbox: Any, faults: list[tuple[str, str]]) -> Any:
    """A stand-in for the solution's `name`: each call is a round trip to its process. A
    SolutionError it raises is also recorded in `faults`."""

    def fail(why: str) -> SolutionError:
        faults.append(("error", why))
        return SolutionError(why)

    def call(*args: Any, **kwargs: Any) -> Any:
        request = {"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
        _send(outbox, "call", json.dumps(request))
        word, text = _receive(inbox)
        try:
            reply = json.loads(text) if word == "reply" else None
        except (ValueError, RecursionError):
            reply = None
        if type(reply) is dict and list(reply) == ["value"]:
            try:
                return decode(reply["value"])
            except (ValueError, RecursionError):
                raise fail(f"{name}() returned what is not plain data") from None
        if type(reply) is dict and sorted(reply) == ["message", "raised"]:
            err = _raised(reply["raised"], reply["message"])
            raise fail(str(err)) if type(err) is SolutionError else err
        raise fail(f"no usable reply from the solution for {name}()")

    call.__name__ = call.__qualname__ = name
    return call


def _solution_names(inbox: Any) -> dict[str, str] | None:
    """The solution's report of its names, checked; None when it failed (or sent nonsense)."""
    word, text = _receive(inbox)
    try:
        report = json.loads(text) if word == "names" else None
    except (ValueError, RecursionError):
        return None
    names = report.get("names") if type(report) is dict else None
    if type(names) is not dict:
        return None
    return {k: v for k, v in names.items() if type(k) is str and v in ("function", "module")}


_ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_GUARD = "__ordered__"


class _GuardOrderings(ast.NodeTransformer):
    """Passes each operand of an ordering comparison in the tests' source through `_GUARD`."""

    def visit_Compare(self, node: ast.Compare) -> ast.Compare:
        self.generic_visit(node)
        operands = [node.left, *node.comparators]
        guarded = {
            j for i, op in enumerate(node.ops) if isinstance(op, _ORDERINGS) for j in (i, i + 1)
        }
        for i in guarded:
            call = ast.Call(ast.Name(_GUARD, ast.Load()), [operands[i]], [])
            operands[i] = ast.copy_location(call, operands[i])
        node.left, node.comparators = operands[0], operands[1:]
        return node


def _compile(source: str, filename: str) -> types.CodeType:
    """The tests' `source`, compiled with its ordering comparisons guarded against NaN."""
    tree = _GuardOrderings().visit(ast.parse(source, filename))
    return compile(ast.fix_missing_locations(tree), filename, "exec")


def _ordered(faults: list[tuple[str, str]], value: Any) -> Any:
    """`value`, if an ordering comparison may use it: not a NaN, which compares False with
    everything and would pass `not (error > tolerance)` as if it were close."""
    if isinstance(value, float) and math.isnan(value):
        faults.append(("wrong", "an ordering comparison met NaN"))
        raise Unordered("NaN has no order")
    return value


def _run(source: str, filename: str, namespace: dict[str, Any], faults: list) -> str | None:
    """None when `source` ran and passed, else the verdict: "wrong ..." (an assert failed, or a
    NaN met an ordering comparison) or "error ..."; a recorded fault decides even when the test
    caught what was raised."""
    faults.clear()
    verdict = None
    try:
        exec(_compile(source, filename), namespace)
    except AssertionError:
        verdict = f"wrong {filename}"
    except BaseException as err:
        verdict = f"error {filename} raised {type(err).__name__}"
    if faults:
        status, why = faults[0]
        verdict = f"{status} {filename}: {why}"
    return verdict


def run_tests() -> None:
    """The tests' process: in, {"setup", "tests"}, the solution's names, then one reply per call;
    out, "call" messages, and finally "verdict pass", "verdict wrong <test>" (its assert failed,
    or an ordering comparison met a NaN) or "verdict error <why>"."""
    inbox, outbox = _channel()
    spec = json.loads(inbox.readline())
    names = _solution_names(inbox)
    if names is None:
        _say(outbox, "verdict error the solution did not run")
        return
    faults: list[tuple[str, str]] = []
    namespace: dict[str, Any] = {"__name__": "__tests__", "__builtins__": builtins}
    for name, kind in names.items():
        # The tests' own builtins stay theirs: a solution cannot redefine abs() for them.
        if not name.isidentifier() or keyword.iskeyword(name) or hasattr(builtins, name):
            continue
        if name.startswith("__"):
            continue
        if kind == "function":
            namespace[name] = _proxy(name, inbox, outbox, faults)
        elif name in sys.stdlib_module_names:  # `import math` in the solution: our own math
            with contextlib.suppress(ImportError):
                namespace[name] = importlib.import_module(name)
    namespace[_GUARD] = functools.partial(_ordered, faults)
    sources = [("setup.py", spec["setup"])] if spec["setup"] else []
    sources += [(f"test_{i}.py", test) for i, test in enumerate(spec["tests"])]
    for filename, source in sources:
        verdict = _run(source, filename, namespace, faults)
        if verdict is not None:
            _say(outbox, "verdict " + verdict)
            return
    _say(outbox, "verdict pass")
