"""Tandem evaluation metrics against hand-computed values: pass@k, the handoff loop on scripted
writers, junior cross-entropy, distribution overlap and marginal-token drift."""

import math

import numpy as np
import pytest
import torch

from rlvr.algorithms.counter_rng import uniform
from rlvr.algorithms.pass_at_k import pass_at_k
from rlvr.algorithms.tandem import JUNIOR, SENIOR
from rlvr.algorithms.tandem.metrics import (
    Turn,
    TurnRequest,
    bootstrap_macro_se,
    distribution_overlap,
    handoff_budget,
    handoff_rollouts,
    junior_cross_entropy,
    kl_divergence,
    macro_mean,
    marginal_drift,
    over_emitted,
    pass_at_k_table,
    pushback,
    smoothed_distribution,
    survival_curve,
    token_counts,
    token_turn_writer,
)

# pass@k and aggregation


def test_pass_at_k_by_hand():
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    assert pass_at_k(8, 2, 4) == pytest.approx(0.785714, abs=1e-6)
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 5, 4) == 1.0  # 3 wrong < k
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 1, 8) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(8, 9, 1)
    with pytest.raises(ValueError):
        pass_at_k(8, 2, 9)


def test_pass_at_k_table_is_per_problem_pass_at_k_in_macro_layout():
    correct = {"a": {"p": [True, False, False, False], "q": [False] * 4}, "b": {"r": [True] * 2}}
    table = pass_at_k_table(correct, [1, 2])
    # p: n=4, c=1 -> pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert table[1] == {"a": {"p": [0.25], "q": [0.0]}, "b": {"r": [1.0]}}
    assert table[2] == {"a": {"p": [0.5], "q": [0.0]}, "b": {"r": [1.0]}}
    assert macro_mean(table[2]).macro == pytest.approx((0.25 + 1.0) / 2)


def test_macro_is_the_mean_of_benchmark_means_of_problem_means():
    values = {
        "amc": {"a1": [1.0, 0.0], "a2": [1.0, 1.0]},  # problems 0.5, 1.0 -> 0.75
        "aime": {"i1": [0.0, 0.0, 0.3]},  # 0.1
    }
    m = macro_mean(values)
    assert m.per_problem["amc"] == {"a1": 0.5, "a2": 1.0}
    assert m.per_benchmark == pytest.approx({"amc": 0.75, "aime": 0.1})
    assert m.macro == pytest.approx(0.425)


def test_bootstrap_se_matches_the_analytic_se_of_a_mean():
    assert bootstrap_macro_se({"a": [0.5] * 10, "b": [1.0] * 3}) == 0.0
    v = np.random.default_rng(0).random(200)
    se = bootstrap_macro_se({"only": v}, n_boot=2000, seed=1)
    assert se == pytest.approx(v.std() / math.sqrt(len(v)), rel=0.1)
    # Two benchmarks: the macro SE is half the root sum of squares of the two SEs.
    se2 = bootstrap_macro_se({"x": v, "y": v}, n_boot=2000, seed=1)
    assert se2 == pytest.approx(math.sqrt(2) * v.std() / math.sqrt(len(v)) / 2, rel=0.1)


# Handoff robustness (5.2) with scripted writers: 0 = EOS, 1 = "s", 2 = "j", 3 = "\n\n"

EOS, S_WORD, J_WORD, STEP = 0, 1, 2, 3


def scripted_writer(word: int, eos_at_context: int = 10**9):
    """Writes its own word then "\\n\\n", and EOS once the context reaches `eos_at_context`."""

    def logits(ids: list[int]) -> torch.Tensor:
        if len(ids) >= eos_at_context:
            target = EOS
        elif ids[-1] in (S_WORD, J_WORD):
            target = STEP
        else:
            target = word
        out = torch.full((4,), float("-inf"))
        out[target] = 0.0
        return out

    return token_turn_writer(logits, lambda turn: turn[-1] == STEP, stop_ids=[EOS])


def recording(writer, log):
    def write(requests):
        log.append(requests)
        return writer(requests)

    return write


def test_strict_handoff_alternates_shares_the_budget_and_stops_at_eos():
    calls = []
    senior = recording(scripted_writer(S_WORD, eos_at_context=1 + 6), calls)
    junior = recording(scripted_writer(J_WORD, eos_at_context=1 + 6), calls)
    [chain] = handoff_rollouts([[STEP]], senior, junior, budgets=[100], seeds=[50])
    # Turns: s\n\n (S), j\n\n (J), s\n\n (S), EOS (J) once the context holds 1 + 6 tokens.
    assert chain.response_ids == [1, 3, 2, 3, 1, 3, 0]
    assert chain.authorship == [1, 1, 0, 0, 1, 1, 0]
    assert (chain.rounds, chain.finish_reason) == (4, "stop")
    assert chain.senior_share == pytest.approx(4 / 7)
    # Each turn sees the whole team text, the rest of the one budget, seed = base + tokens used.
    assert [(len(r.context_ids), r.max_tokens, r.seed) for [r] in calls] == [
        (1, 100, 50),
        (3, 98, 52),
        (5, 96, 54),
        (7, 94, 56),
    ]


def test_budget_and_round_cap_end_chains():
    s, j = scripted_writer(S_WORD), scripted_writer(J_WORD)
    chains = handoff_rollouts(
        [[STEP]] * 3, s, j, budgets=[5, 100, 0], seeds=[0, 0, 0], max_rounds=3
    )
    assert chains[0].response_ids == [1, 3, 2, 3, 1]  # the last turn is cut by the budget
    assert chains[0].authorship == [1, 1, 0, 0, 1]
    assert chains[0].finish_reason == "length"
    assert (chains[1].rounds, chains[1].finish_reason) == (3, "rounds")
    assert chains[1].response_ids == [1, 3, 2, 3, 1, 3]
    assert (chains[2].response_ids, chains[2].finish_reason) == ([], "length")


def test_default_round_cap_is_150():
    s, j = scripted_writer(S_WORD), scripted_writer(J_WORD)
    [chain] = handoff_rollouts([[STEP]], s, j, budgets=[10_000], seeds=[0])
    assert (chain.rounds, len(chain.response_ids), chain.finish_reason) == (150, 300, "rounds")


def test_each_round_calls_each_writer_once_for_the_whole_batch():
    calls = []
    s = recording(scripted_writer(S_WORD), calls)
    j = recording(scripted_writer(J_WORD), calls)
    handoff_rollouts([[STEP]] * 5, s, j, budgets=[100] * 5, seeds=range(5), max_rounds=4)
    assert [len(batch) for batch in calls] == [5, 5, 5, 5]


def test_stochastic_handoff_draws_the_next_writer_at_each_boundary():
    s, j = scripted_writer(S_WORD), scripted_writer(J_WORD)
    n, rounds = 400, 10
    chains = handoff_rollouts(
        [[STEP]] * n, s, j, [100] * n, seeds=range(n), schedule="stochastic", max_rounds=rounds
    )
    for seed, chain in enumerate(chains[:20]):
        writers = [SENIOR] + [
            SENIOR if uniform(seed, r) < 0.5 else JUNIOR for r in range(1, rounds)
        ]
        assert chain.authorship == [w for w in writers for _ in range(2)]
    shares = np.array([c.senior_share for c in chains])
    # The senior always writes turn 1 and wins each later turn with probability 1/2.
    expected = (1 + 0.5 * (rounds - 1)) / rounds
    assert abs(shares.mean() - expected) <= 2.5758 * shares.std(ddof=1) / math.sqrt(n)


def test_handoff_budget_and_bad_writers():
    assert handoff_budget(100) == 3000
    assert handoff_budget(1500) == 4096 - 1500 - 8
    assert handoff_budget(5000) == 0

    def empty(requests):
        return [Turn([], False) for _ in requests]

    with pytest.raises(ValueError, match="1..10"):
        handoff_rollouts([[STEP]], empty, empty, budgets=[10], seeds=[0])
    with pytest.raises(ValueError, match="schedule"):
        handoff_rollouts([[STEP]], empty, empty, budgets=[10], seeds=[0], schedule="random")
    assert TurnRequest([1], 2, 3).max_tokens == 2


# Legibility (5.4)


def test_cross_entropy_by_hand_excludes_masked_positions():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25])).expand(1, 5, 3).clone()
    logits[0, 3] = torch.tensor([0.0, float("-inf"), 0.0])  # an excluded position, e.g. EOS
    ids = torch.tensor([[0, 1, 2, 1, 0]])
    mask = torch.tensor([[True, True, True, False, False]])
    ce = junior_cross_entropy(logits, ids, mask)
    assert ce.tolist() == pytest.approx([(math.log(2) + 2 * math.log(4)) / 3])
    assert torch.isnan(junior_cross_entropy(logits, ids, torch.zeros_like(mask))).all()


def test_cross_entropy_of_own_samples_is_the_mean_entropy():
    g = torch.Generator().manual_seed(0)
    t, v = 4000, 6
    logits = torch.randn(1, t, v, generator=g) * 2
    probs = torch.softmax(logits, -1)
    ids = torch.multinomial(probs[0], 1, generator=g).T
    ce = junior_cross_entropy(logits, ids, torch.ones(1, t, dtype=torch.bool)).item()
    entropy = -(probs * probs.log()).sum(-1)
    nll = -probs[0].log().gather(1, ids.T).squeeze(1)
    # CE - mean entropy is a mean of t independent zero-mean terms.
    tolerance = 4 * (nll - entropy[0]).std().item() / math.sqrt(t)
    assert abs(ce - entropy.mean().item()) <= tolerance


def test_overlap_by_hand_identity_and_one_minus_tv():
    p = torch.log(torch.tensor([[[0.5, 0.5]]]))
    q = torch.log(torch.tensor([[[0.9, 0.1]]]))
    one = torch.ones(1, 1, dtype=torch.bool)
    assert distribution_overlap(p, q, one).item() == pytest.approx(0.6)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 7, 11, generator=g), torch.randn(2, 7, 11, generator=g)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    assert torch.allclose(distribution_overlap(a, a, mask), torch.ones(2))
    tv = 0.5 * (torch.softmax(a, -1) - torch.softmax(b, -1)).abs().sum(-1)
    expected = torch.stack([(1 - tv[0]).mean(), (1 - tv[1, :4]).mean()])
    assert torch.allclose(distribution_overlap(a, b, mask), expected, atol=1e-6)


# Marginal-token drift (5.3)


def test_counts_and_smoothing_by_hand():
    counts = token_counts([[0, 2, 2], [2, 3]], vocab_size=5)
    assert counts.tolist() == [1, 0, 3, 1, 0]
    np.testing.assert_allclose(
        smoothed_distribution(counts), [2 / 10, 1 / 10, 4 / 10, 2 / 10, 1 / 10]
    )
    with pytest.raises(ValueError):
        token_counts([[5]], vocab_size=5)


def test_kl_both_directions_by_hand():
    p, q = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    assert kl_divergence(p, q) == pytest.approx(0.5108, abs=1e-4)
    assert kl_divergence(q, p) == pytest.approx(0.3681, abs=1e-4)
    drift = marginal_drift(np.array([5, 5]), np.array([9, 1]), alpha=0.0, min_junior_count=1)
    assert drift.kl_to_junior == pytest.approx(0.5108, abs=1e-4)
    assert drift.kl_from_junior == pytest.approx(0.3681, abs=1e-4)
    np.testing.assert_allclose(drift.log_ratio, [math.log(5 / 9), math.log(5)])


def test_identical_corpora_have_no_drift():
    counts = np.array([40, 0, 25, 3, 100])
    drift = marginal_drift(counts, counts.copy())
    assert drift.kl_to_junior == 0.0 and drift.kl_from_junior == 0.0
    assert not drift.survival.any()


def test_survival_curve_by_hand_and_non_increasing():
    d = np.array([0.05, -0.5, 1.2, -2.0, 3.0])
    frequent = np.array([True, True, True, True, False])
    curve = survival_curve(d, frequent, np.array([0.0, 0.1, 0.5, 1.0, 2.0]))
    assert curve.tolist() == [1.0, 0.75, 0.5, 0.5, 0.0]
    drift = marginal_drift(
        np.random.default_rng(0).integers(0, 60, 300), np.random.default_rng(1).integers(0, 60, 300)
    )
    assert np.all(np.diff(drift.survival) <= 0)
    # Smoothing 1 and the frequency threshold 20 of the junior's counts are the defaults.
    frequent = np.random.default_rng(1).integers(0, 60, 300) >= 20
    assert drift.survival[0] == pytest.approx(np.mean(np.abs(drift.log_ratio[frequent]) > 0))


def test_pushback_on_a_constructed_example():
    d_grpo = np.array([2.0, -1.5, 0.1, 1.0, -3.0, 0.0])
    d_trl = np.array([1.0, -2.0, 5.0, 1.5, -1.0, 0.0])
    result = pushback(d_grpo, d_trl, top=4)
    # Largest |d_GRPO|: ids 4, 0, 1, 3. TRL moves back on 4 (-3 -> -1) and 0 (2 -> 1) only.
    assert result.token_ids.tolist() == [4, 0, 1, 3]
    assert result.fraction == 0.5
    # shift = [2, -1, -0.5, 0.5] against d_grpo = [-3, 2, -1.5, 1]: ranks [4, 1, 2, 3] vs
    # [1, 4, 2, 3], so rho = 1 - 6 * 18 / (4 * 15).
    assert result.spearman == pytest.approx(-0.8)
    only_small = pushback(d_grpo, d_trl, top=2, candidates=np.array([0, 0, 1, 1, 0, 1], bool))
    assert only_small.token_ids.tolist() == [3, 2]
    assert only_small.fraction == 0.0


def test_over_emitted_lists_the_largest_positive_log_ratios():
    d = np.array([0.1, 2.0, -1.0, 0.5])
    rows = over_emitted(d, np.array([3, 40, 1, 9]), np.array([2, 4, 8, 5]), top=2)
    assert rows == [(1, 2.0, 40, 4), (3, 0.5, 9, 5)]
