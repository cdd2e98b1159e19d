"""Top-p truncation (`rlvr.algorithms.nucleus`): hand values, the fast floor against vLLM's
sort-based filter, and the nucleus log mass with a target outside the nucleus."""

import math

import pytest
import torch

from rlvr.algorithms.nucleus import FIRST_K, nucleus_floor, nucleus_log_mass, top_p_filter

PROBS = torch.tensor([[0.5, 0.05, 0.3, 0.15]])


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        # the mass above 0.15 is 0.8: it reaches top_p 0.8 (dropped) but not 0.81 (kept)
        (0.8, [0, 2]),
        (0.81, [0, 2, 3]),
        (0.5, [0]),  # the top token alone reaches 0.5
        (0.3, [0]),  # never empty
        (0.99, [0, 1, 2, 3]),
    ],
)
def test_nucleus_by_hand(top_p, kept):
    logits = PROBS.log()
    filtered = top_p_filter(logits, top_p)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == kept
    floor = nucleus_floor(PROBS, top_p)
    assert float(floor) == pytest.approx(min(float(PROBS[0, i]) for i in kept))
    log_mass, outside = nucleus_log_mass(logits, torch.tensor([kept[-1]]), top_p)
    # float32 sums of four probabilities: within a few ulps of 1
    want = math.log(sum(float(PROBS[0, i]) for i in kept))
    assert float(log_mass) == pytest.approx(want, abs=1e-6)
    assert not outside.any()


def test_a_target_outside_joins_the_nucleus():
    log_mass, outside = nucleus_log_mass(PROBS.log(), torch.tensor([1]), 0.8)
    assert outside.tolist() == [True]
    assert float(log_mass) == pytest.approx(math.log(0.5 + 0.3 + 0.05))


def test_top_p_one_keeps_everything():
    logits = torch.randn(3, 50)
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    log_mass, outside = nucleus_log_mass(logits, torch.tensor([0, 1, 2]), 1.0)
    assert log_mass.tolist() == [0.0, 0.0, 0.0] and not outside.any()


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_floor_equals_the_sort_based_filter(scale):
    """Rows flat enough to need the whole sort (scale 0.05: thousands of tokens in the nucleus),
    rows decided within the first candidates (scale 8) and between: the kept mass of the floor
    equals that of vLLM's filter. The two sum the same float32 values in other orders: 1e-5."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=gen) * scale
    for top_p in (0.5, 0.9, 0.95):
        probs = logits.softmax(-1)
        floor = nucleus_floor(probs, top_p)
        kept_mass = (probs * (probs >= floor[:, None])).sum(-1)
        reference = top_p_filter(logits, top_p)
        reference_mass = (probs * torch.isfinite(reference)).sum(-1)
        assert torch.allclose(kept_mass, reference_mass, atol=1e-5)
        sizes = (probs >= floor[:, None]).sum(-1)
        assert (sizes >= 1).all()
        if scale == 0.05:
            assert int(sizes.min()) > FIRST_K * 16  # the whole-row sort decided these rows
