"""DUET's pure parts (arXiv:2605.08441) against hand-computed values and CPU-only checks: the
allocation, the surrogate state, markers and the stop rule on char-level streams, weights and
advantages, and exact unbiasedness on an enumerable toy policy (Theorem 3, App. A.2.6)."""

import itertools
import json
import math

import numpy as np
import pytest

from rlvr.algorithms.duet import (
    LengthWindow,
    PromptState,
    StopController,
    StopControllerFactory,
    allocate,
    bisect_log_lambda,
    calibration_chi2,
    coin,
    counts_at,
    duet_advantages,
    has_marker,
    make_divisible,
    neyman_allocation,
    plan_step,
    rollout_seed,
    rollout_weights,
    stratification,
    token_budget,
    variance,
)
from rlvr.generation.base import StopRule
from rlvr.generation.stop_rules import StopRuleTracker

# ---------------------------------------------------------------- A. allocation


def test_neyman_closed_form_meets_budget_and_beats_every_feasible_allocation():
    rng = np.random.default_rng(0)
    sigma = rng.uniform(0.1, 5.0, 20)
    lengths = rng.uniform(50, 3000, 20)
    budget = 123_456.0
    n_star, lam = neyman_allocation(sigma, lengths, budget)
    total = np.sum(sigma * np.sqrt(lengths))
    assert np.sum(n_star * lengths) == pytest.approx(budget, rel=1e-12)
    assert lam == pytest.approx((total / budget) ** 2, rel=1e-12)
    assert variance(sigma, n_star) == pytest.approx(total**2 / budget, rel=1e-12)
    assert variance(sigma, n_star) == pytest.approx(lam * budget, rel=1e-12)
    # Random feasible allocations on the budget plane: token shares from a Dirichlet.
    shares = rng.dirichlet(np.ones(20), size=1000)
    v_random = np.sum(sigma**2 / (shares * budget / lengths), axis=1)
    assert (v_random >= variance(sigma, n_star) * (1 - 1e-12)).all()


def test_bisection_recovers_the_continuous_dual():
    rng = np.random.default_rng(1)
    s, lengths, budget = rng.uniform(0.5, 3, 16), rng.uniform(100, 900, 16), 40_000.0
    total = np.sum(s * np.sqrt(lengths))
    center = 2 * math.log(total / budget)
    # n_min = 0, n_max = inf, no rounding: Phi(lambda) = S / sqrt(lambda).
    lam = bisect_log_lambda(
        lambda x: float(np.sum(s / np.sqrt(x * lengths) * lengths)),
        budget,
        center - 20,
        center + 20,
    )
    assert lam == pytest.approx((total / budget) ** 2, rel=1e-9)


def test_hand_computed_allocation_is_a_step_of_phi():
    # u = 1 / (10 sqrt(lambda)): counts (round(u), round(u), round(4u)) cost 100, 400, 100 each.
    # At u = 1.5 they are (2, 2, 6) -> 1600 > 1500; just below, (1, 1, 6) -> 1100. So
    # lambda* = 1 / (100 * 1.5^2) = 1/225 and the 400 tokens of slack cannot be used.
    n, lam = allocate([1.0, 2.0, 4.0], [100.0, 400.0, 100.0], 1500.0)
    np.testing.assert_array_equal(n, [1, 1, 6])
    assert lam == pytest.approx(1 / 225, rel=1e-9)
    # world 3: 8 rollouts -> take from the largest count twice -> (1, 1, 4).
    n3, lam3 = allocate([1.0, 2.0, 4.0], [100.0, 400.0, 100.0], 1500.0, world_size=3)
    np.testing.assert_array_equal(n3, [1, 1, 4])
    assert lam3 == lam


@pytest.mark.parametrize(("b", "expected"), [(1.0, 8), (0.5, 4), (0.25, 2)])
def test_equal_prompts_get_n_ref_times_b(b, expected):
    lengths = np.full(128, 500.0)
    n, lam = allocate(np.full(128, 1.0), lengths, token_budget(lengths, b))
    np.testing.assert_array_equal(n, np.full(128, expected))
    # Boundary where 1 / sqrt(500 lambda) = expected + 1/2 (half rounds to the even `expected`).
    assert lam == pytest.approx(1 / (500 * (expected + 0.5) ** 2), rel=1e-9)


def test_phi_is_monotone_and_counts_move_the_right_way():
    rng = np.random.default_rng(2)
    s, lengths = rng.uniform(0.1, 10, 30), rng.uniform(50, 2000, 30)
    lams = np.exp(np.linspace(-15, 5, 400))
    phi = [float(counts_at(x, s, lengths) @ lengths) for x in lams]
    assert all(a >= b for a, b in itertools.pairwise(phi))
    for lam in (1e-5, 1e-3, 1e-2):
        base = counts_at(lam, s, lengths)
        more_s = counts_at(lam, s * np.linspace(1, 3, 30), lengths)
        more_l = counts_at(lam, s, lengths * np.linspace(1, 3, 30))
        assert (more_s >= base).all() and (more_l <= base).all()


def test_scaling_the_surrogate_scales_only_the_dual():
    rng = np.random.default_rng(3)
    s, lengths = rng.uniform(0.1, 10, 40), rng.uniform(50, 2000, 40)
    budget = token_budget(lengths, 0.5)
    n, lam = allocate(s, lengths, budget)
    for c in (0.01, 7.0, 1e4):
        n_c, lam_c = allocate(s * c, lengths, budget)
        np.testing.assert_array_equal(n_c, n)
        assert lam_c == pytest.approx(lam * c**2, rel=1e-9)


def test_allocation_invariants_on_random_instances():
    rng = np.random.default_rng(4)
    for _ in range(300):
        m = int(rng.integers(1, 60))
        s = rng.exponential(2.0, m) * (rng.random(m) > 0.2)  # some zero surrogates
        lengths = rng.uniform(20, 3072, m)
        budget = token_budget(lengths, float(rng.choice([0.1, 0.25, 0.5, 1.0, 3.0])))
        n_min, n_max = int(rng.integers(1, 3)), int(rng.integers(4, 33))
        world = int(rng.choice([1, 2, 4, 8]))
        n, lam = allocate(s, lengths, budget, n_min, n_max, world)
        assert n.dtype == np.int64 and n.shape == (m,)
        assert (n >= n_min).all() and (n <= n_max).all()
        assert n.sum() % world == 0
        cost, floor_cost = float(n @ lengths), float(np.full(m, n_min) @ lengths)
        if world == 1 and floor_cost <= budget:
            assert cost <= budget
        assert cost < max(budget, floor_cost) + world * lengths.max()
        n2, lam2 = allocate(list(s), list(lengths), budget, n_min, n_max, world)
        np.testing.assert_array_equal(n2, n)
        assert lam2 == lam


def test_degenerate_inputs():
    # Every surrogate 0 (frozen p5 floor of 0, all groups degenerate): all counts at n_min.
    n, lam = allocate([0.0, 0.0, 0.0], [10.0, 20.0, 30.0], 1000.0)
    np.testing.assert_array_equal(n, [1, 1, 1])
    assert lam == 0.0
    # A budget below n_min everywhere: n_min, whatever the surrogate.
    n, _ = allocate([5.0, 1.0], [100.0, 100.0], 150.0)
    np.testing.assert_array_equal(n, [1, 1])
    # A budget above n_max everywhere: n_max.
    n, _ = allocate([5.0, 1.0], [100.0, 100.0], 1e9, n_max=32)
    np.testing.assert_array_equal(n, [32, 32])
    with pytest.raises(ValueError):
        allocate([1.0], [0.0], 10.0)
    with pytest.raises(ValueError):
        allocate([-1.0], [10.0], 10.0)
    with pytest.raises(ValueError):
        allocate([1.0], [10.0], 10.0, n_min=0)


def test_make_divisible_takes_from_the_largest_then_pads_the_smallest():
    # 14 -> take from the first 5 (ties by index), then from the other 5 -> 12.
    np.testing.assert_array_equal(make_divisible([3, 5, 5, 1], 4), [3, 4, 4, 1])
    np.testing.assert_array_equal(make_divisible([2, 2, 1], 2), [1, 2, 1])
    # Everything at n_min: pad the smallest, lowest index first (may exceed the budget).
    np.testing.assert_array_equal(make_divisible([1, 1, 1], 2), [2, 1, 1])
    np.testing.assert_array_equal(make_divisible([1, 1, 1], 5), [2, 2, 1])
    np.testing.assert_array_equal(make_divisible([1, 1], 5), [3, 2])
    with pytest.raises(ValueError):
        make_divisible([2, 2, 2], 4, n_min=2, n_max=2)


def test_corollary_and_theorem_2_identity():
    rng = np.random.default_rng(5)
    for _ in range(50):
        sigma, lengths = rng.uniform(0.2, 4, 25), rng.uniform(50, 3000, 25)
        budget = 2e5
        n_star, _ = neyman_allocation(sigma, lengths, budget)
        v_star = variance(sigma, n_star)
        v_unif = variance(sigma, np.full(25, budget / lengths.sum()))
        assert v_unif >= v_star * (1 - 1e-12)
        # Plug-in allocation from a miscalibrated surrogate, with the true lengths.
        s_hat = sigma * rng.uniform(0.3, 3, 25)
        n_s, _ = neyman_allocation(s_hat, lengths, budget)
        w = sigma * np.sqrt(lengths) / np.sum(sigma * np.sqrt(lengths))
        r = s_hat / sigma
        e_r, e_inv = np.sum(w * r), np.sum(w / r)
        assert variance(sigma, n_s) == pytest.approx(v_star * e_r * e_inv, rel=1e-10)
        chi2_w = np.sum(w * (r - 1) ** 2)
        assert e_r * e_inv - 1 <= chi2_w / r.min() ** 2 + 1e-12
    # Equality iff sigma / sqrt(L) is constant.
    lengths = np.array([100.0, 400.0, 900.0])
    sigma = 0.5 * np.sqrt(lengths)
    n_star, _ = neyman_allocation(sigma, lengths, 1e4)
    v_unif = variance(sigma, np.full(3, 1e4 / lengths.sum()))
    assert v_unif == pytest.approx(variance(sigma, n_star), rel=1e-12)


def _best_integer_variance(sigma, lengths, budget):
    """Brute force over (n0, n1); n2 is then the most the budget allows (V falls in n2)."""
    n0 = np.arange(1, int(budget // lengths[0]) + 1)[:, None]
    n1 = np.arange(1, int(budget // lengths[1]) + 1)[None, :]
    n2 = np.floor((budget - n0 * lengths[0] - n1 * lengths[1]) / lengths[2])
    v = sigma[0] ** 2 / n0 + sigma[1] ** 2 / n1 + sigma[2] ** 2 / np.maximum(n2, 1)
    return float(np.where(n2 >= 1, v, np.inf).min())


def test_integer_gap_shrinks_with_the_budget():
    sigma, lengths = np.array([3.0, 1.0, 2.0]), np.array([50.0, 100.0, 200.0])
    budgets = [800, 1600, 3200, 6400, 12800, 25600, 51200]
    excess = []
    for budget in budgets:
        n, _ = allocate(sigma, lengths, budget, n_max=10**6)
        assert (neyman_allocation(sigma, lengths, budget)[0] >= 1).all()
        excess.append(variance(sigma, n) / _best_integer_variance(sigma, lengths, budget) - 1)
    assert min(excess) >= -1e-12
    # O(M L_max / B): the excess times B / (M L_max) stays below 1.
    assert all(e * b / (3 * 200) < 1 for e, b in zip(excess, budgets, strict=True))
    assert max(excess[4:]) < max(excess[:4])


# ---------------------------------------------------------------- B. surrogate state


def test_hand_computed_surrogate_and_lengths():
    state = PromptState()
    # Prompt 7: kept rollouts g = A * logp = (-10, 20, -2); the aborted one is ignored.
    observed = state.update(
        [7, 7, 7, 7],
        advantages=[1.0, -1.0, 0.5, 3.0],
        logprob_sums=[-10.0, -20.0, -4.0, -99.0],
        lengths=[100, 200, 300, 4000],
        kept=[True, True, True, False],
    )
    # Population std: mean 8/3, mean of squares 168 -> variance 1448/9.
    assert observed == {7: pytest.approx(math.sqrt(1448) / 3, rel=1e-14)}
    assert state.observed(7) == {
        "sigma": pytest.approx(math.sqrt(1448) / 3, rel=1e-14),
        "k": 1,
        "length": 200.0,
        "n_lengths": 3,
        "visits": 1,
    }
    assert state.s_hat(7) == pytest.approx(math.sqrt(1448) / 3, rel=1e-14)
    assert state.l_hat(7, cold_length=999.0) == 200.0
    assert state.s_hat(8) == 0.01 and state.l_hat(8, cold_length=999.0) == 999.0


def test_all_equal_rewards_give_a_zero_surrogate_exactly():
    adv, _ = duet_advantages([1.0, 1.0, 1.0], [3], np.ones(3))
    state = PromptState()
    observed = state.update(["q"] * 3, adv, [-5.0, -17.0, -3.0], [10, 20, 30], [True] * 3)
    assert observed == {"q": 0.0}
    assert state.observed("q")["sigma"] == 0.0 and state.observed("q")["k"] == 1


def test_fewer_than_two_kept_leaves_the_surrogate_alone():
    state = PromptState()
    state.update([1, 1], [1.0, -1.0], [-2.0, -4.0], [10, 30], [True, True])
    before = state.observed(1)
    assert (
        state.update(
            [1, 1, 2], [1.0, -1.0, 1.0], [-8.0, -1.0, -1.0], [50, 60, 70], [True, False, True]
        )
        == {}
    )
    after = state.observed(1)
    assert (after["sigma"], after["k"]) == (before["sigma"], before["k"])
    # Kept lengths still count (Alg. 1 lines 50-51): (10 + 30 + 50) / 3; visits count every
    # appearance.
    assert after["length"] == 30.0 and after["n_lengths"] == 3 and after["visits"] == 2
    assert state.observed(2)["k"] == 0 and state.s_hat(2) == 0.01


def test_running_mean_is_the_arithmetic_mean_of_observations():
    rng = np.random.default_rng(6)
    state = PromptState()
    seen = []
    for _ in range(25):
        adv, logp = rng.normal(size=4), rng.normal(-50, 10, size=4)
        seen.append(np.std(adv * logp))
        state.update([3] * 4, adv, logp, [1, 2, 3, 4], [True] * 4)
    assert state.observed(3)["sigma"] == pytest.approx(np.mean(seen), rel=1e-12)
    assert state.observed(3)["k"] == 25


def test_floor_is_fixed_in_epoch_one_then_frozen_at_p5():
    state = PromptState()
    # 21 prompts with g = (2q, 0), so sigma_obs = q: the linear 5th percentile is exactly 1.
    for q in range(21):
        state.update([q, q], [1.0, 0.0], [2.0 * q, -7.0], [5, 5], [True, True])
    assert [state.observed(q)["sigma"] for q in (0, 3, 20)] == [0.0, 3.0, 20.0]
    assert state.s_floor == 0.01 and state.s_hat(0) == 0.01
    state.end_epoch()
    # The percentile interpolates at index 0.05 * 20: 1 up to rounding, not by construction.
    floor = state.s_floor
    assert floor == pytest.approx(1.0, abs=1e-12) and state.floor_frozen and state.epoch == 2
    assert state.s_hat(0) == floor and state.s_hat(3) == 3.0 and state.s_hat(99) == floor
    state.update([50, 50], [1.0, 0.0], [-0.1, -7.0], [5, 5], [True, True])
    state.end_epoch()
    assert state.s_floor == floor and state.epoch == 3  # frozen: the very same value
    # floor_min (our option; the default 0 is the paper's behaviour) keeps a zero p5 from
    # making n_min absorbing.
    state = PromptState(floor_min=0.5)
    state.update([0, 0], [0.0, 0.0], [-1.0, -2.0], [5, 5], [True, True])
    state.end_epoch()
    assert state.s_floor == 0.5


@pytest.mark.parametrize("k_warmup", [1, 2])
def test_k_warmup_activates_after_that_many_observations(k_warmup):
    state = PromptState(k_warmup=k_warmup)
    for k in range(1, 4):
        state.update([1, 1], [1.0, 0.0], [6.0, -2.0], [5, 5], [True, True])  # sigma_obs 3
        assert state.s_hat(1) == (3.0 if k >= k_warmup else 0.01)


def test_capacity_drops_the_least_recently_updated_prompt():
    state = PromptState(capacity=3)
    for q in (1, 2, 3):
        state.update([q, q], [1.0, -1.0], [-1.0, 1.0], [5, 5], [True, True])
    state.update([1], [0.0], [-1.0], [9], [True])  # touch 1: 2 is now the oldest
    state.update([4, 4], [1.0, -1.0], [-2.0, 2.0], [5, 5], [True, True])
    assert len(state) == 3 and 2 not in state and all(q in state for q in (1, 3, 4))
    assert state.s_hat(2) == 0.01  # cold again


def test_a_prompt_twice_in_one_step_is_refused_not_merged():
    state = PromptState()
    # prompt 1's rows split by prompt 2's: two groups of one prompt, which would merge into one
    with pytest.raises(ValueError, match="prompt 1 has two separate runs"):
        state.update([1, 1, 2, 2, 1, 1], [1.0, -1.0] * 3, [-1.0] * 6, [5] * 6, [True] * 6)
    assert len(state) == 0  # nothing was folded in
    state.update([1, 1, 1, 2, 2], [1.0, -1.0, 0.0, 1.0, -1.0], [-1.0] * 5, [5] * 5, [True] * 5)
    assert state.observed(1)["n_lengths"] == 3 and state.observed(2)["n_lengths"] == 2


def test_prompt_state_round_trips_through_json_exactly():
    rng = np.random.default_rng(7)
    state = PromptState(capacity=5)
    for step in range(8):
        state.update(
            [*np.sort(rng.integers(0, 8, 6)), f"s{step}"],  # each prompt's rows together
            rng.normal(size=7),
            rng.normal(-40, 9, size=7),
            rng.integers(1, 500, size=7),
            rng.random(7) > 0.2,
        )
    state.end_epoch()
    snapshot = json.loads(json.dumps(state.state_dict()))
    restored = PromptState(capacity=5)
    restored.load_state_dict(snapshot)
    assert restored.state_dict() == state.state_dict()
    for twin in (state, restored):
        twin.update([np.int64(100), 101], [1.0, -1.0], [-3.0, -9.0], [7, 8], [True, True])
    assert restored.state_dict() == state.state_dict()
    with pytest.raises(TypeError):
        state.update([1.5], [0.0], [0.0], [1], [True])


def test_length_window_cold_start_and_refit_schedule():
    window = LengthWindow(3072)
    assert (window.k1, window.k2, window.cold_length()) == (921, 2150, 3072.0)
    # Lengths 1..100: p30 = 30.7, p80 = 80.2 -> K1 = max(32, 30) = 32, K2 = max(82, 80) = 82.
    assert not window.observe(range(1, 101), step=5)  # too early: 5 steps since step 0
    assert window.cold_length() == 50.5
    assert window.observe([], step=10)
    assert (window.k1, window.k2) == (32, 82)
    # The next refit only 10 steps later; a window of 100 then holds just 100..199.
    small = LengthWindow(3072, size=100)
    small.observe(range(1, 101), step=10)
    assert not small.observe(range(100, 200), step=19)
    assert small.observe([], step=20)
    assert list(small.lengths) == list(range(100, 200))
    assert (small.k1, small.k2) == (129, 179)  # p30 = 129.7, p80 = 179.2
    # Too few samples: no refit even when due, until the window holds 32.
    sparse = LengthWindow(3072)
    assert not sparse.observe(range(31), step=10)
    assert sparse.observe([40], step=11)
    restored = LengthWindow(3072)
    restored.load_state_dict(json.loads(json.dumps(window.state_dict())))
    assert restored.state_dict() == window.state_dict()


# ---------------------------------------------------------------- C. markers and the stop rule


@pytest.mark.parametrize(
    "text",
    [
        r"so the answer is \boxed{\frac{1}{2}}.",
        r"\boxed{\{1,2\}}",
        r"\boxed{\frac{\sqrt{a^{2}}}{b}} and more",
        r"\boxed[5]",
        "## Final Answer\nThe value",
        "final answer: 7",
        "<answer>x</answer>",
        "<final_answer>3</final_answer>",
        "Therefore, the answer is 5",
        "We get 3. Therefore the answer is 3",
    ],
)
def test_math_markers(text):
    assert has_marker(text, "math")


@pytest.mark.parametrize(
    "text",
    [
        r"\boxed{\frac{1}{2}",
        r"\boxed",
        r"\boxed{\left\{ x",
        "<answer>x",
        "Final answer:   ",
        "Therefore, the answer is",
        "```python\nprint(1)\n```",
    ],
)
def test_math_non_markers(text):
    assert not has_marker(text, "math")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```python\nprint(1)\n```", True),
        ("```\nx = 1\n```\nDone.", True),
        ("    return x\n```\n", True),  # closes the fence the prompt template opened
        ("<answer>7</answer>", True),
        ("```python\ndef f(x):\n    return x", False),
        ("```\ndef f(x):", False),
        ("x = 1  ```", False),  # not at column 0
        (r"\boxed{1}", False),
    ],
)
def test_code_markers(text, expected):
    assert has_marker(text, "code") is expected


def test_qa_markers_are_the_generic_forms_only():
    assert has_marker("<answer>Paris</answer>", "qa")
    assert not has_marker(r"\boxed{Paris}", "qa")
    with pytest.raises(ValueError):
        has_marker("x", "poetry")


def _decode(ids):
    return "".join(map(chr, ids))


def _stream(controller, text, max_tokens=10_000):
    """Drive the rule as an engine does; returns (response length before EOS, forced?)."""
    tracker = StopRuleTracker(controller, eos_token_id=0)
    ids = []
    for char in text[:max_tokens]:
        ids.append(ord(char))
        if len(ids) < max_tokens and tracker.observe(ids):
            return len(ids), True
    return len(ids), False


def _controller(**kwargs):
    defaults = dict(k1=16, k2=1000, grace=5, eps_abort=0.05, seed=0, domain="math")
    return StopController(_decode, **{**defaults, **kwargs})


def test_stop_controller_is_a_stop_rule():
    assert isinstance(_controller(), StopRule)


def test_marker_is_caught_at_the_next_poll_and_trimmed_after_the_grace():
    # Marker completed at token 37 -> first poll at or after it is t = 40; EOS at 40 + 5.
    text = "a" * 19 + "<answer>1</answer>" + "b" * 200
    controller = _controller()
    assert _stream(controller, text) == (45, True)
    assert controller.flags() == {
        "marker": True,
        "eps_kept": False,
        "aborted": False,
        "marker_at": 40,
        "stop_at": 45,
    }
    assert controller.should_stop([1] * 46)  # latched
    # Marker completed at token 10 (before K1): caught at the first poll, t = 16.
    controller = _controller()
    assert _stream(controller, "a" + r"\boxed{7}" + "b" * 200) == (21, True)
    assert controller.flags()["marker_at"] == 16


def test_marker_older_than_the_window_is_missed():
    # Marker in tokens 1..9; the first poll at t = 304 decodes tokens 49..304 only.
    controller = _controller(k1=300, k2=320, grace=10, eps_abort=0.0)
    assert _stream(controller, r"\boxed{7}" + "b" * 600) == (330, True)
    assert controller.flags() == {
        "marker": False,
        "eps_kept": False,
        "aborted": True,
        "marker_at": None,
        "stop_at": 330,
    }


def test_the_gate_checks_once_more_before_drawing_the_coin():
    # Polls never land (poll_every 1000): the detect at K2 + G = 60 finds the marker.
    controller = _controller(k1=16, k2=50, grace=10, poll_every=1000, eps_abort=0.0)
    assert _stream(controller, "a" * 30 + r"\boxed{7}" + "b" * 200) == (70, True)
    assert controller.flags()["marker_at"] == 60 and not controller.flags()["aborted"]


def test_natural_eos_before_any_decision_keeps_the_rollout():
    controller = _controller(k1=8, k2=40, grace=10)
    assert _stream(controller, "a" * 45) == (45, False)
    assert controller.flags() == {
        "marker": False,
        "eps_kept": False,
        "aborted": False,
        "marker_at": None,
        "stop_at": None,
    }


def test_one_coin_per_marker_less_rollout():
    eps, rows = 0.05, 20_000
    text = "a" * 12 + r"\boxed{1}" + "c" * 9  # marker only after the gate at t = 8
    kept = []
    for row in range(rows):
        controller = _controller(k1=4, k2=4, grace=4, eps_abort=eps, seed=rollout_seed(0, 3, row))
        length, forced = _stream(controller, text)
        flags = controller.flags()
        if flags["eps_kept"]:
            # Eps-kept: no further checks, runs to the natural end despite the later marker.
            assert (length, forced, flags["marker"]) == (30, False, False)
        else:
            assert (length, forced) == (8, True) and flags["aborted"] and flags["stop_at"] == 8
        kept.append(flags["eps_kept"])
    rate = np.mean(kept)
    assert abs(rate - eps) <= 4 * math.sqrt(eps * (1 - eps) / rows)
    # Weights: eps-kept 1 / (s_pre * eps) = 20 (uniform n: s_pre = 1), aborted 0 and masked.
    weights, keep = rollout_weights(
        [rows], [{"eps_kept": k, "aborted": not k} for k in kept], eps_abort=eps
    )
    assert set(weights[keep]) == {20.0} and set(weights[~keep]) == {0.0}


def test_coins_are_reproducible_and_independent_across_rows():
    # SplitMix64's published first output for state 0 is 0xE220A8397B1DCDAF.
    assert coin(0) == (0xE220A8397B1DCDAF >> 11) / 2**53
    assert rollout_seed(1, 2, 3) == rollout_seed(1, 2, 3)
    assert len({rollout_seed(0, s, r) for s in range(30) for r in range(30)}) == 900
    assert rollout_seed(0, 1, 5) != rollout_seed(0, 5, 1)

    def kept(seed):
        controller = _controller(k1=2, k2=2, grace=0, eps_abort=0.5, seed=seed)
        _stream(controller, "aaaa")
        return controller.flags()["eps_kept"]

    rows = 4000
    coins = np.array([kept(rollout_seed(9, 0, r)) for r in range(rows)])
    assert coins.tolist()[:50] == [kept(rollout_seed(9, 0, r)) for r in range(50)]
    both = np.mean(coins[:-1] & coins[1:])
    assert abs(both - 0.25) <= 4 * math.sqrt(0.25 * 0.75 / (rows - 1))


def test_factory_numbers_rollouts_across_requests():
    factory = StopControllerFactory(_decode, request_sizes=[2, 3], k1=8, k2=40, base_seed=4, step=9)
    assert factory(1, 0).seed == rollout_seed(4, 9, 2)
    assert factory(0, 1).seed == rollout_seed(4, 9, 1)
    assert (factory(1, 2).k1, factory(1, 2).k2, factory(1, 2).grace) == (8, 40, 150)
    with pytest.raises(IndexError):
        factory(0, 2)


def test_factory_rows_continue_from_first_row_across_engine_shards():
    # Requests of sizes [2, 3, 1, 2] split after request 1: the second shard starts at row 5.
    whole = StopControllerFactory(_decode, [2, 3, 1, 2], k1=8, k2=40, base_seed=4, step=9)
    head = StopControllerFactory(_decode, [2, 3], k1=8, k2=40, base_seed=4, step=9)
    tail = StopControllerFactory(_decode, [1, 2], k1=8, k2=40, base_seed=4, step=9, first_row=5)
    assert tail(0, 0).seed == rollout_seed(4, 9, 5)
    assert tail(1, 1).seed == rollout_seed(4, 9, 7)
    one = [whole(i, j).seed for i, n in enumerate([2, 3, 1, 2]) for j in range(n)]
    split = [head(i, j).seed for i, n in enumerate([2, 3]) for j in range(n)]
    split += [tail(i, j).seed for i, n in enumerate([1, 2]) for j in range(n)]
    assert split == one


# ---------------------------------------------------------------- D. weights and advantages


def test_hand_computed_weights():
    # n = (1, 3, 4): mean 8/3, s_pre = (3/8, 1, 1).
    np.testing.assert_allclose(stratification([1, 3, 4]), [3 / 8, 1.0, 1.0], rtol=1e-15)
    flags = [
        {"marker": True},
        {"eps_kept": True},
        {"aborted": True},
        {},
        {"marker": True},
        {"eps_kept": True},
        {"aborted": True},
        {},
    ]
    weights, keep = rollout_weights([1, 3, 4], flags, eps_pre=0.05, eps_abort=0.05)
    np.testing.assert_allclose(weights, [8 / 3, 20, 0, 1, 1, 20, 0, 1], rtol=1e-14)
    np.testing.assert_array_equal(keep, [True, True, False, True, True, True, False, True])
    # s_pre clipped at eps_pre: n = (1, 40) -> 1 / 20.5 < 0.05; eps-kept there: 1 / 0.05^2 = 400.
    flags = [{"eps_kept": True}] + [{}] * 40
    weights, _ = rollout_weights([1, 40], flags)
    assert weights[0] == pytest.approx(400.0, rel=1e-12) and weights[1] == 1.0
    # Cap at 1000: 1 / (0.05 * 0.01) = 2000.
    weights, _ = rollout_weights([1, 40], flags, eps_abort=0.01)
    assert weights[0] == 1000.0
    with pytest.raises(ValueError):
        rollout_weights([2], [{}])
    with pytest.raises(ValueError):
        rollout_weights([1], [{"aborted": True, "eps_kept": True}])


def test_advantages_include_aborted_rollouts_before_masking():
    # Group (1, 0): mean 1/2, sample std 1/sqrt(2).
    adv, _ = duet_advantages([1.0, 0.0], [2], np.ones(2))
    np.testing.assert_allclose(adv, [1 / math.sqrt(2), -1 / math.sqrt(2)], rtol=1e-5)
    # Adding an aborted zero-reward rollout: mean 1/3, sample std 1/sqrt(3); the kept
    # advantages change (the documented coupling), the aborted row's weighted advantage is 0.
    weights, keep = rollout_weights([3], [{}, {}, {"aborted": True}])
    adv, weighted = duet_advantages([1.0, 0.0, 0.0], [3], weights)
    third = math.sqrt(3)
    np.testing.assert_allclose(
        adv, [(2 / 3) * third, -(1 / 3) * third, -(1 / 3) * third], rtol=1e-5
    )
    np.testing.assert_array_equal(weighted[~keep], [0.0])
    np.testing.assert_allclose(weighted[keep], adv[keep], rtol=1e-15)
    # A group of one: A = r (verl), or 0 on request.
    adv, _ = duet_advantages([1.0], [1], np.ones(1))
    assert adv.tolist() == [1.0]
    adv, _ = duet_advantages([1.0], [1], np.ones(1), singleton="zero")
    assert adv.tolist() == [0.0]


def test_calibration_chi2():
    assert calibration_chi2([1.0, 2.0], [1.0, 1.0]) == 0.5
    assert calibration_chi2([1e-6], [0.0]) == 0.0  # sigma clipped at the floor
    assert calibration_chi2([2.0, 2.0], [2.0, 2.0]) == 0.0


def test_plan_step_reads_the_state_and_closes_the_budget():
    state, window = PromptState(), LengthWindow(3072)
    # g = (8, 0) and (2, 0): sigma_obs 4 and 1.
    adv, logp = [1.0, 0.0, 1.0, 0.0], [8.0, -3.0, 2.0, -3.0]
    state.update([0, 0, 1, 1], adv, logp, [100, 300, 50, 50], [True] * 4)
    window.observe([100, 300, 50, 50], step=1)
    plan = plan_step([0, 1, 2], state, window, b=0.5, world_size=2)
    # s_hat = (4, 1, 0.01); L_hat = (200, 50, cold = window mean 125); B = 0.5 * 8 * 375.
    np.testing.assert_array_equal(plan.s_hat, [4.0, 1.0, 0.01])
    np.testing.assert_array_equal(plan.l_hat, [200.0, 50.0, 125.0])
    assert plan.budget == 1500.0
    counts, lam = allocate(plan.s_hat, plan.l_hat, 1500.0, world_size=2)
    np.testing.assert_array_equal(plan.counts, counts)
    assert plan.lam == lam and plan.planned_tokens == float(counts @ plan.l_hat) <= 1500.0
    np.testing.assert_array_equal(plan.s_pre, stratification(counts))


# ---------------------------------------------------------------- E. exact unbiasedness on a toy

X, Y, MARK, EOS = 0, 1, 2, 3
T_MAX = 8
TOY_TEXT = {X: "x", Y: "y", MARK: "<answer>m</answer>"}
TOY_EPS = 0.05


def _toy_decode(ids):
    return "".join(TOY_TEXT[i] for i in ids)


def _toy_trajectories():
    """Every natural trajectory: k < 8 non-EOS tokens then EOS, or 8 non-EOS tokens."""
    out = [(*body, EOS) for k in range(T_MAX) for body in itertools.product((X, Y, MARK), repeat=k)]
    return out + list(itertools.product((X, Y, MARK), repeat=T_MAX))


def _toy_reward(tokens):
    """1 if MARK appears and the number of x before the first MARK is even (fixed at MARK:
    Assumption A3 of App. A.2.2)."""
    if MARK not in tokens:
        return 0.0
    return float(tokens[: tokens.index(MARK)].count(X) % 2 == 0)


def _softmax(theta):
    z = np.exp(theta - theta.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def _toy_generate(natural, eps_abort):
    """What DUET samples when the policy's natural draw is `natural`: the rule (K1 = 1, poll every
    token, G = 1, K2 + G = 5) sees each token; a forced EOS is not a policy sample."""
    controller = StopController(
        _toy_decode, k1=1, k2=4, grace=1, poll_every=1, eps_abort=eps_abort, seed=0, domain="qa"
    )
    tracker = StopRuleTracker(controller, eos_token_id=EOS)
    sampled = []
    for token in natural:
        sampled.append(token)
        if token == EOS or len(sampled) == T_MAX:
            break
        if tracker.observe(sampled):
            break
    return sampled, controller.flags()


def _score(probs, sampled):
    """Gradient of the log-prob of the sampled tokens w.r.t. theta `[T_MAX, 4]`."""
    grad = np.zeros_like(probs)
    for position, token in enumerate(sampled):
        grad[position] -= probs[position]
        grad[position, token] += 1.0
    return grad


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(11)
    theta = rng.normal(0.0, 0.6, size=(T_MAX, 4))
    theta[:, EOS] -= 1.0  # long enough rollouts that the gate at 5 matters
    theta[:4, MARK] -= 1.0  # and enough of them marker-less at the gate
    probs = _softmax(theta)
    trajectories = _toy_trajectories()
    padded = np.full((len(trajectories), T_MAX), -1)
    for i, tokens in enumerate(trajectories):
        padded[i, : len(tokens)] = tokens
    rewards = np.array([_toy_reward(list(t)) for t in trajectories])

    def probability(th):
        per_position = _softmax(th)[np.arange(T_MAX), np.maximum(padded, 0)]
        return np.where(padded >= 0, per_position, 1.0).prod(axis=1)

    # Exact grad of J = E[R] by central differences (independent of the score identity).
    grad_j = np.zeros_like(theta)
    for index in np.ndindex(theta.shape):
        step = np.zeros_like(theta)
        step[index] = 1e-6
        grad_j[index] = (probability(theta + step) - probability(theta - step)) @ rewards / 2e-6

    # One row per DUET outcome of every natural trajectory: the keep branch (coin forced by
    # eps_abort = 1) and, for coin rollouts, the abort branch (eps_abort = 0), with its
    # probability and Z = (R - 1/2) * score of the tokens the policy sampled.
    p = probability(theta)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    flags, row_p, row_z, marker, z_nat_sq = [], [], [], [], []
    for tokens, p_y in zip(trajectories, p, strict=True):
        z_nat = (_toy_reward(list(tokens)) - 0.5) * _score(probs, tokens)
        z_nat_sq.append(float(np.sum(z_nat**2)))
        sampled, keep_flags = _toy_generate(tokens, eps_abort=1.0)
        marker.append(keep_flags["marker"])
        branches = [(1.0, sampled, keep_flags)]
        if keep_flags["eps_kept"]:
            aborted, abort_flags = _toy_generate(tokens, eps_abort=0.0)
            assert abort_flags["aborted"] and len(aborted) == 5
            branches = [(TOY_EPS, sampled, keep_flags), (1 - TOY_EPS, aborted, abort_flags)]
        for branch_p, tokens_sampled, branch_flags in branches:
            flags.append(branch_flags)
            row_p.append(p_y * branch_p)
            row_z.append(
                (_toy_reward(tokens_sampled) - 0.5) * _score(probs, tokens_sampled).ravel()
            )
    return dict(
        theta=theta,
        grad_j=grad_j,
        p=p,
        flags=flags,
        row_p=np.array(row_p),
        row_z=np.array(row_z),
        marker=np.array(marker),
        z_nat_sq=np.array(z_nat_sq),
    )


def _toy_moments(toy, weights):
    """Exact E[hhat] `[T_MAX, 4]` and E||hhat||^2 with hhat = w * Z."""
    mean = ((toy["row_p"] * weights) @ toy["row_z"]).reshape(toy["theta"].shape)
    second = float((toy["row_p"] * weights**2) @ np.sum(toy["row_z"] ** 2, axis=1))
    return mean, second


def test_duet_estimator_is_exactly_unbiased_on_the_toy(toy):
    weights, _ = rollout_weights([len(toy["flags"])], toy["flags"], eps_abort=TOY_EPS)
    mean, second = _toy_moments(toy, weights)
    np.testing.assert_allclose(mean, toy["grad_j"], atol=1e-8)

    # Theorem 3: E||hhat||^2 - E||Z_nat||^2 <= (1 - p_marker)(1 - eps)/eps * sigma^2_mless.
    p, marker = toy["p"], toy["marker"]
    p_marker = float(p[marker].sum())
    sigma2_mless = float(p[~marker] @ toy["z_nat_sq"][~marker]) / (1 - p_marker)
    surcharge = second - float(p @ toy["z_nat_sq"])
    assert 0 < 1 - p_marker < 1 and surcharge > 0
    assert surcharge <= (1 - p_marker) * (1 - TOY_EPS) / TOY_EPS * sigma2_mless + 1e-12


def test_dropping_marker_less_rollouts_without_reweighting_is_biased(toy):
    # Power check: eps-kept rollouts at weight 1 instead of 1 / eps miss the exact gradient by
    # far more than the 1e-8 the unbiased estimator is held to.
    weights, _ = rollout_weights([len(toy["flags"])], toy["flags"], eps_abort=1.0)
    mean, _ = _toy_moments(toy, weights)
    assert np.abs(mean - toy["grad_j"]).max() > 1e-3
