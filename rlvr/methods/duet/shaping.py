"""DUET shaping: importance-weighted group advantages, aborted rollouts out of the loss."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlvr.algorithms import duet
from rlvr.training.batch import TrainBatch, build_batch
from rlvr.training.rollouts import Rollouts


def shape_duet(
    rollouts: Rollouts, counts: list[int], cfg: Any, pad_id: int
) -> tuple[TrainBatch, dict[str, float]]:
    """DUET's weighted advantages (Eq. 6) in a padded batch; aborted rollouts get no loss tokens.

    `counts[q]` is the number of consecutive rows of prompt q (the plan's counts, in request
    order). GRPO advantages are taken over all rows of a prompt, aborted ones included, then
    scaled by w = (1 - I_abort) / (s_pre * p_abort); the batch carries w * A. Sets
    `rollouts.advantages` (unweighted, for the surrogate) and `rollouts.weights`.
    """
    du = cfg.algorithm.duet
    weights, kept = duet.rollout_weights(counts, rollouts.flags, du.eps_pre, du.eps_abort)
    adv, weighted = duet.duet_advantages(
        rollouts.rewards, counts, weights, eps=cfg.algorithm.advantage_eps
    )
    rollouts.advantages, rollouts.weights = adv, weights
    masks = [[bool(k)] * len(r) for k, r in zip(kept, rollouts.response_ids, strict=True)]
    batch = build_batch(
        rollouts.prompt_ids,
        rollouts.response_ids,
        pad_id,
        loss_masks=masks,
        rollout_logprobs=rollouts.engine_logprobs,
        forced_eos=rollouts.forced_eos,
    )
    batch.advantages = torch.as_tensor(weighted, dtype=torch.float32)
    stats = {
        "advantage_abs_mean": float(np.mean(np.abs(adv))),
        "nonzero_advantage_frac": float(np.mean(np.abs(weighted) > 0)),
    }
    return batch, stats
