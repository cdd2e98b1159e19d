"""Recovery inside a run: actors SIGKILLed at seeded points of a tiny run, and the run still ends
bit-identical to the uninterrupted one; past run.max_failures it stops with a committed state."""

from __future__ import annotations

import json
import random
import time

KINDS = ("GeneratorActor", "PolicyActor", "ControllerActor", "VerifierActor")


def test_chaos_kills_end_bit_identical(
    tiny_run_dir, tmp_path, run_cli, tiny_train_args, run_records, assert_same_weights, run_control
):
    """One actor of each kind SIGKILLed, in a seeded order, each at a seeded moment after a
    different step commits (the last two together). A lost generator, policy or controller costs
    a recovery (restart the actors, restore the committed step, redo the step in flight); a lost
    verifier costs nothing (the pool re-runs its items). With run.max_failures=1 a second loss
    in one process is one too many: the run stops naming its committed step. Its newest
    checkpoint is then damaged (as lost unsynced writes would leave it), and `--resume` falls back
    to the one before and recovers from the last loss. Metrics, rollouts, evaluations and final
    weights equal the uninterrupted run's. (The driver's own SIGKILL and resume are
    test_train_workflow.py's off-policy test.)"""
    rng = random.Random(7)
    kinds = rng.sample(KINDS, len(KINDS))
    at_step = dict(zip(kinds, (0, 1, 2, 2), strict=True))
    run = tmp_path / "full"

    def kill_after(proc, step: int) -> None:
        run_control.wait_for_commit(proc, run / "checkpoints" / f"step_{step:06d}", poll_s=0.01)
        time.sleep(rng.uniform(0, 0.3))
        for kind in [k for k in kinds if at_step[k] == step]:
            run_control.kill_actor(proc, kind)

    first = run_cli(tiny_train_args(tmp_path, "run.steps=4", "run.max_failures=1"))
    kill_after(first, 0)
    kill_after(first, 1)
    log, _ = first.communicate(timeout=900)
    assert first.returncode != 0, log[-4000:]
    assert "run.max_failures=1" in log and f"rlvr train --resume {run}" in log, log[-4000:]
    assert log.count("recovering (") == 1
    # The machine lost unsynced writes too: the newest checkpoint's controller state came back
    # empty. The resume moves it aside and goes on from the one before.
    newest = max(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    (newest / "controller.json").write_text("")
    second = run_cli(["train", "--resume", str(run)])
    kill_after(second, 2)
    log2, _ = second.communicate(timeout=900)
    assert second.returncode == 0, log2[-4000:]
    assert log2.count("recovering (") == 1
    assert (run / "checkpoints" / f"damaged_{newest.name}").is_dir()

    # Each loss of a generator, policy or controller was met by a recovery or the stop, whose
    # cause names the actor the driver met first; the verifier's loss was absorbed.
    lost = [{k for k in kinds if at_step[k] == s and k != "VerifierActor"} for s in (0, 1, 2)]
    recoveries = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert len(recoveries) == 2, recoveries
    assert any(k in recoveries[0]["cause"] for k in lost[0])
    assert any(f"{k} failed" in log for k in lost[1])
    assert any(k in recoveries[1]["cause"] for k in lost[2])
    metrics = run_records(run, "metrics.jsonl")
    assert [m["reward_uncomputed"] for m in metrics] == [0, 0, 0, 0]
    for name in ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl"):
        # exact: a recovered step redoes the same pure computations on the same state
        assert run_records(run, name) == run_records(tiny_run_dir, name), name
    assert_same_weights(tiny_run_dir, run)
