"""The engines' shared Tandem pieces: batched draws that equal the seeding contract's
`sample_token` row by row, and the author tracker fed a growing response at the engine's pace."""

import pytest
import torch

from rlvr.algorithms.tandem import WordSwitchSchedule, sample_token
from rlvr.generation.hf_backend import processed_logprobs
from rlvr.generation.tandem_support import (
    AuthorTracker,
    counters_from_flags,
    draw_tokens,
    tandem_seed,
)

SCHEDULE = WordSwitchSchedule(frozenset({1}), p=0.5, cap=3)


@pytest.mark.parametrize("vocab", [37, 1024])
@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_draws_equal_sample_token_row_by_row(vocab, temperature, top_p):
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    for _ in range(3):  # several steps: each generator advances exactly as sample_token's
        trackers = [AuthorTracker(SCHEDULE, 40 + i, temperature, top_p) for i in range(9)]
        mirrors = [torch.Generator().manual_seed(40 + i) for i in range(9)]
        tokens, logprobs = draw_tokens(logits, trackers)
        want = [sample_token(logits[i], mirrors[i], temperature, top_p) for i in range(9)]
        assert tokens == want
        expected = processed_logprobs(logits, temperature, top_p)[range(9), want]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
        for tracker, mirror in zip(trackers, mirrors, strict=True):
            assert torch.equal(tracker.generator.get_state(), mirror.get_state())


def test_rows_with_different_settings_each_follow_their_own():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    settings = [(0.0, 1.0), (1.0, 1.0), (0.0, 1.0), (0.5, 0.8)]
    trackers = [AuthorTracker(SCHEDULE, 7, t, p) for t, p in settings]
    tokens, _ = draw_tokens(logits, trackers)
    want = [
        sample_token(logits[i], torch.Generator().manual_seed(7), t, p)
        for i, (t, p) in enumerate(settings)
    ]
    assert tokens == want


def test_the_tracker_catches_up_at_the_engines_pace():
    live: list[int] = []
    tracker = AuthorTracker(SCHEDULE, 5, 1.0, 1.0)
    response = [5, 1, 5, 5, 5, 9, 1, 5]
    for token in response[:3]:
        live.append(token)
        tracker.observe(live)
    live.extend(response[3:6])  # three tokens at once, as after a preemption
    live.append(-1)  # an async placeholder is not a token yet
    tracker.observe(live, len(live) - 1)
    live.pop()
    live.extend(response[6:])
    assert tracker.finish(live) == SCHEDULE.authorship(5, response)
    assert tracker.state.author == SCHEDULE.replay(5, response).author
    counters = counters_from_flags(tracker.flags())
    # boundaries at tokens 2 and 7; the cap (3) after token 5 (three tokens since token 2)
    assert (counters.boundary_redraws, counters.cap_redraws) == (2, 1)
    assert tracker.flags()["tandem"]["redraws"] == 3
    with pytest.raises(RuntimeError, match="8 flags for 1 tokens"):
        tracker.finish(response[:1])


def test_unseeded_samples_get_a_fresh_seed_and_seeded_ones_keep_theirs():
    assert tandem_seed(12) == 12
    assert tandem_seed(None) != tandem_seed(None)
