"""Code verification: run a response's Python solution against a problem's tests in a sandbox.

The gold (a problem's `answer`, a str) is a JSON object with one of two test formats:

* `{"asserts": ["assert f(1) == 2", ...]}` (MBPP/HumanEval style): the solution is executed,
  then each assert statement in the same namespace; all must pass. An optional `"setup"` string
  (imports, helpers) runs between the solution and the asserts.
* `{"io": [{"input": "3\\n", "output": "9\\n"}, ...]}` (competitive-programming style): the
  solution runs as a script once per case with `input` on stdin; its stdout must equal `output`
  up to trailing whitespace on each line and trailing blank lines.

The solution is the last ```python (or ```py, or bare ```) fenced block of the response, else the
whole response. Reward 1.0 when every test passes, else 0.0; status "correct", "wrong" (a test
failed), "timeout" (the item's wall-clock budget ran out), "error" (syntax error, exception
outside an assert, a crash or a limit hit; also an unusable gold) or "no_code" (empty solution).

Each item runs in rlvr.verifiers.sandbox (fresh process, no network, limits, killed at the
timeout); `CodeVerifier` has MathVerifier's interface (`verify`, `verify_batch`, `wait_ready`,
`close`, context manager) and its per-item hard timeout, so the VerifierActor pool works alike.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from rlvr.verifiers.base import ClosingVerifier
from rlvr.verifiers.sandbox import Limits, available_mode, run_python

__all__ = ["STATUSES", "CodeVerifier", "extract_code", "parse_gold"]

STATUSES = ("correct", "wrong", "timeout", "error", "no_code")

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# The assert harness: the verdict is a line carrying a per-run random token, so a solution that
# exits early (sys.exit(0), os._exit(0)) or prints "ok" does not pass.
_HARNESS = """
import sys
def _rlvr_main(token, solution, setup, tests):
    g = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(solution, "solution.py", "exec"), g)
        if setup:
            exec(compile(setup, "setup.py", "exec"), g)
    except BaseException as err:
        print(token + " error " + type(err).__name__, flush=True)
        return
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d.py" % i, "exec"), g)
        except AssertionError:
            print(token + " wrong " + str(i), flush=True)
            return
        except BaseException as err:
            print(token + " error " + type(err).__name__, flush=True)
            return
    print(token + " pass", flush=True)
_rlvr_main(*__import__("json").loads(sys.stdin.readline()))
"""


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


class CodeVerifier(ClosingVerifier):
    """Runs solutions against tests, up to `num_workers` sandboxes at once, each item within
    `timeout` seconds of wall clock (all its io cases together). `mode` is the sandbox's
    isolation ("auto", "namespaces" or "hook"; see rlvr.verifiers.sandbox)."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout: float = 5.0,
        memory_limit_mb: int | None = 512,
        mode: str = "auto",
    ):
        if num_workers < 1 or timeout <= 0:
            raise ValueError("num_workers must be >= 1 and timeout > 0")
        self.num_workers = num_workers
        self.timeout = timeout
        self.limits = Limits(memory_mb=memory_limit_mb or 512, cpu_s=max(1, int(timeout) + 1))
        self.mode = mode
        self._closed = False
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="code-verify")

    def wait_ready(self) -> None:
        """Probe the sandbox once (fixes the isolation mode; raises if no run works)."""
        mode = available_mode() if self.mode == "auto" else self.mode
        result = run_python("print(6 * 7)", timeout=30.0, limits=self.limits, mode=mode)
        if result.stdout.strip() != "42":
            raise RuntimeError(f"code sandbox does not run ({mode}): {result.stderr[-500:]}")
        self.mode = mode

    def _run(self, code: str, stdin: str, deadline: float):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        return run_python(code, stdin, timeout=remaining, limits=self.limits, mode=self.mode)

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
            token = secrets.token_hex(16)
            payload = json.dumps([token, code, spec.get("setup", ""), spec["asserts"]])
            result = self._run(_HARNESS, payload + "\n", deadline)
            if result is None or result.timed_out:
                return 0.0, "timeout"
            verdicts = [line for line in result.stdout.splitlines() if line.startswith(token)]
            if not verdicts:  # died before a verdict: a limit, a crash or os._exit
                return 0.0, "error"
            verdict = verdicts[-1].split()[1]
            if verdict == "pass" and result.returncode == 0:
                return 1.0, "correct"
            return 0.0, "wrong" if verdict == "wrong" else "error"
        for case in spec["io"]:
            result = self._run(code, case["input"], deadline)
            if result is None or result.timed_out:
                return 0.0, "timeout"
            if result.returncode != 0:
                return 0.0, "error"
            if _normalize(result.stdout) != _normalize(case["output"]):
                return 0.0, "wrong"
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
