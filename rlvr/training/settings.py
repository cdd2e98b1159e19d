"""Every setting of a policy trainer in one typed, immutable object: what the run's `model`,
`training` and `generation` sections and its method decide, built once and sent to each rank."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rlvr.algorithms import grpo
from rlvr.training.schedule import LrSchedule

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
EngineIS = Literal["off", "tis", "mask"]


@dataclass(frozen=True)
class LoraSettings:
    """A PEFT LoRA adapter in place of training every weight."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    top_layers: int | None = None
    """Adapt only the last N decoder layers (None: every layer)."""


@dataclass(frozen=True)
class TrainerSettings:
    """How a `PolicyTrainer` trains; the fields are documented where the config defines them
    (`training.*`), and each group below is one concern of the trainer."""

    # the model under DeepSpeed
    zero_stage: Literal[0, 1, 2, 3] = 2
    lora: LoraSettings | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    # the optimizer and its schedule
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    lr_schedule: LrSchedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    # micro-batches and memory
    micro_batch_size: int = 8
    micro_batch_tokens: int = 0
    lm_head_chunk: int = 0
    shared_prefix: bool = False
    gradient_checkpointing: bool = False
    # the update: a registered loss (`rlvr.training.losses`) with its options
    loss: str = "grpo"
    loss_module: str | None = None
    """Module to import before looking ``loss`` up (one outside the project registers it)."""
    loss_options: Mapping[str, Any] = field(default_factory=dict)
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_response_len: int | None = None
    mini_batches: int = 1
    epochs: int = 1
    # the sampler the rollouts came from, and the engine importance correction
    temperature: float = 1.0
    top_p: float = 1.0
    engine_is: EngineIS = "off"
    engine_is_cap: float = 2.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.mini_batches < 1 or self.epochs < 1:
            raise ValueError(
                f"mini_batches={self.mini_batches} and epochs={self.epochs} must be >= 1"
            )
        if self.engine_is not in grpo.ENGINE_IS_MODES:
            raise ValueError(
                f"engine_is must be one of {grpo.ENGINE_IS_MODES}, got {self.engine_is!r}"
            )
