"""PromptSampler: each step's batch is a pure function of (seed, step), epochs cover the pool."""

import pytest

from rlvr.tasks.sampler import PromptSampler


def test_epoch_covers_pool_exactly_once():
    s = PromptSampler(list(range(10)), batch_size=5, seed=3)
    assert sorted(s.batch(0) + s.batch(1)) == list(range(10))
    assert sorted(s.batch(2) + s.batch(3)) == list(range(10))
    assert s.batch(0) + s.batch(1) != s.batch(2) + s.batch(3)  # reshuffled per epoch


def test_batches_straddle_epochs_and_are_stateless():
    s = PromptSampler(list(range(7)), batch_size=3, seed=1)
    seq = [x for step in range(7) for x in s.batch(step)]
    assert sorted(seq[:7]) == list(range(7))
    assert sorted(seq[7:14]) == list(range(7))
    fresh = PromptSampler(list(range(7)), batch_size=3, seed=1)
    assert fresh.batch(5) == s.batch(5)


def test_different_seeds_differ_and_errors():
    a = [PromptSampler(list(range(50)), 10, seed=0).batch(i) for i in range(5)]
    b = [PromptSampler(list(range(50)), 10, seed=1).batch(i) for i in range(5)]
    assert a != b
    with pytest.raises(ValueError, match="empty"):
        PromptSampler([], 2, 0)
