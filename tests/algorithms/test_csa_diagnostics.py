"""CSA-Epoch's operational layer (arXiv:2605.20270, App. B.5, Thm 5.1): the Brier early-reset
diagnostic, the warm start, the drift budget nu, the epoch log, and pathwise validity under
periodic policy improvement."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from rlvr.algorithms.csa import CSAController, plugin_bet
from rlvr.algorithms.csa.diagnostics import BrierMonitor
from rlvr.algorithms.csa.simulation import logistic_fail_prob, make_streams, summarise

ALPHA, DELTA = 0.3, 0.1
GRID2 = [0.2, 0.5]

# (score, failed) pairs whose Brier terms (s - f)^2 are exact binary fractions: with W = 2 and
# rho = 0.2 the baseline is (0.25 + 0)/2 = 0.125 and the bar 0.15. The windows after the warm-up:
# 0.125 (not above), 0.25 (run 1), 0.125 (dip: run 0), 0.28125 (run 1), 0.40625 (run 2 = W: fire).
BRIER_ROUNDS = [
    (0.5, False),
    (0.0, False),
    (0.5, True),
    (0.5, False),
    (1.0, True),
    (0.75, False),
    (0.5, True),
]
BRIER_WINDOWS = [0.25, 0.125, 0.125, 0.25, 0.125, 0.28125, 0.40625]
BRIER_RUNS = [0, 0, 0, 1, 0, 1, 2]


def feed(ctrl: CSAController, rounds) -> list:
    """Decide and label each (score, passed) round in turn."""
    out = []
    for s, p in rounds:
        d = ctrl.decide(s)
        ctrl.observe(d.seq, p)
        out.append(d)
    return out


def roundtrip(ctrl: CSAController) -> CSAController:
    return CSAController.from_state_dict(json.loads(json.dumps(ctrl.state_dict())))


# --------------------------------------------------------------------------- Brier monitor


def test_brier_monitor_by_hand():
    mon = BrierMonitor(window=2, threshold=0.2)
    fired = []
    for (s, f), window, run in zip(BRIER_ROUNDS, BRIER_WINDOWS, BRIER_RUNS, strict=True):
        fired.append(mon.update(s, f))
        assert mon.window_brier == window and mon.view()["rounds_above"] == run
    assert fired == [False] * 6 + [True]
    assert mon.baseline == 0.125 and mon.view()["bar"] == (1 + 0.2) * 0.125
    mon.reset()
    assert mon.view() == {
        "baseline": None,
        "window_brier": None,
        "bar": None,
        "rounds_above": 0,
        "labels": 0,
    }


def test_brier_monitor_edge_cases():
    # A window mean exactly at the bar is no rise: baseline 0.125, rho = 1 -> bar 0.25 (exact).
    mon = BrierMonitor(window=2, threshold=1.0)
    for s, f in [(0.5, False), (0.0, False), (0.5, True), (0.5, False), (0.5, True)]:
        assert not mon.update(s, f)
    assert mon.window_brier == 0.25 and mon.view()["rounds_above"] == 0
    # Baseline 0: any positive window mean is a rise; a zero window is not.
    mon = BrierMonitor(window=1, threshold=0.2)
    assert not mon.update(0.0, False) and mon.baseline == 0.0
    assert not mon.update(1.0, True)
    assert mon.update(0.5, False)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            BrierMonitor(window=bad)
    for bad in (0.0, -0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="threshold"):
            BrierMonitor(threshold=bad)


def test_brier_monitor_state_round_trip():
    a = BrierMonitor(window=2, threshold=0.2)
    for s, f in BRIER_ROUNDS[:5]:
        a.update(s, f)
    b = BrierMonitor(window=2, threshold=0.2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.update(s, f) for s, f in BRIER_ROUNDS[5:]] == [
        b.update(s, f) for s, f in BRIER_ROUNDS[5:]
    ]
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="exceed the window"):
        BrierMonitor(window=1).load_state_dict(a.state_dict())


# --------------------------------------------------------------------------- Brier in the controller


def test_brier_alarm_starts_an_epoch_at_the_next_seq_and_keeps_open_rounds():
    ctrl = CSAController(0.5, DELTA, GRID2, brier_window=2, brier_threshold=0.2)
    for s, _ in BRIER_ROUNDS:
        ctrl.decide(s)
    ctrl.decide(0.1)  # seqs 7 and 8 are decided before the alarm: open rounds of epoch 1
    ctrl.decide(0.1)
    for seq, (_, failed) in enumerate(BRIER_ROUNDS[:-1]):
        ctrl.observe(seq, not failed)
    assert ctrl.epoch == 1 and ctrl.metrics()["brier"]["rounds_above"] == 1
    ctrl.observe(6, not BRIER_ROUNDS[6][1])
    # Fired while applying seq 6, from applied labels only; the boundary is the next seq decided.
    assert ctrl.epoch == 2
    assert ctrl.epoch_log == [
        {
            "epoch": 2,
            "first_seq": 9,
            "reason": "brier",
            "baseline": 0.125,
            "window_brier": 0.40625,
            "bar": (1 + 0.2) * 0.125,
            "rounds_above": 2,
            "labels": 2,
        }
    ]
    assert ctrl.metrics()["brier"]["labels"] == 0  # a fresh warm-up for the new epoch
    # The open rounds still take their labels: realised-risk counters only, no e-process, no Brier.
    ctrl.observe(7, False)
    ctrl.observe(8, False)
    state = ctrl.state_dict()
    assert state["n"] == [0, 0] and state["applied"] == 9 and state["brier"]["values"] == []
    assert ctrl.decide(0.3).seq == 9


def test_brier_skips_expired_and_unverified_rounds():
    ctrl = CSAController(0.5, DELTA, GRID2, brier_window=2)
    for s in (0.5, 0.0, 0.5):
        ctrl.decide(s)
    ctrl.observe(0, True)
    ctrl.expire(1)  # an imputed failure is not a verifier label
    ctrl.observe(2, True)
    assert ctrl.state_dict()["brier"]["values"] == [0.25, 0.25]
    sparse = CSAController(0.5, DELTA, GRID2, sparse_pi_min=0.5, seed=3, brier_window=4)
    labelled = 0
    for s in np.linspace(0.0, 1.0, 40):
        d = sparse.decide(float(s))
        if sparse.wants_label(d.seq):
            sparse.observe(d.seq, True)
            labelled += 1
    assert 0 < labelled < 40 and sparse.metrics()["applied"] == 40
    assert sparse.metrics()["brier"]["labels"] == min(labelled, 4)


def test_brier_state_restores_exactly_mid_run():
    rng = np.random.default_rng(0)
    scores = rng.random(900)
    # Calibrated for 500 rounds (P(fail) = s), then 0.35 worse everywhere: the Brier rises.
    fail_p = np.where(np.arange(900) < 500, scores, np.minimum(scores + 0.35, 1.0))
    passed = rng.random(900) >= fail_p
    rounds = list(zip(scores.tolist(), passed.tolist(), strict=True))
    a = CSAController(ALPHA, DELTA, GRID2, brier_window=100, drift_budget=0.05)
    feed(a, rounds[:560])
    assert a.metrics()["brier"]["rounds_above"] > 0, "the snapshot should be taken mid-run"
    b = roundtrip(a)
    feed(a, rounds[560:])
    feed(b, rounds[560:])
    assert a.state_dict() == b.state_dict()
    assert [e["reason"] for e in a.epoch_log] == ["brier"]
    assert 560 < a.epoch_log[0]["first_seq"] <= 700


def test_brier_fires_after_a_shift_and_not_on_a_calibrated_stream():
    # Calibrated scores (P(fail | s) = s, Brier 1/6) for 2500 rounds, then P(fail | s) =
    # min(s + 0.5, 1) (Brier 1/4, +50%), on 20 streams with the default W = 500.
    n, horizon, shift = 20, 4500, 2500
    streams = make_streams(n, horizon, 7, lambda s: s)
    worse = np.minimum(streams.scores + 0.5, 1.0)
    fail_p = np.where(np.arange(horizon) < shift, streams.scores, worse)
    passed = np.random.default_rng(8).random((n, horizon)) >= fail_p
    first_alarm = []
    for r in range(n):
        ctrl = CSAController(ALPHA, DELTA, GRID2, brier_window=500)
        feed(ctrl, zip(streams.scores[r].tolist(), passed[r].tolist(), strict=True))
        first_alarm.append(ctrl.epoch_log[0]["first_seq"] if ctrl.epoch_log else None)
    # No false alarm before the shift; after it the window must first cross the bar and then stay
    # above it for W labels, so no alarm comes sooner than W after the shift (our simulation of
    # 200 streams: 500-1200 rounds, hence the bound 3W).
    assert all(a is not None and shift + 500 < a <= shift + 1500 for a in first_alarm)


# --------------------------------------------------------------------------- warm start (A6)


def test_warm_start_seeds_the_e_processes_like_rounds():
    warm = CSAController(ALPHA, DELTA, GRID2)
    assert warm.warm_start([0.1] * 23, [True] * 23) == 23
    live = CSAController(ALPHA, DELTA, GRID2)
    feed(live, [(0.1, True)] * 23)
    # Same wealth bit for bit (23 passes certify both thresholds), but no seq, release or risk.
    np.testing.assert_array_equal(warm.log_wealth, live.log_wealth)
    assert warm.threshold == 0.5 and warm.state_dict()["cert_seq"] == [0, 0]
    m = warm.metrics()
    assert (m["decided"], m["applied"], m["released"], m["warm_rounds"]) == (0, 0, 0, 23)
    assert warm.decide(0.1) == (0, True, 0.5)  # released from the very first round
    assert roundtrip(warm).state_dict() == warm.state_dict()


def test_warm_start_only_before_the_epochs_rounds():
    ctrl = CSAController(ALPHA, DELTA, GRID2)
    ctrl.decide(0.1)  # decided (abstained) but not applied: the warm rounds may still go first
    ctrl.warm_start([0.1, 0.3], [True, False])
    with pytest.raises(ValueError, match="warm start"):
        ctrl.warm_start([0.1], [True])
    ctrl.observe(0, True)
    assert ctrl.state_dict()["n"] == [2, 3]
    ctrl.start_new_epoch()
    assert ctrl.metrics()["warm_rounds"] == 0
    ctrl.warm_start([], [])  # n0 = 0 is the paper's code default: nothing happens
    fresh = CSAController(ALPHA, DELTA, GRID2)
    feed(fresh, [(0.1, True)])
    with pytest.raises(ValueError, match="warm start"):
        fresh.warm_start([0.1], [True])
    with pytest.raises(ValueError, match="labels"):
        CSAController(ALPHA, DELTA, GRID2).warm_start([0.1, 0.2], [True])
    with pytest.raises(ValueError, match="finite"):
        CSAController(ALPHA, DELTA, GRID2).warm_start([math.nan], [True])
    # Warm rounds were scored by the old map: a new scorer before any round still resets.
    seeded = CSAController(ALPHA, DELTA, GRID2)
    seeded.switch_versions(scorer="g0")
    seeded.warm_start([0.1], [True])
    seeded.switch_versions(scorer="g1")
    assert seeded.epoch == 2 and seeded.epoch_log[-1]["reason"] == "scorer"


# --------------------------------------------------------------------------- drift budget (A9)


def test_drift_budget_by_hand():
    ctrl = CSAController(ALPHA, DELTA, GRID2, drift_budget=0.1)
    feed(ctrl, [(0.1, True), (0.3, True), (0.1, False)])
    # Budget alpha + nu = 0.4: x = -0.4 (pass) or 0.6 (fail); cap 1/(2 * 0.6) = 5/6.
    # Seq 1 gates q = 0.5 only: lam = min(0.4/0.36, 5/6) = 5/6, factor 1 + (5/6)(0.4) = 4/3.
    # Seq 2 gates both with r_hat = 0: lam = 5/6, factor 1 - (5/6)(0.6) = 1/2.
    np.testing.assert_allclose(np.exp(ctrl.log_wealth), [1 / 2, 2 / 3], rtol=1e-13)  # rounding
    np.testing.assert_array_equal(plugin_bet(np.array([2]), np.array([0]), 0.4), [5 / 6])


def test_drift_budget_tests_alpha_plus_nu_and_loosens_the_bound_by_nu():
    rng = np.random.default_rng(1)
    rounds = list(zip(rng.random(800).tolist(), (rng.random(800) > 0.3).tolist(), strict=True))
    nu = CSAController(ALPHA, DELTA, GRID2, drift_budget=0.1)
    wider = CSAController(ALPHA + 0.1, DELTA, GRID2)
    feed(nu, rounds)
    feed(wider, rounds)
    a, b = nu.state_dict(), wider.state_dict()
    for key in ("ell", "n", "fails", "cert", "cert_seq", "qi", "released", "released_fails"):
        assert a[key] == b[key], key
    m = nu.metrics()
    assert m["released"] > 0
    # nu_bar = (0.1 added once per released round) / N: equal to nu up to float summation.
    assert m["nu_bar"] == pytest.approx(0.1, rel=1e-12)
    risk_bound = ALPHA + m["nu_bar"] + m["slack"]
    assert m["over_bound"] == (m["risk"] > risk_bound)
    assert CSAController(ALPHA, DELTA, GRID2).metrics()["nu_bar"] == 0.0
    for bad in (-0.01, 0.7, 0.9, math.nan):
        with pytest.raises(ValueError, match="drift_budget"):
            CSAController(ALPHA, DELTA, GRID2, drift_budget=bad)


def test_snapshot_from_before_the_diagnostics_restores():
    ctrl = CSAController(ALPHA, DELTA, GRID2)
    feed(ctrl, [(0.1, True)] * 5)
    old = ctrl.state_dict()
    for key in ("drift_budget", "brier_window", "brier_threshold"):
        del old["config"][key]
    for key in ("released_nu", "warm_rounds", "brier", "epoch_log"):
        del old[key]
    assert CSAController.from_state_dict(old).state_dict() == ctrl.state_dict()


# --------------------------------------------------------------------------- epochs (R5)


def test_epoch_log_names_every_reason_and_open_rounds_keep_their_labels():
    ctrl = CSAController(ALPHA, DELTA, GRID2, epoch_length=4)
    ctrl.switch_versions(policy="p0", scorer="g0")
    feed(ctrl, [(0.1, True)] * 5)  # seq 4 opens epoch 2 on schedule
    ctrl.decide(0.1)  # seq 5: open across the next change
    ctrl.switch_versions(scorer="g1")  # a surrogate retrain (R5): epoch 3 from seq 6
    ctrl.decide(0.1)  # seq 6: open across the operator's reset
    ctrl.start_new_epoch(reason="drift alarm")  # epoch 4 from seq 7
    assert [(e["epoch"], e["first_seq"], e["reason"]) for e in ctrl.epoch_log] == [
        (2, 4, "schedule"),
        (3, 6, "scorer"),
        (4, 7, "drift alarm"),
    ]
    ctrl.observe(5, False)
    ctrl.observe(6, False)
    m = ctrl.metrics()
    assert (m["applied"], m["pending"], m["epoch"]) == (7, 0, 4)
    assert ctrl.state_dict()["n"] == [0, 0]  # neither entered epoch 4's e-processes
    nxt = CSAController(ALPHA, DELTA, GRID2, drift_budget=0.05)
    nxt.carry_over(ctrl)
    assert nxt.epoch_log[-1] == {"epoch": 5, "first_seq": 7, "reason": "config_changed"}
    assert nxt.epoch_log[:-1] == ctrl.epoch_log


# --------------------------------------------------------------------------- pathwise validity


def test_pathwise_validity_under_periodic_policy_improvement():
    """G0 streams (s ~ U(0, 1) under a frozen score map) whose policy improves every K rounds:
    P(fail | s) = sigmoid((s - c_k)/0.1) with c_k = 0.40 + 0.05 k in phase k, so the error rate
    drops at each update and the safe frontier rises (Theorem C.1's setting). Each update is
    recorded with `switch_versions(policy=..., trained_through=...)`, trained on labels up to the
    last applied seq (R2)."""
    n, horizon, k = 100, 3000, 500
    centre = 0.40 + 0.05 * (np.arange(horizon) // k)
    streams = make_streams(n, horizon, 11, lambda s: logistic_fail_prob(s, centre))
    grid = np.linspace(0.02, 0.98, 15)
    released = np.zeros((n, horizon), dtype=bool)
    for r in range(n):
        ctrl = CSAController(ALPHA, DELTA, grid)
        for t in range(horizon):
            if t and t % k == 0:
                assert ctrl.switch_versions(policy=f"pi{t // k}", trained_through=t - 1) == t
            d = ctrl.decide(streams.scores[r, t])
            released[r, t] = d.release
            ctrl.observe(d.seq, bool(streams.passed[r, t]))
        assert (
            ctrl.epoch == 1 and ctrl.versions_at(horizon - 1)["policy"] == f"pi{horizon // k - 1}"
        )
    out = summarise(released, streams.passed, ALPHA, DELTA)
    # If each stream violated with probability delta (2 delta for the slack version, Thm 5.1),
    # the count would exceed the binomial 1 - 1e-3 quantile with probability <= 1e-3, so a count
    # past it rejects "violation rate <= delta" at level 1e-3 (R = 100: 20 and 33 streams; this
    # seed sees 0 and 0).
    assert out["pathv_strict"].sum() <= stats.binom.ppf(1 - 1e-3, n, DELTA)
    assert out["pathv_slack"].sum() <= stats.binom.ppf(1 - 1e-3, n, 2 * DELTA)
    # The improvement reaches the release rate: the last phase releases more than the second.
    phase = released.reshape(n, horizon // k, k).mean(axis=(0, 2))
    assert phase[-1] > phase[1] + 0.1
