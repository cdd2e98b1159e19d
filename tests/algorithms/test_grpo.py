"""GRPO core against hand-computed values: advantages, PPO-clip loss and gradients, k3 KL."""

import math

import numpy as np
import pytest
import torch

from rlvr.algorithms.advantages import group_advantages
from rlvr.algorithms.grpo import (
    engine_is_weights,
    kl_k3,
    kl_loss,
    masked_mean,
    policy_loss,
)

# Groups interleaved on purpose: a = [1, 0, 0, 1], b = [2, 4, 9].
REWARDS = [1.0, 2.0, 0.0, 4.0, 0.0, 1.0, 9.0]
GROUPS = ["a", "b", "a", "b", "a", "a", "b"]
# a: mean 0.5, sample std sqrt(1/3); b: mean 5, deviations (-3, -1, 4), sample std sqrt(13).
A_STD = math.sqrt(1 / 3)
B_STD = math.sqrt(13)
EXPECTED_GROUP = [
    0.5 / A_STD,
    -3 / B_STD,
    -0.5 / A_STD,
    -1 / B_STD,
    -0.5 / A_STD,
    0.5 / A_STD,
    4 / B_STD,
]


def test_all_equal_rewards_give_zero_advantages():
    adv = group_advantages(np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(adv, np.zeros(6))


def test_hand_computed_group_advantages_use_sample_std():
    adv = group_advantages(np.array(REWARDS), GROUPS)
    assert isinstance(adv, np.ndarray)
    np.testing.assert_allclose(adv, EXPECTED_GROUP, rtol=1e-5)
    # Population std would give 1.0 for group a's members; the sample std gives sqrt(3)/2.
    assert adv[0] == pytest.approx(math.sqrt(3) / 2, rel=1e-5)


def test_scale_none_is_mean_centering_only():
    adv = group_advantages(np.array(REWARDS), GROUPS, scale="none")
    np.testing.assert_allclose(adv, [0.5, -3.0, -0.5, -1.0, -0.5, 0.5, 4.0])


def test_singleton_groups():
    rewards = np.array([0.7, 1.0, 0.0])
    groups = ["solo", "pair", "pair"]
    zero = group_advantages(rewards, groups)
    reward = group_advantages(rewards, groups, singleton="reward")
    pair = 0.5 / math.sqrt(0.5)
    np.testing.assert_allclose(zero, [0.0, pair, -pair], rtol=1e-5)
    np.testing.assert_allclose(reward, [0.7, pair, -pair], rtol=1e-5)


def test_torch_in_torch_out_with_tensor_group_ids():
    rewards = torch.tensor(REWARDS, dtype=torch.float32)
    ids = torch.tensor([0, 1, 0, 1, 0, 0, 1])
    adv = group_advantages(rewards, ids)
    assert isinstance(adv, torch.Tensor) and adv.dtype == torch.float32
    np.testing.assert_allclose(adv.numpy(), EXPECTED_GROUP, rtol=1e-5)
    assert group_advantages(torch.tensor([1, 0]), ["g", "g"]).dtype == torch.float32


def test_unknown_names_fail_loudly():
    with pytest.raises(ValueError, match="advantage scale"):
        group_advantages(np.zeros(2), [0, 0], scale="batch")
    with pytest.raises(ValueError, match="loss aggregation"):
        policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), agg="sum"
        )


# Hand example: seq 0 (A = +1) has ratios 1.1, 1.3, 0.7; seq 1 (A = -2) has 0.5, 1.5 and one pad.
# With clip 0.2, per-token losses max(-A r, -A clip(r)) are
#   seq 0: -1.1, -1.2 (1.3 clipped to 1.2), -0.7      seq 1: 1.6 (0.5 clipped to 0.8), 3.0
RATIOS = [[1.1, 1.3, 0.7], [0.5, 1.5, 1.0]]
ADV = [1.0, -2.0]
MASK = [[True, True, True], [True, True, False]]


def _hand_inputs(pad_logp=-math.inf, pad_old=math.nan):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, 0.0]], dtype=torch.float64)
    logp = old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    logp[1, 2] = pad_logp
    old[1, 2] = pad_old
    logp.requires_grad_(True)
    return logp, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK)


@pytest.mark.parametrize(
    ("agg", "max_len", "expected"),
    [
        ("token-mean", None, (-1.1 - 1.2 - 0.7 + 1.6 + 3.0) / 5),
        ("seq-mean-token-mean", None, ((-3.0 / 3) + (4.6 / 2)) / 2),
        ("seq-mean-token-sum-norm", None, ((-3.0 / 3) + (4.6 / 3)) / 2),
        ("seq-mean-token-sum-norm", 8, ((-3.0 / 8) + (4.6 / 8)) / 2),
    ],
)
def test_loss_aggregations_match_hand_values(agg, max_len, expected):
    logp, old, adv, mask = _hand_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, agg=agg, max_len=max_len)
    assert loss.item() == pytest.approx(expected, rel=1e-9)


def test_token_and_seq_means_differ_on_unequal_lengths():
    logp, old, adv, mask = _hand_inputs()
    token, _ = policy_loss(logp, old, adv, mask, agg="token-mean")
    seq, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    assert token.item() == pytest.approx(0.32)
    assert seq.item() == pytest.approx(0.65)


def test_gradients_are_hand_values_and_finite_with_inf_and_nan_pads():
    logp, old, adv, mask = _hand_inputs(pad_logp=-math.inf, pad_old=math.nan)
    loss, stats = policy_loss(logp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss)
    # d/dlogp of -A r is -A r when the unclipped term is active, 0 when clipped; over 5 tokens.
    expected = torch.tensor(
        [[-1.1 / 5, 0.0, -0.7 / 5], [0.0, 2 * 1.5 / 5, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 5)
    log_ratios = [math.log(r) for r in (1.1, 1.3, 0.7, 0.5, 1.5)]
    assert stats["approx_kl"].item() == pytest.approx(-sum(log_ratios) / 5)
    assert stats["ratio_mean"].item() == pytest.approx((1.1 + 1.3 + 0.7 + 0.5 + 1.5) / 5)
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["ratio_min"].item() == pytest.approx(0.5)
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_nan_pads_stay_finite_for_every_aggregation(agg):
    logp, old, adv, mask = _hand_inputs(pad_logp=math.nan, pad_old=-math.inf)
    loss, _ = policy_loss(logp, old, adv, mask, agg=agg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[1, 2] == 0.0


def _grad_at_ratio(ratio: float, advantage: float, clip_low=0.2, clip_high=0.2) -> float:
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), math.log(ratio), dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logp, old, torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool),
        clip_low=clip_low, clip_high=clip_high,
    )  # fmt: skip
    loss.backward()
    return logp.grad.item()


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_grad"),
    [
        (1.2 - 1e-3, 1.0, -(1.2 - 1e-3)),  # just inside the upper clip: full gradient
        (1.2 + 1e-3, 1.0, 0.0),  # just outside, positive advantage: clipped
        (0.8 + 1e-3, -1.0, 0.8 + 1e-3),  # just inside the lower clip
        (0.8 - 1e-3, -1.0, 0.0),  # just outside, negative advantage: clipped
        (0.5, 1.0, -0.5),  # below the clip a positive advantage still pushes up
        (1.5, -1.0, 1.5),  # above the clip a negative advantage still pushes down
    ],
)
def test_clipping_engages_exactly_at_the_boundary(ratio, advantage, expected_grad):
    assert _grad_at_ratio(ratio, advantage) == pytest.approx(expected_grad)


def test_asymmetric_clip_uses_each_side():
    # clip_high = 0.28 (DAPO clip-higher): 1.25 is inside, though outside a symmetric 0.2 clip.
    assert _grad_at_ratio(1.25, 1.0, clip_high=0.28) == pytest.approx(-1.25)
    assert _grad_at_ratio(1.25, 1.0) == 0.0
    assert _grad_at_ratio(1.28 + 1e-3, 1.0, clip_high=0.28) == 0.0
    # The lower side keeps clip_low = 0.2 whatever clip_high is.
    assert _grad_at_ratio(0.8 - 1e-3, -1.0, clip_high=0.28) == 0.0
    assert _grad_at_ratio(0.75, -1.0, clip_low=0.3) == pytest.approx(0.75)


def test_weights_scale_each_sequence():
    logp, old, adv, mask = _hand_inputs()
    weights = torch.tensor([2.0, 0.5], dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, mask, weights=weights)
    assert loss.item() == pytest.approx((2.0 * -3.0 + 0.5 * 4.6) / 5)


def test_token_level_advantages_equal_broadcast_sequence_advantages():
    logp, old, adv, mask = _hand_inputs()
    per_seq, _ = policy_loss(logp, old, adv, mask)
    per_token, _ = policy_loss(logp, old, adv[:, None].expand(2, 3).clone(), mask)
    assert per_seq.item() == per_token.item()


def test_empty_mask_gives_zero_loss_and_zero_gradient():
    logp = torch.full((2, 3), -math.inf, requires_grad=True)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, stats = policy_loss(
            logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), agg=agg
        )
        loss.backward()
        assert loss.item() == 0.0 and stats["clip_frac"].item() == 0.0
        assert (logp.grad == 0).all()


def test_kl_k3_is_zero_when_equal_and_matches_formula():
    logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=torch.float64))
    assert (kl_k3(logp, logp) == 0).all()
    ref = torch.log(torch.tensor([[0.25, 0.6]], dtype=torch.float64))
    # d = ref - logp: log(0.5) and log(3); k3 = e^d - d - 1.
    expected = [0.5 - math.log(0.5) - 1, 3.0 - math.log(3.0) - 1]
    torch.testing.assert_close(kl_k3(logp, ref)[0], torch.tensor(expected, dtype=torch.float64))
    assert (kl_k3(logp, ref) >= 0).all()


def test_kl_loss_ignores_inf_pads_in_value_and_gradient():
    logp = torch.tensor([[math.log(0.5), -math.inf]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.nan]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]])
    kl = kl_loss(logp, ref, mask)
    kl.backward()
    assert kl.item() == pytest.approx(0.5 - math.log(0.5) - 1)
    # d k3 / d logp = -(e^d - 1) = 0.5 at the valid token; the pad gets exactly 0.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, 0.0]], dtype=torch.float64))


def test_kl_k3_is_clamped_as_verl_low_var_kl():
    # d = ref - logp = 25 is clamped to 20 before the exp, and e^20 - 21 to 10 after it;
    # d = -30 is clamped to -20: e^-20 + 20 - 1 = 19.000000002 -> 10. A clamped token has no grad.
    logp = torch.tensor([[-30.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-5.0, -30.0, -1.5]], dtype=torch.float64)
    k3 = kl_k3(logp, ref)
    expected = [10.0, 10.0, math.exp(-0.5) + 0.5 - 1]
    torch.testing.assert_close(k3[0], torch.tensor(expected, dtype=torch.float64))
    k3.sum().backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, 0.0, -(math.exp(-0.5) - 1)]], dtype=torch.float64)
    )


def test_kl_loss_aggregates_like_the_policy_loss():
    # two sequences: 1 token and 3 tokens; k3 per token below
    d = torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.2, 0.1]], dtype=torch.float64)
    logp = torch.zeros_like(d)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    k = (d.exp() - d - 1).tolist()
    tok = [k[0][0], k[1][0], k[1][1], k[1][2]]
    assert kl_loss(logp, d, mask, "token-mean").item() == pytest.approx(sum(tok) / 4)
    seq = (k[0][0] + sum(k[1]) / 3) / 2
    assert kl_loss(logp, d, mask, "seq-mean-token-mean").item() == pytest.approx(seq)
    norm = (k[0][0] / 8 + sum(k[1]) / 8) / 2
    assert kl_loss(logp, d, mask, "seq-mean-token-sum-norm", 8).item() == pytest.approx(norm)


def test_engine_is_weights_tis_mask_and_stats():
    # rho = exp(old - rollout): 1.5, 3.0 (past the cap 2), 0.5; the 4th token is a stop rule's
    # forced EOS, the 5th a one-token nucleus of the engine (log-prob 0) that pi_old gives 0.5,
    # the 6th lies outside pi_old's nucleus (rho 0) and the 7th outside the mask.
    old = torch.log(torch.tensor([[0.3, 0.6, 0.1, 0.2, 0.5, 0.4, 0.9]]))
    rollout = torch.log(torch.tensor([[0.2, 0.2, 0.2, 1.0, 1.0, 0.4, 0.1]]))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    forced = torch.tensor([[0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    outside = torch.tensor([[0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    w, stats = engine_is_weights(old, rollout, mask, "tis", 2.0, outside, forced)
    torch.testing.assert_close(w, torch.tensor([[1.5, 2.0, 0.5, 1.0, 0.5, 0.0, 1.0]]))
    w, _ = engine_is_weights(old, rollout, mask, "mask", 2.0, outside, forced)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]]))
    w, _ = engine_is_weights(old, rollout, mask, "off", 2.0, outside, forced)
    assert torch.equal(w, torch.ones_like(w))
    # float32 log/exp round trips: a few ulps of 3.0
    ratios = (1.5, 3.0, 0.5, 0.5, 0.0)
    assert stats["engine_ratio_mean"].item() == pytest.approx(sum(ratios) / 5, rel=1e-6)
    assert stats["engine_ratio_max"].item() == pytest.approx(3.0, rel=1e-6)
    assert stats["engine_capped_frac"].item() == pytest.approx(1 / 5)
    # the KL over the tokens inside pi_old's nucleus (outside, log rho is -inf)
    kl = -sum(math.log(r) for r in ratios[:4]) / 4
    assert stats["engine_kl"].item() == pytest.approx(kl, rel=1e-5)
    assert stats["engine_outside_frac"].item() == pytest.approx(1 / 5)
    assert stats["engine_tokens"].item() == 5
    assert stats["engine_inside_tokens"].item() == 4
    with pytest.raises(ValueError, match="one of"):
        engine_is_weights(old, rollout, mask, "clip")
    with pytest.raises(ValueError, match="cap"):
        engine_is_weights(old, rollout, mask, "tis", cap=0.5)


def test_policy_loss_token_weights_scale_each_token():
    logp = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0])
    weights = torch.tensor([[0.5, 2.0, math.nan]])  # NaN outside the mask stays out
    loss, _ = policy_loss(logp, logp, adv, mask, token_weights=weights)
    # ratio 1: token losses -2 * 0.5 and -2 * 2.0, token mean over 2 tokens
    assert loss.item() == pytest.approx((-1.0 - 4.0) / 2)


def test_masked_mean_ignores_nan_outside_mask():
    x = torch.tensor([[1.0, 3.0, math.nan], [math.inf, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.float32)
    assert masked_mean(x, mask).item() == pytest.approx(3.0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
