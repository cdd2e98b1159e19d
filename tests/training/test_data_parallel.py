"""Splitting a training batch across data-parallel ranks: equal shares of every mini-batch,
balanced by token count, fillers that carry no loss and count nowhere."""

from __future__ import annotations

import torch

from rlvr.training.batch import build_batch
from rlvr.training.data_parallel import (
    mini_batch_bounds,
    shard_batch,
    shard_rows,
    shard_sequences,
    token_budget_rows,
)


def test_hand_values_two_ranks_two_mini_batches():
    # slices [0, 4) and [4, 7); each dealt longest first to the least-loaded rank with room
    assert mini_batch_bounds(7, 2) == [0, 4, 7]
    assert shard_rows([5, 9, 1, 7, 4, 2, 11], world=2, mini_batches=2) == [
        [1, 2, 6, None],
        [0, 3, 4, 5],
    ]


def test_every_row_once_equal_lengths_and_local_slices_match():
    costs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for world in (1, 2, 3, 4, 16):
        for mini in (1, 2, 3, 20):
            shards = shard_rows(costs, world, mini)
            flat = [r for s in shards for r in s if r is not None]
            assert sorted(flat) == list(range(len(costs)))
            assert len({len(s) for s in shards}) == 1
            # a rank's local mini-batch k holds only rows of the global mini-batch k
            bounds = mini_batch_bounds(len(costs), mini)
            local = mini_batch_bounds(len(shards[0]), mini)
            for k in range(len(bounds) - 1):
                for s in shards:
                    rows = [r for r in s[local[k] : local[k + 1]] if r is not None]
                    assert all(bounds[k] <= r < bounds[k + 1] for r in rows)


def test_one_rank_keeps_the_batch_as_is():
    assert shard_rows([4, 2, 7], world=1, mini_batches=1) == [[0, 1, 2]]


def test_fillers_have_no_loss_and_do_not_count():
    batch = build_batch([[1, 2], [3], [4, 5, 6]], [[7, 8], [9, 10, 11], [12]], pad_id=0)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5])
    shards, sources = shard_batch(batch, world=2, mini_batches=1)
    assert [len(s) for s in shards] == [2, 2]
    assert sum(int(s.counted_rows.sum()) for s in shards) == 3
    assert sum(s.num_loss_tokens for s in shards) == batch.num_loss_tokens
    for shard, rows in zip(shards, sources, strict=True):
        for i, row in enumerate(rows):
            if row is None:
                assert shard.filler[i] and not shard.response_mask[i].any()
                assert shard.advantages[i] == 0
            else:
                assert torch.equal(shard.advantages[i], batch.advantages[row])


def test_sequences_split_in_equal_chunks():
    assert shard_sequences(5, 2) == [[0, 1, 2], [3, 4, None]]
    assert shard_sequences(1, 3) == [[0], [None], [None]]
    assert shard_sequences(0, 2) == [[], []]


def test_token_budget_groups_rows_longest_first():
    lengths = [5, 9, 1, 7, 4, 2, 11]
    # Longest first: 11 alone (2 x 11 > 16), 9 alone (2 x 9 > 16), 7 takes 5 (2 x 7 = 14),
    # 4 starts anew (3 x 7 > 16) and takes 2 and 1 (3 x 4 = 12).
    assert token_budget_rows(lengths, 16) == [[6], [1], [3, 0], [4, 5, 2]]
    assert token_budget_rows(lengths, 100) == [[6, 1, 3, 0, 4, 5, 2]]
    assert token_budget_rows(lengths, 5) == [[6], [1], [3], [0], [4], [5, 2]]  # 11 > 5: alone
    assert sorted(r for g in token_budget_rows(lengths, 16) for r in g) == list(range(7))


def test_token_budget_splits_the_costliest_to_reach_a_count():
    """Another rank needs 4 micro-batches: halve the costliest (rows x longest) until 4."""
    lengths = [5, 9, 1, 7, 4, 2, 11]
    # [6 1 3 | 0 4 5 2] costs 3 x 11 = 33 and 4 x 5 = 20: the first is halved next
    assert token_budget_rows(lengths, 100, count=3) == [[6], [1, 3], [0, 4, 5, 2]]
    assert len(token_budget_rows(lengths, 100, count=7)) == 7
    assert len(token_budget_rows(lengths, 100, count=9)) == 7  # never more than the rows
