"""verifier.kind: code end to end on the tiny model through the actors (configs/tiny-code.yaml):
every rollout is scored by the sandboxed code verifier in the VerifierActor pool."""

from __future__ import annotations

import json

from rlvr.verifiers.code import STATUSES


def test_code_task_trains_through_the_code_verifier(tmp_path, run_cli):
    proc = run_cli(
        ["train", "--config", "configs/tiny-code.yaml"]
        + [f"--set=run.output_dir={tmp_path}", "--set=run.steps=1"]
    )
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    run = tmp_path / "tiny-code"
    rollouts = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 * 4  # prompts_per_step x group_size
    # Verdicts of the code verifier (the tiny model's text mostly fails to parse: "error"), none
    # the pool's failure status.
    assert {r["status"] for r in rollouts} <= set(STATUSES)
    for r in rollouts:
        assert json.loads(r["gold"])["asserts"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0] and metrics[0]["reward_uncomputed"] == 0
