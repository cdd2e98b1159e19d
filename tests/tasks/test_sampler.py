"""PromptSampler: each step's batch is a pure function of (seed, step), epochs cover the pool."""

import numpy as np
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


def stream(s: PromptSampler, steps: int) -> list[int]:
    return [x for step in range(steps) for x in s.batch(step)]


@pytest.mark.parametrize(
    ("n", "batch_size"), [(8, 8), (9, 8), (10, 4), (12, 4), (13, 5), (18, 8), (36, 8), (60, 8)]
)
def test_no_step_holds_an_item_twice_and_every_epoch_covers_the_pool(n, batch_size):
    epochs = 40
    steps = epochs * n // batch_size
    s = PromptSampler(list(range(n)), batch_size, seed=5)
    for step in range(steps):
        items = s.batch(step)
        assert len(items) == batch_size and len(set(items)) == batch_size, (step, items)
    seq = stream(s, steps)
    for e in range(epochs):
        assert sorted(seq[e * n : (e + 1) * n]) == list(range(n)), e


def test_without_a_repeat_the_order_is_the_plain_concatenation_of_epochs():
    # Only a straddling batch that would repeat an item changes the order, so a large pool draws
    # exactly the seeded permutations one after the other (the order before the change).
    n, size, seed, epochs = 1001, 8, 0, 3
    plain = [int(i) for e in range(epochs) for i in np.random.default_rng([seed, e]).permutation(n)]
    steps = epochs * n // size
    batches = [plain[i * size : (i + 1) * size] for i in range(steps)]
    assert all(len(set(b)) == size for b in batches)  # this seed repeats nothing at 2 boundaries
    s = PromptSampler(list(range(n)), size, seed)
    assert [s.batch(step) for step in range(steps)] == batches


def test_batches_are_a_pure_function_of_seed_and_step():
    steps = 60
    s = PromptSampler(list(range(9)), 8, seed=2)
    forward = [s.batch(step) for step in range(steps)]
    backward = [s.batch(step) for step in reversed(range(steps))][::-1]
    assert forward == backward
    for step in (0, 7, 31, 59):  # a fresh instance, as after a resume, at any step
        assert PromptSampler(list(range(9)), 8, seed=2).batch(step) == forward[step]
    assert PromptSampler(list(range(9)), 8, seed=3).batch(1) != forward[1]


@pytest.mark.parametrize(("n", "batch_size"), [(7, 3), (8, 8), (13, 5), (18, 8)])
def test_epoch_of_matches_the_batches(n, batch_size):
    s = PromptSampler(list(range(n)), batch_size, seed=0)
    drawn = 0
    for step in range(30):
        # the step's first item is of its epoch, and it ends that epoch iff it holds the last item
        assert s.epoch_of(step) == drawn // n
        drawn += len(s.batch(step))
        assert (s.epoch_of(step + 1) > s.epoch_of(step)) == (drawn >= (s.epoch_of(step) + 1) * n)


def test_a_pool_smaller_than_a_step_is_refused():
    with pytest.raises(ValueError, match=r"holds 5 items, fewer than batch_size=8"):
        PromptSampler(list(range(5)), 8, seed=0)
