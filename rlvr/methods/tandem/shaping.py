"""Tandem RL in the training step (arXiv:2606.28166): where the junior comes from, and the
shaping of co-written rollouts into a senior-only batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlvr.algorithms.tandem import authorship_matrix, schedule_metrics, senior_loss_mask
from rlvr.config import Config, ConfigError
from rlvr.generation.tandem_support import check_same_tokenizer, counters_from_flags
from rlvr.methods.grpo.shaping import shape_grpo
from rlvr.models import resolve_model_path
from rlvr.models.checks import check_model_dir
from rlvr.training.batch import TrainBatch
from rlvr.training.rollouts import Rollouts


def junior_dir(cfg: Config, model_dir: Path) -> Path:
    """The junior's model directory: `algorithm.tandem.junior_path`, or the senior's starting
    weights (`model_dir`, after any SFT warm-up) when it is None. Checked like the senior's
    (backend head size) and against the senior's tokenizer, naming the key on failure."""
    spec = cfg.algorithm.tandem.junior_path
    if spec is None:
        return model_dir
    try:
        path = resolve_model_path(spec, seed=cfg.model.seed)
        check_same_tokenizer(model_dir, path)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"invalid config: algorithm.tandem.junior_path: {err}") from None
    try:
        check_model_dir(path, cfg.generation.max_model_len, cfg.vllm_on_cpu())
    except ConfigError as err:
        raise ConfigError(str(err).replace("model.path", "algorithm.tandem.junior_path")) from None
    return path


def shape_tandem(rollouts: Rollouts, cfg: Any, pad_id: int) -> tuple[TrainBatch, dict[str, float]]:
    """GRPO shaping of co-written rollouts: group advantages of the team rewards on every token,
    then the loss mask cut to the senior's tokens (the batch also carries `authorship`, which the
    PolicyActor gates with again). Adds the schedule metrics (senior token fraction, switches
    per sequence, mean run length, cap-triggered share of redraws).

    Raises when any rollout lacks its authorship: the update must never fall back to plain GRPO.
    """
    authorships = rollouts.authorships
    if len(authorships) != len(rollouts) or any(a is None for a in authorships):
        raise ValueError("tandem is enabled but the rollouts carry no authorship")
    batch, stats = shape_grpo(rollouts, cfg, pad_id=pad_id)
    batch.authorship = authorship_matrix(
        authorships,
        rollouts.lengths,
        [len(p) for p in rollouts.prompt_ids],
        batch.input_ids.shape[1],
    )
    batch.response_mask = senior_loss_mask(batch.response_mask, batch.authorship)
    stats.update(schedule_metrics(authorships, [counters_from_flags(f) for f in rollouts.flags]))
    return batch, stats
