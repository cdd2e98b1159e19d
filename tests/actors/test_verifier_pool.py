"""VerifierPool: spreads work over actors, keeps order, and re-runs the items of an actor that dies
so that the result is the uninterrupted pool's; only an input that kills every actor it reaches
fails, after a bounded number of runs."""

import os
import threading

import pytest
import ray

from actors.verifier import MAX_RERUNS, VerifierActor, VerifierPool

pytestmark = pytest.mark.ray

RESPONSES = [
    "\\boxed{4}",
    "\\boxed{5}",
    "no answer here",
    "The answer is 7",
    "\\boxed{\\frac{1}{2}}",
]
GOLDS = ["4", "4", "1", "7", "0.5"]
SCORED = [(1.0, "correct"), (0.0, "wrong"), (0.0, "no_answer"), (1.0, "correct"), (1.0, "correct")]
# sympy cannot finish this comparison: the actor's worker times out on it (a verdict, "timeout");
# against a symbolic gold, since a plain number would refuse it at once as unevaluated
SLOW = "\\boxed{9^{9^{9^{9}}}}"
SLOW_GOLD = "\\sqrt{2}"
KILLER = "this response takes its verifier actor down"


class KilledByOneInput(VerifierActor):
    """A verifier actor whose process dies whenever its batch holds KILLER."""

    def score(self, responses: list[str], *rest: list) -> list[tuple[float, str]]:
        if KILLER in responses:
            os._exit(1)
        return super().score(responses, *rest)


class KilledByOneInputPool(VerifierPool):
    actor_class = KilledByOneInput


def test_pool_scores_in_order_and_reruns_a_dead_actors_items(ray_cluster, kill_actor):
    pool = VerifierPool(size=2, timeout_s=3.0)
    try:
        assert pool.score(RESPONSES, GOLDS) == SCORED
        kill_actor(pool.actors[0])
        # its items (0, 2, 4) run on the live actors, the replacement included: nothing changes
        assert pool.score(RESPONSES, GOLDS) == SCORED
        assert pool.replaced == 1
        assert pool.score(RESPONSES, GOLDS) == SCORED and pool.replaced == 1
    finally:
        pool.shutdown()


def test_an_actor_killed_while_scoring_changes_nothing(ray_cluster):
    """Actor 0's chunk holds an item that runs for the full per-item timeout (2 s); the actor is
    killed 0.5 s into the call, between submit and get."""
    pool = VerifierPool(size=2, timeout_s=2.0)
    responses, golds = [SLOW, *RESPONSES], [SLOW_GOLD, *GOLDS]
    try:
        uninterrupted = pool.score(responses, golds)
        assert uninterrupted == [(0.0, "timeout"), *SCORED]
        victim = pool.actors[0]
        killer = threading.Timer(0.5, ray.kill, args=(victim,), kwargs={"no_restart": True})
        killer.start()
        try:
            interrupted = pool.score(responses, golds)
        finally:
            killer.join()
        # exact: verification is a pure function of (response, gold)
        assert interrupted == uninterrupted
        assert pool.replaced == 1 and victim not in pool.actors
    finally:
        pool.shutdown()


def test_an_input_that_kills_every_actor_fails_after_bounded_reruns(ray_cluster):
    pool = KilledByOneInputPool(size=2, timeout_s=3.0)
    responses, golds = [KILLER, *RESPONSES], ["1", *GOLDS]
    try:
        out = pool.score(responses, golds)
        # the items that shared KILLER's chunk were re-run alone and scored
        assert out == [(0.0, "verifier_failed"), *SCORED]
        # the first run and MAX_RERUNS re-runs, each taking an actor down
        assert pool.replaced == 1 + MAX_RERUNS
        assert pool.score(RESPONSES, GOLDS) == SCORED
    finally:
        pool.shutdown()


def test_pathological_input_times_out_not_hangs(ray_cluster):
    pool = VerifierPool(size=1, timeout_s=1.0)
    try:
        out = pool.score([SLOW, "\\boxed{3}"], [SLOW_GOLD, "3"])
        assert out == [(0.0, "timeout"), (1.0, "correct")]
        assert pool.replaced == 0
    finally:
        pool.shutdown()


POINTS = "tests.verifiers.reward_fns:points"
SLEEPS = "tests.verifiers.reward_fns:sleeps"


def test_a_reward_plugin_reads_prompts_and_metadata_and_its_items_rerun(ray_cluster, kill_actor):
    """kind python through the actors: each item's prompt and metadata reach the function; a
    dead actor's items re-run on the live ones; a call past the timeout scores "timeout"."""
    pool = KilledByOneInputPool(size=2, timeout_s=2.0, kind="python", function=POINTS)
    n = 5
    prompts = [f"p{i}" for i in range(n)]
    metadata = [{"points": i / 4} for i in range(n)]
    scored = [(i / 4, f"p{i}") for i in range(n)]
    try:
        assert pool.score(["r"] * n, ["g"] * n, prompts, metadata) == scored
        kill_actor(pool.actors[1])
        assert pool.score(["r"] * n, ["g"] * n, prompts, metadata) == scored
        out = pool.score([KILLER, "r"], ["g", "g"], ["p0", "p1"], metadata[:2])
        assert out == [(0.0, "verifier_failed"), (0.25, "p1")]
        assert pool.replaced == 1 + 1 + MAX_RERUNS
    finally:
        pool.shutdown()
    pool = VerifierPool(size=1, timeout_s=1.0, kind="python", function=SLEEPS)
    try:
        assert pool.score(["sleep"], ["g"]) == [(0.0, "timeout")]
        assert pool.score(["a", "b"], ["g", "g"]) == [(1.0, "correct")] * 2
        assert pool.replaced == 0
    finally:
        pool.shutdown()
