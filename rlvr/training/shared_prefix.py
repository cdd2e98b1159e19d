"""Shared-prefix packing: the rows of a micro-batch that share a prompt run as one sequence.

A GRPO group is G responses to one prompt, and a plain forward runs that prompt G times. Packed,
a group is one sequence, the prompt once and then each response, every response at the positions
it has in its own row and under a mask that lets it see the prompt and its own earlier tokens
only. Each response token then has exactly the context and position it has alone, so log-probs,
losses and gradients are those of the plain forward (up to float summation order), for
(G - 1) x prompt fewer tokens of work (Prefix Grouper's shared-prefix forward, arXiv:2506.05433,
here as one block mask).

The hidden state that predicts a response's first token is the prompt's last one, shared by the
group: `PackedGroups.predicting` maps every loss token to the packed position whose hidden state
predicts it, so the LM head (`rlvr.training.lm_head`) reads the packed hidden states directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from rlvr.training.batch import TrainBatch

BLOCK_MASK_ATTENTION = ("sdpa", "eager")
"""transformers attention implementations that take an arbitrary 4D additive mask."""


@dataclass
class PackedGroups:
    """One packed sequence per prompt of a micro-batch, right-padded to one length."""

    input_ids: torch.Tensor  # [G, L] long
    position_ids: torch.Tensor  # [G, L] long, each response continuing its prompt's positions
    attention_mask: torch.Tensor  # [G, 1, L, L] additive: 0 where a query may attend, else min
    predicting: tuple[torch.Tensor, torch.Tensor]
    """(pack, position) of the hidden state predicting each loss token, in the order of
    ``batch.response_mask.nonzero()``."""


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window of a model that has one on any layer (Mistral, Gemma, Qwen2 with
    use_sliding_window), else None. A packed response sits further from earlier tokens than in
    its own row, so a window would cut its context differently."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def longest_pack(batch: TrainBatch) -> int:
    """Tokens of the longest packed sequence of ``batch`` (`packed_length` of each prompt group)."""
    return max(packed_length(batch, rows) for rows in prompt_groups(batch))


def prompt_groups(batch: TrainBatch) -> list[list[int]]:
    """Rows sharing one prompt (same ``prompt_lens`` and the same prompt ids), in first-seen
    order, rows in batch order within each."""
    if batch.prompt_lens is None:
        raise ValueError("shared-prefix packing needs the batch's prompt_lens")
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, p in enumerate(batch.prompt_lens.tolist()):
        groups.setdefault(tuple(batch.input_ids[row, :p].tolist()), []).append(row)
    return list(groups.values())


def packed_length(batch: TrainBatch, rows: list[int]) -> int:
    """Tokens of ``rows`` packed behind one prompt: the prompt once, then every response."""
    p = int(batch.prompt_lens[rows[0]])
    return p + sum(int(batch.attention_mask[r].sum()) - p for r in rows)


def pack_shared_prefixes(batch: TrainBatch, mask_dtype: torch.dtype) -> PackedGroups:
    """Pack every prompt group of ``batch`` (`prompt_groups`) into one sequence.

    A padding position attends to itself only, so no softmax row is empty; nothing reads it.
    """
    groups = prompt_groups(batch)
    lengths = [packed_length(batch, rows) for rows in groups]
    width = max(lengths)
    device = batch.input_ids.device
    input_ids = torch.zeros((len(groups), width), dtype=torch.long, device=device)
    position_ids = torch.zeros_like(input_ids)
    allowed = torch.eye(width, dtype=torch.bool, device=device).repeat(len(groups), 1, 1)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    # where, in its pack, each (row, column) token of the batch sits
    pack_of = torch.zeros(batch.input_ids.shape, dtype=torch.long, device=device)
    place = torch.zeros(batch.input_ids.shape, dtype=torch.long, device=device)
    for g, rows in enumerate(groups):
        p = int(batch.prompt_lens[rows[0]])
        input_ids[g, :p] = batch.input_ids[rows[0], :p]
        position_ids[g, :p] = torch.arange(p, device=device)
        allowed[g, :p, :p] = causal[:p, :p]
        start = p
        for row in rows:
            r = int(batch.attention_mask[row].sum()) - p
            span = slice(start, start + r)
            input_ids[g, span] = batch.input_ids[row, p : p + r]
            position_ids[g, span] = torch.arange(p, p + r, device=device)
            allowed[g, span, :p] = True
            allowed[g, span, span] = causal[:r, :r]
            pack_of[row] = g
            place[row, :p] = torch.arange(p, device=device)
            place[row, p : p + r] = torch.arange(start, start + r, device=device)
            start += r
    rows, cols = batch.response_mask.nonzero(as_tuple=True)
    mask = torch.zeros(allowed.shape, dtype=mask_dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(mask_dtype).min)
    return PackedGroups(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask[:, None],
        predicting=(pack_of[rows, cols], place[rows, cols - 1]),
    )
