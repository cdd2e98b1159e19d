"""Tandem RL's section of the training config (`algorithm.tandem`)."""

from __future__ import annotations

from pydantic import Field

from rlvr.config import Section


class TandemConfig(Section):
    """Tandem RL: a frozen junior co-writes every training rollout; only senior tokens train."""

    p: float = Field(
        0.5, gt=0.0, le=1.0, description="Probability that the senior wins an author draw."
    )
    cap: int = Field(
        32, ge=1, description="K: redraw the author after this many tokens without a word start."
    )
    junior_path: str | None = Field(
        None,
        description="Frozen junior ('tiny', 'tiny-llama', 'smollm2' or an HF directory with the "
        "senior's tokenizer); None = the senior's starting weights (the base model).",
    )
