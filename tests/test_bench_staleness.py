"""bench/staleness.py's summary of one run: the steady window's medians by hand, a run too
short for a steady step (5 steps at k = 4) reported as n/a instead of failing the bench, and the
trained tokens' outside-nucleus share as the mean over every step."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # as when it runs as a script: its folder's harness on the path
SPEC = importlib.util.spec_from_file_location("bench_staleness", BENCH / "staleness.py")
staleness = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(staleness)


def write_run(run: Path, k: int, steps: int) -> None:
    """A run directory whose step s took s + 1 seconds, generated 10 tokens, whose rollouts
    were min(s, k) versions old and min(s, k) / 100 of whose trained tokens lay outside pi_old's
    nucleus."""
    run.mkdir()
    metrics = [
        {
            "time_step": float(s + 1),
            "tokens_generated": 10,
            "busy_share_engines": 0.5,
            "busy_share_policy": 0.25,
            "rollout_staleness": min(s, k),
            "train_engine_outside_frac": min(s, k) / 100,
        }
        for s in range(steps)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    evals = [{"eval_accuracy": 0.25}, {"eval_accuracy": 0.5}]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))


def test_the_steady_window_leaves_out_warm_up_fill_and_drain(tmp_path):
    write_run(tmp_path / "k1", k=1, steps=6)
    summary = staleness.summarise(tmp_path / "k1", 1)
    # steady steps 1-4 (step 0 warms up, step 5 has nothing left to collect): 2, 3, 4, 5 s
    assert summary["time_step"] == 3.5
    assert summary["tokens_per_step_s"] == (10 / 3 + 10 / 4) / 2
    assert summary["token_staleness_mean"] == 1
    assert (summary["eval_accuracy_before"], summary["eval_accuracy"]) == (0.25, 0.5)
    # every step's share, the warm-up and the drain included: 0, .01, .01, .01, .01, .01; the
    # float mean of six hundredths, exact to a few ulps
    assert summary["engine_outside_frac"] == pytest.approx(0.05 / 6, rel=1e-12)
    assert staleness.table({(1, 0): [summary]}).splitlines()[-1].split("|")[-2] == " 0.0083 "


def test_a_run_without_engine_weights_reports_no_outside_share(tmp_path):
    write_run(tmp_path / "k0", k=0, steps=3)
    metrics = (tmp_path / "k0" / "metrics.jsonl").read_text().splitlines()
    first = json.loads(metrics[0])
    del first["train_engine_outside_frac"]
    (tmp_path / "k0" / "metrics.jsonl").write_text(
        "\n".join([json.dumps(first), *metrics[1:]]) + "\n"
    )
    summary = staleness.summarise(tmp_path / "k0", 0)
    assert summary["engine_outside_frac"] is None
    assert staleness.table({(0, 0): [summary]}).splitlines()[-1].split("|")[-2] == " n/a "


def test_a_run_without_a_steady_step_reports_accuracy_and_no_times(tmp_path):
    write_run(tmp_path / "k0", k=0, steps=5)
    write_run(tmp_path / "k4", k=4, steps=5)
    short = staleness.summarise(tmp_path / "k4", 4)
    assert short["time_step"] is None and short["busy_share_policy"] is None
    assert short["token_staleness_mean"] == 4  # from the steps past the pipeline's fill
    assert short["eval_accuracy"] == 0.5
    rows = staleness.table(
        {(0, 0): [staleness.summarise(tmp_path / "k0", 0)], (4, 0): [short]}
    ).splitlines()
    assert rows[-1].split("|")[5:11] == [" n/a "] * 6
    assert rows[-1].split("|")[-2] == " 0.0200 "  # no step time, but an outside share
    assert rows[-2].split("|")[6] == " 1.00x "


def test_overrides_reach_every_run_and_name_its_directory(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(staleness, "run_rlvr", lambda argv, log: calls.append(argv))
    plain = staleness.train(Path("tiny.yaml"), (1, 0), 0, 6, tmp_path, tmp_path / "log", [])
    top_p = ["generation.top_p=0.95"]
    nucleus = staleness.train(Path("tiny.yaml"), (1, 0), 0, 6, tmp_path, tmp_path / "log", top_p)
    assert "--set=generation.top_p=0.95" not in calls[0]
    assert calls[1][-1] == "--set=generation.top_p=0.95"
    # a finished run under other overrides is never taken for this one
    assert plain.name == "k1-seed0" and nucleus.name.startswith("k1-seed0-") and nucleus != plain
