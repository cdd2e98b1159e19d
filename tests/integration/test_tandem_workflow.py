"""Tandem end to end on the tiny model through the actors: the GeneratorActor co-writes every
rollout with the frozen junior inside its vLLM engine, the driver logs the schedule metrics, and
the PolicyActor trains on the senior's tokens only; held-out evaluation co-writes too, and the best
checkpoint is the one with the best tandem accuracy."""

from __future__ import annotations

import json

TANDEM = [
    "algorithm.name=tandem",
    "run.steps=2",
    "run.eval_every=1",
]


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _assert_trains_on_the_senior_s_tokens(metrics: list[dict]) -> None:
    """Two steps whose authors switch, the senior writing about half (p = 0.5: the code's
    smoke-test band; 0 or 1 would mean the mask never reached the loss), and whose update saw
    exactly the senior's tokens."""
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        frac = m["tandem/senior_token_frac"]
        assert 0.3 <= frac <= 0.7
        assert m["train_tokens"] == round(frac * m["tokens_generated"])
        assert m["tandem/switches_per_seq"] > 0


def test_tandem_steps_through_the_actors(tmp_path, run_cli, tiny_train_args):
    proc = run_cli(tiny_train_args(tmp_path, *TANDEM))
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    run = tmp_path / "full"
    metrics = _lines(run / "metrics.jsonl")
    _assert_trains_on_the_senior_s_tokens(metrics)
    for m in metrics:
        assert m["tandem/mean_run_length"] > 1
        assert 0.0 <= m["tandem/cap_redraw_share"] <= 1.0
    rollouts = _lines(run / "rollouts.jsonl")
    assert len(rollouts) == 2 * 16
    for r in rollouts:
        counters = r["flags"]["tandem"]
        assert counters["redraws"] == counters["boundary_redraws"] + counters["cap_redraws"]
        assert counters["redraws"] <= r["length"]
    evals = _lines(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [-1, 0, 1]
    for e in evals:
        assert e["best_metric"] == "eval_tandem_accuracy"
        assert 0.0 <= e["eval_tandem_accuracy"] <= 1.0 and 0.0 <= e["eval_accuracy"] <= 1.0
    best = max(evals[1:], key=lambda e: e["eval_tandem_accuracy"])  # the first of ties
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["best_step"], summary["best_metric"]) == (best["step"], "eval_tandem_accuracy")
    progress = json.loads((run / "checkpoints" / "step_000001" / "progress.json").read_text())
    assert (progress["best_step"], progress["best_metric"]) == (
        best["step"],
        "eval_tandem_accuracy",
    )


def test_a_separate_junior_steps_through_the_actors(tmp_path, run_cli, tiny_train_args):
    """`algorithm.tandem.junior: separate` on the transformers engine: the junior gets an
    engine of its own in the run's placement group, and training runs as with the shared one."""
    separate = [
        "algorithm.name=tandem",
        "algorithm.tandem.junior=separate",
        "generation.backend=hf",
        "run.steps=2",
        "resources.torch_threads=1",
        "resources.generator_cpus=0.5",
    ]
    proc = run_cli(tiny_train_args(tmp_path, *separate))
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    run = tmp_path / "full"
    layout = json.loads((run / "layout.json").read_text())["actors"]
    assert [layout[name]["bundle"] for name in ("GeneratorActor 0", "JuniorEngine 0")] == [1, 2]
    _assert_trains_on_the_senior_s_tokens(_lines(run / "metrics.jsonl"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_metric"] == "eval_tandem_accuracy"
