"""Tandem end to end on the tiny model through the actors: the GeneratorActor co-writes every
rollout with the frozen junior inside its vLLM engine, the driver logs the schedule metrics, and
the PolicyActor trains on the senior's tokens only; held-out evaluation co-writes too, and the best
checkpoint is the one with the best tandem accuracy. With the junior on a vLLM engine of its own,
the run writes the same rollouts, even when one of its engines is lost mid-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS = 3
TANDEM = [
    "algorithm.name=tandem",
    f"run.steps={STEPS}",
    "run.eval_every=1",
    # room in the placement group for a junior engine beside the engine, on two cores
    "resources.generator_cpus=0.5",
]


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory, run_cli, tiny_train_args) -> Path:
    """A finished Tandem run whose junior shares the senior's engine."""
    out = tmp_path_factory.mktemp("tandem-shared")
    proc = run_cli(tiny_train_args(out, *TANDEM))
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    return out / "full"


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _assert_trains_on_the_senior_s_tokens(metrics: list[dict]) -> None:
    """Steps whose authors switch, the senior writing about half (p = 0.5: the code's
    smoke-test band; 0 or 1 would mean the mask never reached the loss), and whose update saw
    exactly the senior's tokens."""
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        frac = m["tandem/senior_token_frac"]
        assert 0.3 <= frac <= 0.7
        assert m["train_tokens"] == round(frac * m["tokens_generated"])
        assert m["tandem/switches_per_seq"] > 0


def test_tandem_steps_through_the_actors(shared_run):
    run = shared_run
    metrics = _lines(run / "metrics.jsonl")
    _assert_trains_on_the_senior_s_tokens(metrics)
    for m in metrics:
        assert m["tandem/mean_run_length"] > 1
        assert 0.0 <= m["tandem/cap_redraw_share"] <= 1.0
    rollouts = _lines(run / "rollouts.jsonl")
    assert len(rollouts) == STEPS * 16
    for r in rollouts:
        counters = r["flags"]["tandem"]
        assert counters["redraws"] == counters["boundary_redraws"] + counters["cap_redraws"]
        assert counters["redraws"] <= r["length"]
    evals = _lines(run / "eval.jsonl")
    assert [e["step"] for e in evals] == list(range(-1, STEPS))
    for e in evals:
        assert e["best_metric"] == "eval_tandem_accuracy"
        assert 0.0 <= e["eval_tandem_accuracy"] <= 1.0 and 0.0 <= e["eval_accuracy"] <= 1.0
    best = max(evals[1:], key=lambda e: e["eval_tandem_accuracy"])  # the first of ties
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["best_step"], summary["best_metric"]) == (best["step"], "eval_tandem_accuracy")
    last = run / "checkpoints" / f"step_{STEPS - 1:06d}"
    progress = json.loads((last / "progress.json").read_text())
    assert (progress["best_step"], progress["best_metric"]) == (
        best["step"],
        "eval_tandem_accuracy",
    )


def test_a_separate_junior_writes_the_shared_run_and_recovers(
    shared_run, tmp_path, run_cli, tiny_train_args, run_control
):
    """`algorithm.tandem.junior: separate`: the junior gets a vLLM engine of its own in the run's
    placement group. The driver is SIGKILLed once step 0 commits and the run resumed; in the
    resumed run, one of the two engines is SIGKILLed once step 1 commits, and the run recovers.
    It writes, token for token, the rollouts and evaluations of the shared engine's run, and the
    same schedule and loss-mask metrics (engine log-probs may differ in the last float bits:
    tests/generation/test_tandem_separate.py)."""
    run = tmp_path / "full"
    first = run_cli(tiny_train_args(tmp_path, *TANDEM, "algorithm.tandem.junior=separate"))
    assert run_control.kill_driver_after_commit(first, run / "checkpoints" / "step_000000") == 0
    proc = run_cli(["train", "--resume", str(run)])
    run_control.wait_for_commit(proc, run / "checkpoints" / "step_000001", poll_s=0.01)
    run_control.kill_actor(proc, "GeneratorActor")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    assert log.count("recovering (") == 1, log[-4000:]
    layout = json.loads((run / "layout.json").read_text())["actors"]
    assert [layout[name]["bundle"] for name in ("GeneratorActor 0", "JuniorEngine 0")] == [1, 2]
    metrics = _lines(run / "metrics.jsonl")
    _assert_trains_on_the_senior_s_tokens(metrics)

    def written(path: Path) -> list[tuple]:
        return [
            (r["step"], r["prompt_id"], r["response"], r["reward"], r["flags"]["tandem"])
            for r in _lines(path)
        ]

    assert written(run / "rollouts.jsonl") == written(shared_run / "rollouts.jsonl")
    exact = ("step", "train_tokens", "tokens_generated", "reward_mean")
    tandem = [k for k in metrics[0] if k.startswith("tandem/")]
    for got, want in zip(metrics, _lines(shared_run / "metrics.jsonl"), strict=True):
        assert {k: got[k] for k in (*exact, *tandem)} == {k: want[k] for k in (*exact, *tandem)}
    evals = ("step", "eval_accuracy", "eval_tandem_accuracy")
    assert [{k: e[k] for k in evals} for e in _lines(run / "eval.jsonl")] == [
        {k: e[k] for k in evals} for e in _lines(shared_run / "eval.jsonl")
    ]
