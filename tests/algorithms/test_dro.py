"""DRO kernels (arXiv:2506.13351) against hand-computed values, a toy LM with known logits and a
seeded dilution simulation, plus the token-id scoring input and the rubric JSON parser."""

import json
import math

import numpy as np
import pytest
import torch

from rlvr.algorithms.dro import (
    avg_logprob_rewards,
    avg_prob_rewards,
    build_scoring_ids,
    consistency_gate,
    coverage_gate,
    dro_loss,
    emphasis_weights,
    entropy_mask,
    filter_score,
    group_advantage,
    match_delimiter,
    mean_token_std,
    parse_rubric_items,
    parse_rubric_judgment,
    r3_rewards,
    reference_logprobs,
    reference_rewards,
    score_group,
    select_queries,
    self_certainty,
    split_completion,
    token_std,
)
from rlvr.training.batch import token_logprobs

# Hand-computed case, G=4, L=4: rows 0/2 and 1/3 are equal; columns 0 and 2 are constant across
# rollouts.
P1 = np.array(
    [
        [0.95, 0.60, 0.50, 0.01],
        [0.95, 0.20, 0.50, 0.02],
        [0.95, 0.60, 0.50, 0.01],
        [0.95, 0.20, 0.50, 0.02],
    ]
)


def _two_valued(a: float, b: float) -> list[float]:
    return [a, b, a, b]


# --- R3 arithmetic (Eq. 2) and the baselines of Table 1 -------------------------------------------


def test_sigma_weights_and_r3_by_hand():
    np.testing.assert_allclose(token_std(P1), [0.0, 0.230940, 0.0, 0.005774], atol=1e-6)
    sigma = token_std(P1)
    np.testing.assert_allclose(emphasis_weights(sigma, 0.0), [0.25] * 4, atol=1e-12)
    np.testing.assert_allclose(
        emphasis_weights(sigma, 1.0), [0.234435, 0.295337, 0.234435, 0.235792], atol=1e-6
    )
    np.testing.assert_allclose(
        emphasis_weights(sigma, 2.0), [0.217454, 0.345112, 0.217454, 0.219980], atol=1e-6
    )
    # omega=0 is the clipped mean: 0.95 -> 0.85 and 0.01/0.02 -> 0.05.
    np.testing.assert_allclose(r3_rewards(P1, omega=0.0), _two_valued(0.5, 0.4), atol=1e-12)
    r1 = r3_rewards(P1, omega=1.0)
    r2 = r3_rewards(P1, omega=2.0)
    np.testing.assert_allclose(r1, _two_valued(0.505479, 0.387344), atol=1e-6)
    np.testing.assert_allclose(r2, _two_valued(0.511629, 0.373585), atol=1e-6)
    assert r1[0] - r1[1] == pytest.approx(0.118135, abs=1e-6)
    assert r2[0] - r2[1] == pytest.approx(0.138045, abs=1e-6)
    # A two-valued group of four: +/- 0.5 / sqrt(1/3) = 0.866, minus a hair for eps=1e-4.
    for omega in (0.0, 1.0, 2.0):
        np.testing.assert_allclose(
            group_advantage(r3_rewards(P1, omega)), _two_valued(0.8645, -0.8645), atol=5e-4
        )


def test_avg_prob_and_avg_logprob_baselines_by_hand():
    np.testing.assert_allclose(avg_prob_rewards(P1), _two_valued(0.515, 0.4175), atol=1e-12)
    np.testing.assert_allclose(
        avg_logprob_rewards(np.log(P1)), _two_valued(-1.465109, -1.566475), atol=1e-6
    )
    # With no clipping and omega=0, R3 is Avg Prob.
    np.testing.assert_allclose(
        r3_rewards(P1, omega=0.0, clip_low=0.0, clip_high=1.0), avg_prob_rewards(P1), atol=1e-12
    )


def test_reference_rewards_dispatch_by_name():
    logp = np.log(P1)
    np.testing.assert_allclose(
        reference_rewards(logp, "r3", omega=2.0), r3_rewards(P1, 2.0), atol=1e-12
    )
    np.testing.assert_allclose(reference_rewards(logp, "avg_prob"), avg_prob_rewards(P1))
    np.testing.assert_allclose(reference_rewards(logp, "avg_logprob"), logp.mean(axis=1))
    with pytest.raises(ValueError, match="unknown reference reward"):
        reference_rewards(logp, "sum_logprob")


def test_sigma_on_clipped_option():
    # Clipped, columns 1 and 3 become [.6,.2,.6,.2] and constant 0.05: only column 1 varies.
    sigma = token_std(np.clip(P1, 0.05, 0.85))
    np.testing.assert_allclose(sigma, [0.0, 0.230940, 0.0, 0.0], atol=1e-6)
    w = emphasis_weights(sigma, 1.0)
    expected = np.clip(P1, 0.05, 0.85) @ w
    np.testing.assert_allclose(r3_rewards(P1, 1.0, sigma_on_clipped=True), expected, atol=1e-12)


def test_identical_rollouts():
    p = np.tile([0.9, 0.3, 0.02, 0.6], (5, 1))
    # The float mean of equal values can miss them by an ulp, so a constant column's std is 0
    # only up to rounding (here and in filter_score below).
    np.testing.assert_allclose(token_std(p), np.zeros(4), rtol=0, atol=1e-15)
    np.testing.assert_allclose(emphasis_weights(token_std(p), 2.0), [0.25] * 4, atol=1e-15)
    r = r3_rewards(p, omega=2.0)
    np.testing.assert_allclose(r, [(0.85 + 0.3 + 0.05 + 0.6) / 4] * 5, atol=1e-12)
    adv = group_advantage(r)
    assert np.isfinite(adv).all()
    np.testing.assert_array_equal(adv, np.zeros(5))
    assert filter_score(p) == pytest.approx(0.0, abs=1e-15)


def test_constant_column_is_an_affine_map():
    p = np.array([[0.95, 0.6, 0.5, 0.01], [0.95, 0.2, 0.5, 0.02], [0.7, 0.6, 0.3, 0.2]])
    wider = np.hstack([p, np.full((3, 1), 0.4)])
    r = r3_rewards(p, omega=2.0)
    r_wide = r3_rewards(wider, omega=2.0)
    np.testing.assert_allclose(r, [0.512645, 0.395518, 0.463496], atol=1e-6)
    np.testing.assert_allclose(r_wide, [0.495099, 0.396216, 0.453605], atol=1e-6)
    np.testing.assert_allclose(group_advantage(r, 0.0), group_advantage(r_wide, 0.0), atol=1e-12)
    np.testing.assert_allclose(group_advantage(r), group_advantage(r_wide), atol=1e-3)


def test_emphasis_rises_with_omega():
    rng = np.random.default_rng(0)
    p = rng.normal(0.5, 0.02, size=(16, 200))
    p[:8, 0], p[8:, 0] = 0.7, 0.2
    sigma = token_std(p)
    w0 = [emphasis_weights(sigma, omega)[0] for omega in (0.0, 1.0, 2.0, 4.0)]
    np.testing.assert_allclose(w0, [0.005, 0.0063, 0.0080, 0.0129], atol=1e-4)
    assert w0 == sorted(w0) and len(set(w0)) == 4
    corr = [np.corrcoef(group_advantage(r3_rewards(p, om)), p[:, 0])[0, 1] for om in (0, 1, 2, 4)]
    assert corr == sorted(corr) and len(set(corr)) == 4
    # At omega=0 R3 is an affine map of Avg Prob here (no entry reaches the clip bounds).
    assert corr[0] == pytest.approx(np.corrcoef(avg_prob_rewards(p), p[:, 0])[0, 1], abs=1e-12)


def _dilution_trial(rng: np.random.Generator, frac: float) -> np.ndarray:
    """One group of our dilution simulation (after App. D): correlations of (Avg Logprob, Avg
    Prob, R3) with the reflective mean."""
    g, length = 16, int(rng.integers(25, 751))
    n_ref = max(1, round(frac * length))
    u = rng.normal(size=g)
    reflective = 0.45 + 0.2 * u[:, None] + rng.normal(0, 0.05, (g, n_ref))
    kind = rng.choice(3, size=length - n_ref, p=[0.7, 0.2, 0.1])
    other = np.empty((g, kind.size))
    easy, mid, rare = (kind == 0), (kind == 1), (kind == 2)
    other[:, easy] = rng.normal(0.93, 0.03, (g, easy.sum()))
    other[:, mid] = rng.normal(rng.uniform(0.2, 0.8, mid.sum()), 0.03, (g, mid.sum()))
    other[:, rare] = np.minimum(np.exp(rng.normal(np.log(0.005), 0.5, (g, rare.sum()))), 0.04)
    p = np.clip(np.hstack([reflective, other]), 1e-6, 1.0)
    target = reflective.mean(axis=1)
    rewards = (avg_logprob_rewards(np.log(p)), avg_prob_rewards(p), r3_rewards(p, omega=2.0))
    return np.array([np.corrcoef(r, target)[0, 1] for r in rewards])


def test_dilution_ordering():
    rng = np.random.default_rng(1234)
    for frac in (0.005, 0.02):
        logprob, avgprob, r3 = np.mean([_dilution_trial(rng, frac) for _ in range(1000)], axis=0)
        assert r3 > avgprob > logprob, (frac, logprob, avgprob, r3)
        if frac == 0.005:
            assert r3 - avgprob > 0.15


def test_degenerate_shapes():
    p = np.array([[0.9], [0.3], [0.02]])
    np.testing.assert_allclose(emphasis_weights(token_std(p), 1.5), [1.0])
    np.testing.assert_allclose(r3_rewards(p), [0.85, 0.3, 0.05], atol=1e-12)
    assert filter_score(p) == pytest.approx(np.std([0.9, 0.3, 0.02], ddof=1))
    with pytest.raises(ValueError, match="more than 1 rollouts"):
        r3_rewards(np.array([[0.5, 0.4]]))
    with pytest.raises(ValueError, match="at least 2 rewards"):
        group_advantage([0.3])
    with pytest.raises(ValueError, match="L >= 1"):
        r3_rewards(np.zeros((4, 0)))
    with pytest.raises(ValueError, match="probabilities"):
        r3_rewards(np.array([[0.5, 1.2], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="no tokens"):
        build_scoring_ids([1, 2], [3], [], [])


# --- scoring input as token ids (Sec. 3.1.1, App. M) and the toy LM -------------------------------


def test_build_scoring_ids_slices_at_the_delimiter():
    ids, pos = build_scoring_ids(
        prompt_ids=[10, 11],
        completion_ids=[20, 21, 99, 13, 30, 31],
        delimiter_ids=[99],
        reference_ids=[40, 41, 42],
        separator_ids=[13],
    )
    # The sampled answer [13, 30, 31] is gone; the fixed separator follows the delimiter.
    assert ids == [10, 11, 20, 21, 99, 13, 40, 41, 42]
    assert pos == range(6, 9)
    assert [ids[t] for t in pos] == [40, 41, 42]


def test_build_scoring_ids_multi_token_delimiter_and_array_inputs():
    completion = np.array([5, 7, 8, 7, 8, 9, 7, 8])
    ids, pos = build_scoring_ids(
        torch.tensor([1]), completion, torch.tensor([7, 8]), np.array([2, 3])
    )
    # The first occurrence splits; ids come back as plain ints.
    assert ids == [1, 5, 7, 8, 2, 3]
    assert all(type(t) is int for t in ids)
    assert pos == range(4, 6)


def test_build_scoring_ids_falls_back_to_the_whole_completion():
    completion = [20, 21, 22]
    ids, pos = build_scoring_ids([10], completion, [99], [40], separator_ids=[13])
    assert ids == [10, 20, 21, 22, 40] and pos == range(4, 5)
    # An empty delimiter is the "without slicing" ablation: the same ids.
    assert build_scoring_ids([10], completion, [], [40], separator_ids=[13]) == (ids, pos)


def test_split_completion():
    assert split_completion([1, 2, 9, 3, 4], [9]) == ([1, 2], [3, 4])
    assert split_completion([1, 2, 9], [9]) == ([1, 2], [])
    assert split_completion([1, 2, 3], [9]) == ([1, 2, 3], None)
    assert split_completion([1, 9], [9, 9]) == ([1, 9], None)


def test_match_delimiter_takes_the_first_occurrence_of_any_variant():
    variants = [[7, 8], [5, 8], [7]]
    assert match_delimiter([1, 5, 8, 2, 7, 8], variants) == [5, 8]
    # same start: the longer variant wins, so its whole span leaves the CoT
    assert match_delimiter([1, 7, 8, 2], variants) == [7, 8]
    assert match_delimiter([1, 7, 2], variants) == [7]
    assert match_delimiter(np.array([1, 2, 3]), variants) is None
    assert match_delimiter([1, 2], []) is None
    assert match_delimiter([1, 2], [[]]) is None


def _toy_logits(ids: list[int], vocab: int = 7) -> torch.Tensor:
    """A toy LM with known logits: the next token is 0 with odds 4:1 against each other token once
    "insight" (id 4) has appeared, else uniform. Row t predicts ids[t + 1], as a causal LM's logits
    do."""
    rows = []
    for t in range(len(ids)):
        row = torch.zeros(vocab, dtype=torch.float64)
        if 4 in ids[: t + 1]:
            row[0] = math.log(4.0)
        rows.append(row)
    return torch.stack(rows)


def _toy_certainty(prompt, completions, delimiter, reference, vocab):
    built = [build_scoring_ids(prompt, c, delimiter, reference) for c in completions]
    rows = [
        token_logprobs(_toy_logits(ids, vocab)[None], torch.tensor([ids]))[0] for ids, _ in built
    ]
    return self_certainty(rows, [pos for _, pos in built])


def test_toy_lm_certainties_and_r3():
    p = _toy_certainty([1], [[2, 4, 3], [2, 3, 3]], [], [0, 1], vocab=5)
    np.testing.assert_allclose(p, [[0.5, 0.125], [0.2, 0.2]], atol=1e-12)
    np.testing.assert_allclose(token_std(p), [0.212132, 0.053033], atol=1e-6)
    np.testing.assert_allclose(emphasis_weights(token_std(p), 1.0), [0.539691, 0.460309], atol=1e-6)
    np.testing.assert_allclose(r3_rewards(p, 1.0), [0.327384, 0.2], atol=1e-6)
    np.testing.assert_allclose(r3_rewards(p, 2.0), [0.342082, 0.2], atol=1e-6)
    np.testing.assert_allclose(r3_rewards(p, 0.0), [0.3125, 0.2], atol=1e-12)


def test_slicing_ignores_the_sampled_answer():
    # Vocab 7: 5 = "</think>". Answers after it may contain "insight" (4).
    def rewards(completions, delimiter):
        return r3_rewards(_toy_certainty([1], completions, delimiter, [0, 1], vocab=7), 1.5)

    base = [[2, 4, 3, 5, 1], [2, 3, 3, 5, 1]]
    new_answer = [[2, 4, 3, 5, 1], [2, 3, 3, 5, 4, 0]]
    new_cot = [[2, 4, 3, 5, 1], [2, 4, 3, 5, 1, 2]]
    np.testing.assert_array_equal(rewards(base, [5]), rewards(new_answer, [5]))
    assert not np.allclose(rewards(base, [5]), rewards(new_cot, [5]))
    assert not np.allclose(rewards(base, []), rewards(new_answer, []))


def test_reference_logprobs_reads_ragged_rows_at_their_positions():
    rows = [np.array([0.0, -0.1, -0.2, -0.3]), torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0])]
    out = reference_logprobs(rows, [range(2, 4), [3, 4]])
    np.testing.assert_allclose(out, [[-0.2, -0.3], [-3.0, -4.0]])
    # A rounding error above 0 (low-precision engines) reads as certainty 1; a real positive fails.
    assert reference_logprobs([[0.0, 1e-6]], [[1]]).tolist() == [[0.0]]
    with pytest.raises(ValueError, match="<= 0"):
        reference_logprobs([[0.0, 0.5]], [[1]])
    with pytest.raises(ValueError, match="same non-zero number"):
        reference_logprobs(rows, [range(2, 4), [4]])
    with pytest.raises(ValueError, match="outside"):
        reference_logprobs(rows, [range(0, 2), [3, 4]])
    with pytest.raises(ValueError, match="outside"):
        reference_logprobs(rows, [range(3, 5), [3, 4]])


# --- filter (Sec. 4.2) ----------------------------------------------------------------------------


F2 = np.full((4, 20), 0.5)
F2[:, 0] = [0.9, 0.9, 0.1, 0.1]
F2[:, 1] = [0.6, 0.6, 0.4, 0.4]
F3 = np.full((4, 20), 0.5)
F3[:2], F3[2:] = 0.53, 0.47


def test_filter_scores_and_ranking():
    assert filter_score(P1) == pytest.approx(0.230940, abs=1e-6)
    assert filter_score(F2) == pytest.approx(0.288675, abs=1e-6)
    assert mean_token_std(F2) == pytest.approx(0.028868, abs=1e-6)
    assert filter_score(F3) == pytest.approx(0.034641, abs=1e-6)
    assert mean_token_std(F3) == pytest.approx(0.034641, abs=1e-6)
    # DRO's top-10% statistic prefers the sparse strong signal; the all-token mean does not.
    assert filter_score(F2) > filter_score(F3)
    assert mean_token_std(F3) > mean_token_std(F2)


def test_filter_top_fraction_rounds_up_without_float_noise():
    # L=30: 0.1 * 30 is 3.0000000000000004 in floats, but J_top must hold 3 tokens, not 4.
    p = np.full((4, 30), 0.5)
    for j, d in enumerate([0.3, 0.2, 0.1, 0.05]):
        p[:, j] = [0.5 + d, 0.5 + d, 0.5 - d, 0.5 - d]
    scale = 2 / math.sqrt(3)  # the ddof=1 std of [d, d, -d, -d] is d * 2 / sqrt(3)
    assert filter_score(p) == pytest.approx(scale * 0.2, abs=1e-12)


def _corpus() -> list[np.ndarray]:
    """100 queries: query n has one reflective column of half-spread d_n = (n % 17) / 100 + n / 1e5
    around a base certainty 0.3 + n / 500, so sbar and the mean certainty are known in closed form
    (the n / 1e5 term keeps float rounding from deciding the order)."""
    corpus = []
    for n in range(100):
        base, d = 0.3 + n / 500, (n % 17) / 100 + n / 1e5
        p = np.full((4, 10), base)
        p[:, 3] = [base + d, base + d, base - d, base - d]
        corpus.append(p)
    return corpus


def test_filter_retention_on_a_constructed_corpus():
    corpus = _corpus()
    scores = [filter_score(p) for p in corpus]
    means = [float(p.mean()) for p in corpus]
    np.testing.assert_allclose(
        scores, [((n % 17) / 100 + n / 1e5) * 2 / math.sqrt(3) for n in range(100)], atol=1e-12
    )
    only = select_queries(scores, means, query_frac=0.10)
    # d is about 0.16 for n % 17 == 16, then 0.15; the larger n leads within each.
    assert only.by_score.tolist() == [84, 67, 50, 33, 16, 83, 66, 49, 32, 15]
    assert only.hard.size == 0
    sel = select_queries(scores, means, query_frac=0.10, retention=0.18)
    assert sel.by_score.tolist() == only.by_score.tolist()
    # The fill takes the lowest mean certainty = lowest base, including zero-variance query 0.
    assert sel.hard.tolist() == list(range(8))
    assert sel.kept.tolist() == sorted(list(range(8)) + only.by_score.tolist())


def test_filter_never_keeps_zero_variance_by_score():
    scores = np.zeros(100)
    scores[[3, 40, 77]] = [0.2, 0.1, 0.3]
    means = np.linspace(0.9, 0.1, 100)
    sel = select_queries(scores, means, query_frac=0.10, retention=0.15)
    assert sel.by_score.tolist() == [77, 3, 40]
    # 15 - 10 = 5 hard queries: the lowest means sit at the end of the corpus.
    assert sel.hard.tolist() == [99, 98, 97, 96, 95]
    # Equal scores keep corpus order.
    ties = select_queries([0.2, 0.3, 0.3, 0.1], [0.5] * 4, query_frac=0.5)
    assert ties.by_score.tolist() == [1, 2]
    # ContractNLI keeps 200 of 330.
    many = select_queries(np.arange(330.0), np.zeros(330), 0.10, retention=200 / 330)
    assert many.by_score.size == 33 and many.kept.size == 200


# --- gates (Sec. 4.1) -----------------------------------------------------------------------------


R8 = np.array([0.9, 0.8, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])  # top two by R3: rollouts 0 and 1


def _rows(*rows: str) -> np.ndarray:
    return np.array([[c == "1" for c in row] for row in rows])


def test_uncovered_rubric_rejects():
    s = _rows("11110", "11110", "11110", "11110", "00000", "00000", "00000", "00000")
    assert not coverage_gate(s, mu=1)
    assert consistency_gate(s, R8, rho_g=0.25, nu=0.6)


def test_inconsistent_top_rollout_rejects():
    s = _rows("11111", "11000", "00111", "00000", "00000", "00000", "00000", "00000")
    assert coverage_gate(s, mu=1)
    assert not consistency_gate(s, R8, rho_g=0.25, nu=0.6)


def test_accept_with_inclusive_share():
    s = _rows("11100", "11111", "00000", "00000", "00000", "00000", "00000", "00000")
    assert coverage_gate(s, mu=1)
    assert consistency_gate(s, R8, rho_g=0.25, nu=0.6)
    score = score_group(np.log(np.full((8, 3), 0.5)), s)
    # Equal rewards: the band is rollouts 0 and 1 by the lower-index tie break.
    assert score.coverage and score.consistency and score.accepted


def test_coverage_needs_mu_rollouts_per_item():
    s = _rows("110", "011", "101")
    assert coverage_gate(s, mu=2)
    assert not coverage_gate(s, mu=3)


@pytest.mark.parametrize(("k", "needed"), [(7, 5), (10, 6), (3, 2), (5, 3)])
def test_consistency_share_rounding(k, needed):
    r = np.arange(16.0)[::-1]  # rollout i has the i-th largest reward
    s = np.ones((16, k), dtype=bool)
    s[3, needed - 1 :] = False  # the 4th best meets exactly needed - 1 items
    assert not consistency_gate(s, r)
    s[3, needed - 1] = True  # now exactly needed
    assert consistency_gate(s, r)
    s[4] = False  # the 5th best is outside the top ceil(0.25 * 16) = 4
    assert consistency_gate(s, r)


def test_gates_pass_for_an_ungated_query():
    empty = np.zeros((4, 0), dtype=bool)
    assert coverage_gate(empty) and consistency_gate(empty, [0.1, 0.2, 0.3, 0.4])
    assert score_group(np.log(P1)).accepted


def test_truncated_rollout_counts_as_satisfying_nothing():
    # Rollout 0 has the best reward but no final answer: its row is all False.
    s = _rows("000", "111", "111", "111")
    assert coverage_gate(s)
    assert not consistency_gate(s, [0.9, 0.1, 0.2, 0.3], rho_g=0.25)


def test_score_group_outputs():
    logp = np.log(P1)
    s = _rows("11", "10", "11", "01")
    score = score_group(logp, s, omega=2.0)
    np.testing.assert_allclose(score.rewards, r3_rewards(P1, 2.0), atol=1e-12)
    np.testing.assert_allclose(score.advantages, group_advantage(score.rewards), atol=1e-12)
    assert score.mean_prob == pytest.approx(P1.mean())
    assert score.sbar == pytest.approx(0.230940, abs=1e-6)
    assert score.coverage and score.consistency
    # The band is rollout 0 (tied with 2, lower index wins); 1 of 2 items fails nu = 0.6.
    s[0, 1] = False
    assert not score_group(logp, s, omega=2.0).accepted


# --- rubric JSON ---------------------------------------------------------------------------------


def test_parse_rubric_judgment_takes_the_last_array():
    text = (
        'Example format: [{"id": 0, "satisfied": true}]\n'
        "Now the verdicts:\n```json\n"
        '[{"id": 0, "satisfied": false, "justification": "cites [1] wrongly"},\n'
        ' {"id": 1, "satisfied": true, "justification": "ok"},\n'
        ' {"id": "3", "satisfied": "Yes"}]\n```'
    )
    # Nested brackets in a justification are part of the last array; id 2 is missing.
    out = parse_rubric_judgment(text, [0, 1, 2, 3])
    assert out.dtype == bool
    assert out.tolist() == [False, True, False, True]


def test_parse_rubric_judgment_doubtful_and_duplicate_entries_are_no():
    text = (
        '[{"id": 0, "satisfied": "maybe"}, {"id": 1, "satisfied": 1},'
        ' {"id": 2, "satisfied": true}, {"id": 2, "satisfied": false}, {"id": 3, "satisfied": true}]'
    )
    assert parse_rubric_judgment(text, [0, 1, 2, 3]).tolist() == [False, False, False, True]
    # Ids follow the caller's rubric order, including gaps left by validation.
    assert parse_rubric_judgment(text, [3, 0]).tolist() == [True, False]


@pytest.mark.parametrize(
    "text",
    ["no json here", '[{"id": 0, "satisfied": true', "[1, 2, 3]", "[]", '{"id": 0}'],
)
def test_parse_rubric_judgment_unparseable_is_none(text):
    assert parse_rubric_judgment(text, [0, 1]) is None


def test_parse_rubric_items_truncates_to_ten():
    items = [{"id": i, "rubric_item": f"Does the answer state fact {i}?"} for i in range(12)]
    text = "<think>draft [x]</think>\n" + json.dumps(items)
    out = parse_rubric_items(text)
    assert out == [f"Does the answer state fact {i}?" for i in range(10)]
    skipped = (
        '[{"id": 0, "rubric_item": "  "}, {"id": 1}, "text", {"id": 2, "rubric_item": " A? "}]'
    )
    assert parse_rubric_items(skipped) == ["A?"]
    assert parse_rubric_items('[{"id": 0, "rubric_item": ""}]') is None
    assert parse_rubric_items("I cannot write rubrics.") is None


# --- entropy mask and loss (Eq. 3, App. F.2) ------------------------------------------------------


def test_entropy_mask_keeps_the_ceil_fraction():
    ent = torch.arange(10.0)[None]
    mask = torch.ones(1, 10, dtype=torch.bool)
    keep, thr = entropy_mask(ent, mask, 0.4)
    assert keep.sum() == 4 and thr == 6.0
    keep, thr = entropy_mask(ent[:, :8], mask[:, :8], 0.4)
    assert keep.sum() == 4 and thr == 4.0  # ceil(3.2) = 4
    keep, _ = entropy_mask(torch.ones(1, 10), mask, 0.4)
    assert keep.sum() == 10  # all tied
    # Masked positions neither count for the threshold nor get kept.
    ent = torch.tensor([[1.0, 9.0, 2.0, 3.0]])
    keep, thr = entropy_mask(ent, torch.tensor([[True, False, True, True]]), 0.3)
    assert keep.tolist() == [[False, False, False, True]] and thr == 3.0
    keep, thr = entropy_mask(ent, torch.zeros(1, 4, dtype=torch.bool), 0.3)
    assert not keep.any() and thr == math.inf


NEG_INF = -math.inf


def _loss_batch():
    """Four sequences, T=3: 0 (accepted), 1 (accepted, truncated), 2 and 3 (rejected group).

    Padding holds -inf log-probs. Only sequence 0's first two tokens are in M; the 80/20 mask at
    rho_ent=0.5 keeps its higher-entropy token 1, whose ratio 0.4/0.2 = 2 is clipped to 1.2."""
    logp = torch.tensor(
        [
            [math.log(0.5), math.log(0.4), NEG_INF],
            [math.log(0.3), math.log(0.3), math.log(0.3)],
            [math.log(0.9), math.log(0.1), math.log(0.2)],
            [math.log(0.6), NEG_INF, NEG_INF],
        ],
        dtype=torch.float64,
        requires_grad=True,
    )
    old = torch.tensor(
        [
            [math.log(0.5), math.log(0.2), NEG_INF],
            [math.log(0.1), math.log(0.1), math.log(0.1)],
            [math.log(0.1), math.log(0.9), math.log(0.2)],
            [math.log(0.1), NEG_INF, NEG_INF],
        ],
        dtype=torch.float64,
    )
    ref = torch.tensor(
        [
            [math.log(0.25), math.log(0.4), NEG_INF],
            [math.log(0.9), math.log(0.9), math.log(0.9)],
            [math.log(0.01), math.log(0.01), math.log(0.01)],
            [math.log(0.01), NEG_INF, NEG_INF],
        ],
        dtype=torch.float64,
    )
    entropy = torch.tensor(
        [[0.3, 0.9, 5.0], [8.0, 8.0, 8.0], [9.0, 9.0, 9.0], [9.0, 0.0, 0.0]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return dict(
        logp=logp,
        old_logp=old,
        ref_logp=ref,
        entropy=entropy,
        advantages=torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64),
        mask=mask,
        truncated=torch.tensor([False, True, False, False]),
        accepted=torch.tensor([True, True, False, False]),
    )


def test_loss_hand_computed():
    b = _loss_batch()
    loss, stats = dro_loss(**b, beta=0.1, rho_ent=0.5, max_len=4)
    # PG: -min(2 * 1, 1.2 * 1) on one token; KL k3 at token 0: 0.5 - ln 0.5 - 1 = ln 2 - 0.5.
    # Normaliser: N_acc = 2 (the truncated sequence counts) times max_len 4.
    kl = math.log(2) - 0.5
    assert loss.item() == pytest.approx((-1.2 + 0.1 * kl) / 8, abs=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(-1.2 / 8, abs=1e-12)
    assert stats["kl_loss"].item() == pytest.approx(kl / 8, abs=1e-12)
    assert stats["kl_mean"].item() == pytest.approx(kl / 2, abs=1e-12)
    assert stats["entropy_threshold"].item() == pytest.approx(0.9)
    assert stats["pg_token_frac"].item() == pytest.approx(0.5)
    assert stats["num_sequences"].item() == 2
    assert stats["clip_frac"].item() == pytest.approx(1.0)
    loss.backward()
    grad = b["logp"].grad
    assert torch.isfinite(grad).all()
    # Clipped PG passes no gradient; KL at token 0: beta * (1 - exp(ref - logp)) / 8 = 0.1*0.5/8.
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[0, 0] = 0.1 * 0.5 / 8
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def test_rejected_groups_give_exactly_zero_gradient_and_do_not_count():
    b = _loss_batch()
    all_rejected = torch.zeros(4, dtype=torch.bool)
    loss, stats = dro_loss(**{**b, "accepted": all_rejected}, beta=0.1, rho_ent=0.5)
    loss.backward()
    assert loss.item() == 0.0 and stats["num_sequences"].item() == 0
    assert stats["kl_loss"].item() == 0.0
    # Same stats keys whether or not anything was accepted, so step metrics aggregate.
    assert stats.keys() == dro_loss(**_loss_batch(), beta=0.1)[1].keys()
    assert torch.equal(b["logp"].grad, torch.zeros(4, 3, dtype=torch.float64))
    # Dropping the rejected rows beforehand gives the same loss: they never entered it.
    b = _loss_batch()
    full, _ = dro_loss(**b, beta=0.1, rho_ent=0.5, max_len=4)
    kept = {k: v[:2].detach() if k != "logp" else v[:2] for k, v in b.items()}
    alone, _ = dro_loss(**kept, beta=0.1, rho_ent=0.5, max_len=4)
    assert full.item() == pytest.approx(alone.item(), abs=1e-15)


def test_gradient_is_advantage_weighted_score_at_ratio_one():
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 5, 4, dtype=torch.float64), -1)[..., 0]
    logp = logp.clone().requires_grad_(True)
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    loss, _ = dro_loss(logp, logp.detach(), adv, mask, beta=0.0, max_len=6)
    loss.backward()
    expected = torch.where(mask, -adv[:, None] / (3 * 6), torch.zeros(3, 5, dtype=torch.float64))
    torch.testing.assert_close(logp.grad, expected, atol=1e-15, rtol=0)


def test_truncated_rollout_shifts_the_baseline_but_gets_no_gradient():
    rewards = np.array([0.6, 0.2, 0.4, 0.9])  # rollout 3 is truncated
    adv = torch.tensor(group_advantage(rewards))
    without = group_advantage(rewards[:3])
    assert not np.allclose(adv.numpy()[:3], without)
    logp = torch.full((4, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    mask = torch.ones(4, 2, dtype=torch.bool)
    truncated = torch.tensor([False, False, False, True])
    loss, _ = dro_loss(logp, logp.detach(), adv, mask, truncated=truncated, beta=0.0)
    loss.backward()
    assert torch.equal(logp.grad[3], torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(logp.grad[:3], (-adv[:3, None] / 8).expand(3, 2), rtol=0, atol=1e-15)


def test_micro_batches_share_the_step_normaliser():
    torch.manual_seed(1)
    logp = torch.log(torch.rand(4, 3, dtype=torch.float64))
    old = torch.log(torch.rand(4, 3, dtype=torch.float64))
    ref = torch.log(torch.rand(4, 3, dtype=torch.float64))
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.bool)
    accepted = torch.tensor([True, True, False, True])
    args = dict(beta=0.01, max_len=5)
    full, _ = dro_loss(logp, old, adv, mask, ref, accepted=accepted, **args)
    parts = [
        dro_loss(
            logp[s], old[s], adv[s], mask[s], ref[s], accepted=accepted[s], num_sequences=3, **args
        )[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert full.item() == pytest.approx(sum(p.item() for p in parts), abs=1e-14)
    with pytest.raises(ValueError, match="num_sequences"):
        dro_loss(logp, old, adv, mask, ref, num_sequences=2, **args)
    with pytest.raises(ValueError, match="needs ref_logp"):
        dro_loss(logp, old, adv, mask, beta=0.1)
