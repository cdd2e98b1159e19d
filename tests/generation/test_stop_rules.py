"""StopRuleTracker: each response token reaches the rule once, in order, a stop is latched, and
the EOS it forced is flagged."""

from rlvr.generation.stop_rules import FORCED_EOS, StopRuleTracker


def test_one_call_per_new_token(stop_after):
    rule = stop_after(3)
    tracker = StopRuleTracker(rule, eos_token_id=2)
    ids: list[int] = []
    fired = []
    for token in [10, 11, 12, 13]:
        ids.append(token)
        fired.append(tracker.observe(ids))
        fired.append(tracker.observe(ids))  # a second look at the same ids asks nothing new
    assert fired == [False, False, False, False, True, True, True, True]
    assert rule.shown == [1, 2, 3]  # latched at 3: the 4th token is never shown


def test_backlog_is_replayed_prefix_by_prefix(stop_on_token):
    rule = stop_on_token(12)
    tracker = StopRuleTracker(rule, eos_token_id=2)
    # Three tokens arrive at once (e.g. after a preemption); the rule must fire at the 2nd.
    assert tracker.observe([11, 12, 12])
    assert rule.flags() == {"aborted": True, "at": 2}
    assert tracker.seen == 2


def test_length_excludes_placeholders(stop_after):
    rule = stop_after(2)
    tracker = StopRuleTracker(rule, eos_token_id=2)
    assert not tracker.observe([7, -1], length=1)
    assert rule.shown == [1]
    assert tracker.observe([7, 8], length=2)
    assert rule.shown == [1, 2]


def test_the_forced_eos_is_flagged_where_it_follows_the_firing(stop_after):
    tracker = StopRuleTracker(stop_after(2), eos_token_id=2)
    assert not tracker.observe([7])
    assert FORCED_EOS not in tracker.flags(1)
    assert tracker.observe([7, 8])
    assert FORCED_EOS not in tracker.flags(2)  # max_tokens ended it before EOS could be forced
    assert tracker.flags(3)[FORCED_EOS] == 2  # the response's 3rd token, EOS, was forced
