"""Placement layouts on the session's one-node cluster: per-role placement groups, and a tiny run
with each policy rank and its engine colocated in one bundle, weights handed over between them."""

from __future__ import annotations

import json

import pytest
from ray.util.placement_group import remove_placement_group

from rlvr.config import load_config
from rlvr.run.placement import plan_placement
from workflows.components import place_groups, placement_layout

pytestmark = pytest.mark.ray


def test_per_role_strategies_give_each_role_a_group(ray_cluster):
    cfg = load_config(
        None,
        [
            "run.name=roles",
            "resources.policy_cpus=0.1",
            "resources.generator_cpus=0.1",
            "resources.generator_engines=2",
            "resources.policy_strategy=STRICT_PACK",
            "resources.generator_strategy=SPREAD",
        ],
    )
    plan = plan_placement(cfg.resources)
    groups = place_groups(cfg.run.name, plan)
    try:
        layout = placement_layout(groups, plan)
    finally:
        for group in groups:
            remove_placement_group(group)
    assert {k: (v["group"], v["bundle"]) for k, v in layout.items()} == {
        "PolicyActor 0": ("policy", 0),
        "GeneratorActor 0": ("generator", 0),
        "GeneratorActor 1": ("generator", 1),
    }


def test_a_colocated_run_trains_and_syncs_by_hand_over(tmp_path, run_cli, tiny_train_args):
    """Also the trainer's token-budget micro-batches and chunked LM head, through the actors."""
    proc = run_cli(
        tiny_train_args(
            tmp_path,
            "run.steps=2",
            "resources.colocate=true",
            "resources.policy_cpus=0.5",
            "resources.generator_cpus=0.5",
            "sync.bucket_mb=0.25",
            # and the trainer's token-budget micro-batches with the chunked LM head
            "training.micro_batch_tokens=128",
            "training.lm_head_chunk=32",
        )
    )
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    run = tmp_path / "full"
    written = json.loads((run / "layout.json").read_text())
    assert written["weight_sync"] == "colocated"  # "auto" when colocated
    layout = written["actors"]
    assert layout["PolicyActor 0"] == layout["GeneratorActor 0"]
    assert (layout["PolicyActor 0"]["group"], layout["PolicyActor 0"]["bundle"]) == ("colocated", 0)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["time_sync"] > 0 for m in metrics)
