"""GRPO's group-normalised advantages (arXiv:2402.03300, Sec. 4.1) and their scaling registry.

numpy only, so the processes that plan steps from rewards (the controller's DUET and LACONIC
state) never import torch; tensors are taken and returned as they are when torch is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from rlvr.algorithms.groups import group_rows

AdvantageScale = Callable[[float, float], float]

ADVANTAGE_SCALES: dict[str, AdvantageScale] = {}


def register_advantage_scale(name: str) -> Callable[[AdvantageScale], AdvantageScale]:
    """Register `fn(group_std, eps) -> divisor` under `name` for `group_advantages(scale=name)`."""

    def wrap(fn: AdvantageScale) -> AdvantageScale:
        ADVANTAGE_SCALES[name] = fn
        return fn

    return wrap


def lookup(registry: dict, name: str, what: str) -> Any:
    """`registry[name]`, or a ValueError that lists the registered names."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(registry)}")
    return registry[name]


@register_advantage_scale("group")
def _scale_by_group_std(std: float, eps: float) -> float:
    return std + eps


@register_advantage_scale("none")
def _no_scale(std: float, eps: float) -> float:
    # Dr.GRPO: dividing by the group std up-weights near-uniform groups (too easy or too hard).
    return 1.0


def group_advantages(
    rewards: Any,
    group_ids: Sequence[Hashable] | Any,
    scale: str = "group",
    eps: float = 1e-6,
    singleton: str = "zero",
) -> Any:
    """Per-sequence GRPO advantages `[batch]`: (r - group mean) / (group std + eps) within each group.

    `group_ids[i]` names the prompt that sequence i answers (any hashable: str ids, ints). The std is
    the sample (unbiased, ddof=1) std, as `torch.std` in verl's GRPO estimator; a group whose rewards
    are all equal gets advantage 0 everywhere. `scale="none"` (Dr.GRPO) skips the division. A group
    of one sequence has no baseline: `singleton="zero"` gives it 0 (no signal), `singleton="reward"`
    gives it A = r (verl's behaviour: mean 0, std 1). Returns the kind of `rewards` (numpy float64
    array, or a float tensor on the same device). ``rewards`` and ``group_ids`` are numpy arrays,
    sequences or torch tensors.
    """
    divisor = lookup(ADVANTAGE_SCALES, scale, "advantage scale")
    if singleton not in ("zero", "reward"):
        raise ValueError(f"singleton must be 'zero' or 'reward', got {singleton!r}")
    # a tensor exists only where torch was imported
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(rewards, torch.Tensor)
    r = (rewards.detach().cpu().numpy() if is_torch else np.asarray(rewards)).astype(np.float64)
    if torch is not None and isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    if r.ndim != 1 or len(group_ids) != len(r):
        raise ValueError(
            f"rewards must be [batch] matching group_ids, got {r.shape} vs {len(group_ids)}"
        )

    adv = np.zeros_like(r)
    for idx in group_rows(group_ids).values():
        group = r[idx]
        if len(idx) == 1:
            adv[idx] = group if singleton == "reward" else 0.0
            continue
        adv[idx] = (group - group.mean()) / divisor(float(group.std(ddof=1)), eps)

    if not is_torch:
        return adv
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return torch.as_tensor(adv, dtype=dtype, device=rewards.device)
