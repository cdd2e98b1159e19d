"""Split one training batch across data-parallel ranks so that N ranks take the 1-rank update.

The trainer cuts its batch into ``mini_batches`` contiguous slices, one optimizer step each, and
normalises every loss by global counts. Giving each rank an equal share of every slice (balanced
by token count, evened out with filler rows that carry no loss and count nowhere) keeps each
global mini-batch the 1-rank one, and gives every rank the same number of micro-batches, which
ZeRO-3's per-forward parameter gathers require.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from rlvr.training.batch import TrainBatch


def mini_batch_bounds(n: int, mini_batches: int) -> list[int]:
    """Row bounds of the optimizer steps over ``n`` rows: ``min(mini_batches, n)`` contiguous,
    near-equal slices (whole GRPO groups stay together when the batch is in group order)."""
    count = min(mini_batches, n)
    return [round(i * n / count) for i in range(count + 1)]


def shard_rows(costs: Sequence[int], world: int, mini_batches: int) -> list[list[int | None]]:
    """Per rank, the source row of each of its rows (None: a filler), rank 0 first.

    Every mini-batch slice is dealt out longest row first to the least-loaded rank with a free
    slot; each rank gets the same number of rows per slice (the largest slice's share, ceil), so
    a rank's local slices are exactly its shares.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    bounds = mini_batch_bounds(len(costs), mini_batches)
    slots = max(
        (math.ceil((b - a) / world) for a, b in zip(bounds, bounds[1:], strict=False)), default=0
    )
    shards: list[list[int | None]] = [[] for _ in range(world)]
    for start, stop in zip(bounds, bounds[1:], strict=False):
        load = [0] * world
        taken: list[list[int]] = [[] for _ in range(world)]
        for row in sorted(range(start, stop), key=lambda r: (-costs[r], r)):
            rank = min((r for r in range(world) if len(taken[r]) < slots), key=lambda r: load[r])
            taken[rank].append(row)
            load[rank] += costs[row]
        for rank in range(world):
            shards[rank] += sorted(taken[rank]) + [None] * (slots - len(taken[rank]))
    return shards


def shard_batch(
    batch: TrainBatch, world: int, mini_batches: int
) -> tuple[list[TrainBatch], list[list[int | None]]]:
    """`shard_rows` applied to ``batch``, costed by attended tokens: each rank's batch, and the
    source rows it holds. Fillers copy the shortest row with no loss token, zero advantage and
    weight, and ``filler`` set."""
    costs = batch.attention_mask.sum(dim=1).tolist()
    shortest = min(range(len(batch)), key=lambda r: costs[r])
    sources = shard_rows(costs, world, mini_batches)
    out = []
    for rows in sources:
        part = batch.select([shortest if r is None else r for r in rows])
        filler = torch.tensor([r is None for r in rows], dtype=torch.bool)
        if batch.filler is not None:
            filler |= part.filler
        keep = ~filler
        part = replace(
            part,
            response_mask=part.response_mask & keep[:, None],
            advantages=None if part.advantages is None else part.advantages * keep,
            weights=None if part.weights is None else part.weights * keep,
            filler=filler,
        )
        out.append(part)
    return out, sources


def token_budget_rows(
    lengths: Sequence[int], max_tokens: int, count: int | None = None
) -> list[list[int]]:
    """Rows of each micro-batch under a budget of ``max_tokens`` padded tokens (rows x the
    longest row's length), verl's dynamic batch size: rows longest first, each micro-batch filled
    while it fits (a row longer than the budget goes alone), so short rows are not padded to long
    ones. ``count`` (at most the number of rows) asks for at least that many micro-batches, by
    halving the costliest: every data-parallel rank runs as many (ZeRO-3 gathers per forward).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    groups: list[list[int]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    want = min(count or 0, len(lengths))
    while len(groups) < want:
        splittable = [g for g in groups if len(g) > 1]
        largest = max(splittable, key=lambda g: (len(g) * lengths[g[0]], len(g)))
        at = groups.index(largest)
        half = len(largest) // 2
        groups[at : at + 1] = [largest[:half], largest[half:]]
    return groups


def shard_sequences(count: int, world: int) -> list[list[int | None]]:
    """Per rank, the sequences it scores (None: a filler): contiguous near-equal chunks, padded
    to one length so every rank runs the same number of forwards."""
    per_rank = math.ceil(count / world) if count else 0
    return [
        [i if i < count else None for i in range(r * per_rank, (r + 1) * per_rank)]
        for r in range(world)
    ]
