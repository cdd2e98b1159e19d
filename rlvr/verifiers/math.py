"""Math answer verification: extract the final answer, compare it to the gold with math-verify.

math-verify's own timeout uses `signal.alarm`, which silently does nothing outside the main thread
(Ray actors call from a thread pool), and sympy can hang on inputs such as 9^{9^{9^9}}. So every
comparison runs in a persistent worker process with math-verify's timeouts off, and the calling
thread enforces a hard deadline: a worker that misses it is killed and replaced.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from rlvr.answers import extract_answer
from rlvr.verifiers.base import ClosingVerifier
from rlvr.verifiers.worker import WorkerLost, WorkerPool

__all__ = ["STATUSES", "MathVerifier", "extract_answer", "verify_math"]

STATUSES = ("correct", "wrong", "no_answer", "unevaluated", "timeout", "error")
# Integers math-verify compares exactly (checked against it in the tests); int() stays cheap.
_PLAIN_INT = re.compile(r"[+-]?\d{1,18}")
_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")
"""A gold that is a plain number (thousands commas and decimals allowed)."""
_DECORATION = re.compile(r"\\[,!;: ]|\$|\\left|\\right|\s")
_FRACTION = re.compile(r"[+-]?(\\[dt]?frac\{\d+\}\{\d+\}|\d+/\d+)")
_ARITHMETIC = re.compile(r"[\d)}]([-+*/^×·÷]|\\(times|cdot|div|frac))|\\[dt]?frac")
"""An operation whose left operand is a number or a closed group, or a fraction anywhere."""


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


def unevaluated(answer: str, gold: str) -> bool:
    """Whether `answer` is an arithmetic expression left for the reader to evaluate where `gold`
    is a plain number: `\\boxed{99 * 56}` for 5544 restates the question, and math-verify, which
    evaluates what it parses, would count it correct, a reward a policy learns to collect. A
    single fraction stays a final form for a gold that is not an integer (1/2 for 0.5)."""
    if not _NUMBER.fullmatch(gold):
        return False
    text = _DECORATION.sub("", answer)
    if _FRACTION.fullmatch(text):
        return "." not in gold and int(gold.replace(",", "")) == float(gold.replace(",", ""))
    return bool(_ARITHMETIC.search(text))


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


def _handler(_: str) -> Callable[[str, str], tuple[float, str]]:
    """The worker's comparison (rlvr.verifiers.worker), with sympy and the parser warmed up."""
    # math-verify warns once that its timeout is off: here that is the design.
    logging.disable(logging.WARNING)
    _compare("\\frac{1}{2}", "0.5")  # import sympy and build the parser before reporting ready
    return _compare


class MathVerifier(ClosingVerifier):
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
        self._workers = WorkerPool(
            "rlvr.verifiers.math:_handler",
            num_workers=num_workers,
            memory_limit_mb=memory_limit_mb,
            name="MathVerifier",
        )
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="math-verify")

    def wait_ready(self) -> None:
        """Block until every idle worker has started; call before latency-sensitive work."""
        self._workers.wait_ready()

    def _compare(self, answer: str, gold: str, timeout: float) -> tuple[float, str]:
        try:
            result = self._workers.call([answer, gold], timeout)
        except WorkerLost as lost:
            return 0.0, "timeout" if lost.timed_out else "error"
        if result is None:
            return 0.0, "error"
        reward, status = result
        return float(reward), str(status)

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
        if unevaluated(answer, gold_answer):
            return 0.0, "unevaluated"
        return self._compare(answer, gold_answer, self.timeout if timeout is None else timeout)

    def verify_batch(
        self,
        responses: list[str],
        golds: list[str],
        timeout: float | None = None,
        prompts: list[str] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[tuple[float, str]]:
        """`verify` for each pair, in input order, run in parallel across the workers (`prompts`
        and `metadata`, which reward plug-ins read, are not used)."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        return list(self._threads.map(partial(self.verify, timeout=timeout), responses, golds))

    def close(self) -> None:
        """Kill the workers: calls in flight score (0.0, "error"), calls still waiting raise."""
        self._workers.close()
        self._threads.shutdown(wait=True)


_default_verifier: MathVerifier | None = None
_default_lock = threading.Lock()


def verify_math(response: str, gold: str, timeout: float = 5.0) -> tuple[float, str]:
    """`MathVerifier.verify` on a lazily created module-wide pool (2 workers)."""
    global _default_verifier
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier()
    return _default_verifier.verify(response, gold, timeout=timeout)
