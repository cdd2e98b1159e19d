"""Tandem RL's section of the training config (`algorithm.tandem`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlvr.config import Config, Section


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
    junior: Literal["shared", "separate"] = Field(
        "shared",
        description="Where the junior runs: 'shared' = inside each senior engine (both models "
        "run on every token); 'separate' = in an engine of its own beside each senior engine, "
        "only a token's author runs its forward and a trajectory changes engines by token ids.",
    )


def check_tandem(cfg: Config) -> None:
    """Refuse the settings `algorithm.tandem.junior: separate` cannot run with, by key."""
    if cfg.algorithm.tandem.junior == "separate" and cfg.resources.colocate:
        raise ValueError(
            "algorithm.tandem.junior: separate cannot run here: resources.colocate shares each "
            "engine's device with a policy rank, and a junior engine has no rank to pair with "
            "(use resources.colocate: false, or algorithm.tandem.junior: shared)"
        )
