"""Top-p truncation (`rlvr.algorithms.nucleus`): hand values, the kept set and its mass against
vLLM's own CPU filter on bf16 logits full of ties, and a target outside the nucleus."""

import math

import pytest
import torch

from rlvr.algorithms.nucleus import FIRST_K, nucleus_log_mass, nucleus_mask, top_p_filter

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
    assert nucleus_mask(logits, top_p)[0].nonzero().flatten().tolist() == kept
    log_mass, outside = nucleus_log_mass(logits, torch.tensor([kept[-1]]), top_p)
    # float32 sums of four probabilities: within a few ulps of 1
    want = math.log(sum(float(PROBS[0, i]) for i in kept))
    assert float(log_mass) == pytest.approx(want, abs=1e-6)
    assert not outside.any()


def test_a_target_outside_is_flagged_and_left_out_of_the_mass():
    log_mass, outside = nucleus_log_mass(PROBS.log(), torch.tensor([1]), 0.8)
    assert outside.tolist() == [True]
    assert float(log_mass) == pytest.approx(math.log(0.5 + 0.3))


def test_top_p_one_keeps_everything():
    logits = torch.randn(3, 50)
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    log_mass, outside = nucleus_log_mass(logits, torch.tensor([0, 1, 2]), 1.0)
    assert log_mass.tolist() == [0.0, 0.0, 0.0] and not outside.any()


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_the_mask_equals_the_sort_based_filter(scale):
    """Rows flat enough to need the whole row (scale 0.05: thousands of tokens in the nucleus),
    rows decided within the first candidates (scale 8) and between keep what the filter keeps."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=gen) * scale
    for top_p in (0.5, 0.9, 0.95):
        kept = nucleus_mask(logits, top_p)
        assert torch.equal(kept, torch.isfinite(top_p_filter(logits, top_p)))
        if scale == 0.05:
            assert int(kept.sum(-1).min()) > FIRST_K * 16  # the whole row decided these


def _tied_logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """bf16 logits, as an engine's model computes them, then made fp32 and divided by the
    temperature as vLLM's sampler does: wide enough tied groups lie at every nucleus boundary."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=gen) * 4.0 + 0.5
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(torch.bfloat16)
    return logits.float().div_(torch.tensor([[0.9]]))


@pytest.mark.parametrize("seed", range(6))
def test_ties_at_the_boundary_are_cut_where_vllm_cuts_them(seed):
    """vLLM's own CPU filter, called directly, on bf16 logits full of ties: the same kept set,
    and the same nucleus log mass (the trainer's log p - log mass is vLLM's processed log-prob
    of the token; float32 softmax sums in two orders: 1e-5)."""
    sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    logits = _tied_logits(seed, rows=64, vocab=3000)
    top_p = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)[seed]
    p = torch.full((len(logits),), top_p)
    reference = sampler.apply_top_k_top_p(logits.clone(), None, p)
    kept = nucleus_mask(logits, top_p)
    assert torch.equal(kept, torch.isfinite(reference))
    targets = kept.float().multinomial(1, generator=torch.Generator().manual_seed(seed))[:, 0]
    log_mass, outside = nucleus_log_mass(logits, targets, top_p)
    assert not outside.any()
    trainer = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0] - log_mass
    engine = reference.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(trainer, engine, rtol=0, atol=1e-5)


def test_a_tie_cut_keeps_part_of_the_group():
    """Four tied tokens of 0.2 under one of 0.2 + epsilon: top-p 0.5 needs the top token and two
    of the tied four, as vLLM keeps them, not the whole group."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1e-3]])
    kept = nucleus_mask(logits, 0.5)
    assert int(kept.sum()) == 3 and bool(kept[0, 4])
    assert torch.equal(kept, torch.isfinite(top_p_filter(logits, 0.5)))
