"""DAPO's section of the training config (`algorithm.dapo`)."""

from __future__ import annotations

from pydantic import Field

from rlvr.config import Section


class DapoConfig(Section):
    """DAPO's dynamic sampling for GRPO: drop groups whose rewards are all equal and generate
    groups for fresh prompts until prompts_per_step informative groups are collected."""

    max_rounds: int = Field(
        3, ge=1, description="Generation rounds per step, the first one included."
    )
