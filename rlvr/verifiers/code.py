"""Code verification: run a response's Python solution against a problem's tests in a sandbox.

The gold (a problem's `answer`, a str) is a JSON object with one of two test formats:

* `{"asserts": ["assert f(1) == 2", ...]}` (MBPP/HumanEval style): each entry is Python source
  run after the solution (an optional `"setup"` string, imports and helpers, first), and passes
  when it raises nothing. HumanEval's `def check(candidate): ...` + `check(f)` is one entry.
* `{"io": [{"input": "3\\n", "output": "9\\n"}, ...]}` (competitive-programming style): the
  solution runs as a script once per case with `input` on stdin; its stdout must equal `output`
  up to trailing whitespace on each line and trailing blank lines.

The solution is the last ```python (or ```py, or bare ```) fenced block of the response, else the
whole response. Reward 1.0 when every test passes, else 0.0; status "correct", "wrong" (a test
failed), "timeout" (the item's wall-clock budget ran out), "error" (syntax error, exception
outside an assert, a crash or a limit hit; also an unusable gold), "no_code" (empty solution) or
"output_limit" (an io run wrote more than IO_OUTPUT_MB MiB on stdout: what was kept is not
compared, since a prefix of the right output followed by anything would match it).

Who decides the verdict. A policy under training searches for rewards it can forge, and anything
that runs in the solution's interpreter can be rewritten by the solution (frames, gc, builtins,
stdout, atexit, exit paths, objects that equal everything). So the solution's process only
computes values, and the verdict is made where the solution's code never runs:

* asserts: two sandboxes per item (rlvr.verifiers.harness). The tests, their expected values
  and the comparisons live in one, which never runs the solution's code and whose verdict line
  is the only one read; the solution, with the setup (as before: a solution may lean on its
  imports), runs in the other and answers each call the tests make with a value, strictly
  serialised plain data of any size, relayed in 64 KiB pieces (objects of its own classes,
  subclasses of builtins included, are refused). It never receives the tests, only each call's
  arguments. Two rules keep a wrong value from passing a test by its shape rather than its
  value: an exception the solution raises reaches the tests as its nearest builtin error
  (marked as the solution's, so a test may expect a ValueError), but one that only control flow
  raises (StopIteration, StopAsyncIteration, GeneratorExit, SystemExit, ...) arrives as a
  SolutionError that fails the test that made the call even if it catches it, so
  `all(map(f, xs))` cannot end early on it; and every ordering comparison (<, <=, >, >=)
  written in the tests or the setup fails its test when an operand is a NaN, which compares
  False with everything and would pass `not abs(f(x) - y) > 1e-6` as a close value would
  (equality, `math.isnan` and comparisons made inside library functions, `max` included, are
  Python's). Running the
  tests' own code apart, rather than parsing `assert f(x) == y` into a call and a value, keeps
  every form of test the data holds (HumanEval's `check(candidate)` with loops and
  `abs(...) < 1e-6`, MBPP's `math.isclose` and `set(...) == set(...)`) under the same guarantee,
  with no weaker mode to fall back to. What a solution can still do: return the right values
  without computing them (if it knows them: tests printed in the prompt can be copied), and pass
  a test that relies on another function of the solution (HumanEval's `poly` beside
  `find_zero`), which the test then trusts. What no longer works: a test that needs the
  solution's objects themselves (an instance of its class, an argument it mutates in place) or
  passes a function to it; such an item scores "error".
* io: the solution's stdout is compared with the expected output here; it never sees it. At
  most IO_OUTPUT_MB (16) MiB of it is kept; a longer output scores "output_limit".

Each sandbox also hides the host's files (namespaces mode), so no dataset file can be read to
learn the expected values (rlvr.verifiers.sandbox). `CodeVerifier` has MathVerifier's interface
(`verify`, `verify_batch`, `wait_ready`, `close`, context manager) and its per-item hard timeout,
so the VerifierActor pool works alike.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

from rlvr.verifiers import harness
from rlvr.verifiers.base import ClosingVerifier
from rlvr.verifiers.sandbox import Limits, Sandbox, resolve_mode, run_python

__all__ = ["STATUSES", "CodeVerifier", "extract_code", "parse_gold"]

STATUSES = ("correct", "wrong", "timeout", "error", "no_code", "output_limit")
IO_OUTPUT_MB = 16
"""The most stdout an io case's run may write (MiB): past it the item scores "output_limit",
never compared as if what was kept were the whole output."""

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_HARNESS = Path(harness.__file__).read_text(encoding="utf-8")
SOLUTION_PROGRAM = _HARNESS + "\nserve_solution()\n"
TESTS_PROGRAM = _HARNESS + "\nrun_tests()\n"
_VERDICTS = {b"pass": (1.0, "correct"), b"wrong": (0.0, "wrong")}
_PROBE_GOLD = json.dumps({"asserts": ["assert f() == 42"]})


def extract_code(response: str) -> str:
    """The last fenced Python (or unlabelled) block of `response`, else the whole response."""
    blocks = [m.group(2) for m in _FENCE.finditer(response)]
    return (blocks[-1] if blocks else response).strip("\n")


def parse_gold(gold: str) -> dict:
    """The test spec of a gold: a dict with a non-empty "asserts" list or "io" list."""
    spec = json.loads(gold)
    if not isinstance(spec, dict):
        raise ValueError("a code gold is a JSON object")
    if "asserts" in spec:
        tests = spec["asserts"]
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError('"asserts" must be a non-empty list of strings')
        if not isinstance(spec.get("setup", ""), str):
            raise ValueError('"setup" must be a string')
    elif "io" in spec:
        cases = spec["io"]
        if not cases or not all(
            isinstance(c, dict)
            and isinstance(c.get("input"), str)
            and isinstance(c.get("output"), str)
            for c in cases
        ):
            raise ValueError('"io" must be a non-empty list of {"input": str, "output": str}')
    else:
        raise ValueError('a code gold has "asserts" or "io"')
    return spec


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _line(message: dict) -> bytes:
    return json.dumps(message).encode("utf-8") + b"\n"


def _lost(box: Sandbox) -> tuple[float, str]:
    """The score of an item whose sandbox stopped answering: it ran out of time, or it died
    (a crash, a limit, an exit) before a verdict."""
    return (0.0, "timeout") if box.expired() else (0.0, "error")


class CodeVerifier(ClosingVerifier):
    """Runs solutions against tests, up to `num_workers` items at once, each within `timeout`
    seconds of wall clock (all its io cases together). `mode` is the sandbox's isolation
    ("auto", "namespaces" or "hook"), `unsafe_hook` lets "auto" fall back to the audit-hook
    mode where namespaces do not work (see rlvr.verifiers.sandbox)."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout: float = 5.0,
        memory_limit_mb: int | None = 512,
        mode: str = "auto",
        unsafe_hook: bool = False,
    ):
        if num_workers < 1 or timeout <= 0:
            raise ValueError("num_workers must be >= 1 and timeout > 0")
        self.num_workers = num_workers
        self.timeout = timeout
        self.limits = Limits(memory_mb=memory_limit_mb or 512, cpu_s=max(1, int(timeout) + 1))
        self._io_limits = replace(self.limits, output_kb=IO_OUTPUT_MB << 10)
        self.mode = mode
        self.unsafe_hook = unsafe_hook
        self._closed = False
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="code-verify")

    def wait_ready(self) -> None:
        """Probe the sandbox once, then score a known-good solution end to end (fixes the
        isolation mode; raises if it does not run, or if only the audit-hook mode does and
        `unsafe_hook` is off)."""
        mode = resolve_mode(self.mode, self.unsafe_hook)
        result = run_python("print(6 * 7)", timeout=30.0, limits=self.limits, mode=mode)
        if result.stdout.strip() != "42":
            raise RuntimeError(f"code sandbox does not run ({mode}): {result.stderr[-500:]}")
        self.mode = mode
        probe = self.verify("def f():\n    return 42", _PROBE_GOLD, timeout=30.0)
        if probe != (1.0, "correct"):
            raise RuntimeError(f"code sandbox ({mode}): a known-good solution scored {probe}")

    def _sandbox(self, program: str, deadline: float) -> Sandbox:
        return Sandbox(
            program, deadline - time.monotonic(), self.limits, self.mode, self.unsafe_hook
        )

    def _asserts(self, code: str, spec: dict, deadline: float) -> tuple[float, str]:
        """The verdict of the tests' sandbox, relaying messages between it and the solution's:
        line by line (each at most a piece of a message, rlvr.verifiers.harness.FRAME_PIECE),
        the solution's names, then each call and its reply, so a value of any size crosses."""
        setup = spec.get("setup", "")
        with (
            self._sandbox(SOLUTION_PROGRAM, deadline) as solution,
            self._sandbox(TESTS_PROGRAM, deadline) as tests,
        ):
            solution.send(_line({"solution": code, "setup": setup}))
            tests.send(_line({"setup": setup, "tests": spec["asserts"]}))
            talker, listener = solution, tests  # the solution's names come first
            while True:
                line = talker.read_line()
                if line is None:
                    return _lost(talker)
                word, _, rest = line.partition(b" ")
                if talker is tests and word == b"verdict":
                    return _VERDICTS.get(rest.split(b" ")[0], (0.0, "error"))
                if talker is tests and word not in (b"more", b"call"):
                    return _lost(tests)
                if not listener.send(line + b"\n"):
                    return _lost(listener)
                if word != b"more":  # the message is whole: the other side's turn
                    talker, listener = listener, talker

    def _io_case(self, code: str, case: dict, deadline: float) -> tuple[float, str] | None:
        """A failed io case's score; None when its output is right."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return 0.0, "timeout"
        result = run_python(
            code, case["input"], remaining, self._io_limits, self.mode, self.unsafe_hook
        )
        if result.timed_out:
            return 0.0, "timeout"
        if result.stdout_truncated:
            return 0.0, "output_limit"
        if result.returncode != 0:
            return 0.0, "error"
        if _normalize(result.stdout) != _normalize(case["output"]):
            return 0.0, "wrong"
        return None

    def verify(self, response: str, gold: str, timeout: float | None = None) -> tuple[float, str]:
        """Reward in {0.0, 1.0} and a status in STATUSES for one response against its gold."""
        if self._closed:
            raise RuntimeError("CodeVerifier is closed")
        code = extract_code(response)
        if not code.strip():
            return 0.0, "no_code"
        try:
            spec = parse_gold(gold)
        except ValueError:
            return 0.0, "error"
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if "asserts" in spec:
            if deadline <= time.monotonic():
                return 0.0, "timeout"
            return self._asserts(code, spec, deadline)
        for case in spec["io"]:
            failed = self._io_case(code, case, deadline)
            if failed is not None:
                return failed
        return 1.0, "correct"

    def verify_batch(
        self,
        responses: list[str],
        golds: list[str],
        timeout: float | None = None,
        prompts: list[str] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[tuple[float, str]]:
        """`verify` for each pair, in input order, up to `num_workers` at once (`prompts` and
        `metadata`, which reward plug-ins read, are not used)."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        return list(self._threads.map(partial(self.verify, timeout=timeout), responses, golds))

    def close(self) -> None:
        """Stop taking work; runs in flight finish (each within its timeout)."""
        self._closed = True
        self._threads.shutdown(wait=True)
