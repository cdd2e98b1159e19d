"""Per-step rollout statistics: reward (and each weighted component's), accuracy, response lengths,
truncation, and the rewards never computed (the verifier or the environment failed); unbiased pass@k.

Pure functions over plain lists so the driver, the bench and the tests compute them identically.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlvr.algorithms.groups import group_rows
from rlvr.generation.segments import POLICY_VERSIONS
from rlvr.training.rollouts import UNCOMPUTED


class UncomputedRewards(RuntimeError):
    """Too many of a step's rewards could not be computed to train (or pick a checkpoint) on."""


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


def reward_part_stats(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """With several weighted rewards (`verifier.rewards`), each component's mean reward,
    `reward/<name>_mean`, over the rollouts the verifier scored ({} entries, uncomputed, left out).
    """
    values: dict[str, list[float]] = {}
    for item in parts:
        for name, reward in item.items():
            values.setdefault(name, []).append(reward)
    return {f"reward/{name}_mean": float(np.mean(v)) for name, v in values.items()}


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


def uncomputed_stats(statuses: Sequence[str], max_share: float, where: str) -> dict[str, float]:
    """How many of the rollouts' rewards were never computed (`UNCOMPUTED`: the verifier failed,
    or the trajectory's environment did; each a 0.0 that says nothing about its answer), their
    share and their count per status; past `max_share` (`verifier.max_uncomputed_share`) the
    rewards are damaged, and this fails loudly, naming `where`, the share and the statuses."""
    by_status = dict(sorted(Counter(s for s in statuses if s in UNCOMPUTED).items()))
    failed = sum(by_status.values())
    share = failed / len(statuses) if statuses else 0.0
    if share > max_share:
        counts = ", ".join(f"{s} {n}" for s, n in by_status.items())
        raise UncomputedRewards(
            f"{where}: {failed} of {len(statuses)} rewards uncomputed (share {share:.3g} > "
            f"verifier.max_uncomputed_share={max_share:g}), by status: {counts}; "
            "the step is not committed"
        )
    out = {"reward_uncomputed": failed, "reward_uncomputed_frac": share}
    out.update({f"reward_uncomputed_{s}": n for s, n in by_status.items()})
    return out


def agent_stats(flags: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per step of multi-turn rollouts (each rollout's `flags["agent"]`): the model's turns and
    tool calls per trajectory, the share of calls that failed (a malformed call, an unknown tool,
    bad arguments, an error, a timeout...), the code points of environment text repaired per
    trajectory (rlvr.envs.base.repair_text), and the share of trajectories each end reason
    ended; {} for single-turn rollouts."""
    agents = [f["agent"] for f in flags if "agent" in f]
    if not agents:
        return {}
    calls = sum(a["tool_calls"] for a in agents)
    out = {
        "agent_turns_mean": float(np.mean([a["turns"] for a in agents])),
        "agent_tool_calls_per_trajectory": calls / len(agents),
        "agent_tool_error_share": sum(a["tool_errors"] for a in agents) / calls if calls else 0.0,
        "agent_repaired_chars_per_trajectory": sum(a["repaired_chars"] for a in agents)
        / len(agents),
    }
    reasons = [a["end_reason"] for a in agents]
    for reason in sorted(set(reasons)):
        out[f"agent_end_{reason}"] = reasons.count(reason) / len(agents)
    return out


def token_staleness(flags: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
    """Per step: the staleness (step - sampling version) of the model tokens of the rollouts that
    record their versions: mean, max, and the share of tokens at each staleness; {} when none
    does (rollouts not sampled by segments)."""
    counts: dict[int, int] = {}
    for f in flags:
        for version, n in f.get(POLICY_VERSIONS, ()):
            counts[step - version] = counts.get(step - version, 0) + n
    total = sum(counts.values())
    if not total:
        return {}
    out = {
        "token_staleness_mean": sum(s * n for s, n in counts.items()) / total,
        "token_staleness_max": float(max(counts)),
    }
    out.update({f"token_staleness_share_{s}": n / total for s, n in sorted(counts.items())})
    return out
