"""CSA (arXiv:2605.20270): hand-computed kernel and controller checks, then stream-level checks on
synthetic streams (fixed seeds; counts over R streams compared with binomial or theory bounds)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from rlvr.algorithms.csa import (
    AlreadyLabelledError,
    Calibrator,
    CSABatch,
    CSAController,
    UnknownSeqError,
    log_certification_threshold,
    majority_answer,
    make_grid,
    plugin_bet,
    selective_risk_slack,
)
from rlvr.algorithms.csa.baselines import (
    ACI,
    BASELINES,
    CRC,
    LTT,
    SAOCP,
    AlwaysAct,
    ConfFact,
    FixedThreshold,
    NaiveTuning,
    NEXConf,
    marginal_eprocess,
)
from rlvr.algorithms.csa.simulation import (
    Streams,
    flip_labels,
    g0_selective_risk,
    make_streams,
    replay_cell,
    run_method,
    summarise,
    synthetic_cell,
)

ALPHA, DELTA = 0.3, 0.1
R, T = 200, 3000  # streams x rounds for the stream-level checks on synthetic streams
G0_GRID = np.linspace(0.02, 0.98, 50)
G0_STAR = G0_GRID[np.flatnonzero(g0_selective_risk(G0_GRID) <= ALPHA)[-1]]  # grid oracle q*
PASS_FACTOR = 58 / 49  # 1 + lam x with lam = 0.3/0.49 = 30/49 and x = -0.3 (a pass at alpha 0.3)
FAIL_FACTOR = 4 / 7  # 1 - (30/49) * 0.7


def feed(ctrl: CSAController, rounds) -> list:
    """Decide then label each (score, passed) round in order; returns the decisions."""
    out = []
    for s, p in rounds:
        d = ctrl.decide(s)
        ctrl.observe(d.seq, p)
        out.append(d)
    return out


def random_rounds(n: int, seed: int) -> list[tuple[float, bool]]:
    st = synthetic_cell("iid", 1, n, seed)
    return list(zip(st.scores[0].tolist(), st.passed[0].tolist(), strict=True))


def csa_summary(streams: Streams, alpha=ALPHA, grid=G0_GRID, **kw):
    csa = CSABatch(streams.scores.shape[0], alpha, DELTA, grid, **kw)
    run = run_method(csa, streams)
    return csa, summarise(run.released, streams.passed, alpha, DELTA)


def method_summary(method, streams: Streams, alpha=ALPHA):
    run = run_method(method, streams)
    return summarise(run.released, streams.passed, alpha, DELTA)


# --------------------------------------------------------------------------- score, grid, kernel


def test_majority_answer_counts_unextractable_samples_in_k():
    assert majority_answer(["4", "4", None, "5", "4"]) == ("4", pytest.approx(0.4))
    assert majority_answer(["a", "b"]) == ("a", 0.5)  # tie: first seen
    assert majority_answer([None, None]) == (None, 1.0)
    with pytest.raises(ValueError):
        majority_answer([])


def test_calibrator_is_isotonic_and_round_trips():
    raw = [0.0, 0.0, 0.2, 0.2, 0.4, 0.4]
    # Per-raw fail means 0, 0.5, 0.5: already monotone; 0.1 interpolates between the knots.
    cal = Calibrator.fit(raw, [1, 1, 1, 0, 0, 1])
    assert cal(0.0) == 0.0 and cal(0.2) == 0.5 and cal(0.3) == 0.5
    assert cal(0.1) == pytest.approx(0.25)
    assert cal(-1.0) == 0.0 and cal(2.0) == 0.5  # clipped outside the CAL range
    # Fail means 0.5, 1, 0 violate monotonicity: the last two pool to 0.5.
    pooled = Calibrator.fit(raw, [1, 0, 0, 0, 1, 1])
    np.testing.assert_allclose(pooled(np.array([0.0, 0.2, 0.4])), [0.5, 0.5, 0.5])
    back = Calibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    x = np.linspace(-0.5, 1.5, 41)
    np.testing.assert_array_equal(back(x), cal(x))


def test_make_grid_hand_values():
    cal = np.linspace(0, 1, 101)  # P2 = 0.02, P98 = 0.98
    # alpha 0.1: cap max(0.3, 0.15) = 0.3 -> grid on [0.02, 0.3].
    np.testing.assert_allclose(make_grid(cal, 0.1, m=3), [0.02, math.sqrt(0.02 * 0.3), 0.3])
    np.testing.assert_allclose(make_grid(cal, 0.1, m=3, spacing="linear"), [0.02, 0.16, 0.3])
    # alpha 0.3: cap 0.9 > 0.8 ceiling; P98 = 0.98 -> hi = 0.8.
    assert make_grid(cal, 0.3, m=15)[-1] == 0.8
    # All-zero CAL scores: the grid collapses onto the floor (duplicates only cost Bonferroni budget).
    np.testing.assert_array_equal(make_grid(np.zeros(50), 0.1, m=4), [0.001] * 4)
    with pytest.raises(ValueError, match="no room"):
        make_grid(np.full(10, 0.9), 0.1)


def test_plugin_bet_hand_values():
    lam = plugin_bet(np.array([0, 2, 3, 1]), np.array([0, 0, 1, 1]), 0.3)
    # n=0 -> 0; r_hat 0 -> 0.3/0.49; r_hat 1/3 > alpha -> 0; r_hat 1 -> 0.
    np.testing.assert_allclose(lam, [0.0, 0.3 / 0.49, 0.0, 0.0])
    # alpha 0.6: 0.6/0.16 = 3.75 is capped at 1/(2 * 0.4) = 1.25, computed as 0.5 / (1 - 0.6):
    # neither 0.6 nor 0.4 is a binary fraction, so 1.25 only up to rounding.
    assert plugin_bet(np.array([4]), np.array([0]), 0.6)[0] == pytest.approx(1.25, rel=1e-12)


def test_bonferroni_levels():
    assert log_certification_threshold(15, 0.1, 1, False) == pytest.approx(math.log(300))
    assert log_certification_threshold(15, 0.1, 1, True) == pytest.approx(
        math.log(math.pi**2 * 15 / 0.6)
    )
    assert log_certification_threshold(15, 0.1, 3, True) == pytest.approx(
        math.log(math.pi**2 * 15 * 9 / 0.6)
    )
    # A restarted single-epoch stream continues with the epoch formula.
    assert log_certification_threshold(15, 0.1, 2, False) == log_certification_threshold(
        15, 0.1, 2, True
    )


def test_slack_values_and_edge_cases():
    assert selective_risk_slack(500, 0.1) == pytest.approx(0.117, abs=5e-4)
    assert selective_risk_slack(5000, 0.1) == pytest.approx(0.039, abs=5e-4)
    assert selective_risk_slack(1, 0.1) == pytest.approx(math.sqrt(math.log(20)))
    assert selective_risk_slack(0, 0.1) == math.inf


# --------------------------------------------------------------------------- controller by hand


def test_bet_before_update_and_wealth_by_hand():
    ctrl = CSAController(ALPHA, DELTA, [0.2, 0.5])
    feed(ctrl, [(0.1, True)])
    # First gated round: n = 0 so lam = 0, wealth unchanged, stats absorb the round.
    np.testing.assert_array_equal(ctrl.log_wealth, [0.0, 0.0])
    feed(ctrl, [(0.3, True)])  # gates only q = 0.5, whose bet is now 30/49
    np.testing.assert_allclose(np.exp(ctrl.log_wealth), [1.0, PASS_FACTOR], rtol=1e-13)
    feed(ctrl, [(0.1, False)])  # both bet 30/49 (r_hat = 0) and lose
    np.testing.assert_allclose(
        np.exp(ctrl.log_wealth), [FAIL_FACTOR, PASS_FACTOR * FAIL_FACTOR], rtol=1e-13
    )
    before = ctrl.log_wealth
    feed(ctrl, [(0.6, True), (0.2, True)])  # above the grid: untouched; s = q gates q (<=)
    # r_hat = 1/2 and 1/3 exceed alpha: lam = 0, wealth unchanged, but the counts move.
    np.testing.assert_array_equal(ctrl.log_wealth, before)
    state = ctrl.state_dict()
    assert state["n"] == [3, 4] and state["fails"] == [1, 1]


def test_certification_round_and_max_certified_release():
    ctrl = CSAController(ALPHA, DELTA, [0.2, 0.5])  # delta_q = 0.1/4: certify at log 40
    # All passes at s = 0.1: after k rounds log E = (k-1) log(58/49); log 40/log(58/49) = 21.88,
    # so the 23rd round (seq 22) certifies both thresholds at once.
    decisions = feed(ctrl, [(0.1, True)] * 23)
    assert all(d.threshold is None and not d.release for d in decisions)
    assert ctrl.state_dict()["cert_seq"] == [22, 22]
    assert ctrl.threshold == 0.5
    assert ctrl.decide(0.1) == (23, True, 0.5)
    assert ctrl.decide(0.55) == (24, False, 0.5)


def test_reorder_buffer_applies_in_seq_order():
    rounds = random_rounds(60, seed=3)
    in_order = CSAController(ALPHA, DELTA, G0_GRID)
    feed(in_order, rounds)
    shuffled = CSAController(ALPHA, DELTA, G0_GRID)
    seqs = [shuffled.decide(s).seq for s, _ in rounds]
    order = np.random.default_rng(0).permutation(seqs).tolist()
    order.remove(0)
    for seq in order:
        shuffled.observe(seq, rounds[seq][1])
    assert shuffled.metrics()["applied"] == 0 and shuffled.blocking_seq == 0
    shuffled.observe(0, rounds[0][1])
    assert shuffled.state_dict() == in_order.state_dict()


def test_duplicate_and_unknown_labels_raise_without_state_change():
    ctrl = CSAController(ALPHA, DELTA, [0.2, 0.5])
    for s in (0.1, 0.3, 0.4):
        ctrl.decide(s)
    ctrl.observe(0, True)
    ctrl.observe(2, False)  # buffered behind seq 1
    snap = json.dumps(ctrl.state_dict())
    with pytest.raises(AlreadyLabelledError):
        ctrl.observe(0, True)  # applied
    with pytest.raises(AlreadyLabelledError):
        ctrl.observe(2, True)  # buffered
    with pytest.raises(UnknownSeqError):
        ctrl.observe(3, True)
    with pytest.raises(UnknownSeqError):
        ctrl.observe(-1, True)
    with pytest.raises(TypeError):
        ctrl.observe(1, "yes")
    with pytest.raises(TypeError):
        ctrl.observe(True, True)
    assert json.dumps(ctrl.state_dict()) == snap


def test_expired_label_counts_as_failure():
    a, b = CSAController(ALPHA, DELTA, G0_GRID), CSAController(ALPHA, DELTA, G0_GRID)
    rounds = random_rounds(40, seed=4)
    for ctrl in (a, b):
        feed(ctrl, rounds[:20])
        ctrl.decide(0.3)
        ctrl.decide(0.1)
        ctrl.observe(21, True)
        assert ctrl.blocking_seq == 20
    a.expire(20)
    b.observe(20, False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.pop("expired") == 1 and sb.pop("expired") == 0
    assert sa == sb
    with pytest.raises(AlreadyLabelledError):
        a.observe(20, True)  # a late label after the timeout is refused


def test_metrics_by_hand():
    ctrl = CSAController(ALPHA, DELTA, [0.2, 0.5])
    feed(ctrl, [(0.1, True)] * 23)
    feed(ctrl, [(0.1, False), (0.4, True), (0.7, False), (0.15, True)])
    m = ctrl.metrics()
    # Released: seq 23 (fail), 24 (pass), 26 (pass); seq 25 abstained (0.7 > 0.5).
    assert (m["released"], m["applied"], m["decided"]) == (3, 27, 27)
    assert m["risk"] == pytest.approx(1 / 3) and m["release_rate"] == pytest.approx(3 / 27)
    assert m["slack"] == pytest.approx(math.sqrt(math.log(60) / 3))  # k = ceil(log2 3) - 1 = 1
    assert m["threshold"] == 0.5 and m["certified"] == [0.2, 0.5]
    assert m["epoch"] == 1 and m["pending"] == 0 and not m["over_bound"]


def test_scheduled_epochs_reset_and_use_their_bonferroni_level():
    ctrl = CSAController(ALPHA, DELTA, [0.2, 0.5], epoch_length=40)
    decisions = feed(ctrl, [(0.1, True)] * 90)
    thresholds = [d.threshold for d in decisions]
    # Epoch 1: log(pi^2 * 2/(6 * 0.1)) / log(58/49) = 20.7 -> certifies at seq 21.
    # Epoch 2 (seq 40..79): log(pi^2 * 2 * 4/0.6) / log(58/49) = 28.9 -> certifies at seq 69.
    assert thresholds[:22] == [None] * 22 and thresholds[22:40] == [0.5] * 18
    assert thresholds[40:70] == [None] * 30 and thresholds[70:80] == [0.5] * 10
    assert thresholds[80:] == [None] * 10 and ctrl.epoch == 3


def test_new_epoch_ignores_labels_of_earlier_rounds_except_in_metrics():
    ctrl = CSAController(ALPHA, DELTA, [0.2, 0.5])
    for s in (0.1, 0.1, 0.3):
        ctrl.decide(s)
    assert ctrl.start_new_epoch() == 2
    for seq in range(3):
        ctrl.observe(seq, False)
    np.testing.assert_array_equal(ctrl.log_wealth, [0.0, 0.0])
    assert ctrl.state_dict()["n"] == [0, 0] and ctrl.metrics()["applied"] == 3
    with pytest.raises(ValueError):
        ctrl.start_new_epoch(epoch=2)


def test_restart_after_lost_snapshot_is_a_new_epoch_with_fresh_seqs():
    ctrl = CSAController(ALPHA, DELTA, [0.2, 0.5])
    ctrl.start_new_epoch(epoch=4, next_seq=1000)
    decisions = feed(ctrl, [(0.1, True)] * 39)
    assert decisions[0].seq == 1000
    # Epoch 4's level log(pi^2 * 2 * 16/0.6) = 6.27 needs 38 wealth steps of log(58/49): seq 1038.
    assert ctrl.state_dict()["cert_seq"] == [1038, 1038]
    with pytest.raises(UnknownSeqError):
        ctrl.observe(5, True)  # a label for a round of the lost state
    with pytest.raises(ValueError, match="issued no rounds"):
        ctrl.start_new_epoch(next_seq=2000)


def test_version_switches_at_seq_boundaries():
    ctrl = CSAController(ALPHA, DELTA, G0_GRID)
    assert ctrl.switch_versions(policy="p0", scorer="g0") == 0
    assert ctrl.epoch == 1  # nothing decided yet: no reset
    for s in (0.1, 0.2, 0.3):
        ctrl.decide(s)
    ctrl.observe(0, True)
    with pytest.raises(ValueError, match="not all applied"):
        ctrl.switch_versions(policy="p1", trained_through=1)
    assert ctrl.switch_versions(policy="p1", trained_through=0) == 3
    assert ctrl.epoch == 1  # a policy update keeps the e-processes (assumption P)
    assert ctrl.versions_at(2) == {"policy": "p0", "scorer": "g0"}
    assert ctrl.versions_at(3) == {"policy": "p1", "scorer": "g0"}
    ctrl.decide(0.1)
    assert ctrl.switch_versions(scorer="g1") == 4
    assert ctrl.epoch == 2  # a new score map starts a new epoch (our choice)
    assert ctrl.metrics()["versions"] == {"policy": "p1", "scorer": "g1"}


def test_sparse_selection_is_outcome_independent_and_weighted():
    pi = 0.2
    ctrl = CSAController(ALPHA, DELTA, G0_GRID, sparse_pi_min=pi, seed=7)
    n = 20000
    selected = verified_released_fails = 0
    for s, p in random_rounds(n, seed=5):
        d = ctrl.decide(s)
        if ctrl.wants_label(d.seq):
            selected += 1
            verified_released_fails += d.release and not p
            ctrl.observe(d.seq, p)
        else:
            with pytest.raises(AlreadyLabelledError, match="closed|not selected"):
                ctrl.observe(d.seq, p)
    lo, hi = stats.binom.ppf([1e-6, 1 - 1e-6], n, pi)
    assert lo <= selected <= hi
    m = ctrl.metrics()
    assert m["applied"] == n and m["pending"] == 0 and m["released"] > 0
    # Realised risk is importance-weighted: verified released failures count 1/pi each.
    assert m["risk"] == pytest.approx(verified_released_fails / pi / m["released"])


def test_state_round_trip_is_bit_exact_mid_stream():
    rounds = random_rounds(1500, seed=6)
    ctrl = CSAController(ALPHA, DELTA, G0_GRID, epoch_length=700, sparse_pi_min=0.5, seed=1)
    ctrl.switch_versions(policy="p0", scorer="g0")
    held = []
    for i, (s, p) in enumerate(rounds[:1000]):
        d = ctrl.decide(s)
        if ctrl.wants_label(d.seq):
            # Hold back every 7th label so the snapshot carries pending rounds and buffered labels.
            if i % 7 == 0:
                held.append((d.seq, p))
            else:
                ctrl.observe(d.seq, p)
    state = ctrl.state_dict()
    assert state["pending"] and state["labels"]
    restored = CSAController.from_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    for c in (ctrl, restored):
        for seq, p in held:
            c.observe(seq, p)
        for s, p in rounds[1000:]:
            d = c.decide(s)
            if c.wants_label(d.seq):
                c.observe(d.seq, p)
    assert json.dumps(restored.state_dict()) == json.dumps(ctrl.state_dict())
    assert restored.log_wealth.tobytes() == ctrl.log_wealth.tobytes()
    with pytest.raises(ValueError, match="configuration differs"):
        CSAController(0.2, DELTA, G0_GRID).load_state_dict(state)


@pytest.mark.parametrize("epoch_length,pi", [(None, None), (500, None), (None, 0.3)])
def test_controller_and_batch_agree_bit_for_bit(epoch_length, pi):
    n_streams, horizon = 3, 1500
    st = synthetic_cell("improving", n_streams, horizon, seed=8)
    grid = make_grid(st.scores[:, :300].ravel(), ALPHA, m=15)
    ctrls = [
        CSAController(ALPHA, DELTA, grid, epoch_length=epoch_length, sparse_pi_min=pi, seed=r)
        for r in range(n_streams)
    ]
    batch = CSABatch(n_streams, ALPHA, DELTA, grid, epoch_length=epoch_length)
    for t in range(horizon):
        release = batch.decide(st.scores[:, t])
        verified = np.zeros(n_streams, dtype=bool)
        for r, c in enumerate(ctrls):
            d = c.decide(st.scores[r, t])
            assert d.release == release[r]
            assert (d.threshold is None) == np.isnan(batch.threshold[r])
            verified[r] = c.wants_label(d.seq)
            if verified[r]:
                c.observe(d.seq, st.passed[r, t])
        batch.observe(st.passed[:, t], verified)
    for r, c in enumerate(ctrls):
        assert c.log_wealth.tobytes() == batch.log_wealth[r].tobytes()
        np.testing.assert_array_equal(c.certified, batch.certified[r])
    assert batch.certified.any()


# --------------------------------------------------------------------------- baselines by hand


def test_aci_steps_by_hand():
    aci = ACI(1, ALPHA)
    aci.decide(np.array([0.2]))
    aci.observe(np.array([False]))  # released failure: 0.3 + 0.01 * (0.3 - 1)
    assert aci.threshold[0] == pytest.approx(0.293)
    assert not aci.decide(np.array([0.5]))[0]
    aci.observe(np.array([True]))  # abstained: + 0.01 * 0.3/2
    assert aci.threshold[0] == pytest.approx(0.2945)


def test_saocp_weights_by_hand():
    sa = SAOCP(1, ALPHA)
    gammas = 0.002 * 2.0 ** np.arange(6)
    sa.decide(np.array([0.25]))
    sa.observe(np.array([False]))  # every expert released a failure: equal losses, equal weights
    q = 0.3 - 0.7 * gammas
    np.testing.assert_allclose(sa.expert_q[0], q)
    assert sa.threshold[0] == pytest.approx(q.mean())
    sa.decide(np.array([0.29]))
    sa.observe(np.array([True]))  # experts 0-2 (q >= 0.29) release a pass; 3-5 abstain: loss 0.15
    w = np.array([1, 1, 1] + [math.exp(-0.05 * 0.15)] * 3)
    np.testing.assert_allclose(sa.weights[0], w / w.sum())


def test_naive_tuning_steps_every_20_rounds():
    nt = NaiveTuning(1, ALPHA)
    for _ in range(20):
        nt.decide(np.array([0.1]))
        nt.observe(np.array([False]))
    assert nt.threshold[0] == pytest.approx(0.48)  # risk 1 > 0.32
    for _ in range(19):
        nt.decide(np.array([0.1]))
        nt.observe(np.array([True]))
    assert nt.threshold[0] == pytest.approx(0.48)
    nt.decide(np.array([0.1]))
    nt.observe(np.array([True]))
    assert nt.threshold[0] == pytest.approx(0.46)  # risk 20/40 still > 0.32


def test_nex_conf_window_by_hand():
    nex = NEXConf(1, ALPHA, grid=[0.2, 0.5], window=3, decay=0.5, warmup=1)
    expected = []
    for s, p in [(0.1, True), (0.4, False), (0.1, True), (0.45, True), (0.1, True)]:
        nex.decide(np.array([s]))
        expected.append(nex.threshold[0])
        nex.observe(np.array([p]))
    # Round 1: warm-up. Round 2: all pass -> 0.5. Round 3: q=0.5 has fail mass 1 of gate 1.5 -> 0.2.
    # Round 4: 0.5 of 1.75 -> 0.5. Round 5: round 1 left, round 2's failure now weighs 0.25 -> 0.5.
    np.testing.assert_array_equal(expected, [np.nan, 0.5, 0.2, 0.5, 0.5])
    # The window now holds rounds 3-5 with weights 0.25, 0.5, 1.
    np.testing.assert_allclose(nex._gate_mass[0], [0.25 + 1, 0.25 + 0.5 + 1])
    # No decay, window 2: once no threshold qualifies, the last one (0.2) stays in force.
    nex = NEXConf(1, ALPHA, grid=[0.2, 0.5], window=2, decay=1.0, warmup=1)
    expected = []
    for s, p in [(0.1, True), (0.4, False), (0.1, False), (0.1, True), (0.3, True)]:
        nex.decide(np.array([s]))
        expected.append(nex.threshold[0])
        nex.observe(np.array([p]))
    np.testing.assert_array_equal(expected, [np.nan, 0.5, 0.2, 0.2, 0.2])


def test_locked_thresholds_by_hand():
    # Prefix of 20: 10 passes at s = 0.1, then 10 failures at s = 0.4; grid {0.2, 0.5}.
    scores = [0.1] * 10 + [0.4] * 10
    passed = [True] * 10 + [False] * 10
    kw = {"grid": [0.2, 0.5], "n_cal": 20}
    methods = {
        "conformal": CRC(1, ALPHA, DELTA, bound="conformal", **kw),  # 1/11 <= 0.3 at 0.2
        "hoeffding": CRC(1, ALPHA, DELTA, **kw),  # sqrt(log 20/20) = 0.387 > 0.3: refuse
        "ltt": LTT(1, ALPHA, DELTA, **kw),  # min(e^-1.8, e 0.7^10 = 0.077) > 0.05: refuse
        "conffact": ConfFact(1, ALPHA, DELTA, **kw),  # 1 - 0.05^(1/10) = 0.259 <= 0.3 at 0.2
    }
    for method in methods.values():
        for s, p in zip(scores, passed, strict=True):
            assert not method.decide(np.array([s]))[0]  # abstains while calibrating
            method.observe(np.array([p]))
    got = {k: m.threshold[0] for k, m in methods.items()}
    assert got["conformal"] == 0.2 and got["conffact"] == 0.2
    assert np.isnan(got["hoeffding"]) and np.isnan(got["ltt"])


def test_every_baseline_runs_through_the_common_interface():
    st = synthetic_cell("iid", 4, 600, seed=11)
    for name, build in BASELINES.items():
        run = run_method(build(4, ALPHA, DELTA, G0_GRID), st)
        assert run.released.shape == (4, 600), name
    with pytest.raises(ValueError, match="sparse"):
        run_method(AlwaysAct(4), st, verified=np.ones((4, 600), dtype=bool))


def test_summarise_by_hand():
    out = summarise(np.array([[1, 1, 0, 1]], bool), np.array([[1, 0, 1, 0]], bool), 0.5, 0.1, 2)
    assert out["risk"][0] == pytest.approx(2 / 3) and out["release_rate"][0] == 0.75
    assert out["max_risk"][0] == pytest.approx(2 / 3) and out["pathv_strict"][0]
    assert not out["pathv_slack"][0] and not out["refused"][0]


def test_replay_cells_order_items_by_score():
    scores = np.arange(40) / 40.0
    passed = np.ones(40, dtype=bool)

    def order(name, horizon):
        return np.rint(replay_cell(name, scores, passed, 2, horizon, seed=0).scores * 40).astype(
            int
        )

    iid = order("iid", 80)
    assert all(sorted(row[:40]) == list(range(40)) for row in iid)
    eh = order("easy_hard", 80)
    assert (eh[:, :20] < 20).all() and (eh[:, 20:40] >= 20).all() and (eh[:, 40:60] < 20).all()
    qr = order("quartile_rev", 40)
    assert all((qr[:, 10 * i : 10 * (i + 1)] // 10 == i).all() for i in range(4))
    wo = order("window_outrun", 120)
    assert (wo[:, :20] < 20).all() and (wo[:, 40:60] >= 20).all() and (wo[:, 60:80] < 20).all()
    qu = order("quartile", 100)
    assert (qu[:, :50] < 10).all() and (qu[:, 50:] >= 30).all()
    mu = order("multi", 400)
    assert (mu[:, :100] < 20).all() and (mu[:, 100:200] >= 20).all() and (mu[:, 300:] >= 20).all()
    ad = order("adversarial", 100)
    assert (ad[:, :40] < 20).all() and (ad[:, 40:80] >= 20).all() and (ad[:, 80:] >= 36).all()


# --------------------------------------------------------------------------- synthetic streams


def single_threshold_run(n_paths, horizon, fail_rate, delta_q, seed, fixed_bet=None):
    """One threshold gating every round (score 0 <= q): CSABatch with m = 1, delta = 2 delta_q."""
    csa = CSABatch(n_paths, ALPHA, 2 * delta_q, [1.0], fixed_bet=fixed_bet)
    rng = np.random.default_rng(seed)
    zeros = np.zeros(n_paths)
    for _ in range(horizon):
        csa.decide(zeros)
        csa.observe(rng.random(n_paths) >= fail_rate)
        if (csa.first_cert_round >= 0).all():
            break
    return csa


@pytest.mark.parametrize("fail_rate", [ALPHA, ALPHA + 0.02])
def test_ville_type_one_error(fail_rate):
    """Under the null (fail rate >= alpha) the wealth reaches 1/delta_q on <= delta_q of paths
    (our simulation gave 0.030 at the boundary, 0.010 at alpha + 0.02); bound checked with a
    binomial tolerance."""
    n_paths = 20_000
    csa = single_threshold_run(n_paths, 5000, fail_rate, 0.1, seed=12)
    crossed = int((csa.first_cert_round >= 0).sum())
    assert crossed <= stats.binom.ppf(1 - 1e-6, n_paths, 0.1)
    assert crossed > 0  # the boundary null does cross sometimes: the test has power to see it


@pytest.mark.parametrize("fail_rate", [0.2, 0.1])
def test_certification_time_between_the_theorems(fail_rate):
    """Mean certification time: fixed bet eta/2 <= Thm 5.3's bound, every mean >= Thm 5.4's lower
    bound, plug-in faster than fixed (our simulation: r=.2 fixed 1195, plug-in 383; r=.1 296,
    88)."""
    delta_q = 0.1 / 30
    eta = ALPHA - fail_rate
    upper = 4 * (math.log(1 / delta_q) + 1) / eta**2
    kl = fail_rate * math.log(fail_rate / ALPHA) + (1 - fail_rate) * math.log(
        (1 - fail_rate) / (1 - ALPHA)
    )
    lower = (1 - 2 * delta_q) * math.log((1 - delta_q) / delta_q) / kl
    means = {}
    for name, bet in (("fixed", eta / 2), ("plugin", None)):
        csa = single_threshold_run(5000, 6000, fail_rate, delta_q, seed=13, fixed_bet=bet)
        assert (csa.first_cert_round >= 0).all()
        means[name] = (csa.first_cert_round + 1).mean()
    assert means["fixed"] <= upper
    assert min(means.values()) >= lower
    assert means["plugin"] <= means["fixed"]


@pytest.fixture(scope="module")
def iid():
    return synthetic_cell("iid", R, T, seed=0)


@pytest.fixture(scope="module")
def iid_csa(iid):
    return csa_summary(iid)


def test_iid_grid_oracle():
    assert pytest.approx(0.686, abs=1e-3) == G0_STAR
    assert g0_selective_risk(G0_STAR) == pytest.approx(0.291, abs=1e-3)


def test_iid_csa_is_pathwise_valid(iid_csa):
    csa, s = iid_csa
    assert s["pathv_strict"].sum() == 0 and s["pathv_slack"].sum() == 0
    assert 0.19 <= s["risk"].mean() <= 0.24 and 0.52 <= s["release_rate"].mean() <= 0.60
    assert (csa.deployed >= 0).all() and (csa.grid[csa.deployed] <= G0_STAR).all()


def test_iid_online_heuristics_violate(iid):
    violate = {
        "always": method_summary(AlwaysAct(R), iid),
        "aci": method_summary(ACI(R, ALPHA), iid),
        "naive": method_summary(NaiveTuning(R, ALPHA), iid),
    }
    for name, s in violate.items():
        assert s["pathv_strict"].sum() >= 0.9 * R, name
    assert violate["always"]["risk"].mean() == pytest.approx(0.5, abs=0.01)
    assert violate["aci"]["risk"].mean() == pytest.approx(0.33, abs=0.01)
    # Fixed at 0.7, just above q* = 0.686, violates on most streams (our simulation gave 174/200
    # violating streams).
    assert method_summary(FixedThreshold(R, 0.7), iid)["pathv_strict"].sum() >= 0.75 * R


def test_improving_drift():
    st = synthetic_cell("improving", R, T, seed=1)
    _, s = csa_summary(st)
    assert s["pathv_strict"].sum() == 0 and s["pathv_slack"].sum() == 0
    assert 0.12 <= s["risk"].mean() <= 0.16 and 0.43 <= s["release_rate"].mean() <= 0.51
    for method in (AlwaysAct(R), ACI(R, ALPHA), NaiveTuning(R, ALPHA)):
        assert method_summary(method, st)["pathv_strict"].sum() >= 0.9 * R, method.name


@pytest.mark.parametrize("epoch_length", [None, 500])
def test_periodic_policy_improvement_keeps_every_path_valid(epoch_length):
    """The live protocol (Sec. 6.2): the policy is fixed within each 100-request round and improves
    between rounds (c steps 0.4 -> 0.6), single-epoch and with the 500-round epochs the paper
    suggests for aggressive updates. Thm 5.1 allows violations on <= 2 delta of the streams: the
    count must stay under the binomial 1 - 1e-6 quantile of that (our simulation: 0 of 200), and
    the release rate rises as the policy improves."""
    st = synthetic_cell("expert_iteration", R, T, seed=3)
    run = run_method(CSABatch(R, ALPHA, DELTA, G0_GRID, epoch_length=epoch_length), st)
    s = summarise(run.released, st.passed, ALPHA, DELTA)
    allowed = stats.binom.ppf(1 - 1e-6, R, 2 * DELTA)
    assert s["pathv_slack"].sum() <= allowed and s["pathv_strict"].sum() <= allowed
    assert s["pathv_slack"].sum() == 0
    # Last five rounds against rounds 6-10 (by then every stream has certified once).
    assert run.released[:, -500:].mean() > run.released[:, 500:1000].mean() + 0.05
    if epoch_length is None:  # the deployed threshold climbs with the policy (it resets by epoch)
        assert run.threshold[:, -1].mean() > run.threshold[:, 999].mean()


@pytest.mark.parametrize("m", [10, 25, 50, 100])
def test_grid_size(iid, m):
    grid = np.linspace(0.02, 0.98, m)
    csa, s = csa_summary(iid, grid=grid)
    assert s["pathv_strict"].sum() == 0
    # Thm C.1 bounds false certification by delta/2 per stream; none happens here.
    assert not (csa.certified & (g0_selective_risk(grid) >= ALPHA)).any()
    assert 0.16 <= s["risk"].mean() <= 0.23 and 0.50 <= s["release_rate"].mean() <= 0.60
    assert 0.55 <= csa.certified.mean() <= 0.70


def test_bet_ablation(iid):
    grid = np.linspace(0.02, 0.98, 20)
    tiny, _ = csa_summary(iid, grid=grid, fixed_bet=0.01)
    assert not tiny.certified.any()  # lam = 0.01 never certifies in 3000 rounds
    ar = {
        bet: csa_summary(iid, grid=grid, fixed_bet=bet)[1]["release_rate"].mean()
        for bet in (None, 0.25, 0.5)
    }
    assert ar[None] >= max(ar[0.25], ar[0.5]) - 0.02


def test_noisy_verifier(iid):
    rates = []
    for p in (0.0, 0.05, 0.1, 0.2):
        noisy = Streams(iid.scores, flip_labels(iid.passed, p, seed=14))
        _, s = csa_summary(noisy)
        assert s["pathv_slack"].sum() == 0 and s["risk"].mean() <= ALPHA, p
        rates.append(s["release_rate"].mean())
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False))


def test_sparse_verifier(iid):
    rng = np.random.default_rng(15)
    first = {}
    for pi in (1.0, 0.5, 0.2, 0.1):
        verified = rng.random(iid.scores.shape) < pi
        csa = CSABatch(R, ALPHA, DELTA, G0_GRID)
        run = run_method(csa, iid, verified=verified)
        s = summarise(run.released, iid.passed, ALPHA, DELTA)
        assert s["pathv_strict"].sum() == 0 and s["pathv_slack"].sum() == 0, pi
        # Median first certification; a never-certified stream counts as T (censored above).
        first[pi] = np.median(np.where(csa.first_cert_round >= 0, csa.first_cert_round, T))
    for pi in (0.5, 0.2, 0.1):
        assert 0.75 / pi <= first[pi] / first[1.0] <= 1.33 / pi, pi


def test_marginal_control_does_not_bound_selective_risk():
    alpha = 0.1
    st = make_streams(R, T, 16, lambda s: 0.25 + 0.5 * s)
    run = run_method(marginal_eprocess(R, alpha, DELTA, G0_GRID), st)
    marginal = (run.released & ~st.passed).sum(axis=1) / T
    s = summarise(run.released, st.passed, alpha, DELTA)
    # Our simulation gave marginal risk 0.029 vs selective risk 0.288.
    assert marginal.mean() <= alpha and s["risk"].mean() > 2 * alpha
    _, s_csa = csa_summary(st, alpha=alpha)
    assert s_csa["refused"].all()  # r(q) >= 0.25 > alpha everywhere: CSA correctly refuses


def test_refuses_when_every_threshold_is_unsafe():
    st = make_streams(R, T, 17, lambda s: np.full_like(s, 0.4))
    csa = CSABatch(R, ALPHA, DELTA, G0_GRID)
    run = run_method(csa, st)
    assert not run.released.any() and not csa.certified.any()


FRONTIER_DROP_REASON = (
    "outside the guarantee: single-epoch CSA assumes a nondecreasing safe frontier (Theorem C.1); "
    "when it drops (degrading drift, abrupt shift, score covariate shift) thresholds certified "
    "earlier stay deployed and violate (our simulation: 121, 200 and 200 of 200 streams); "
    "alternating easy/hard blocks defeat epochs too (26-52 of 200)"
)


@pytest.mark.xfail(strict=True, reason=FRONTIER_DROP_REASON)
@pytest.mark.parametrize(
    "cell,epoch_length",
    [
        ("degrading", None),
        ("abrupt", None),
        ("covariate", None),
        ("alternating", None),
        ("alternating", 500),
    ],
)
def test_csa_violates_when_the_frontier_drops(cell, epoch_length):
    _, s = csa_summary(synthetic_cell(cell, R, T, seed=18), epoch_length=epoch_length)
    assert s["pathv_strict"].sum() == 0


@pytest.mark.parametrize(
    "cell,epoch_length",
    # Epoch(1000) also fixes the abrupt shift up to 1/200 strict (0 with slack); on the covariate
    # shift it must be shorter than the easy prefix, or q > 0.5 certifies vacuously again.
    [("degrading", 1000), ("abrupt", 500), ("covariate", 500)],
)
def test_epochs_restore_validity(cell, epoch_length):
    _, s = csa_summary(synthetic_cell(cell, R, T, seed=18), epoch_length=epoch_length)
    assert s["pathv_strict"].sum() == 0 and s["pathv_slack"].sum() == 0


def test_unit_invariants():
    """Wealth factors in [1/2, 1 + alpha/(2(1-alpha))], rounds with s > q leave E(q) alone, q_deploy
    never decreases. (Bet-before-update, duplicates, reordering and snapshots: tests above.)"""
    ctrl = CSAController(ALPHA, DELTA, G0_GRID)
    upper = 1 + ALPHA / (2 * (1 - ALPHA))
    deployed = []
    for s, p in random_rounds(3000, seed=19):
        before = ctrl.log_wealth
        ctrl.observe(ctrl.decide(s).seq, p)
        factor = np.exp(ctrl.log_wealth - before)
        assert ((factor >= 0.5 - 1e-12) & (factor <= upper + 1e-12)).all()
        above = s > G0_GRID
        np.testing.assert_array_equal(ctrl.log_wealth[above], before[above])  # s > q: untouched
        deployed.append(-1.0 if ctrl.threshold is None else ctrl.threshold)
    assert np.all(np.diff(deployed) >= 0)  # single epoch: q_deploy never decreases
    assert deployed[-1] > 0
