"""DAPO's dynamic sampling (Yu et al., arXiv:2503.14476, Sec. 3.2; a baseline of DUET,
arXiv:2605.08441 App. A.3): a group whose rewards are all equal has zero GRPO advantage, so it is
dropped after generation and fresh prompts are generated until the step holds its target of
informative groups or runs out of rounds.

Pure: which groups a round keeps, how many prompts the next round draws, and which prompts those
are, as a function of (seed, step, round) so a resumed step redraws exactly the same prompts.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from rlvr.algorithms.groups import group_rows

__all__ = ["RoundOutcome", "informative_groups", "refill_indices", "sift_round"]


def informative_groups(
    rewards: Sequence[float] | np.ndarray, group_ids: Sequence[Hashable]
) -> tuple[list[Hashable], list[Hashable]]:
    """Split groups into (informative, all-equal), each in order of first appearance.

    A group is informative when its rewards are not all equal: only then does GRPO give any of
    its rollouts a non-zero advantage (a group of one is never informative).
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards for {len(group_ids)} group ids")
    groups = {g: [float(rewards[i]) for i in rows] for g, rows in group_rows(group_ids).items()}
    informative = [g for g, rs in groups.items() if min(rs) != max(rs)]
    equal = [g for g, rs in groups.items() if min(rs) == max(rs)]
    return informative, equal


@dataclass(frozen=True)
class RoundOutcome:
    """What one generation round of a step contributes."""

    kept: list[Hashable]
    """Informative groups taken into the step's batch, at most the step's remaining need."""
    dropped: list[Hashable]
    """Every other group of the round: all-equal ones, and informative ones beyond the target."""
    refill: int
    """Prompts to draw for the next round (0: the step is done)."""


def sift_round(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[Hashable],
    have: int,
    target: int,
    round_index: int,
    max_rounds: int,
) -> RoundOutcome:
    """Keep a round's informative groups (first come, up to `target - have`), drop the rest, and
    say how many fresh prompts the next round needs: the remaining deficit, or 0 once the target
    is met or round `round_index` (0-based) was the last of `max_rounds`."""
    if not 0 <= have <= target or not 0 <= round_index < max_rounds:
        raise ValueError(
            f"need 0 <= have={have} <= target={target} and 0 <= round={round_index} < "
            f"max_rounds={max_rounds}"
        )
    informative, _ = informative_groups(rewards, group_ids)
    need = target - have
    kept = informative[:need]
    taken = set(kept)
    dropped = [g for g in dict.fromkeys(group_ids) if g not in taken]
    deficit = need - len(kept)
    last = round_index == max_rounds - 1
    return RoundOutcome(kept=kept, dropped=dropped, refill=0 if last else deficit)


def refill_indices(
    pool_size: int, count: int, exclude: Collection[int], seed: int, step: int, round_index: int
) -> list[int]:
    """Pool indices of the `count` fresh prompts of a refill round, none in `exclude` (the
    prompts the step already drew), fewer if the pool has fewer left.

    A permutation seeded by (seed, step, round_index): the main batches stay exactly the
    sampler's (the same prompts GRPO gets at each step) and a resumed step draws the same
    refills, with no sampler state to checkpoint.
    """
    if count < 0 or pool_size < 0:
        raise ValueError(f"count={count} and pool_size={pool_size} must be >= 0")
    order = np.random.default_rng([seed, step, round_index]).permutation(pool_size)
    excluded = set(exclude)
    return [int(i) for i in order if int(i) not in excluded][:count]
