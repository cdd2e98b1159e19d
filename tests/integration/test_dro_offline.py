"""`rlvr filter` and `rlvr rubrics` on the tiny model (no warm-up, transformers backend): the
scored table, the retention rule, the retained dataset loadable as reference data, the plot, and
the rubric cache training reads."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rlvr.algorithms import dro
from rlvr.config import load_config
from rlvr.tasks.loaders import load_reference_problems
from rlvr.verifiers.rubric import load_rubrics
from workflows.cli import main as cli_main

SMALL = [
    "model.sft_warmup_steps=0",
    "task.n_train=20",
    "task.n_test=4",
    "generation.backend=hf",
    "generation.max_tokens=12",
    "algorithm.dro.filter.group_size=4",
]


@pytest.fixture(scope="module")
def filtered(tiny_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("filter")
    args = ["filter", "--config", str(tiny_config.parent / "tiny-dro.yaml"), "--out", str(out)]
    assert cli_main([*args, *[f"--set={s}" for s in SMALL]]) == 0
    return out


def test_filter_outputs(filtered):
    table = pq.read_table(filtered / "scores.parquet").to_pandas()
    assert len(table) == 20 and list(table.columns)[:4] == ["id", "sbar", "mean_prob", "mean_sigma"]
    assert (table.sbar >= 0).all() and ((table.mean_prob > 0) & (table.mean_prob < 1)).all()
    # preset retention 0.3 with query_frac 0.1: ceil(2) by sbar, then the 4 lowest-certainty others
    by_score = table[table.kept_by == "score"]
    hard = table[table.kept_by == "hard"]
    assert len(by_score) == 2 and len(hard) == 4
    assert by_score.sbar.min() >= table[table.kept_by != "score"].sbar.max()
    rest = table[table.kept_by == ""]
    assert hard.mean_prob.max() <= rest.mean_prob.min()
    expected = dro.select_queries(table.sbar.to_numpy(), table.mean_prob.to_numpy(), 0.1, 0.3)
    assert sorted(table.index[table.kept_by != ""]) == expected.kept.tolist()

    kept = load_reference_problems(filtered / "train.jsonl")
    assert [p.id for p in kept] == table.id[table.kept_by != ""].tolist()
    for p in kept:
        assert p.reference == f" \\boxed{{{p.answer}}}." and p.solution
    assert len(load_reference_problems(filtered / "test.jsonl")) == 4
    assert (filtered / "sbar_hist.png").stat().st_size > 0
    summary = json.loads((filtered / "summary.json").read_text())
    assert summary["kept"] == 6 and "task.name=reference_file" in summary["train_with"]


def test_rubrics_for_the_retained_dataset(filtered, tiny_config, tmp_path):
    cfg_args = [
        "--set=model.sft_warmup_steps=0",
        "--set=task.name=reference_file",
        f"--set=task.train_path={filtered / 'train.jsonl'}",
        f"--set=task.test_path={filtered / 'test.jsonl'}",
    ]
    args = ["rubrics", "--config", str(tiny_config.parent / "tiny-dro.yaml"), *cfg_args]
    assert cli_main(args) == 0
    cfg = load_config(tiny_config.parent / "tiny-dro.yaml", [a[6:] for a in cfg_args])
    from rlvr.methods.dro.method import rubric_cache_path
    from workflows.train import prepare

    model_dir, train, _ = prepare(cfg)
    path = rubric_cache_path(cfg, model_dir)
    assert path.parent == filtered  # cached with the dataset
    rubrics = load_rubrics(path)
    assert sorted(rubrics) == sorted(p.id for p in train)
    for p in train:
        assert rubrics[p.id].items == (f'The response contains "{p.answer}".',)
