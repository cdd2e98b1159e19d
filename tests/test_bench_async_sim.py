"""bench/async_sim.py's timeline model: exact step times by hand for one engine, the asynchronous
schedule at staleness 0 equal to the synchronous one, never slower, and never staler than k."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # as when it runs as a script: its folder's harness on the path
SPEC = importlib.util.spec_from_file_location("bench_async_sim", BENCH / "async_sim.py")
sim = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = sim  # dataclasses look their module up there
SPEC.loader.exec_module(sim)

COSTS = sim.Costs(
    decode_step_s=0.01,
    decode_token_s=0.001,
    prefill_s=0.002,
    train_token_s=0.0001,
    train_sample_s=0.0,
    train_step_s=0.5,
    sync_s=0.2,
)
EXACT = 1e-12  # sums of a few exact decimal costs: only float rounding differs


def fixed(length: int, group_size: int) -> "sim.Lengths":
    return sim.Lengths(draw=lambda rng, n: np.full((n, group_size), length))


def lognormal(seed: int = 0) -> "sim.Lengths":
    draw = lambda rng, n: np.clip(np.rint(rng.lognormal(np.log(60), 0.8, (n, 4))), 1, 400)  # noqa: E731
    return sim.Lengths(draw=draw, seed=seed)


def test_one_engine_fixed_lengths_step_time_by_hand():
    # 2 groups x 2 samples of 4 tokens: prefill 4 x 0.002, 4 decode steps of 0.01 + 4 x 0.001;
    # train 0.5 + 16 tokens x 0.0001; sync 0.2
    step = 4 * 0.002 + 4 * (0.01 + 4 * 0.001) + (0.5 + 16 * 0.0001) + 0.2
    timeline = sim.simulate_sync(fixed(4, 2), sim.Layout(1, 2, 2), COSTS, steps=3)
    assert timeline.step_ends == pytest.approx([step, 2 * step, 3 * step], rel=EXACT)
    shares = timeline.window(warmup=1)
    assert shares["step_s"] == pytest.approx(step, rel=EXACT)
    assert shares["engine_busy"] == pytest.approx(0.064 / step, rel=EXACT)
    assert shares["trainer_idle"] == pytest.approx(1 - (0.5016 + 0.2) / step, rel=EXACT)


def test_an_engine_is_governed_by_its_longest_sample():
    # lengths 1 and 3: one step with both running, two with the long one alone
    seconds = sim.engine_seconds([np.array([3, 1])], COSTS)
    assert seconds == pytest.approx(2 * 0.002 + 0.012 + 2 * 0.011, rel=EXACT)


def test_async_one_step_ahead_by_hand():
    """k = 1, one group of one 10-token sample per step: groups 0 and 1 run together (decode
    steps of 0.012) and end at 0.124; then each step is training (0.501) + sync (0.2), while the
    next group (0.112 alone) is generated during the training."""
    timeline = sim.simulate_async(fixed(10, 1), sim.Layout(1, 1, 1), COSTS, 3, 1, partial=False)
    first = 0.004 + 10 * 0.012 + 0.501 + 0.2
    assert timeline.step_ends == pytest.approx([first, first + 0.701, first + 1.402], rel=EXACT)
    assert timeline.staleness == [0, 1, 1]


def test_partial_rollouts_sync_without_draining_by_hand():
    """Short training (0.051): without partial rollouts step 1's update waits for group 2 to
    end; with them the engine pauses mid-sample (4.4545 of 10 tokens), syncs, and continues."""
    costs = sim.Costs(0.01, 0.001, 0.002, 0.0001, 0.0, 0.05, 0.2)
    layout = sim.Layout(1, 1, 1)
    s0 = 0.004 + 10 * 0.012 + 0.051 + 0.2  # 0.375
    drained = sim.simulate_async(fixed(10, 1), layout, costs, 3, 1, partial=False)
    g2_end = s0 + 0.002 + 10 * 0.011  # 0.487: the update waits for it
    g3_end = g2_end + 0.2 + 0.002 + 10 * 0.011
    assert drained.step_ends == pytest.approx([s0, g2_end + 0.2, g3_end + 0.2], rel=EXACT)
    partial = sim.simulate_async(fixed(10, 1), layout, costs, 3, 1, partial=True)
    s1 = s0 + 0.051 + 0.2  # 0.626
    done = (s0 + 0.051 - (s0 + 0.002)) / 0.011  # tokens of group 2 before the pause
    s2 = s1 + 0.002 + (10 - done) * 0.012 + 0.051 + 0.2
    assert partial.step_ends == pytest.approx([s0, s1, s2], rel=EXACT)
    assert partial.staleness == [0, 1, 1]


@pytest.mark.parametrize("partial", [False, True])
def test_async_at_staleness_zero_is_the_synchronous_schedule(partial):
    layout = sim.Layout(engines=3, groups_per_step=5, group_size=4)
    sync = sim.simulate_sync(lognormal(), layout, COSTS, steps=6)
    async0 = sim.simulate_async(lognormal(), layout, COSTS, 6, 0, partial)
    assert async0.step_ends == pytest.approx(sync.step_ends, rel=1e-9)
    assert async0.engine_busy == pytest.approx(sync.engine_busy, rel=1e-9)
    assert async0.trainer_busy == pytest.approx(sync.trainer_busy, rel=1e-9)
    assert async0.staleness == [0] * 30 and async0.dropped == 0


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("partial", [False, True])
def test_async_is_never_slower_and_never_staler_than_k(k, partial):
    layout = sim.Layout(engines=4, groups_per_step=8, group_size=4)
    sync = sim.simulate_sync(lognormal(1), layout, COSTS, steps=10)
    stream = sim.simulate_async(lognormal(1), layout, COSTS, 10, k, partial)
    assert stream.step_ends[-1] <= sync.step_ends[-1]
    assert len(stream.staleness) == 10 * 8
    assert max(stream.staleness) <= k
    assert max(stream.staleness) >= 1  # the bound is used, not trivially met


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        sim.simulate_async(fixed(4, 1), sim.Layout(1, 1, 1), COSTS, 2, -1, False)
    with pytest.raises(ValueError):
        sim.Lengths(rows=np.array([[0, 3]]))
    with pytest.raises(IndexError):
        sim.simulate_sync(sim.Lengths(rows=np.array([[3]])), sim.Layout(1, 1, 1), COSTS, 2)


def test_fixed_lag_batches_one_step_ahead_by_hand():
    """k = 1, one 10-token sample per step: batch 0 (0.002 + 10 x 0.011) then step 0 (0.501 +
    0.2); batch 1 (version 0) runs during step 0, so every later step is training + sync."""
    timeline = sim.simulate_batches(fixed(10, 1), sim.Layout(1, 1, 1), COSTS, 3, 1)
    first = 0.002 + 10 * 0.011 + 0.501 + 0.2
    assert timeline.step_ends == pytest.approx([first, first + 0.701, first + 1.402], rel=EXACT)
    assert timeline.staleness == [0, 1, 1]


def test_fixed_lag_partial_batches_wait_for_the_next_version_by_hand():
    """k = 1, partial after 4 of 10 tokens: batch 1's head (version 0) runs during step 0, its
    tail (6 tokens, prefill recomputed) only once version 1 exists, at step 0's end."""
    timeline = sim.simulate_batches(fixed(10, 1), sim.Layout(1, 1, 1), COSTS, 2, 1, 4)
    batch0_head = 0.002 + 4 * 0.011
    batch0_tail = 0.002 + 6 * 0.011  # version 0 again (max(0, 0 - 1 + 1)): no wait
    s0 = batch0_head + batch0_tail + 0.501 + 0.2
    s1 = s0 + 0.002 + 6 * 0.011 + 0.501 + 0.2  # batch 1's tail after s0, then step 1
    assert timeline.step_ends == pytest.approx([s0, s1], rel=EXACT)


def test_fixed_lag_batches_at_staleness_zero_are_the_synchronous_schedule():
    layout = sim.Layout(engines=3, groups_per_step=5, group_size=4)
    sync = sim.simulate_sync(lognormal(), layout, COSTS, steps=6)
    batches = sim.simulate_batches(lognormal(), layout, COSTS, 6, 0)
    assert batches.step_ends == pytest.approx(sync.step_ends, rel=1e-9)
    assert batches.engine_busy == pytest.approx(sync.engine_busy, rel=1e-9)
    assert batches.staleness == [0] * 30


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fixed_lag_batches_are_never_slower_and_exactly_k_stale(k):
    layout = sim.Layout(engines=4, groups_per_step=8, group_size=4)
    sync = sim.simulate_sync(lognormal(1), layout, COSTS, steps=10)
    batches = sim.simulate_batches(lognormal(1), layout, COSTS, 10, k)
    assert batches.step_ends[-1] <= sync.step_ends[-1]
    assert batches.staleness == [min(t, k) for t in range(10) for _ in range(8)]
    # partial rollouts past every sample's length are the whole batches
    never = sim.simulate_batches(lognormal(1), layout, COSTS, 10, k, partial_tokens=10_000)
    assert never.step_ends == pytest.approx(batches.step_ends, rel=1e-9)
