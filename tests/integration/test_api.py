"""The Python API drives a real run through the actors: a reward function defined here (not
importable by name) scores every rollout in the verifier actors; a background run streams its
metrics as they commit, stops after a given step and resumes in the foreground to the same end
as the command's runs."""

from __future__ import annotations

import pytest

import rlvr
from rlvr.run.rundir import RunDir

pytestmark = pytest.mark.ray

STEPS = 3
FAST = {
    "task.n_test": 8,
    "generation.prompts_per_step": 2,
    "generation.group_size": 4,
    "generation.max_tokens": 24,
    "run.eval_every": 0,
    "run.loggers": [],
    "resources.num_verifiers": 1,
    "resources.torch_threads": 1,  # beside another test worker (conftest.FAST)
}


def test_a_background_run_stops_and_resumes_with_a_reward_defined_here(tmp_path, driver_env):
    import ray

    scale = 100.0  # captured: the function travels by value, with what it refers to

    def length_reward(prompts, responses, golds, metadata):
        return [min(len(r) / scale, 1.0) for r in responses]

    cfg = rlvr.load_config(
        "tiny",
        {
            **FAST,
            "run.steps": STEPS,
            "run.output_dir": str(tmp_path),
            "run.name": "api",
            "verifier.kind": "python",
            "verifier.function": length_reward,
        },
    )
    had_ray = ray.is_initialized()
    run = rlvr.train(cfg, background=True)
    with pytest.raises(RuntimeError, match="is training in this process"):
        rlvr.train(cfg)
    # Asked at once, without waiting: the run ends once step 0 commits, however fast it goes.
    assert run.stop(timeout=0, after_step=0) is None
    summary = ray.get(run.controller().summary.remote())  # its actor, by name, while it runs
    assert summary["last_applied_step"] < STEPS
    seen = [record["step"] for record in run]  # streamed as they commit, until the run ends
    assert run.status == "stopped" and run.wait() is None
    assert seen == [0] and run.last_step == 0 and run.stop() == 0
    assert ray.is_initialized() == had_ray  # a cluster started for the run ended with it

    # a resume keeps its config: another one is refused before anything starts
    with pytest.raises(rlvr.ConfigError, match=r"differs from .*config.yaml at run.steps"):
        rlvr.train(cfg, {"run.steps": STEPS + 1}, resume=run.run_dir)

    summary = run.resume(background=False)
    assert summary["steps"] == STEPS and summary["eval_after"]["step"] == STEPS - 1
    saved = RunDir(run.run_dir)
    assert [m["step"] for m in saved.read_metrics()] == list(range(STEPS))
    assert saved.load_config_dict()["verifier"]["function"].endswith("length_reward")
    rollouts = saved.read_rollouts()
    assert rollouts and all(
        r["reward"] == pytest.approx(min(len(r["response"]) / scale, 1.0)) for r in rollouts
    )
    # what math-verify would never give: the function defined here scored them
    assert any(0.0 < r["reward"] < 1.0 for r in rollouts)
    assert list(run.metrics()["step"]) == list(range(STEPS))
