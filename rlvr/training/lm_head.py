"""Log-probs and entropies at the loss tokens only, the LM head applied in chunks.

A causal LM's forward ends in a [tokens x vocabulary] logits tensor (49,152 columns for SmolLM2),
most of a training step's memory, though the loss reads one log-prob per response token. Here the
model runs with its head on no position (transformers' ``logits_to_keep``), and the head is then
applied only to the hidden states that predict loss tokens, in chunks of ``chunk_tokens``. With
gradients on, each chunk keeps only its input and log-sum-exp and recomputes its logits in
backward (`FusedHeadLogprob`), so one chunk's logits are alive at a time (the fused linear
cross-entropy idea); under ZeRO-3 the chunks' logits are kept instead, as a frozen head's weight
is partitioned again by the time a recomputation runs.
Values and alignment are those of `rlvr.training.batch.token_logprobs` and `token_entropy` at
every loss token; every other position holds 0.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from rlvr.algorithms.nucleus import nucleus_log_mass
from rlvr.training.batch import TrainBatch, check_temperature
from rlvr.training.shared_prefix import pack_shared_prefixes


class TokenStats(NamedTuple):
    """What one pass computes at the loss tokens, each ``[b, t]`` (0 or False elsewhere)."""

    logp: torch.Tensor
    """log p_T(token): differentiable when grad is on."""
    entropy: torch.Tensor | None
    """Entropy of p_T (no grad), when asked."""
    nucleus_logp: torch.Tensor | None = None
    """log-prob (no grad) under p_T truncated to its top-p nucleus and renormalised, the
    distribution the engine samples from (`nucleus.nucleus_log_mass`), when asked."""
    outside: torch.Tensor | None = None
    """bool: the token lay outside that nucleus (probability 0 there; `nucleus_logp` is then
    meaningless and the engine importance weight 0)."""


def causal_lm(model: Any) -> Any:
    """The transformers causal LM inside a DeepSpeed engine (``.module``) and a PEFT wrapper
    (its LoRA layers stay in place, so `disable_adapter` still applies)."""
    module = getattr(model, "module", model)
    get_base = getattr(module, "get_base_model", None)
    return get_base() if get_base is not None else module


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """H = -sum p log p per row of normalised ``log_probs`` (one temporary of their size)."""
    return -log_probs.exp().mul_(log_probs).sum(-1)


def _chunk_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
    top_p: float,
) -> tuple[torch.Tensor, ...]:
    """Log-prob of each target and, without grad, the entropy (empty unless ``with_entropy``)
    and the top-p nucleus' log mass and outside flags (empty when ``top_p`` is 1), from
    ``hidden``, the head called as a module (ZeRO-3 gathers its weight in the call) and
    differentiated by autograd."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    with torch.no_grad():
        entropy = _entropy(logits - lse[:, None]) if with_entropy else logp.new_empty(0)
        return logp, entropy, *_nucleus(logits, targets, top_p)


def _nucleus(
    logits: torch.Tensor, targets: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`nucleus_log_mass` of tempered ``logits``, or two empty tensors when ``top_p`` is 1."""
    if top_p >= 1.0:
        return logits.new_empty(0), targets.new_empty(0, dtype=torch.bool)
    return nucleus_log_mass(logits, targets, top_p)


class FusedHeadLogprob(torch.autograd.Function):
    """Log-probs of ``targets`` under softmax(linear(hidden) / T), and their entropies, with a
    backward that recomputes the logits from ``hidden`` instead of keeping them.

    The gradient is written out: d log p(y) / d logits = onehot(y) - softmax, scaled by 1 / T,
    then through the linear map. Against autograd through a recomputed chunk this runs the
    elementwise work over [tokens x vocabulary] once per pass instead of through every op's
    saved tensors, and the entropy (no gradient) only in forward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, ...]:
        logits = _logits(hidden, weight, bias, temperature)
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        entropy = _entropy(logits.sub_(lse[:, None])) if with_entropy else logp.new_empty(0)
        log_mass, outside = _nucleus(logits, targets, top_p)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy, log_mass, outside)
        return logp, entropy, log_mass, outside

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor, *_non_differentiable: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grad_logits = _logits(hidden, weight, bias, ctx.temperature)
        grad_logits.sub_(lse[:, None]).exp_().mul_(-grad_logp[:, None])  # -g * softmax
        rows = torch.arange(len(targets), device=targets.device)
        grad_logits[rows, targets] += grad_logp
        if ctx.temperature != 1.0:
            grad_logits.div_(ctx.temperature)
        grad_logits = grad_logits.to(weight.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = grad_logits @ weight if need_hidden else None
        grad_weight = grad_logits.T @ hidden if need_weight else None
        grad_bias = grad_logits.sum(0) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """fp32 logits / ``temperature`` of the linear head, computed in the head's dtype."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def _fused_chunk_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Linear,
    temperature: float,
    with_entropy: bool,
    top_p: float,
) -> tuple[torch.Tensor, ...]:
    """`_chunk_stats` through `FusedHeadLogprob`."""
    return FusedHeadLogprob.apply(
        hidden, head.weight, head.bias, targets, temperature, with_entropy, top_p
    )


def loss_token_stats(
    model: Any,
    batch: TrainBatch,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool = True,
    recompute: bool = True,
    head_calls: int | None = None,
    shared_prefix: bool = False,
    top_p: float = 1.0,
) -> TokenStats:
    """Log-probs ``[b, t]`` (differentiable when grad is on) and entropies ``[b, t]`` (no grad;
    None without ``with_entropy``) of softmax(logits / ``temperature``) at
    ``batch.response_mask``, 0 elsewhere; with ``top_p`` < 1 also the nucleus log-probs.

    ``shared_prefix`` runs each prompt once for the rows that share it
    (`shared_prefix.pack_shared_prefixes`). ``recompute`` False keeps every chunk's logits for
    backward instead (ZeRO-3 partitions a frozen head's weight again before a recomputation
    runs). ``head_calls`` runs the head that many times, the chunks the loss tokens need and
    then empty ones: under ZeRO-3 every call gathers the head's weight collectively, so
    data-parallel ranks must call it equally often.
    """
    check_temperature(temperature)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    rows, cols = batch.response_mask.nonzero(as_tuple=True)
    if shared_prefix:
        packed = pack_shared_prefixes(batch, causal_lm(model).dtype)
        hidden = last_hidden_state(
            model, packed.input_ids, packed.attention_mask, packed.position_ids
        )
        predicting = hidden[packed.predicting]
    else:
        hidden = last_hidden_state(model, batch.input_ids, batch.attention_mask)
        predicting = hidden[rows, cols - 1]
    targets = batch.input_ids[rows, cols]
    needed = head_calls_needed(len(targets), chunk_tokens)
    if head_calls is not None and head_calls < needed:
        raise ValueError(f"head_calls={head_calls} but the loss tokens need {needed}")
    head = causal_lm(model).get_output_embeddings()
    chunks = []
    for i in range(needed if head_calls is None else head_calls):
        # Calls past the loss tokens take empty chunks; even one with no loss token at all keeps
        # a graph through every weight for the backward every micro-batch runs.
        span = slice(i * chunk_tokens, (i + 1) * chunk_tokens)
        args = (predicting[span], targets[span], head, temperature, with_entropy, top_p)
        if recompute and type(head) is torch.nn.Linear:
            chunks.append(_fused_chunk_stats(*args))
        elif recompute and torch.is_grad_enabled():
            chunks.append(checkpoint(_chunk_stats, *args, use_reentrant=False))
        else:
            chunks.append(_chunk_stats(*args))
    logp, entropy, log_mass, outside = (torch.cat(parts) for parts in zip(*chunks, strict=True))
    shape, device = batch.input_ids.shape, hidden.device

    def spread(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device).index_put((rows, cols), values)

    return TokenStats(
        spread(logp),
        spread(entropy) if with_entropy else None,
        spread(logp.detach() - log_mass) if top_p < 1.0 else None,
        spread(outside, torch.bool) if top_p < 1.0 else None,
    )


def last_hidden_state(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final norm's output (the head's input) at every position: the whole model runs (a
    DeepSpeed engine's forward, with its ZeRO-3 hooks) with its head on no position."""
    nowhere = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=nowhere,
    ).hidden_states[-1]


def head_calls_needed(loss_tokens: int, chunk_tokens: int) -> int:
    """Head calls over ``loss_tokens`` in chunks of ``chunk_tokens``: at least one, so that a
    micro-batch without loss tokens still has a graph through the head."""
    return max(1, -(-loss_tokens // chunk_tokens))
