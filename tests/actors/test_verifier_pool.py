"""VerifierPool: spreads work over actors, keeps order, turns a dead actor into failed rewards."""

import ray

from actors.verifier import VerifierPool


def test_pool_scores_in_order_and_survives_a_dead_actor(ray_cluster):
    pool = VerifierPool(size=2, timeout_s=3.0)
    try:
        responses = ["\\boxed{4}", "\\boxed{5}", "no answer here", "The answer is 7"]
        golds = ["4", "4", "1", "7"]
        assert pool.score(responses, golds) == [
            (1.0, "correct"),
            (0.0, "wrong"),
            (0.0, "no_answer"),
            (1.0, "correct"),
        ]
        # kill one actor: its items fail, the others are scored, and the pool replaces it
        ray.kill(pool.actors[0], no_restart=True)
        out = pool.score(responses, golds)
        assert out[0] == (0.0, "error") and out[2] == (0.0, "error")
        assert out[1] == (0.0, "wrong") and out[3] == (1.0, "correct")
        assert pool.replaced == 1
        assert pool.score(responses, golds)[0] == (1.0, "correct")
    finally:
        pool.shutdown()


def test_pathological_input_times_out_not_hangs(ray_cluster):
    pool = VerifierPool(size=1, timeout_s=1.0)
    try:
        out = pool.score(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{3}"], ["1", "3"])
        assert out == [(0.0, "timeout"), (1.0, "correct")]
    finally:
        pool.shutdown()
