"""A policy's reward hacks against the code verifier: every wrong solution of
tests/verifiers/hostile_solutions.py scores 0 whatever it does to its own process, and a correct
solution still scores 1 (namespaces mode, the one training runs use)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlvr.verifiers.code import CodeVerifier
from rlvr.verifiers.sandbox import available_mode
from tests.verifiers.hostile_solutions import (
    ASSERT_GOLD,
    CORRECT,
    SECRET_ENV,
    dataset_lines,
    hostile_cases,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

# A dataset file outside /tmp, where the repository is: readable by anyone on the host.
DATA_FILE = Path(__file__).resolve().parents[2] / ".hostile-dataset.jsonl"
CASES = hostile_cases(str(DATA_FILE))
READS_THE_FILE = "the expected values read from the dataset file"


@pytest.fixture(scope="module")
def scored() -> dict[str, tuple[float, str]]:
    """Every case's score, from one batch (the suite takes seconds, not a sandbox start each)."""
    if available_mode() != "namespaces":
        pytest.skip("no namespaces here: the verifier refuses to run code by default")
    DATA_FILE.write_text(dataset_lines())
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET_ENV, ASSERT_GOLD)  # the gold in the verifier's own environment
    try:
        with CodeVerifier(num_workers=2, timeout=5.0) as verifier:
            out = verifier.verify_batch([c.response for c in CASES], [c.gold for c in CASES])
    finally:
        patch.undo()
        DATA_FILE.unlink()
    return {c.name: s for c, s in zip(CASES, out, strict=True)}


def test_the_suite_covers_every_class_of_trick():
    kinds = {c.kind for c in CASES}
    assert len(CASES) >= 20
    assert {"frames", "gc", "builtins", "stdout", "exit", "BaseException", "comparison"} <= kinds
    assert {"__del__", "signals", "threads", "files", "environment", "argv", "memory"} <= kinds
    assert {"StopIteration", "NaN", "output cap"} <= kinds


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hostile_solution_scores_zero(scored, case):
    reward, status = scored[case.name]
    assert reward == 0.0 and status in ("wrong", "error", "timeout"), (case.kind, status)


def test_the_file_reader_finds_the_gold_where_it_can_see_the_file(tmp_path):
    """Control: outside the sandbox the same program reads the gold and answers every test."""
    data = tmp_path / "data.jsonl"
    data.write_text(dataset_lines())
    (case,) = [c for c in hostile_cases(str(data)) if c.name == READS_THE_FILE]
    namespace: dict = {}
    exec(case.program, namespace)
    assert [namespace["f"](x) for x in (1, 0, -2)] == [4, 1, -5]


@pytest.mark.parametrize("right", CORRECT, ids=[c.name for c in CORRECT])
def test_a_correct_solution_still_scores_one(right):
    with CodeVerifier(num_workers=1, timeout=10.0) as verifier:
        assert verifier.verify(right.response, right.gold) == (1.0, "correct")
