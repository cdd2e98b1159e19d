"""Which placement groups a run asks Ray for, and which bundle holds each model actor.

Three layouts, from `resources` (`rlvr.config.ResourcesConfig`):
- one group of every model actor under `placement_strategy` (policy rank bundles, then engines):
  the strategy relates the two roles (STRICT_SPREAD puts every actor on its own node);
- a group per role when `policy_strategy` or `generator_strategy` is set: each role's actors are
  placed among themselves (e.g. ranks STRICT_PACK on one node for their all-reduce, engines SPREAD
  over the others), the unset one taking `placement_strategy`;
- `colocate`: one bundle per pair, policy rank i and engine i, which then share its node and, on
  GPUs, its one device (the engine sleeps while the rank trains).

Pure data, so the config check (`Config.check_cluster`) and the actor start agree on one plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlvr.config import ResourcesConfig

Bundle = dict[str, float]


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: its name suffix, strategy and bundles."""

    role: str
    """"models" (every model actor), "policy", "generator" or "colocated"."""
    strategy: str
    bundles: tuple[Bundle, ...]


@dataclass(frozen=True)
class PlacementPlan:
    groups: tuple[GroupPlan, ...]
    policy: tuple[tuple[int, int], ...]
    """Per policy rank, (group index, bundle index)."""
    generator: tuple[tuple[int, int], ...]
    """Per engine, (group index, bundle index)."""


def merge_bundles(a: Bundle, b: Bundle) -> Bundle:
    """The resources of two actors that share one bundle."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0.0) + value
    return out


def plan_placement(r: ResourcesConfig) -> PlacementPlan:
    """The groups and bundle assignment of `r`'s layout (see the module docstring)."""
    ranks, engines = r.policy_ranks, r.generator_engines
    policy, generator = r.policy_bundle(), r.generator_bundle()
    if r.colocate:
        pair = merge_bundles(policy, generator)
        group = GroupPlan("colocated", r.placement_strategy, (pair,) * ranks)
        return PlacementPlan(
            (group,), tuple((0, i) for i in range(ranks)), tuple((0, i) for i in range(engines))
        )
    if r.policy_strategy is None and r.generator_strategy is None:
        group = GroupPlan(
            "models", r.placement_strategy, (policy,) * ranks + (generator,) * engines
        )
        return PlacementPlan(
            (group,),
            tuple((0, i) for i in range(ranks)),
            tuple((0, ranks + i) for i in range(engines)),
        )
    groups = (
        GroupPlan("policy", r.policy_strategy or r.placement_strategy, (policy,) * ranks),
        GroupPlan(
            "generator", r.generator_strategy or r.placement_strategy, (generator,) * engines
        ),
    )
    return PlacementPlan(
        groups, tuple((0, i) for i in range(ranks)), tuple((1, i) for i in range(engines))
    )
