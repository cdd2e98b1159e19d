"""Per-step rollout statistics: reward, accuracy, response lengths and truncation.

Pure functions over plain lists so the driver, the bench and the tests compute them identically.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlvr.algorithms.groups import group_rows


def rollout_stats(
    rewards: Sequence[float],
    lengths: Sequence[int],
    finish_reasons: Sequence[str],
    correct: Sequence[bool] | None = None,
) -> dict[str, float]:
    """Summary of one step's rollouts (all of them, before any filtering)."""
    r = np.asarray(rewards, dtype=np.float64)
    n = np.asarray(lengths, dtype=np.float64)
    if r.size == 0:
        return {"rollouts": 0}
    acc = (
        np.asarray(correct, dtype=np.float64)
        if correct is not None
        else (r >= 1.0).astype(np.float64)
    )
    return {
        "rollouts": int(r.size),
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "accuracy": float(acc.mean()),
        "length_mean": float(n.mean()),
        "length_p50": float(np.percentile(n, 50)),
        "length_p90": float(np.percentile(n, 90)),
        "tokens_generated": int(n.sum()),
        "truncated_frac": float(np.mean([f == "length" for f in finish_reasons])),
    }


def group_stats(rewards: Sequence[float], group_ids: Sequence[str]) -> dict[str, float]:
    """Share of groups whose rewards are all equal (they give GRPO no signal)."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards for {len(group_ids)} group ids")
    groups = {g: [rewards[i] for i in rows] for g, rows in group_rows(group_ids).items()}
    if not groups:
        return {}
    degenerate = [len(set(v)) <= 1 for v in groups.values()]
    solved = [all(x >= 1.0 for x in v) for v in groups.values()]
    return {
        "groups": len(groups),
        "zero_signal_group_frac": float(np.mean(degenerate)),
        "solved_group_frac": float(np.mean(solved)),
    }
