"""The training batch (prompt + response token ids, right-padded, with the loss mask) and the
per-token log-prob / entropy functions that define its alignment.

Log-prob alignment used everywhere in `rlvr.training`: ``logp[:, t]`` is
``log p(input_ids[:, t] | input_ids[:, :t])``. Position 0 has no prediction; it holds 0 and is never in
``response_mask``.

Log-probs and entropies are those of the sampling distribution at temperature T, softmax(logits / T):
the distribution the rollouts were drawn from (verl, OpenRLHF and TRL divide the logits the same
way). T = 1 gives the model's own distribution, which DRO's R3 scoring needs (its reward
is the policy's own certainty of the reference answer, arXiv:2506.13351).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from rlvr.algorithms.nucleus import nucleus_log_mass


@dataclass
class TrainBatch:
    """One batch of B sequences of length T (prompt then response, right-padded with the pad id).

        ``response_mask`` is True exactly on response tokens that receive loss (never on prompt or
        padding tokens). The optional per-sequence ``advantages`` / ``weights`` (``[B]``) and per-token
        ``old_logp`` / ``ref_logp`` (``[B, T]``, same alignment as the module docstring) are filled in by
        the caller or by the trainer before the loss. ``rollout_logp`` holds the generation engine's
        log-prob of each sampled response token (same alignment; 0 elsewhere), for the engine
        importance correction, and ``forced`` the tokens it did not draw (a stop rule's forced EOS),
    which that correction leaves out. A Tandem batch also carries ``authorship``, which the policy turns into
        its senior-only loss mask. ``filler`` marks rows a data-parallel split added so that every rank
        holds as many rows (`rlvr.training.data_parallel`): they have no loss token and count in no
        denominator. ``prompt_lens`` lets rows that share a prompt run it once
        (`rlvr.training.shared_prefix`). The ``old_*`` fields are the trainer's own record of its
        old-policy pass (`PolicyTrainer.train_step`), so every update of a step uses the same values.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 on prompt + response tokens
    response_mask: torch.Tensor  # [B, T] bool
    advantages: torch.Tensor | None = None  # [B] float
    weights: torch.Tensor | None = None  # [B] float
    old_logp: torch.Tensor | None = None  # [B, T] float
    ref_logp: torch.Tensor | None = None  # [B, T] float
    rollout_logp: torch.Tensor | None = None  # [B, T] float, the engine's sampled-token log-probs
    forced: torch.Tensor | None = None  # [B, T] bool, tokens a stop rule forced (no draw)
    authorship: torch.Tensor | None = None  # [B, T] long, Tandem: 1 where the senior wrote
    filler: torch.Tensor | None = None  # [B] bool, rows that only even out data-parallel shards
    prompt_lens: torch.Tensor | None = None  # [B] long, prompt tokens at the start of each row
    # What the trainer's old-policy pass measured, for every update of a step:
    old_entropy: torch.Tensor | None = None  # [B, T] float, entropy of pi_old (DRO's 80/20 cut)
    old_nucleus_logp: torch.Tensor | None = None  # [B, T] float, pi_old within the engine's top-p
    old_outside: torch.Tensor | None = None  # [B, T] bool, token outside pi_old's top-p nucleus
    # The method's per-step scalars for its loss (`rlvr.training.losses.LossContext.inputs`):
    loss_inputs: dict[str, float] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def counted_rows(self) -> torch.Tensor:
        """[B] bool: rows that count as sequences in a loss normaliser (all but fillers)."""
        if self.filler is None:
            return torch.ones(len(self), dtype=torch.bool)
        return ~self.filler

    @property
    def num_loss_tokens(self) -> int:
        """Number of tokens that receive loss (the token-mean denominator)."""
        return int(self.response_mask.sum())

    def micro_batch(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop``, with trailing columns that are padding in every row cut off.

        Cutting right padding never changes a result (attention is causal and padding is masked),
        and it keeps micro-batches of short sequences cheap.
        """
        rows = slice(start, stop)
        width = int(self.attention_mask[rows].sum(dim=1).max())
        cols = slice(0, max(width, 1))
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, torch.Tensor):
                out[f.name] = value
            elif value.dim() == 1:
                out[f.name] = value[rows]
            else:
                out[f.name] = value[rows, cols]
        return TrainBatch(**out)

    def rows(self, rows: list[int]) -> TrainBatch:
        """A micro-batch of the given rows, in that order, trailing all-padding columns cut off."""
        return self.select(rows).micro_batch(0, len(rows))

    def select(self, rows: list[int]) -> TrainBatch:
        """The given rows, in order (e.g. only those with loss tokens)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        picked = {
            f.name: getattr(self, f.name)[index]
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **picked)

    def to(self, device: torch.device | str) -> TrainBatch:
        """A copy with every tensor moved to ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def rows_that_train(batch: TrainBatch, loss_agg: str, counts_every_row: bool = False) -> list[int]:
    """Rows a train step must see: those with loss tokens, or every row when the loss normaliser
    counts rows without any (Dr.GRPO's seq-mean-token-sum-norm, or `counts_every_row`, e.g. the
    DRO loss). Elsewhere a row without loss tokens adds nothing to the loss or its denominators,
    so leaving it out (DUET's aborted rollouts) saves its forward and backward and changes
    nothing."""
    if counts_every_row or loss_agg == "seq-mean-token-sum-norm":
        return list(range(len(batch)))
    return torch.nonzero(batch.response_mask.any(dim=1)).flatten().tolist()


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    loss_masks: list[list[bool]] | None = None,
    rollout_logprobs: list[list[float]] | None = None,
    forced_eos: Sequence[int | None] | None = None,
) -> TrainBatch:
    """Pack prompt/response token ids into a right-padded `TrainBatch`.

    ``loss_masks[i]`` (one flag per response token) drops response tokens from the loss, e.g. the
    junior's tokens in a Tandem rollout; by default every response token gets loss.
    ``rollout_logprobs[i]`` (one per response token) are the engine's log-probs of the sampled
    tokens, carried as ``rollout_logp``; ``forced_eos[i]``, the index in response i of the EOS a
    stop rule forced (None: none was), marks it in ``forced``.
    """
    if not prompts:
        raise ValueError("empty batch")
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if loss_masks is not None and len(loss_masks) != len(responses):
        raise ValueError(f"{len(loss_masks)} loss masks but {len(responses)} responses")
    if rollout_logprobs is not None and len(rollout_logprobs) != len(responses):
        raise ValueError(f"{len(rollout_logprobs)} log-prob rows but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        # Position 0 has no prediction, so a response needs at least one prompt token before it.
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    n = len(prompts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.bool)
    rollout_logp = None if rollout_logprobs is None else torch.zeros((n, width))
    forced = None if forced_eos is None else torch.zeros((n, width), dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        p, r = len(prompt), len(response)
        input_ids[i, : p + r] = torch.tensor(prompt + response, dtype=torch.long)
        attention_mask[i, : p + r] = 1
        if loss_masks is None:
            response_mask[i, p : p + r] = True
        else:
            if len(loss_masks[i]) != r:
                raise ValueError(
                    f"loss mask {i} has {len(loss_masks[i])} flags for {r} response tokens"
                )
            response_mask[i, p : p + r] = torch.tensor(loss_masks[i], dtype=torch.bool)
        if rollout_logp is not None:
            if len(rollout_logprobs[i]) != r:
                raise ValueError(
                    f"log-prob row {i} has {len(rollout_logprobs[i])} values for {r} response tokens"
                )
            rollout_logp[i, p : p + r] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
        if forced is not None and forced_eos[i] is not None:
            if not 0 <= forced_eos[i] < r:
                raise ValueError(f"forced EOS at {forced_eos[i]} in response {i} of {r} tokens")
            forced[i, p + forced_eos[i]] = True
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rollout_logp=rollout_logp,
        forced=forced,
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
    )


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs of each token given its prefix: ``[b, t, V], [b, t] -> [b, t]`` float32.

    ``out[:, t] = log p_T(input_ids[:, t] | input_ids[:, :t])`` from ``logits[:, t - 1] / T``;
    ``out[:, 0]`` is 0 (no prediction).
    """
    check_temperature(temperature)
    # gather - logsumexp keeps no [b, t, V] log-softmax alive for backward (the logits suffice).
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) predicting each token, aligned like `token_logprobs`."""
    check_temperature(temperature)
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))


@torch.no_grad()
def token_nucleus_log_mass(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """At each ``mask`` token, aligned like `token_logprobs`: the log mass of the top-p nucleus
    of softmax(logits / T) predicting it, and whether the token lies outside that nucleus
    (`nucleus.nucleus_log_mass`); 0 and False elsewhere. ``[b, t, V], [b, t], [b, t]``."""
    check_temperature(temperature)
    rows, cols = mask.nonzero(as_tuple=True)
    log_mass, outside = nucleus_log_mass(
        logits[rows, cols - 1].float() / temperature, input_ids[rows, cols], top_p
    )
    out = torch.zeros(input_ids.shape, device=logits.device)
    flags = torch.zeros(input_ids.shape, dtype=torch.bool, device=logits.device)
    return out.index_put_((rows, cols), log_mass), flags.index_put_((rows, cols), outside)


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
