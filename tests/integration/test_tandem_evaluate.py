"""`rlvr tandem-eval` on a briefly SFT-warmed tiny model (transformers backend, small n): the JSON's
structure and its invariants; the junior evaluated against itself has no drift and full overlap."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from rlvr.config import load_config
from rlvr.models.sft import sft_warmup
from rlvr.models.tiny import build_tiny_model
from rlvr.tasks import load_task
from workflows.cli import main

KS = [1, 2, 4]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_config):
    """The junior's own evaluation: checkpoint = the run's starting model = the default junior."""
    tmp = tmp_path_factory.mktemp("eval")
    # one-step sums of small operands: 100 SFT steps (about 10 s) solve some of them
    easy = ["task.difficulty.max_operand=9", "task.difficulty.max_steps=1", "task.n_train=100"]
    cfg = load_config(tiny_config, [*easy, "task.n_test=6"])
    train, _ = load_task(cfg.task)
    base = build_tiny_model(tmp / "tiny", seed=0)
    model = sft_warmup(base, train, tmp / "sft", steps=100, lr=3e-3, batch_size=16)
    raw = cfg.to_dict()
    raw["model"].update(path=str(model), sft_warmup_steps=0)
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp / "out"
    argv = ["tandem-eval", "--checkpoint", str(model), "--config", str(config), "--backend", "hf"]
    argv += ["--n", "4", "--k", *map(str, KS), "--out", str(out), "--step-boundary", "\\n"]
    assert main(argv) == 0
    return out


def test_writes_json_and_plots(evaluated):
    assert (evaluated / "pass_at_k.png").stat().st_size > 0
    assert (evaluated / "survival.png").stat().st_size > 0
    report = json.loads((evaluated / "evaluation.json").read_text())
    assert report["problems"] == {"arithmetic": 6}
    assert report["settings"]["step_boundary"] == "\n"
    for key in ("solo_senior", "solo_junior", "handoff", "legibility", "drift"):
        assert key in report


def test_pass_at_k_lies_in_0_1_and_grows_with_k(evaluated):
    report = json.loads((evaluated / "evaluation.json").read_text())
    curves = [
        report["solo_senior"]["pass_at_k"],
        report["solo_junior"]["pass_at_k"],
        report["handoff"]["strict"]["pass_at_k"],
        report["handoff"]["stochastic"]["pass_at_k"],
    ]
    for curve in curves:
        assert sorted(curve, key=int) == [str(k) for k in KS]
        means = [curve[str(k)]["mean"] for k in KS]
        assert all(0.0 <= m <= 1.0 for m in means)
        assert means == sorted(means)
        assert all(curve[str(k)]["se"] >= 0.0 for k in KS)
    # the warmed model solves some problems: the checks above are not vacuous
    assert curves[0]["4"]["mean"] > 0


def test_handoff_shares_the_writing(evaluated):
    report = json.loads((evaluated / "evaluation.json").read_text())
    strict, stochastic = report["handoff"]["strict"], report["handoff"]["stochastic"]
    # multi-step answers hand over at "\n": the senior writes turn 1, the junior some later ones
    assert 0.0 < strict["senior_share"] < 1.0
    assert strict["rounds_mean"] > 1.0
    assert 0.0 < stochastic["senior_share"] <= 1.0


def test_junior_against_itself_has_no_drift_and_full_overlap(evaluated):
    report = json.loads((evaluated / "evaluation.json").read_text())
    assert report["senior"] == report["junior"]
    # same model, same seeds: identical solo samples
    assert report["solo_senior"] == report["solo_junior"]
    ce = report["legibility"]["junior_ce"]["mean"]
    assert math.isfinite(ce) and ce > 0
    assert report["legibility"]["overlap"]["mean"] == pytest.approx(1.0, abs=1e-5)
    drift = report["drift"]
    assert drift["kl_to_junior"] == pytest.approx(0.0, abs=1e-12)
    assert drift["kl_from_junior"] == pytest.approx(0.0, abs=1e-12)
    assert drift["frequent_tokens"] > 0
    assert max(drift["survival"]) == 0.0
