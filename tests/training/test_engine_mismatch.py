"""The engine/trainer mismatch that bench/engine_mismatch.py reports is the trainer's own: a
token outside pi_old's top-p nucleus has ratio 0 and counts in the outside share, and the KL over
an update pools only the tokens it was computed over (those inside the nucleus)."""

import math

import pytest
import torch

from rlvr.algorithms.grpo import engine_is_weights
from rlvr.training.batch import build_batch
from rlvr.training.engine_mismatch import MismatchTally, mismatch, trainer_logprobs

PROBS = torch.tensor([0.6, 0.3, 0.05, 0.05])
TOP_P = 0.8  # keeps tokens 0 and 1 (mass 0.9): token 2 lies outside


class ConstantLM:
    """A language model predicting `PROBS` at every position."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        logits = PROBS.log().expand(*input_ids.shape, len(PROBS))
        return type("Output", (), {"logits": logits})()


def test_a_token_outside_the_nucleus_has_ratio_zero_and_counts_as_outside():
    # the engine drew token 1 from its nucleus (0.3 / 0.9) and claims 0.5 for token 2
    rollout = [math.log(0.3 / 0.9), math.log(0.5)]
    batch = build_batch([[0], [0]], [[1, 2], [1]], 3, rollout_logprobs=[rollout, rollout[:1]])
    logp, outside = trainer_logprobs(ConstantLM(), batch, temperature=1.0, top_p=TOP_P)
    assert outside.tolist() == [[False, False, True], [False, False, False]]
    stats = mismatch(batch, logp, outside)
    assert stats["engine_outside_frac"] == pytest.approx(1 / 3)
    # ratios 1, 0, 1; float32 log/exp round trips: a few ulps
    assert stats["engine_ratio_mean"] == pytest.approx(2 / 3, rel=1e-6)
    assert abs(stats["engine_kl"]) < 1e-6
    # the outside token's nucleus log-prob is meaningless: no log-prob difference is read off it
    assert stats["max_abs_logp_diff"] < 1e-6


def test_the_full_softmax_has_no_nucleus_to_leave():
    batch = build_batch([[0]], [[2]], 3, rollout_logprobs=[[math.log(0.05)]])
    logp, outside = trainer_logprobs(ConstantLM(), batch, temperature=1.0)
    assert outside is None
    assert mismatch(batch, logp)["engine_ratio_mean"] == pytest.approx(1.0, rel=1e-6)


def test_the_tally_pools_the_kl_over_the_tokens_inside_the_nucleus():
    # micro-batch 1: one token inside (log rho -0.4), one outside; micro-batch 2: two inside
    old = torch.tensor([[-1.4, -1.0], [-1.1, -1.3]])
    rollout = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    outside = torch.tensor([[False, True], [False, False]])
    tally = MismatchTally()
    for row in range(2):
        rows = slice(row, row + 1)
        tally.add(engine_is_weights(old[rows], rollout[rows], mask[rows], outside=outside[rows])[1])
    pooled = tally.summary(lambda values, op: values)
    _, whole = engine_is_weights(old, rollout, mask, outside=outside)
    # float32 sums in another order
    for key in MismatchTally.MEANS:
        assert pooled[key] == pytest.approx(float(whole[key]), rel=1e-6), key
    assert pooled["engine_kl"] == pytest.approx((0.4 + 0.1 + 0.3) / 3, rel=1e-6)
    assert pooled["engine_ratio_max"] == pytest.approx(float(whole["engine_ratio_max"]))
