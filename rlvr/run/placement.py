"""Which placement groups a run asks Ray for, and which bundle holds each model actor.

Three layouts, from `resources` (`rlvr.config.ResourcesConfig`):
- one group of every model actor under `placement_strategy` (policy rank bundles, then engines):
  the strategy relates the two roles (STRICT_SPREAD puts every actor on its own node);
- a group per role when `policy_strategy` or `generator_strategy` is set: each role's actors are
  placed among themselves (e.g. ranks STRICT_PACK on one node for their all-reduce, engines SPREAD
  over the others), the unset one taking `placement_strategy`;
- `colocate`: one bundle per pair, policy rank i and engine i, which then share its node and, on
  GPUs, its one device (the engine sleeps while the rank trains).

An engine's companion (Tandem's separate junior: `Method.companion_engine`) gets a bundle like an
engine's, in the engines' group, after them.

Pure data, so the check of a config against a cluster (`check_cluster`) and the actor start agree on
one plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlvr.config import Config, ConfigError, ResourcesConfig

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
    companion: tuple[tuple[int, int], ...] = ()
    """Per engine's companion, if the engines have them, (group index, bundle index)."""


def merge_bundles(a: Bundle, b: Bundle) -> Bundle:
    """The resources of two actors that share one bundle."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0.0) + value
    return out


def companions(cfg: Config) -> int:
    """Companion engines the run starts: one per generation engine when its method asks."""
    from rlvr.methods.base import build_method  # the methods import the config this reads

    return cfg.resources.generator_engines if build_method(cfg).companion_engine() else 0


def plan_placement(r: ResourcesConfig, companion_engines: int = 0) -> PlacementPlan:
    """The groups and bundle assignment of `r`'s layout (see the module docstring), with
    `companion_engines` (0, or one per engine) placed beside the engines."""
    ranks, engines = r.policy_ranks, r.generator_engines
    policy, generator = r.policy_bundle(), r.generator_bundle()
    if companion_engines and r.colocate:
        raise ConfigError("invalid config: resources.colocate: companion engines have no rank")
    if r.colocate:
        pair = merge_bundles(policy, generator)
        group = GroupPlan("colocated", r.placement_strategy, (pair,) * ranks)
        return PlacementPlan(
            (group,), tuple((0, i) for i in range(ranks)), tuple((0, i) for i in range(engines))
        )
    if r.policy_strategy is None and r.generator_strategy is None:
        group = GroupPlan(
            "models",
            r.placement_strategy,
            (policy,) * ranks + (generator,) * (engines + companion_engines),
        )
        return PlacementPlan(
            (group,),
            tuple((0, i) for i in range(ranks)),
            tuple((0, ranks + i) for i in range(engines)),
            tuple((0, ranks + engines + i) for i in range(companion_engines)),
        )
    groups = (
        GroupPlan("policy", r.policy_strategy or r.placement_strategy, (policy,) * ranks),
        GroupPlan(
            "generator",
            r.generator_strategy or r.placement_strategy,
            (generator,) * (engines + companion_engines),
        ),
    )
    return PlacementPlan(
        groups,
        tuple((0, i) for i in range(ranks)),
        tuple((1, i) for i in range(engines)),
        tuple((1, engines + i) for i in range(companion_engines)),
    )


def check_cpus(cfg: Config, available: float) -> None:
    """Fail before any actor starts when the actors ask for more CPUs than the cluster has."""
    check_cluster(cfg, [{"CPU": available}], strict_placement=False)


def check_cluster(
    cfg: Config, nodes: list[dict[str, float]], strict_placement: bool = True
) -> None:
    """Fail before any actor starts when the layout cannot fit the cluster's nodes (each a
    dict of its resources), naming the keys to change: a resource short in total, or a
    STRICT_SPREAD / STRICT_PACK placement the node count or the largest node cannot hold."""
    r = cfg.resources
    keys = {
        "CPU": "resources.policy_ranks / policy_cpus / generator_engines / generator_cpus / "
        "verifier_cpus or num_verifiers",
        "GPU": "resources.policy_ranks / policy_gpus / generator_engines / generator_gpus",
    }
    extra = companions(cfg)
    for resource, need in r.demand(companion_engines=extra).items():
        have = sum(node.get(resource, 0.0) for node in nodes)
        if need > have + 1e-9:
            what = "CPUs" if resource == "CPU" else "GPUs" if resource == "GPU" else resource
            lower = keys.get(resource, "resources.policy_resources / generator_resources")
            juniors = f" (with {extra} junior engine{'s' * (extra > 1)})" if extra else ""
            raise ConfigError(
                f"invalid config: resources: the actors need {need:g} {what}{juniors} but "
                f"{have:g} are available; lower {lower}"
                + (" or use algorithm.tandem.junior: shared" if extra else "")
            )
    if not strict_placement:
        return
    for group in plan_placement(r, extra).groups:
        _check_group(group, nodes)


def _check_group(group: GroupPlan, nodes: list[dict[str, float]]) -> None:
    """One placement group against the nodes: every bundle fits some node, STRICT_SPREAD has a
    node per bundle, STRICT_PACK a node for all of them."""
    key = {"policy": "policy_strategy", "generator": "generator_strategy"}.get(
        group.role, "placement_strategy"
    )
    key = f"resources.{key}"

    def fits(need: dict[str, float], node: dict[str, float]) -> bool:
        return all(node.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)

    actors = {
        "models": "model actors (resources.policy_ranks + generator_engines, and a junior "
        "engine per engine with algorithm.tandem.junior: separate)",
        "policy": "policy ranks (resources.policy_ranks)",
        "generator": "engines (resources.generator_engines, and a junior engine per engine "
        "with algorithm.tandem.junior: separate)",
        "colocated": "rank + engine pairs (resources.policy_ranks)",
    }[group.role]
    for bundle in group.bundles:
        if not any(fits(bundle, node) for node in nodes):
            raise ConfigError(
                f"invalid config: resources: no node has {bundle}, the bundle of one of the "
                f"{actors}"
            )
    if group.strategy == "STRICT_SPREAD" and len(group.bundles) > len(nodes):
        raise ConfigError(
            f"invalid config: {key}: STRICT_SPREAD puts each of the {len(group.bundles)} "
            f"{actors} on its own node, but the cluster has {len(nodes)}"
        )
    if group.strategy == "STRICT_PACK":
        need: dict[str, float] = {}
        for bundle in group.bundles:
            need = merge_bundles(need, bundle)
        if not any(fits(need, node) for node in nodes):
            raise ConfigError(
                f"invalid config: {key}: STRICT_PACK puts all {actors} on one node, and no "
                f"node has {need}"
            )
