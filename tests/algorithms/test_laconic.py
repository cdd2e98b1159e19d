"""LACONIC (Liu et al., "LACONIC: Length-Aware Constrained Reinforcement Learning for LLM")
against hand-computed values and our numpy reference runs of the paper's equations."""

import json
import math

import numpy as np
import pytest

from rlvr.algorithms.advantages import group_advantages
from rlvr.algorithms.laconic import (
    DEFAULT_ETA,
    DEFAULT_LAM_INIT,
    DEFAULT_LAM_MAX,
    DualState,
    dual_update,
    lagrangian_rewards,
    length_cost,
    linear_length_cost,
    resolve_lam_max,
    safe_lambda_ceiling,
    simulate_bandit,
    simulate_best_response,
    step_metrics,
)

LMAX = 4096


def test_defaults():
    # eta 0.002 is inferred from the paper's eta ablation (Table 6) and lam_max 0.3 is that
    # ablation's ceiling (Sec. 5.3); lam_init 0 is our choice (Algorithm 1 gives no value).
    assert (DEFAULT_ETA, DEFAULT_LAM_MAX, DEFAULT_LAM_INIT) == (0.002, 0.3, 0.0)
    state = DualState(budget=2000)
    assert (state.eta, state.lam_max, state.lam, state.last_step) == (0.002, 0.3, 0.0, -1)


def test_hinge_cost_is_zero_within_budget_and_unclipped_above():
    # Eq. 6 by hand, B = 2000: the cost at Lmax is 4096/2000 - 1 = 1.048, not capped at 1.
    np.testing.assert_allclose(
        length_cost([1500, 2000, 3000, 4096], 2000), [0.0, 0.0, 0.5, 1.048], rtol=0, atol=1e-12
    )
    assert length_cost([4096], 1000)[0] == pytest.approx(3.096)


def test_linear_cost_is_signed():
    np.testing.assert_allclose(linear_length_cost([1500, 2000, 3000], 2000), [-0.25, 0.0, 0.5])


def test_lagrangian_reward_and_group_advantages_by_hand():
    # By hand: one group, B = 1000, lambda = 0.1.
    r, lens = [1.0, 1.0, 0.0, 0.0], [500, 2000, 800, 3000]
    np.testing.assert_allclose(length_cost(lens, 1000), [0.0, 1.0, 0.0, 2.0])
    ell = lagrangian_rewards(r, lens, 1000, 0.1)
    np.testing.assert_allclose(ell, [1.0, 0.9, 0.0, -0.2], atol=1e-15)
    # mean 0.425, sample std sqrt(0.74917 / 3) = 0.61305.
    adv = group_advantages(ell, [0, 0, 0, 0])
    np.testing.assert_allclose(adv, [0.9379, 0.7748, -0.6933, -1.0195], atol=1e-4)
    plain = group_advantages(np.array(r), [0, 0, 0, 0])
    np.testing.assert_allclose(plain, [0.866, 0.866, -0.866, -0.866], atol=1e-3)
    # The linear cost also rewards the two responses under budget: c = [-0.5, 1, -0.2, 2].
    np.testing.assert_allclose(
        lagrangian_rewards(r, lens, 1000, 0.1, cost="linear"), [1.05, 0.9, 0.02, -0.2]
    )


def test_tiny_lambda_still_ranks_a_uniform_group_by_excess_length():
    # Scale invariance; eps = 1e-6 against std 0.0005/sqrt(2) shrinks 0.7071 to 0.7051.
    ell = lagrangian_rewards([1.0, 1.0], [500, 1500], 1000, 0.001)
    np.testing.assert_allclose(ell, [1.0, 0.9995])
    np.testing.assert_allclose(group_advantages(ell, [0, 0]), [0.7051, -0.7051], atol=1e-4)
    np.testing.assert_allclose(group_advantages(ell, [0, 0], eps=0.0), [0.7071, -0.7071], atol=1e-4)
    within = lagrangian_rewards([1.0, 1.0, 1.0], [10, 500, 1000], 1000, 0.3)
    np.testing.assert_array_equal(group_advantages(within, [0, 0, 0]), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("cost", ["hinge", "linear"])
def test_lambda_zero_is_bitwise_grpo(cost):
    # Same rollouts, lambda = 0 -> identical rewards and advantages, bit for bit.
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(16), 8)
    rewards = rng.random(128) * rng.integers(0, 2, 128)
    lengths = rng.integers(1, LMAX + 1, 128)
    ell = lagrangian_rewards(rewards, lengths, 1000, 0.0, cost=cost)
    assert ell.dtype == np.float64
    np.testing.assert_array_equal(ell, rewards)
    np.testing.assert_array_equal(group_advantages(ell, groups), group_advantages(rewards, groups))


def test_budget_at_lmax_keeps_lambda_at_zero_so_every_step_is_grpo():
    # GRPO equivalence in a second form: B = Lmax means Lbar <= B always, so the dual never
    # leaves 0.
    rng = np.random.default_rng(1)
    state = DualState(budget=LMAX, eta=0.01)
    for step in range(50):
        lengths = rng.integers(1, LMAX + 1, 64)
        rewards = rng.integers(0, 2, 64).astype(float)
        lam = state.lambda_for_step(step)
        assert lam == 0.0
        np.testing.assert_array_equal(lagrangian_rewards(rewards, lengths, LMAX, lam), rewards)
        state.step_update(step, lengths.mean())


def test_dual_update_arithmetic():
    # Eq. 9 by hand with eta = 0.002, Lambda = 0.3.
    lam = dual_update(0.0, 3000, 2000, 0.002, 0.3)
    assert lam == pytest.approx(0.001, abs=1e-18)
    assert dual_update(lam, 1000, 2000, 0.002, 0.3) == 0.0
    assert dual_update(0.0005, 1000, 2000, 0.002, 0.3) == 0.0
    lam = dual_update(0.29, 4000, 1000, 0.002, 0.3)
    assert lam == pytest.approx(0.296, abs=1e-15)
    assert dual_update(lam, 4000, 1000, 0.002, 0.3) == 0.3
    assert dual_update(0.123, 1000, 1000, 0.002, 0.3) == 0.123


def test_dual_invariants_hold_and_a_clipped_cost_dual_would_break_them():
    # Random (lambda, Lbar): the signed violation moves lambda both ways within [0, Lambda].
    rng = np.random.default_rng(2)
    budget, eta, lam_max = 1000.0, 0.002, 0.3
    lams = rng.uniform(0, lam_max, 2000)
    lams[:100] = 0.0
    lams[100:200] = lam_max
    lbars = rng.uniform(0, LMAX, 2000)
    for lam, lbar in zip(lams, lbars, strict=True):
        new = dual_update(lam, lbar, budget, eta, lam_max)
        assert 0.0 <= new <= lam_max
        assert (new > lam) == (lbar > budget and lam < lam_max)
        assert (new < lam) == (lbar < budget and lam > 0)
        assert -eta - 1e-15 <= new - lam <= eta * (LMAX / budget - 1) + 1e-15
    # Driving the dual with the mean clipped cost instead can never lower lambda.
    under = [
        lam + eta * length_cost([lbar], budget)[0] for lam, lbar in zip(lams, lbars, strict=True)
    ]
    assert all(u >= lam for u, lam in zip(under, lams, strict=True))
    assert any(lbar < budget and lam > 0 for lam, lbar in zip(lams, lbars, strict=True))


def test_lambda_rises_over_budget_pins_at_ceiling_then_decays_to_zero():
    state = DualState(budget=1000)
    trajectory = [state.step_update(t, 1500) for t in range(100)]
    assert np.all(np.diff(trajectory) > 0)
    assert trajectory[-1] == pytest.approx(100 * 0.002 * 0.5)
    trajectory = [state.step_update(t, LMAX) for t in range(100, 150)]
    assert trajectory[-1] == 0.3 and max(trajectory) == 0.3
    trajectory = [state.step_update(t, 500) for t in range(150, 600)]
    assert np.all(np.diff(trajectory) <= 0)
    # 0.3 / (0.002 * 0.5) = 300 steps down, then it stays exactly at 0.
    assert trajectory[298] > 0.0
    assert trajectory[300:] == [0.0] * 150
    assert all(0.0 <= lam_next <= 0.3 for _, _, lam_next, _ in state.history)


def test_step_update_is_idempotent_per_step_and_refuses_skips():
    # A retried step changes lambda once and keeps using the lambda it read first.
    state = DualState(budget=2000)
    assert state.lambda_for_step(0) == 0.0
    first = state.step_update(0, 3000)
    assert state.step_update(0, 3000) == first == pytest.approx(0.001)
    assert state.step_update(0, 100) == first
    second = state.step_update(1, 4000)
    assert state.step_update(0, 3000) == first
    assert state.lambda_for_step(0) == 0.0
    assert state.lambda_for_step(1) == first
    assert state.lambda_for_step(2) == second == state.lam
    assert [h[0] for h in state.history] == [0, 1]
    assert state.history[1] == (1, first, second, 4000.0)
    with pytest.raises(ValueError, match="next step is 2"):
        state.step_update(3, 1000)
    with pytest.raises(ValueError, match="next step is 2"):
        state.lambda_for_step(3)
    assert state.last_step == 1 and state.lam == second


def test_state_dict_round_trip_is_exact_and_resume_reproduces_the_trajectory():
    rng = np.random.default_rng(3)
    lbars = rng.uniform(0, LMAX, 40)
    full = DualState(budget=1000, eta=0.01, lam_max=0.3)
    for t in range(40):
        full.step_update(t, lbars[t])

    first = DualState(budget=1000, eta=0.01, lam_max=0.3)
    for t in range(20):
        first.step_update(t, lbars[t])
    snapshot = json.loads(json.dumps(first.state_dict()))
    resumed = DualState(budget=1)
    resumed.load_state_dict(snapshot)
    assert resumed == first
    assert resumed.state_dict() == first.state_dict()
    for t in range(20, 40):
        resumed.step_update(t, lbars[t])
    assert resumed == full
    assert resumed.lam == full.lam


def test_safe_ceiling_values_and_errors():
    # The safe ceiling B / (Lmax - B) (Sec. 2.3) with Lmax = 4096.
    for budget, expected in [(1000, 0.3230), (1500, 0.5778), (2000, 0.9542), (550, 0.1551)]:
        assert safe_lambda_ceiling(budget, LMAX) == pytest.approx(expected, abs=5e-5)
    with pytest.raises(ValueError, match="below the max response length"):
        safe_lambda_ceiling(LMAX, LMAX)
    with pytest.raises(ValueError, match="below the max response length"):
        safe_lambda_ceiling(5000, LMAX)


def test_ceiling_keeps_every_correct_answer_above_every_wrong_one():
    lengths = np.arange(0, LMAX + 1)
    correct = np.ones(LMAX + 1)
    safe = safe_lambda_ceiling(1000, LMAX)
    assert lagrangian_rewards(correct, lengths, 1000, safe).min() == pytest.approx(0.0, abs=1e-12)
    # The paper's 0.3 at B = 1000: 1 - 0.3 * 3.096 = 0.0712.
    assert lagrangian_rewards(correct, lengths, 1000, 0.3).min() == pytest.approx(0.0712)


def test_resolve_lam_max_auto_and_warning():
    assert resolve_lam_max("auto", 1000, LMAX) == (pytest.approx(1000 / 3096), None)
    assert resolve_lam_max(0.3, 1000, LMAX) == (0.3, None)
    lam_max, warning = resolve_lam_max(0.3, 550, LMAX)
    assert lam_max == 0.3 and "0.1551" in warning
    with pytest.raises(ValueError):
        resolve_lam_max(0.3, LMAX, LMAX)


def test_step_metrics_by_hand():
    m = step_metrics(
        rewards=[1, 0, 1, 0],
        lengths=[500, 1500, 4096, 1000],
        truncated=[False, False, True, False],
        budget=1000,
        lam_used=0.1,
        lam_next=0.1025,
    )
    # c = [0, 0.5, 3.096, 0]; ell = [1, -0.05, 0.6904, 0].
    assert m == pytest.approx(
        {
            "laconic_lambda": 0.1,
            "laconic_lambda_next": 0.1025,
            "laconic_length_mean": 1774.0,
            "laconic_length_over_budget": 1.774,
            "laconic_over_budget_frac": 0.5,
            "laconic_truncated_frac": 0.25,
            "laconic_cost_mean": 3.596 / 4,
            "laconic_reward_mean": 0.5,
            "laconic_lagrangian_reward_mean": 1.6404 / 4,
        }
    )
    linear = step_metrics([1, 0], [500, 1500], [False, False], 1000, 0.1, 0.1, cost="linear")
    assert linear["laconic_cost_mean"] == pytest.approx(0.0)
    assert linear["laconic_lagrangian_reward_mean"] == pytest.approx(0.5)


@pytest.mark.parametrize(("eta", "iterations"), [(0.002, 906), (0.02, 87), (0.05, 31)])
def test_best_response_toy_converges_to_the_fixed_point(eta, iterations):
    # Exact best response (App. C.1): lambda* = (B/tau) exp(-B/tau) = 2 e^-2, L -> B,
    # reward -> 1 - e^-2.
    run = simulate_best_response(3000, eta)
    rel = np.abs(run["length"] - 1000) / 1000
    assert int(np.argmax(rel < 0.01)) == iterations
    assert run["length"][-1] == pytest.approx(1000, rel=1e-3)
    assert run["lam"][-1] == pytest.approx(2 * math.exp(-2), rel=1e-3)
    assert run["reward"][-1] == pytest.approx(1 - math.exp(-2), rel=1e-4)
    assert np.all((run["lam"] >= 0) & (run["lam"] <= 0.3))


def test_best_response_toy_large_step_ends_on_the_ceiling():
    # Any lambda in [lambda*, Lambda] keeps the best response on the kink at L = B.
    run = simulate_best_response(10, 0.2)
    assert run["lam"][-1] == 0.3
    assert run["length"][-1] == 1000.0


def test_bandit_grpo_with_dual_meets_the_budget():
    # Our bandit toy shortened to 500 steps (our full 1500-step runs average 1000.0-1000.6 over
    # their last 500 steps).
    run = simulate_bandit(steps=500, seed=0)
    assert run["batch_length"][:20].mean() > 2500
    assert run["batch_length"][300:].mean() == pytest.approx(1000, rel=0.02)
    assert run["policy_length"][-1] == pytest.approx(1000, rel=0.02)
    assert run["success"][-1] == pytest.approx(0.8647, abs=0.01)
    assert np.all((run["lam"] >= 0) & (run["lam"] <= 1.0))
    assert run["lam"].max() > 0.5
    # The clipped cost never pushes the batch far under budget; the linear cost collapses it.
    linear = simulate_bandit(steps=500, seed=0, cost="linear")
    assert run["batch_length"].min() > 900
    assert linear["batch_length"].min() < 750


def test_eta_zero_holds_lambda_fixed_for_the_ablation():
    state = DualState(budget=100, eta=0.0, lam_max=0.3, lam=0.1)
    for step, length in enumerate([250.0, 10.0, 100.0]):
        assert state.lambda_for_step(step) == 0.1
        assert state.step_update(step, length) == 0.1
    with pytest.raises(ValueError, match="eta"):
        DualState(budget=100, eta=-0.01)
