"""Multi-turn rollouts through the whole run: a user's environment class (a module outside the
package, in a process of its own per trajectory) answering the tiny model's turns on the vLLM
engine, the trainer training on the model's tokens alone, the agent metrics per step, a lost
engine recovered within the run and a killed run resumed, both ending bit for bit as the
uninterrupted run, and `rlvr evaluate` of the result in its environment."""

from __future__ import annotations

import json

from workflows.cli import main as cli_main

ENV = (
    "env.kind=python",
    "env.class=tests.envs.sample_envs:GuessTheAnswer",
    "env.kwargs={tries: 3}",
    "env.max_turns=3",
    "run.steps=3",
)


def test_a_multi_turn_run_trains_on_the_model_s_tokens_and_resumes_exactly(
    tmp_path, run_cli, tiny_train_args, run_records, assert_same_weights, run_control
):
    # the uninterrupted run beside the one that is interrupted
    full = run_cli(tiny_train_args(tmp_path / "a", *ENV))
    reference = run_control.in_background(full)
    proc = run_cli(tiny_train_args(tmp_path / "b", *ENV))
    checkpoints = tmp_path / "b" / "full" / "checkpoints"
    run_control.wait_for_commit(proc, checkpoints / "step_000000", poll_s=0.01)
    run_control.kill_actor(proc, "GeneratorActor")  # in step 1's multi-turn rollouts
    run_control.kill_driver_after_commit(proc, checkpoints / "step_000001")
    resumed = run_cli(["train", "--resume", str(tmp_path / "b" / "full")])
    log, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, log[-4000:]
    log = reference.result(timeout=900)
    assert full.returncode == 0, log[-4000:]
    recoveries = (tmp_path / "b" / "full" / "recoveries.jsonl").read_text().splitlines()
    assert len(recoveries) == 1 and "GeneratorActor" in json.loads(recoveries[0])["cause"]

    run = tmp_path / "a" / "full"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    for m in metrics:
        assert 1.0 <= m["agent_turns_mean"] <= 3.0
        assert m["agent_tool_calls_per_trajectory"] == 0.0
        assert m["agent_end_done"] == 1.0
        # the trainer saw the model's tokens only: the hints between turns are not loss tokens
        assert m["train_tokens"] == sum(r["length"] for r in rollouts if r["step"] == m["step"])
    for r in rollouts:
        agent = r["flags"]["agent"]
        assert agent["turns"] >= 1 and agent["env_reward"] in (0.0, 1.0)
        assert r["reward"] == agent["env_reward"] and r["status"] == "environment"
    runs = [tmp_path / d / "full" for d in ("a", "b")]
    assert run_records(runs[0], "metrics.jsonl") == run_records(runs[1], "metrics.jsonl")
    assert run_records(runs[0], "rollouts.jsonl") == run_records(runs[1], "rollouts.jsonl")
    assert_same_weights(*runs)
    check_evaluate(run, tmp_path)


def check_evaluate(run, tmp_path) -> None:
    """`rlvr evaluate` plays the run's environment (its reward, its agent records); `--no-env`
    samples single-turn, scored by the verifier (the transformers engine, in this process)."""
    common = ["evaluate", "--checkpoint", str(run), "--n", "2", "--backend", "hf"]
    assert cli_main([*common, "--out", str(tmp_path / "with")]) == 0
    assert cli_main([*common, "--no-env", "--out", str(tmp_path / "without")]) == 0
    with_env, without = (
        (
            json.loads((tmp_path / d / "evaluation.json").read_text()),
            [json.loads(x) for x in (tmp_path / d / "items.jsonl").read_text().splitlines()],
        )
        for d in ("with", "without")
    )
    assert with_env[0]["env"] == "python" and without[0]["env"] == "none"
    assert 1.0 <= with_env[0]["agent"]["agent_turns_mean"] <= 3.0 and "agent" not in without[0]
    for item in with_env[1]:
        for sample, correct in zip(item["samples"], item["correct"], strict=True):
            assert sample["status"] == "environment" and sample["agent"]["turns"] >= 1
            assert correct == (sample["agent"]["env_reward"] == 1.0)
    samples = [s for i in without[1] for s in i["samples"]]
    assert all("agent" not in s and s["status"] != "environment" for s in samples)
