"""Policy losses by name, as verl's `core_algos` registers them: each a function of one
`LossContext` (a micro-batch's tensors, the step's normalisers, the loss's options) that returns
the loss to differentiate and its detached statistics. `TrainerSettings.loss` picks one.

A loss defined outside the project registers itself with `@register_policy_loss("name")` in a
module the policy ranks import (`TrainerSettings.loss_module`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlvr.algorithms import dro, grpo

LossFn = Callable[["LossContext"], tuple[torch.Tensor, dict[str, torch.Tensor]]]
StepPrepare = Callable[["StepContext"], dict[str, float]]


@dataclass
class StepContext:
    """What a loss may compute once per train step, before its first update: pi_old's entropy at
    every loss token of the step, gathered from every rank (when the loss asks for it)."""

    old_entropy: torch.Tensor | None
    options: Mapping[str, Any]


@dataclass
class LossContext:
    """One micro-batch of an update, with what makes its loss that of the global batch.

    Tensors are ``[b, t]`` (``advantages`` and ``weights`` ``[b]``). ``agg_share`` is the
    micro-batch's part of the loss aggregation's global count (`grpo.LOSS_AGGREGATIONS` divide by
    the micro-batch's own), ``num_sequences`` the step's counted rows and ``max_len`` Dr.GRPO's
    constant normaliser, both the same for every micro-batch of the step. ``step`` holds what
    the loss's `StepPrepare` computed; ``inputs`` the method's per-step scalars
    (`TrainBatch.loss_inputs`).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor | None
    token_weights: torch.Tensor | None
    ref_logp: torch.Tensor | None
    old_entropy: torch.Tensor | None
    agg: str
    agg_share: float
    num_sequences: int
    max_len: int
    clip_low: float
    clip_high: float
    kl_coef: float
    options: Mapping[str, Any] = field(default_factory=dict)
    step: Mapping[str, float] = field(default_factory=dict)
    inputs: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its function and what the trainer must give it."""

    fn: LossFn
    prepare: StepPrepare | None = None
    needs_old_entropy: bool = False
    """pi_old's entropies at the loss tokens, from the pass before the first update."""
    counts_every_row: bool = False
    """Its normaliser counts rows without loss tokens, so they must reach the trainer."""
    metrics: tuple[str, ...] = ()
    """Statistics beyond the PPO ones it reports, averaged over loss tokens per update."""


_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(
    name: str,
    *,
    prepare: StepPrepare | None = None,
    needs_old_entropy: bool = False,
    counts_every_row: bool = False,
    metrics: tuple[str, ...] = (),
) -> Callable[[LossFn], LossFn]:
    """Decorator: make ``TrainerSettings(loss=name)`` train with this function."""

    def add(fn: LossFn) -> LossFn:
        entry = PolicyLoss(fn, prepare, needs_old_entropy, counts_every_row, metrics)
        if name in _POLICY_LOSSES and _POLICY_LOSSES[name].fn is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = entry
        return fn

    return add


def policy_loss(name: str, module: str | None = None) -> PolicyLoss:
    """The loss registered as ``name``, importing ``module`` first when given (where a loss
    defined outside the project registers itself)."""
    if module is not None:
        importlib.import_module(module)
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        known = ", ".join(sorted(_POLICY_LOSSES))
        raise ValueError(f"unknown policy loss {name!r}; registered: {known}") from None


@register_policy_loss("grpo")
def grpo_loss(ctx: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO-clip surrogate (`grpo.policy_loss`, DUET weights and the engine importance weights
    on it) plus ``kl_coef`` times the k3 KL to the reference, aggregated alike but unweighted."""
    pg_loss, stats = grpo.policy_loss(
        ctx.logp,
        ctx.old_logp,
        ctx.advantages,
        ctx.mask,
        clip_low=ctx.clip_low,
        clip_high=ctx.clip_high,
        agg=ctx.agg,
        weights=ctx.weights,
        max_len=ctx.max_len,
        token_weights=ctx.token_weights,
    )
    pg_loss = pg_loss * ctx.agg_share
    loss, kl = pg_loss, torch.zeros(())
    if ctx.kl_coef > 0:
        kl = grpo.kl_loss(ctx.logp, ctx.ref_logp, ctx.mask, ctx.agg, ctx.max_len) * ctx.agg_share
        loss = loss + ctx.kl_coef * kl
    return loss, {**stats, "pg_loss": pg_loss.detach(), "kl": kl.detach()}


def _entropy_cut(ctx: StepContext) -> dict[str, float]:
    """DRO's 80/20 threshold over every loss token of the step (`dro.entropy_threshold`)."""
    rho = ctx.options.get("rho_ent", dro.DEFAULT_RHO_ENT)
    return {"entropy_threshold": float(dro.entropy_threshold(ctx.old_entropy, rho))}


@register_policy_loss(
    "dro",
    prepare=_entropy_cut,
    needs_old_entropy=True,
    counts_every_row=True,
    metrics=("pg_token_frac",),
)
def dro_policy_loss(ctx: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO's loss (`dro.dro_loss`, arXiv:2506.13351 App. F.2): Dr.GRPO's normaliser over the
    step's sequences, the PG term only above the step's entropy threshold, the k3 KL weighted by
    ``kl_coef`` on every loss token."""
    loss, stats = dro.dro_loss(
        ctx.logp,
        ctx.old_logp,
        ctx.advantages,
        ctx.mask,
        ref_logp=ctx.ref_logp,
        entropy=ctx.old_entropy,
        beta=ctx.kl_coef,
        clip_low=ctx.clip_low,
        clip_high=ctx.clip_high,
        rho_ent=ctx.options.get("rho_ent", dro.DEFAULT_RHO_ENT),
        max_len=ctx.max_len,
        num_sequences=ctx.num_sequences,
        entropy_threshold=ctx.step["entropy_threshold"],
        token_weights=ctx.token_weights,
    )
    return loss, {**stats, "kl": stats["kl_loss"]}
