"""Math verifier: verdicts against math-verify, hard timeouts on pathological inputs, threads."""

import os
import random
import signal
import threading
import time

import psutil
import pytest
from math_verify import parse, verify

from rlvr.verifiers.math import MathVerifier, _plain_int_result, verify_math
from rlvr.verifiers.worker import Worker

TIMEOUT = 1.0  # per-call timeout for the pathological cases
MARGIN = 3.0  # kill + reap + a loaded CPU; a hang would overshoot by far more


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=2, timeout=10.0) as v:
        v.wait_ready()
        yield v


def _worker_pids() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children()
        if any("_worker_main" in part for part in p.cmdline())
    }


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        (r"Thus $\boxed{42}$.", "42", (1.0, "correct")),
        (r"Thus $\boxed{41}$.", "42", (0.0, "wrong")),
        ("I am not sure.", "42", (0.0, "no_answer")),
        (r"\boxed{\frac{1}{2}}", "0.5", (1.0, "correct")),
        (r"\boxed{0.5}", r"\frac{1}{2}", (1.0, "correct")),
        (r"\boxed{\frac{2}{4}}", "1/2", (1.0, "correct")),
        (r"\boxed{\frac{1}{3}}", "0.5", (0.0, "wrong")),
        (r"\boxed{\sqrt{2}}", "2^{1/2}", (1.0, "correct")),
        (r"\boxed{x = 5}", "5", (1.0, "correct")),
        (r"\boxed{\frac{\frac{1}{2}}{2}}", r"\frac{1}{4}", (1.0, "correct")),  # nested braces
        (r"\boxed{3} no wait, \boxed{4}", "4", (1.0, "correct")),  # last boxed wins
        (r"\boxed{4} no wait, \boxed{3}", "4", (0.0, "wrong")),
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", (1.0, "correct")),  # GSM8K style
        ("#### 1,000", "1000", (1.0, "correct")),
        ("The answer is $\\frac{3}{4}$.", "0.75", (1.0, "correct")),
        (r"\boxed{7}", "Adding gives 3 + 4 = 7.\n#### 7", (1.0, "correct")),  # gold solution
        (r"\boxed{7}", r"So the total is \boxed{7}.", (1.0, "correct")),
        (r"\boxed{7}", "", (0.0, "error")),  # a gold with no answer is a data bug
        # an expression restating the question is not an answer, though math-verify evaluates it
        (r"\boxed{99 * 56}", "5544", (0.0, "unevaluated")),
        (r"\boxed{99 \times 56}", "5544", (0.0, "unevaluated")),
        (r"\boxed{(3 + 4)}", "7", (0.0, "unevaluated")),
        ("#### 12 - 5", "7", (0.0, "unevaluated")),
        (r"\boxed{\frac{14}{2}}", "7", (0.0, "unevaluated")),
        (r"\boxed{2^{3}}", "8", (0.0, "unevaluated")),
        (r"\boxed{5,544}", "5544", (1.0, "correct")),
        (r"\boxed{-3}", "-3", (1.0, "correct")),
        (r"\boxed{x + 1}", "x+1", (1.0, "correct")),  # symbolic golds keep their expressions
    ],
)
def test_verdicts(verifier, response, gold, expected):
    assert verifier.verify(response, gold) == expected


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("42", "42"),
        ("42", "43"),
        ("007", "7"),
        ("+5", "5"),
        ("-5", "5"),
        ("-0", "0"),
        ("123456789012345678", "123456789012345679"),
        ("999999999999999999", "999999999999999999"),
    ],
)
def test_plain_integer_shortcut_agrees_with_math_verify(answer, gold):
    reward, _ = _plain_int_result(answer, gold)
    expected = verify(
        parse("\\boxed{" + gold + "}", parsing_timeout=None),
        parse("\\boxed{" + answer + "}", parsing_timeout=None),
        timeout_seconds=None,
    )
    assert reward == float(expected)


PATHOLOGICAL = {
    "tower of exponents": r"\boxed{9^{9^{9^{9}}}}",
    "factorial": r"\boxed{1000000!}",
    "3000 nested fracs": "\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}",
    "5000 nested braces": "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "1 MB sum": "\\boxed{" + "1+" * 500_000 + "1}",
}


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_pathological_answers_time_out_and_the_pool_recovers(verifier, name):
    start = time.monotonic()
    # a symbolic gold: a plain number would refuse the arithmetic ones unevaluated at once
    assert verifier.verify(PATHOLOGICAL[name], r"\sqrt{2}", timeout=TIMEOUT) == (0.0, "timeout")
    assert time.monotonic() - start < TIMEOUT + MARGIN
    # A replacement worker answers the next call, and no process is leaked.
    assert verifier.verify(r"\boxed{\frac{6}{8}}", "0.75") == (1.0, "correct")
    assert len(_worker_pids()) == 2


def test_garbage_bytes(verifier):
    rng = random.Random(0)
    garbage = bytes(rng.randrange(256) for _ in range(20_000)).decode("latin-1")
    surrogates = "\ud800\x00\udfff"
    boxed_garbage = "\\boxed{" + garbage.translate({ord(c): None for c in "{}\\"}) + "}"
    for response in (garbage, boxed_garbage, "\\boxed{" + surrogates + "}"):
        start = time.monotonic()
        reward, status = verifier.verify(response, "1", timeout=TIMEOUT)
        assert reward == 0.0 and status in ("no_answer", "wrong", "unevaluated", "timeout", "error")
        assert time.monotonic() - start < TIMEOUT + MARGIN


def test_batch_runs_in_parallel_with_per_item_timeouts(verifier):
    responses = [
        PATHOLOGICAL["tower of exponents"],
        r"\boxed{\frac{1}{2}}",
        "nothing",
        r"\boxed{\sqrt{4}}",
        r"\boxed{5}",
    ]
    golds = [r"\sqrt{2}", "0.5", "3", "2", "6"]
    start = time.monotonic()
    results = verifier.verify_batch(responses, golds, timeout=TIMEOUT)
    assert results == [
        (0.0, "timeout"),
        (1.0, "correct"),
        (0.0, "no_answer"),
        (1.0, "correct"),
        (0.0, "wrong"),
    ]
    # The other items ran on the second worker while the first one was stuck.
    assert time.monotonic() - start < TIMEOUT + MARGIN
    with pytest.raises(ValueError):
        verifier.verify_batch(["a"], [])


def test_non_main_thread(verifier):
    results = {}

    def work():
        results["timeout"] = verifier.verify(
            PATHOLOGICAL["tower of exponents"], r"\sqrt{2}", timeout=TIMEOUT
        )
        results["correct"] = verifier.verify(r"\boxed{\frac{10}{4}}", "2.5")

    thread = threading.Thread(target=work)
    start = time.monotonic()
    thread.start()
    thread.join(TIMEOUT + MARGIN + 5.0)
    assert not thread.is_alive()
    assert results == {"timeout": (0.0, "timeout"), "correct": (1.0, "correct")}
    assert time.monotonic() - start < TIMEOUT + MARGIN + 5.0


def test_dead_worker_scores_error_and_is_replaced():
    before = _worker_pids()
    with MathVerifier(num_workers=1, timeout=10.0) as v:
        v.wait_ready()
        (pid,) = _worker_pids() - before
        os.kill(pid, signal.SIGKILL)
        assert v.verify(r"\boxed{\frac{1}{2}}", "0.5") == (0.0, "error")
        assert v.verify(r"\boxed{\frac{1}{2}}", "0.5") == (1.0, "correct")
    assert _worker_pids() == before
    with pytest.raises(RuntimeError, match="closed"):
        v.verify(r"\boxed{\frac{1}{2}}", "0.5")


def test_killing_a_dead_worker_with_unflushed_input_closes_its_pipes():
    # A request buffered in stdin when the process died makes close() flush into a broken pipe.
    worker = Worker("rlvr.verifiers.math:_handler", "", memory_limit_mb=None)
    worker.proc.kill()
    worker.proc.wait()
    worker.proc.stdin.write(b"[1, 2]\n")
    worker.kill()
    assert worker.proc.stdin.closed and worker.proc.stdout.closed


def test_module_level_verify_math():
    assert verify_math(r"\boxed{\frac{1}{2}}", "0.5") == (1.0, "correct")
    tower = PATHOLOGICAL["tower of exponents"]
    assert verify_math(tower, r"\sqrt{2}", timeout=TIMEOUT) == (0.0, "timeout")
