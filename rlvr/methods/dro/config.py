"""DRO's section of the training config (`algorithm.dro`, with the offline filter's) and its
checks across sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlvr.algorithms import dro
from rlvr.config import Config, Section


class DroFilterConfig(Section):
    """DRO's offline query filter (`rlvr filter`): keep the queries with the most R3 signal."""

    group_size: int = Field(16, ge=2, description="Reference-model rollouts per scored query.")
    token_frac: float = Field(
        dro.DEFAULT_TOKEN_FRAC, gt=0.0, le=1.0, description="Top share of tokens by sigma in sbar."
    )
    query_frac: float = Field(
        dro.DEFAULT_QUERY_FRAC, gt=0.0, le=1.0, description="Share of queries kept by sbar."
    )
    retention: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Total share kept; above query_frac the rest are the lowest-certainty (hard) "
        "queries (paper: 0.125-0.18). None keeps only the sbar share.",
    )

    @model_validator(mode="after")
    def _check(self) -> DroFilterConfig:
        if self.retention is not None and self.retention < self.query_frac:
            raise ValueError(f"retention={self.retention} must be >= query_frac={self.query_frac}")
        return self


class DroConfig(Section):
    """DRO: reward a CoT by the policy's certainty of a reference answer, gated by rubrics."""

    reward: Literal["r3", "avg_prob", "avg_logprob", "verifier"] = Field(
        "r3",
        description="'r3' (DRO), 'avg_prob' (RLPR), 'avg_logprob' (VeriFree) from the reference "
        "certainties; 'verifier': the exact verifier's reward with the same loss (a baseline).",
    )
    omega: float = Field(
        dro.DEFAULT_OMEGA, ge=0.0, description="Inverse temperature of R3's token emphasis."
    )
    clip_low: float = Field(
        dro.DEFAULT_CLIP_LOW, ge=0.0, le=1.0, description="R3 clips certainties below this."
    )
    clip_high: float = Field(
        dro.DEFAULT_CLIP_HIGH, ge=0.0, le=1.0, description="R3 clips certainties above this."
    )
    delimiter: str = Field(
        "</think>",
        description="Text ending the CoT, matched by token id in each of its tokenizations after "
        "common preceding characters; '' scores the whole completion as the prefix (the "
        "no-slicing ablation).",
    )
    separator: str = Field(
        "\n\n", description="Fixed text between the delimiter and the reference answer."
    )
    scorer: Literal["generator", "trainer", "reference"] = Field(
        "generator",
        description="Who scores R3: the rollout weights in the GeneratorActor (vLLM prompt "
        "log-probs) or the PolicyActor (forward pass), or the frozen reference model.",
    )
    gates: bool = Field(True, description="Reject groups that fail the rubric gates.")
    judge: Literal["reference", "keyword"] = Field(
        "reference",
        description="Rubric author and judge: the frozen reference model on a generation backend, "
        "or 'keyword': deterministic rules (items 'The response contains \"X\".').",
    )
    judge_max_tokens: int = Field(512, gt=0, description="Token budget of a rubric/judge reply.")
    rubrics_path: str | None = Field(
        None, description="Rubric cache (JSON); None: one per task, model and judge in the cache."
    )
    mu: int = Field(
        dro.DEFAULT_MU, ge=1, description="Coverage: rollouts that must meet each item."
    )
    rho_g: float = Field(
        dro.DEFAULT_RHO_G, gt=0.0, le=1.0, description="Consistency: top share of rollouts by R3."
    )
    nu: float = Field(
        dro.DEFAULT_NU, ge=0.0, le=1.0, description="Consistency: share of items each must meet."
    )
    rho_ent: float = Field(
        dro.DEFAULT_RHO_ENT,
        gt=0.0,
        le=1.0,
        description="80/20 rule: share of completion tokens (top entropy) with policy gradient.",
    )
    beta: float = Field(
        dro.DEFAULT_BETA, ge=0.0, description="k3 KL coefficient to the reference policy."
    )
    filter: DroFilterConfig = Field(default_factory=DroFilterConfig)

    @model_validator(mode="after")
    def _check(self) -> DroConfig:
        if self.clip_low > self.clip_high:
            raise ValueError(f"clip_low={self.clip_low} must be <= clip_high={self.clip_high}")
        if self.gates and not self.delimiter:
            raise ValueError("gates judge the final answer after the delimiter; set a delimiter")
        if self.scorer == "reference" and self.judge != "reference":
            raise ValueError("scorer='reference' needs the reference model (judge='reference')")
        return self


def check_dro(cfg: Config) -> None:
    """DRO's KL coefficient is its own, and its verifier baseline runs without gates."""
    if cfg.training.kl_coef:
        raise ValueError(
            "training.kl_coef: DRO sets its KL coefficient with algorithm.dro.beta; leave "
            "training.kl_coef at 0"
        )
    if cfg.algorithm.dro.gates and cfg.algorithm.dro.reward == "verifier":
        raise ValueError(
            "algorithm.dro.gates: the verifier-reward baseline runs without rubric gates"
        )
