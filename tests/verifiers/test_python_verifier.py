"""verifier.kind python: a user's reward function in worker processes, per batch, under the hard
timeout; whatever it does wrong scores the items it touched as errors or timeouts, never raises."""

import os
import threading

import numpy as np
import psutil
import pytest

from rlvr.verifiers.factory import make_verifier
from rlvr.verifiers.python import PythonVerifier, check_function, check_rewards
from tests.verifiers.hostile_solutions import ASSERT_GOLD, CORRECT, hostile_cases

FNS = "tests.verifiers.reward_fns"


def _workers() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children()
        if any("_worker_main" in part for part in p.cmdline())
    }


@pytest.fixture(scope="module")
def plugin():
    """One verifier per reward function, started once for the module."""
    made: dict[str, PythonVerifier] = {}

    def get(name: str) -> PythonVerifier:
        if name not in made:
            made[name] = PythonVerifier(f"{FNS}:{name}", num_workers=2, timeout=1.0)
            made[name].wait_ready()
        return made[name]

    yield get
    for v in made.values():
        v.close()


def test_floats_score_correct_at_one_and_wrong_below(plugin):
    out = plugin("exact").verify_batch(["4", " 5", "x"], ["4", "5", "6"])
    assert out == [(1.0, "correct"), (1.0, "correct"), (0.0, "wrong")]


def test_pairs_and_what_the_function_reads(plugin):
    out = plugin("points").verify_batch(
        ["a", "b"], ["1", "2"], prompts=["p1", "p2"], metadata=[{"points": 0.25}, {"points": 2}]
    )
    assert out == [(0.25, "p1"), (2.0, "p2")]


def test_the_batch_is_one_call_per_worker(plugin):
    assert [r for r, _ in plugin("call_size").verify_batch(["a"] * 5, ["g"] * 5)] == [3, 3, 3, 2, 2]
    assert plugin("call_size").verify_batch([], []) == []


def test_a_raising_function_scores_errors_and_is_logged(plugin, capfd):
    assert plugin("raises").verify_batch(["a", "b", "c"], ["1"] * 3) == [(0.0, "error")] * 3
    err = capfd.readouterr().err
    assert f"reward function {FNS}:raises raised" in err and "a broken reward function" in err


def test_a_wrong_length_is_an_error_for_every_item(plugin, capfd):
    assert plugin("short").verify_batch(["a", "b", "c", "d"], ["1"] * 4) == [(0.0, "error")] * 4
    assert f"reward function {FNS}:short returned a list of 1 for 2 items" in capfd.readouterr().err
    assert check_rewards("f", 3, 1) == [(0.0, "error")]
    assert "reward function f returned a 'int' object, not a list, for 1 items" in (
        capfd.readouterr().err
    )


def test_numpy_returns_are_numbers():
    assert check_rewards("f", np.array([0.5, 1.0]), 2) == [(0.5, "wrong"), (1.0, "correct")]
    assert check_rewards("f", [np.float32(0.5), (np.int64(2), "x")], 2) == [
        (0.5, "wrong"),
        (2.0, "x"),
    ]


def test_a_bad_entry_is_an_error_for_its_item(capfd):
    with PythonVerifier(f"{FNS}:bad_entries", num_workers=1, timeout=5.0) as v:
        out = v.verify_batch(["a"] * 5, ["1"] * 5)
    assert out == [(0.5, "wrong"), (0.0, "error"), (0.0, "error"), (1.0, "correct"), (0.0, "error")]
    err = capfd.readouterr().err
    assert f"reward function {FNS}:bad_entries returned nan for item 1" in err


def test_a_call_past_the_timeout_times_out_and_its_worker_is_replaced(plugin):
    v = plugin("sleeps")
    before = _workers()
    # two calls: ["sleep", "a"] times out as a whole, ["b"] scores
    assert v.verify_batch(["sleep", "a", "b"], ["1"] * 3) == [
        (0.0, "timeout"),
        (0.0, "timeout"),
        (1.0, "correct"),
    ]
    after = _workers()
    assert len(after) == len(before) and len(after - before) == 1
    assert v.verify_batch(["a", "b"], ["1", "1"]) == [(1.0, "correct")] * 2


def test_a_function_that_cannot_be_imported_fails_to_start():
    with pytest.raises(ValueError, match="python"):
        make_verifier("python")
    v = PythonVerifier(f"{FNS}:no_such_fn", timeout=1.0)
    try:
        with pytest.raises(RuntimeError, match="failed to start"):
            v.wait_ready()
    finally:
        v.close()


def test_a_plugin_that_runs_code_gets_the_sandbox_s_guarantees():
    """A wrong solution that forges its way past an in-process harness scores 0 here too."""
    forged = next(c for c in hostile_cases("/nonexistent") if c.kind == "builtins")
    with PythonVerifier(f"{FNS}:code_in_sandbox", num_workers=1, timeout=30.0) as v:
        out = v.verify_batch([CORRECT[0].response, forged.response], [ASSERT_GOLD] * 2)
    assert out[0] == (1.0, "correct")
    assert out[1][0] == 0.0 and out[1][1] in ("wrong", "error")


def test_a_function_passed_as_an_object_scores_in_the_workers_by_value():
    """A closure defined here (not importable by name) travels pickled by value, with what it
    captured, to every worker the verifier starts, a replacement included."""
    bonus = 0.25

    def length_bonus(prompts, responses, golds, metadata):
        import os
        import time

        if "sleep" in responses:
            time.sleep(600)
        return [(len(r) + bonus, f"pid {os.getpid()}") for r in responses]

    with PythonVerifier(length_bonus, num_workers=1, timeout=1.0) as v:
        first = v.verify_batch(["ab", "abc"], ["", ""])
        assert [r for r, _ in first] == [2.25, 3.25]
        # it ran in a worker process, not here
        assert first[0][1] == first[1][1] != f"pid {os.getpid()}"
        assert v.verify_batch(["sleep"], [""]) == [(0.0, "timeout")]
        again = v.verify_batch(["a"], [""])  # on the worker that replaced the one killed
        assert again[0][0] == 1.25 and again[0][1] != first[0][1]
        assert v.function == f"{__name__}:{length_bonus.__qualname__}"


def test_a_function_that_does_not_pickle_is_refused_with_why():
    lock = threading.Lock()
    with pytest.raises(ValueError, match="cannot be sent to the verifier processes.*lock"):
        check_function(lambda *args: lock)
    with pytest.raises(ValueError, match="is not callable"):
        check_function(3)
