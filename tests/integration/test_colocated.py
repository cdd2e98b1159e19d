"""Placement layouts on the session's one-node cluster: per-role placement groups. (A run with each
policy rank and its engine colocated in one bundle is test_train_workflow.py's tiny Llama run.)"""

from __future__ import annotations

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
