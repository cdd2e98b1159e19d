"""`FusedHeadLogprob` against autograd through the plain head: values and gradients."""

from __future__ import annotations

import pytest
import torch

from rlvr.training.lm_head import FusedHeadLogprob


def reference(hidden, head, targets, temperature):
    """Log-probs of ``targets`` and entropies from the full softmax, differentiated by autograd."""
    logits = head(hidden).float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy.detach()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 9])
def test_fused_head_matches_autograd(temperature, bias, tokens):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(tokens, 16, requires_grad=True)
    targets = torch.randint(0, 50, (tokens,))
    upstream = torch.randn(tokens)  # a loss that weighs each token differently

    want_logp, want_entropy = reference(hidden, head, targets, temperature)
    (want_logp * upstream).sum().backward()
    want = [t.grad.clone() for t in (hidden, *head.parameters())]
    for t in (hidden, *head.parameters()):
        t.grad = None

    logp, entropy, _, _ = FusedHeadLogprob.apply(
        hidden, head.weight, head.bias, targets, temperature, True
    )
    (logp * upstream).sum().backward()
    got = [t.grad for t in (hidden, *head.parameters())]
    # fp32 throughout, the same matmuls: equal up to summation order (default fp32 tolerances)
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(entropy, want_entropy)
    assert not entropy.requires_grad
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_fused_head_without_entropy_or_grad():
    """Log-probs only under no_grad (pi_old's pass), and a frozen head (LoRA) gets no gradient."""
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 20, bias=False).requires_grad_(False)
    hidden = torch.randn(5, 8, requires_grad=True)
    targets = torch.randint(0, 20, (5,))
    want, _ = reference(hidden, head, targets, 1.0)
    with torch.no_grad():
        logp, entropy, _, _ = FusedHeadLogprob.apply(hidden, head.weight, None, targets, 1.0, False)
    assert entropy.numel() == 0
    torch.testing.assert_close(logp, want.detach())
    logp, *_ = FusedHeadLogprob.apply(hidden, head.weight, None, targets, 1.0, False)
    logp.sum().backward()
    assert hidden.grad is not None and head.weight.grad is None
