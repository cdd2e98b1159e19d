"""GRPO shaping: group advantages of the step's rewards on the response tokens of a padded batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlvr.algorithms.advantages import group_advantages
from rlvr.training.batch import TrainBatch, build_batch
from rlvr.training.rollouts import Rollouts


def shape_grpo(
    rollouts: Rollouts, cfg: Any, pad_id: int, rewards: np.ndarray | None = None
) -> tuple[TrainBatch, dict[str, float]]:
    """GRPO advantages per prompt group, broadcast to the response tokens of a padded batch.

    `rewards` replaces the verifier rewards when a method shapes them first (LACONIC's Lagrangian).
    """
    adv = group_advantages(
        rollouts.rewards if rewards is None else rewards,
        rollouts.group_ids,
        scale=cfg.algorithm.advantage_scale,
        eps=cfg.algorithm.advantage_eps,
    )
    batch = build_batch(
        rollouts.prompt_ids,
        rollouts.response_ids,
        pad_id,
        loss_masks=rollouts.loss_masks,
        rollout_logprobs=rollouts.engine_logprobs,
        forced_eos=rollouts.forced_eos,
    )
    batch.advantages = torch.as_tensor(np.asarray(adv), dtype=torch.float32)
    stats = {
        "advantage_abs_mean": float(np.mean(np.abs(adv))),
        "nonzero_advantage_frac": float(np.mean(np.abs(adv) > 0)),
    }
    return batch, stats
