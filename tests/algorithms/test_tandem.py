"""Tandem co-generation core: word boundaries, the author state machine against hand-placed redraws,
seeded replay, the segment-loop oracle on scripted models, and the senior-only loss gate."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tokenizers import ByteLevelBPETokenizer

from rlvr.algorithms.grpo import policy_loss
from rlvr.algorithms.tandem import (
    JUNIOR,
    SENIOR,
    SwitchCounters,
    WordSwitchSchedule,
    authorship_matrix,
    require_same_vocab,
    sample_token,
    schedule_metrics,
    senior_loss_mask,
    tandem_generate_reference,
    word_boundary_ids,
)

Z99 = 2.5758  # two-sided 99% normal quantile


def seed_with_draws(schedule: WordSwitchSchedule, wanted: list[int]) -> int:
    """The first seed whose first draws are `wanted` (a scripted coin built from the real one)."""
    return next(
        s for s in range(10_000) if [schedule.draw(s, i) for i in range(len(wanted))] == wanted
    )


# Word boundaries and vocabularies


def test_boundary_set_is_exactly_the_leading_space_tokens_of_a_toy_vocab():
    vocab = {
        "<|endoftext|>": 0,
        "\u0120the": 1,
        "cat": 2,
        "\u0120sat": 3,
        "\u010a": 4,  # "\n"
        "\u010a\u010a": 5,  # "\n\n"
        "\u0120": 6,
        "\u0120\u010a": 7,  # " \n" carries the marker
        "x\u0120": 8,  # marker inside, not leading
    }
    assert word_boundary_ids(vocab) == frozenset({1, 3, 6, 7})


def test_boundary_set_of_a_trained_byte_level_tokenizer_marks_word_starts():
    text = ["the cat sat on the mat and the dog sat on the log"] * 20
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(text, vocab_size=300, min_frequency=1, special_tokens=["<|eos|>"])
    boundary = word_boundary_ids(tok.get_vocab())
    sentence = "the cat sat on the log"
    enc = tok.encode(sentence)
    # A byte-level token that begins a word spans the space before it; the first word has none.
    starts_word = [sentence[start] == " " for start, _ in enc.offsets]
    assert [i in boundary for i in enc.ids] == starts_word
    assert sum(starts_word) == 5
    assert tok.token_to_id("<|eos|>") not in boundary


def test_a_vocab_without_the_marker_is_refused():
    with pytest.raises(ValueError, match="byte-level"):
        word_boundary_ids({"\u2581the": 0, "cat": 1})


def test_vocabularies_must_match_exactly():
    require_same_vocab({"a": 0, "b": 1}, {"b": 1, "a": 0})
    with pytest.raises(ValueError, match="1 with different ids"):
        require_same_vocab({"a": 0, "b": 1}, {"a": 2, "b": 1, "c": 0})
    with pytest.raises(ValueError, match="1 only in the junior"):
        require_same_vocab({"a": 0}, {"a": 0, "z": 1})


# The state machine (arXiv:2606.28166, Sec. 3.3 and App. A.1.2), with redraw positions placed by
# hand

B = frozenset({1})  # token 1 is the only word boundary; 5 is any non-boundary token


@pytest.fixture
def k4():
    return WordSwitchSchedule(B, p=0.5, cap=4)


def test_no_redraw_without_boundary_or_cap(k4):
    state = k4.start(7)
    first = state.author
    assert [state.observe(5) for _ in range(3)] == [first] * 3
    assert (state.since, state.n_tokens, state.counters) == (3, 3, SwitchCounters())


def test_boundary_redraw_changes_the_next_tokens_author_and_resets_the_counter(k4):
    seed = seed_with_draws(k4, [SENIOR, JUNIOR])
    state = k4.start(seed)
    authors = [state.observe(t) for t in [5, 1, 5, 5]]
    # The boundary token itself is still written by the old author.
    assert authors == [SENIOR, SENIOR, JUNIOR, JUNIOR]
    assert state.since == 2
    assert state.counters == SwitchCounters(boundary_redraws=1, cap_redraws=0, switches=1)


def test_cap_redraws_after_the_kth_token_not_the_next(k4):
    seed = seed_with_draws(k4, [JUNIOR, SENIOR])
    state = k4.start(seed)
    authors = [state.observe(5) for _ in range(5)]
    assert authors == [JUNIOR] * 4 + [SENIOR]
    assert state.counters == SwitchCounters(boundary_redraws=0, cap_redraws=1, switches=1)
    assert state.since == 1


def test_counter_restarts_after_a_boundary_and_a_same_author_redraw_counts(k4):
    seed = seed_with_draws(k4, [SENIOR, SENIOR, JUNIOR])
    state = k4.start(seed)
    authors = [state.observe(t) for t in [5, 5, 1, 5, 5, 5, 5, 5]]
    # Redraw 1 after t2 (boundary, same author wins), redraw 2 after t6 (4 tokens later: cap).
    assert authors == [SENIOR] * 7 + [JUNIOR]
    assert state.counters == SwitchCounters(boundary_redraws=1, cap_redraws=1, switches=1)


def test_a_boundary_that_also_reaches_the_cap_counts_as_boundary(k4):
    state = k4.start(0)
    for t in [5, 5, 5, 1]:
        state.observe(t)
    assert (state.counters.boundary_redraws, state.counters.cap_redraws, state.since) == (1, 0, 0)


def test_authorship_follows_the_draw_index_of_each_token():
    schedule = WordSwitchSchedule(frozenset({1, 2}), p=0.5, cap=3)
    tokens = [5, 1, 5, 5, 5, 5, 2, 1, 5]
    # Redraws after t1 (boundary), t4 (cap), t6 (boundary), t7 (boundary): draw index per token.
    draw_index = [0, 0, 1, 1, 1, 2, 2, 3, 4]
    for seed in range(5):
        expected = [schedule.draw(seed, i) for i in draw_index]
        assert schedule.authorship(seed, tokens) == expected


def test_replay_of_every_prefix_equals_the_step_by_step_state():
    schedule = WordSwitchSchedule(frozenset(range(0, 50, 7)), p=0.5, cap=5)
    tokens = np.random.default_rng(0).integers(0, 50, size=300).tolist()
    state = schedule.start(42)
    for n, token in enumerate(tokens, start=1):
        state.observe(token)
        assert schedule.replay(42, tokens[:n]) == state


def test_gaps_between_redraws_never_exceed_the_cap():
    schedule = WordSwitchSchedule(frozenset({3}), p=0.5, cap=6)
    tokens = np.random.default_rng(1).integers(0, 40, size=2000).tolist()
    state = schedule.start(3)
    events = []
    for t, token in enumerate(tokens):
        before = state.counters.redraws
        state.observe(token)
        if state.counters.redraws > before:
            events.append(t)
    assert np.diff([-1, *events]).max() <= 6
    assert state.counters.boundary_redraws == tokens.count(3)


def test_without_boundaries_redraws_come_exactly_every_k_tokens():
    schedule = WordSwitchSchedule(frozenset(), p=0.5, cap=4)
    state = schedule.start(9)
    events = []
    for t in range(40):
        state.observe(5)
        if state.since == 0:
            events.append(t)
    assert events == list(range(3, 40, 4))
    assert state.counters.cap_redraws == 10


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_senior_wins_a_share_p_of_redraws_and_changes_authors_at_rate_2p_1_minus_p(p):
    # Every token is a boundary, so each token's author is one fresh draw.
    n = 20_000
    schedule = WordSwitchSchedule(frozenset({0}), p=p, cap=32)
    authors = np.array(schedule.authorship(2024, [0] * n))
    assert abs(authors.mean() - p) <= Z99 * math.sqrt(p * (1 - p) / n)
    change = 2 * p * (1 - p)
    # Consecutive change indicators are 1-dependent: covariance p(1-p) - change^2.
    var = change * (1 - change) + 2 * abs(p * (1 - p) - change**2)
    assert abs(np.mean(authors[1:] != authors[:-1]) - change) <= Z99 * math.sqrt(var / n)


def test_p_one_is_all_senior_and_p_zero_all_junior():
    tokens = np.random.default_rng(2).integers(0, 10, size=200).tolist()
    for seed in range(10):
        assert set(WordSwitchSchedule(B, p=1.0).authorship(seed, tokens)) == {SENIOR}
        assert set(WordSwitchSchedule(B, p=0.0).authorship(seed, tokens)) == {JUNIOR}


def test_same_seed_same_authorship_different_seed_different():
    schedule = WordSwitchSchedule(frozenset({0, 1}), p=0.5, cap=8)
    tokens = np.random.default_rng(3).integers(0, 6, size=200).tolist()
    assert schedule.authorship(11, tokens) == schedule.authorship(11, tokens)
    assert schedule.authorship(11, tokens) != schedule.authorship(12, tokens)


def test_invalid_schedules_are_refused():
    with pytest.raises(ValueError):
        WordSwitchSchedule(B, p=1.5)
    with pytest.raises(ValueError):
        WordSwitchSchedule(B, cap=0)


# Sampling contract


def test_sample_token_filters_and_draws_one_exponential_per_token():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    assert sample_token(logits, g, temperature=0.0) == 1
    assert torch.equal(g.get_state(), state)  # greedy draws nothing
    # Top-p 0.75 drops 0.05 and 0.15 (mass below them 0.2 <= 0.25); top-k 1 keeps the mode.
    assert {sample_token(logits, g, top_p=0.75) for _ in range(300)} == {1, 2}
    assert {sample_token(logits, g, top_k=1) for _ in range(50)} == {1}
    assert {sample_token(logits, g, top_k=2) for _ in range(300)} == {1, 2}
    # Exactly one Exp(1) draw over the row: argmax(probs / noise) from the same generator.
    for seed in range(20):
        noise = torch.empty(4).exponential_(generator=torch.Generator().manual_seed(seed))
        expected = int((torch.softmax(logits / 0.7, -1) / noise).argmax())
        g = torch.Generator().manual_seed(seed)
        assert sample_token(logits, g, temperature=0.7) == expected


def test_sample_token_frequencies_match_the_distribution():
    probs = np.array([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    logits = torch.tensor(probs).log()
    counts = np.bincount([sample_token(logits, g) for _ in range(n)], minlength=3)
    # Chi-square goodness of fit over all categories at once; false alarm rate 0.1%.
    assert chisquare(counts, n * probs).pvalue > 1e-3


# The segment-loop oracle on scripted models

VOCAB = 10
TABLE = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0))


def scripted(parity: int):
    """Logits a fixed function of the context length, restricted to ids of one parity."""

    def logits(ids: list[int]) -> torch.Tensor:
        row = TABLE[len(ids) % 64]
        return torch.where(
            torch.arange(VOCAB) % 2 == parity, row, torch.full_like(row, float("-inf"))
        )

    return logits


def shared(ids: list[int]) -> torch.Tensor:
    return TABLE[(len(ids) * 7 + sum(ids)) % 64]


SENIOR_EVEN, JUNIOR_ODD = scripted(0), scripted(1)
WORDS = frozenset({2, 3, 4})
PROMPT = [1, 2, 3]


@pytest.mark.parametrize("eos", [8, 9])
def test_authorship_marks_exactly_the_senior_sampled_tokens_including_eos(eos):
    schedule = WordSwitchSchedule(WORDS, p=0.5, cap=4)
    seen = set()
    for seed in range(30):
        out = tandem_generate_reference(
            PROMPT, SENIOR_EVEN, JUNIOR_ODD, schedule, seed, max_tokens=12, stop_ids={eos}
        )
        assert len(out.authorship) == len(out.response_ids)
        assert out.authorship == [int(t % 2 == 0) for t in out.response_ids]
        assert out.authorship == schedule.authorship(seed, out.response_ids)
        assert out.counters == schedule.replay(seed, out.response_ids).counters
        seen.add(out.finish_reason)
        if out.finish_reason == "stop":
            assert out.response_ids[-1] == eos
            assert out.authorship[-1] == int(eos % 2 == 0)
        else:
            assert len(out.response_ids) == 12
    assert seen == {"stop", "length"}


def test_one_generator_draw_per_token_whoever_writes():
    # With one model in both seats the team response is the solo response of that model.
    schedule = WordSwitchSchedule(WORDS, p=0.5, cap=3)
    out = tandem_generate_reference(PROMPT, shared, shared, schedule, 17, 30, stop_ids=set())
    g = torch.Generator().manual_seed(17)
    context, solo = list(PROMPT), []
    for _ in range(30):
        solo.append(sample_token(shared(context), g))
        context.append(solo[-1])
    assert out.response_ids == solo
    assert len(set(out.authorship)) == 2


def test_seeded_rollouts_replay_and_differ_across_seeds():
    schedule = WordSwitchSchedule(WORDS, p=0.5, cap=4)

    def run(seed):
        out = tandem_generate_reference(
            PROMPT, SENIOR_EVEN, JUNIOR_ODD, schedule, seed, 30, set(), temperature=0.9, top_p=0.9
        )
        return out.response_ids, out.authorship

    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize("p", [0.5, 0.8])
def test_identical_models_give_a_senior_token_fraction_near_p(p):
    schedule = WordSwitchSchedule(WORDS, p=p, cap=4)
    fracs = [
        np.mean(
            tandem_generate_reference(PROMPT, shared, shared, schedule, s, 25, set()).authorship
        )
        for s in range(200)
    ]
    # Tokens do not depend on the author here, so every token's author is one Bernoulli(p) draw.
    assert abs(np.mean(fracs) - p) <= Z99 * np.std(fracs, ddof=1) / math.sqrt(len(fracs))


def test_p_one_and_p_zero_rollouts():
    for p, author in [(1.0, SENIOR), (0.0, JUNIOR)]:
        out = tandem_generate_reference(
            PROMPT, SENIOR_EVEN, JUNIOR_ODD, WordSwitchSchedule(WORDS, p=p), 1, 20, set()
        )
        assert set(out.authorship) == {author}
        assert all(t % 2 == (1 - author) for t in out.response_ids)
        assert out.counters.switches == 0


# Loss gate (Sec. 3.4, Eq. 1: senior-emitted positions only, no correction for junior tokens)


def test_authorship_matrix_places_truncates_and_refuses_short_masks():
    m = authorship_matrix([[1, 0, 1], [0, 1, 1, 1]], lengths=[3, 4], offsets=[2, 1], width=5)
    assert m.tolist() == [[0, 0, 1, 0, 1], [0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="2 flags for 3"):
        authorship_matrix([[1, 0]], lengths=[3], offsets=[0], width=5)


def test_senior_mask_is_response_and_senior_and_never_adds_positions():
    response = torch.tensor([[False, True, True, True, False]])
    authorship = torch.tensor([[1, 1, 0, 1, 1]])
    assert senior_loss_mask(response, authorship).tolist() == [[False, True, False, True, False]]
    with pytest.raises(ValueError, match="no authorship mask"):
        senior_loss_mask(response, None)
    with pytest.raises(ValueError, match="authorship"):
        senior_loss_mask(response, authorship[:, :3])


def batch_from_rollouts(p: float):
    """Three scripted rollouts in the trainer's prompt+response layout."""
    schedule = WordSwitchSchedule(WORDS, p=p, cap=4)
    outs = [
        tandem_generate_reference(PROMPT, SENIOR_EVEN, JUNIOR_ODD, schedule, s, 6 + s, set())
        for s in range(3)
    ]
    width = len(PROMPT) + max(len(o.response_ids) for o in outs)
    response_mask = torch.zeros((3, width), dtype=torch.bool)
    for i, o in enumerate(outs):
        response_mask[i, len(PROMPT) : len(PROMPT) + len(o.response_ids)] = True
    authorship = authorship_matrix(
        [o.authorship for o in outs],
        [len(o.response_ids) for o in outs],
        [len(PROMPT)] * 3,
        width,
    )
    return response_mask, authorship


def loss_and_grad(logp_values, old, adv, mask):
    logp = logp_values.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask)
    loss.backward()
    return loss.detach(), logp.grad


def test_p_one_reduces_exactly_to_grpo():
    response_mask, authorship = batch_from_rollouts(p=1.0)
    gated = senior_loss_mask(response_mask, authorship)
    assert torch.equal(gated, response_mask)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(response_mask.shape, generator=g)
    old = logp - 0.3 * torch.rand(response_mask.shape, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25])
    tandem = loss_and_grad(logp, old, adv, gated)
    grpo = loss_and_grad(logp, old, adv, response_mask)
    assert torch.equal(tandem[0], grpo[0]) and torch.equal(tandem[1], grpo[1])


def test_loss_covers_senior_tokens_only_and_ignores_junior_log_probs():
    response_mask, authorship = batch_from_rollouts(p=0.5)
    gated = senior_loss_mask(response_mask, authorship)
    n_senior = int(gated.sum())
    assert 0 < n_senior < int(response_mask.sum())
    logp = -torch.rand(response_mask.shape, generator=torch.Generator().manual_seed(1))
    adv = torch.tensor([1.0, -0.5, 0.25])
    loss, grad = loss_and_grad(logp, logp, adv, gated)
    # Ratio 1 everywhere: each senior token's loss is -A of its row, averaged over senior tokens.
    expected = -(gated.sum(1).float() * adv).sum() / n_senior
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    junior = response_mask & ~gated
    assert torch.all(grad[~gated] == 0)
    # Wild senior log-probs at junior positions (even -inf) change nothing.
    perturbed = torch.where(junior, torch.full_like(logp, float("-inf")), logp)
    loss2, grad2 = loss_and_grad(perturbed, logp, adv, gated)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)


def test_all_junior_batch_gives_zero_loss_zero_gradient_and_no_nan():
    response_mask, authorship = batch_from_rollouts(p=0.0)
    gated = senior_loss_mask(response_mask, authorship)
    assert not gated.any()
    logp = torch.where(response_mask, torch.tensor(float("-inf")), torch.tensor(-1.0))
    loss, grad = loss_and_grad(logp, torch.zeros_like(logp), torch.ones(3), gated)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_schedule_metrics_by_hand():
    authorships = [[1, 1, 0, 0, 1], [0, 0, 0], []]
    counters = [
        SwitchCounters(boundary_redraws=2, cap_redraws=1, switches=2),
        SwitchCounters(boundary_redraws=0, cap_redraws=1, switches=0),
        SwitchCounters(),
    ]
    m = schedule_metrics(authorships, counters)
    assert m == {
        "tandem/senior_token_frac": 3 / 8,
        "tandem/switches_per_seq": 2 / 3,
        "tandem/mean_run_length": 8 / 4,  # runs: 3 + 1
        "tandem/cap_redraw_share": 2 / 4,
    }
