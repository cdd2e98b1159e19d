"""bench/duet.py's summary: each variant's held-out accuracy against full-budget GRPO as the
mean and standard error of per-seed differences (the issue's bar is one standard error)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # as when it runs as a script: its folder's harness on the path
SPEC = importlib.util.spec_from_file_location("bench_duet", BENCH / "duet.py")
duet_bench = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = duet_bench  # dataclasses look their module up there
SPEC.loader.exec_module(duet_bench)


def test_paired_difference_hand_values():
    mean, se = duet_bench.paired_difference([0.5, 0.45, 0.55], [0.5, 0.5, 0.5])
    # differences 0, -0.05, +0.05: sd 0.05, SE 0.05 / sqrt(3); exact up to float rounding
    assert mean == pytest.approx(0.0, abs=1e-15)
    assert se == pytest.approx(0.05 / math.sqrt(3), rel=1e-12)


def test_paired_difference_of_one_seed_has_no_standard_error():
    mean, se = duet_bench.paired_difference([0.4], [0.5])
    assert mean == pytest.approx(-0.1, abs=1e-15) and math.isnan(se)


def test_paired_difference_needs_the_same_seeds():
    with pytest.raises(ValueError):
        duet_bench.paired_difference([0.4, 0.5], [0.5])


def _run(accuracy: float, duet: bool) -> dict:
    step = {"tokens_generated": 100, "rollouts": 8, "time_generate": 1.0, "time_step": 2.0}
    if duet:
        step |= {"duet_abort_rate": 0.1, "duet_n_std": 1.0}
    return {
        "steps": [dict(step) for _ in range(3)],
        "eval": {"eval_accuracy": accuracy},
        "probe": {"marker_less": 0.0},
    }


def test_summary_table_pairs_each_variant_with_grpo_by_seed():
    accs = {"grpo b=1": [0.5, 0.4, 0.6], "duet b=1": [0.45, 0.4, 0.65]}
    runs = {
        s: {name: _run(a[i], name.startswith("duet")) for name, a in accs.items()}
        for i, s in enumerate((0, 1, 2))
    }
    rows = duet_bench.summarize(runs, warmup=1)
    assert "accuracy_gap" in rows["grpo b=1"] and rows["grpo b=1"]["accuracy_gap"] == 0.0
    # per-seed differences -0.05, 0, +0.05 (the seeds' spread of 0.1 cancels out)
    assert rows["duet b=1"]["accuracy_gap"] == pytest.approx(0.0, abs=1e-15)
    assert rows["duet b=1"]["accuracy_gap_se"] == pytest.approx(0.05 / math.sqrt(3), rel=1e-12)
    table = duet_bench.format_table(rows, [0, 1, 2], 3, "test")
    lines = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert "| +0.000 ± 0.029 |" in lines["| duet b=1"]
    assert lines["| grpo b=1"].split(" | ")[2] == "-"
