"""Durable CSA streams: exact restore, lost or corrupt snapshots, idempotent labels, timeouts."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from rlvr.algorithms.csa import AlreadyLabelledError, CSAController, UnknownSeqError
from rlvr.serving.stream_host import (
    SEQ_BLOCK,
    CSAStreamHost,
    LabelSourceError,
    StreamSpec,
    StreamStateError,
    UnknownStreamError,
    read_journal,
    read_record,
    write_record,
)

GRID = (0.1, 0.2, 0.4)
SPEC = StreamSpec(alpha=0.5, delta=0.1, grid=GRID, label_timeout_s=10.0)
SCORES = [0.05, 0.3, 0.15, 0.5, 0.1, 0.35, 0.2, 0.05]


class Clock:
    """Hand-driven wall clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reopen(root, clock=None, **kw) -> CSAStreamHost:
    """A host restored from a copy of `root`, as after a crash (the original keeps running)."""
    copy = root.parent / f"{root.name}-copy{len(list(root.parent.iterdir()))}"
    shutil.copytree(root, copy)
    return CSAStreamHost(copy, clock=clock or Clock(), **kw)


def files(root):
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def play(host: CSAStreamHost, ctrl: CSAController | None = None) -> None:
    """Decide every score, then label all but the last two, out of order; mirror on `ctrl`."""
    for s in SCORES:
        d = host.decide("s", s)
        if ctrl is not None:
            assert tuple(ctrl.decide(s)) == (d["seq"], d["release"], d["threshold"])
    for seq in [1, 0, 3, 2, 5]:
        host.observe("s", seq, passed=seq % 3 != 2)
        if ctrl is not None:
            ctrl.observe(seq, seq % 3 != 2)


def test_host_matches_a_bare_controller_and_restores_exactly(tmp_path):
    clock = Clock()
    host = CSAStreamHost(tmp_path, clock=clock)
    host.open_stream("s", SPEC, policy="p1", scorer="g1")
    ctrl = SPEC.controller()
    ctrl.switch_versions(policy="p1", scorer="g1")
    play(host, ctrl)
    state = host.state("s")
    assert state["controller"] == ctrl.state_dict()
    # Rounds 4, 6 and 7 are open: 4 blocks the queue, 5 waits in the reorder buffer.
    assert [seq for seq, *_ in state["rounds"]] == [4, 5, 6, 7]

    again = reopen(tmp_path, clock)
    assert again.state("s") == state
    assert again.status("s") == host.status("s")
    # Both continue identically: same seqs, same decisions, same wealth.
    for h in (host, again):
        h.observe("s", 4, True)
        assert h.decide("s", 0.1)["seq"] == 8
    assert again.state("s") == host.state("s")


def test_every_change_is_on_disk_before_the_call_returns(tmp_path):
    root = tmp_path / "root"
    host = CSAStreamHost(root, clock=Clock())
    host.open_stream("s", SPEC)
    # A decision is one journal line (the snapshot is not rewritten on the request path) ...
    d = host.decide("s", 0.1)
    assert read_journal(root / "s.journal") == [
        {"seq": 0, "score": 0.1, "time": 1000.0, "source": "feedback"}
    ]
    assert read_record(root / "s.state.json")["controller"]["next_seq"] == 0
    assert reopen(root).state("s") == host.state("s")
    # ... and a label rewrites the snapshot, which empties the journal.
    host.observe("s", d["seq"], True)
    assert read_record(root / "s.state.json") == host.state("s")
    assert (root / "s.journal").read_bytes() == b""
    assert reopen(root).state("s") == host.state("s")


def test_journal_replay_skips_covered_lines_and_drops_a_torn_tail(tmp_path):
    root = tmp_path / "root"
    host = CSAStreamHost(root, clock=Clock())
    host.open_stream("s", SPEC)
    for s in SCORES[:3]:
        host.decide("s", s)
    stale = (root / "s.journal").read_bytes()
    host.observe("s", 0, True)
    state = host.state("s")

    def crashed(damage) -> CSAStreamHost:
        copy = tmp_path / f"crash{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root, copy)
        journal = copy / "s.journal"
        journal.write_bytes(damage(journal.read_bytes()))
        return CSAStreamHost(copy, clock=Clock())

    # A crash between the snapshot and emptying the journal leaves lines the snapshot covers.
    assert crashed(lambda _: stale).state("s") == state
    # A decision whose line was torn by a crash was never acknowledged: it is dropped.
    host.decide("s", 0.2)
    assert crashed(lambda j: j[:-7]).state("s") == state
    # A corrupt line before the last one means lost decisions: a new epoch past the seq bound.
    host.decide("s", 0.3)
    assert [e["seq"] for e in read_journal(root / "s.journal")] == [3, 4]
    restarted = crashed(lambda j: j.replace(b'"score":0.2', b'"score":0.9'))
    status = restarted.status("s")
    assert (status["epoch"], status["next_seq"]) == (2, SEQ_BLOCK)
    assert "journal" in status["restarts"][-1]["detail"]


def test_duplicate_and_unknown_labels_change_nothing(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC)
    for s in SCORES[:3]:
        host.decide("s", s)
    host.observe("s", 0, True)
    # Applied rounds leave the open-round times in the same call, in memory as on disk.
    assert [seq for seq, *_ in host.state("s")["rounds"]] == [1, 2]
    assert read_record(tmp_path / "s.state.json") == host.state("s")
    host.observe("s", 2, False)  # waits in the reorder buffer behind seq 1
    before_state, before_files = host.state("s"), files(tmp_path)
    for seq, err in [(0, AlreadyLabelledError), (2, AlreadyLabelledError), (3, UnknownSeqError)]:
        with pytest.raises(err):
            host.observe("s", seq, True)
    with pytest.raises(UnknownSeqError):
        host.observe("s", -1, True)
    with pytest.raises(UnknownStreamError):
        host.observe("other", 1, True)
    with pytest.raises(UnknownStreamError):
        host.decide("other", 0.1)
    assert host.state("s") == before_state
    assert files(tmp_path) == before_files


@pytest.mark.parametrize("damage", ["corrupt", "delete", "truncate"])
def test_lost_snapshot_restarts_as_a_new_epoch_past_every_issued_seq(tmp_path, damage):
    clock = Clock()
    host = CSAStreamHost(tmp_path, clock=clock, seq_block=16)
    host.open_stream("s", SPEC, policy="p1", scorer="g1")
    # Certify something first, so a fresh restart would visibly reuse the budget.
    for _ in range(12):
        host.observe("s", host.decide("s", 0.05)["seq"], True)
    assert host.status("s")["threshold"] == 0.4
    issued = host.decide("s", 0.05)["seq"]  # 12, still open
    snapshot = tmp_path / "s.state.json"
    if damage == "corrupt":
        text = snapshot.read_text()
        snapshot.write_text(text.replace('"qi":2', '"qi":9'))
    elif damage == "delete":
        snapshot.unlink()
    else:
        snapshot.write_text(snapshot.read_text()[:50])

    restarted = CSAStreamHost(tmp_path, clock=clock, seq_block=16)
    status = restarted.status("s")
    # Marker written at open (bound 0 + 16) and after seq 0..15 would need one; 13 seqs fit.
    assert status["epoch"] == 2
    assert status["next_seq"] == 16 > issued
    assert status["threshold"] is None and status["certified"] == []
    assert status["versions"] == {"policy": "p1", "scorer": "g1"}
    assert status["restarts"][-1]["reason"] == "snapshot_lost"
    # Epoch 2's Bonferroni level is log(pi^2 m j^2 / (6 delta)), stricter than epoch 1's log(2m/delta).
    ctrl = CSAController.from_state_dict(restarted.state("s")["controller"])
    assert ctrl._log_thr == pytest.approx(math.log(math.pi**2 * 3 * 4 / 0.6))
    with pytest.raises(UnknownSeqError):
        restarted.observe("s", issued, True)
    assert restarted.decide("s", 0.05) == {
        "stream": "s",
        "seq": 16,
        "release": False,
        "threshold": None,
        "epoch": 2,
        "versions": {"policy": "p1", "scorer": "g1"},
        "served_policy": None,
    }
    # The restart itself is durable: a second restart resumes epoch 2 rather than starting epoch 3.
    assert CSAStreamHost(tmp_path, clock=clock).status("s")["epoch"] == 2


def test_snapshot_and_marker_both_lost_refuses_to_guess(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC)
    host.decide("s", 0.1)
    (tmp_path / "s.state.json").write_text("garbage")
    (tmp_path / "s.marker.json").unlink()
    with pytest.raises(StreamStateError, match="both unreadable"):
        CSAStreamHost(tmp_path)


def test_missing_marker_is_rebuilt_from_an_intact_snapshot(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock(), seq_block=4)
    host.open_stream("s", SPEC)
    for s in SCORES[:6]:
        host.decide("s", s)
    state = host.state("s")
    (tmp_path / "s.marker.json").unlink()
    again = CSAStreamHost(tmp_path, clock=Clock(), seq_block=4)
    assert again.state("s") == state
    marker = read_record(tmp_path / "s.marker.json")
    assert (marker["epoch"], marker["seq_bound"]) == (1, 6 + 4)


def test_marker_reserves_seqs_in_blocks_and_follows_epochs(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock(), seq_block=4)
    spec = StreamSpec(alpha=0.5, delta=0.1, grid=GRID, epoch_length=5)
    host.open_stream("s", spec)
    marker = tmp_path / "s.marker.json"
    bounds = []
    for _ in range(11):
        host.decide("s", 0.1)
        m = read_record(marker)
        bounds.append((m["epoch"], m["seq_bound"]))
    # The bound must cover next_seq. Seqs 0..3 fit the first block (bound 4); seq 4 makes next_seq 5
    # -> bound 5 + 4; seq 5 opens epoch 2, which the marker must record -> bound max(9, 6 + 4);
    # seq 9 makes next_seq 10, still covered; seq 10 opens epoch 3 -> bound 11 + 4.
    assert bounds == [
        (1, 4),
        (1, 4),
        (1, 4),
        (1, 4),
        (1, 9),
        (2, 10),
        (2, 10),
        (2, 10),
        (2, 10),
        (2, 10),
        (3, 15),
    ]


def test_overdue_labels_close_as_failures(tmp_path):
    clock = Clock()
    host = CSAStreamHost(tmp_path, clock=clock)
    host.open_stream("s", SPEC)
    for i, s in enumerate([0.05, 0.3, 0.5]):
        clock.now = 1000.0 + i
        host.decide("s", s)
    host.observe("s", 1, True)  # buffered behind seq 0
    clock.now = 1010.5  # seq 0 is 10.5 s old, seq 1 is labelled, seq 2 only 8.5 s old
    assert host.expire_overdue() == [("s", 0)]
    state = host.state("s")["controller"]
    assert state["next_apply"] == 2 and state["pending"][0][0] == 2
    m = host.status("s")
    assert (m["applied"], m["expired"]) == (2, 1)
    # Seq 0 (s = 0.05) failed: x = 1 - 0.5 on every threshold, the first bet is 0 (wealth stays 1);
    # seq 1 (s = 0.3) passed on the 0.4 threshold only, where the bet is now clip(-0.5/0.25, 0, 1) = 0.
    assert state["n"] == [1, 1, 2] and state["fails"] == [1, 1, 1] and state["ell"] == [0, 0, 0]
    with pytest.raises(AlreadyLabelledError):
        host.observe("s", 0, True)
    clock.now = 1012.0
    # Any call on the stream sweeps first: seq 2 expires before this decision.
    assert host.decide("s", 0.1)["seq"] == 3
    assert host.status("s")["expired"] == 2


def test_config_change_is_a_new_epoch_and_versions_switch_at_boundaries(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC, policy="p1", scorer="g1")
    for s in SCORES[:3]:
        host.decide("s", s)
    # Same spec, new policy: recorded at seq 3, same epoch (assumption P allows policy updates).
    assert host.open_stream("s", SPEC, policy="p2")["epoch"] == 1
    host.decide("s", 0.1)
    # New scorer: the score map changed, so a new epoch from seq 4 (our choice).
    assert host.open_stream("s", SPEC, scorer="g2")["epoch"] == 2
    assert host.status("s")["version_history"] == [
        {"seq": 0, "policy": "p1", "scorer": "g1"},
        {"seq": 3, "policy": "p2", "scorer": "g1"},
        {"seq": 4, "policy": "p2", "scorer": "g2"},
    ]
    # A new alpha: new epoch, seqs run on, the open rounds still take their labels.
    tighter = StreamSpec(alpha=0.3, delta=0.1, grid=GRID, label_timeout_s=10.0)
    status = host.open_stream("s", tighter)
    assert (status["epoch"], status["next_seq"], status["alpha"]) == (3, 4, 0.3)
    assert status["restarts"][-1]["reason"] == "config_changed"
    assert status["restarts"][-1]["previous"]["decided"] == 4
    assert status["pending"] == 4
    for seq in range(4):
        host.observe("s", seq, seq != 2)
    status = host.status("s")
    assert (status["applied"], status["pending"], status["epoch"]) == (4, 0, 3)
    # ... but only in the realised-risk counters: the new epoch's e-processes have seen nothing.
    state = host.state("s")["controller"]
    assert state["n"] == [0, 0, 0] and state["ell"] == [0.0, 0.0, 0.0]
    with pytest.raises(UnknownSeqError):
        host.observe("s", 4, True)
    # A new label timeout alone changes nothing under test.
    looser = StreamSpec(alpha=0.3, delta=0.1, grid=GRID, label_timeout_s=99.0)
    assert host.open_stream("s", looser)["epoch"] == 3
    assert CSAStreamHost(tmp_path).status("s")["label_timeout_s"] == 99.0


def test_switch_versions_refuses_labels_not_yet_applied(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC)
    host.decide("s", 0.1)
    with pytest.raises(ValueError, match="leak the future"):
        host.switch_versions("s", policy="p2", trained_through=0)
    host.observe("s", 0, True)
    assert host.switch_versions("s", policy="p2", trained_through=0) == 1


def test_stream_names_and_specs_are_validated(tmp_path):
    host = CSAStreamHost(tmp_path)
    for bad in ["", "../x", "a/b", ".hidden", "x" * 65]:
        with pytest.raises(ValueError, match="stream name"):
            host.open_stream(bad, SPEC)
    with pytest.raises(ValueError, match="alpha"):
        StreamSpec(alpha=1.5, delta=0.1, grid=GRID)
    with pytest.raises(ValueError, match="label_timeout_s"):
        StreamSpec(alpha=0.5, delta=0.1, grid=GRID, label_timeout_s=0)
    assert StreamSpec.from_dict(json.loads(json.dumps(SPEC.to_dict()))) == SPEC


def test_label_source_is_fixed_when_the_round_is_decided(tmp_path):
    root = tmp_path / "root"
    host = CSAStreamHost(root, clock=Clock())
    host.open_stream("s", SPEC)
    assert host.decide("s", 0.1, source="shadow")["seq"] == 0
    assert host.decide("s", 0.1)["seq"] == 1  # feedback, the default
    before = files(root)
    with pytest.raises(LabelSourceError, match="labelled by shadow"):
        host.observe("s", 0, True)
    with pytest.raises(LabelSourceError, match="labelled by feedback"):
        host.observe("s", 1, True, source="shadow")
    assert files(root) == before
    # Decision 1 lives only in the journal: its source survives a crash all the same.
    again = reopen(root)
    with pytest.raises(LabelSourceError):
        again.observe("s", 0, True)
    for h in (host, again):
        h.observe("s", 0, True, source="shadow")
        h.observe("s", 1, False)
        assert h.status("s")["applied"] == 2
    with pytest.raises(ValueError, match="label source"):
        host.decide("s", 0.1, source="client")


def audit(root, name="s") -> list[dict]:
    return [json.loads(line) for line in (root / f"{name}.audit.jsonl").read_text().splitlines()]


def test_every_applied_round_leaves_one_audit_line(tmp_path):
    clock = Clock()
    host = CSAStreamHost(tmp_path, clock=clock)
    host.open_stream("s", SPEC, policy="p1", scorer="g1")
    decided = []
    for i in range(24):
        clock.now = 1000.0 + i
        decided.append(host.decide("s", 0.15, source="shadow" if i % 2 else "feedback"))
        if i < 22:
            host.observe("s", i, True, source="shadow" if i % 2 else "feedback")
    assert not (tmp_path / "s.audit.jsonl").exists() or len(audit(tmp_path)) == 22
    clock.now = 1032.5  # seq 22 (decided at 1022) is overdue, seq 23 (1023) not yet
    host.expire_overdue()
    lines = audit(tmp_path)
    assert [r["seq"] for r in lines] == list(range(23))
    for r, d in zip(lines, decided, strict=False):
        assert r["threshold"] == d["threshold"]
        assert r["action"] == ("release" if d["release"] else "abstain")
        assert r["versions"] == {"policy": "p1", "scorer": "g1"} and r["epoch"] == 1
        assert r["score"] == 0.15 and r["in_epoch"]
        assert r["decided_at"] == 1000.0 + r["seq"]
    assert any(r["action"] == "release" for r in lines), "the stream never certified"
    assert [r["label"] for r in lines] == ["pass"] * 22 + ["expired"]
    assert [r["source"] for r in lines[:4]] == ["feedback", "shadow", "feedback", "shadow"]
    assert lines[21]["applied_at"] == 1021.0 and lines[22]["applied_at"] == 1032.5
    # A configuration change: seq 23 is applied later, outside the epoch it was decided in.
    host.open_stream("s", StreamSpec(alpha=0.3, delta=0.1, grid=GRID, label_timeout_s=10.0))
    host.observe("s", 23, False, source="shadow")
    last = audit(tmp_path)[-1]
    assert (last["seq"], last["epoch"], last["in_epoch"], last["label"]) == (23, 1, False, "fail")


def test_a_snapshot_from_before_label_sources_restores(tmp_path):
    root = tmp_path / "root"
    host = CSAStreamHost(root, clock=Clock())
    host.open_stream("s", SPEC)
    host.decide("s", 0.1)
    host.decide("s", 0.2)
    host.observe("s", 0, True)  # the snapshot now holds open round 1
    host.close()
    record = read_record(root / "s.state.json")
    record["decided_at"] = [[seq, t] for seq, t, *_ in record.pop("rounds")]
    write_record(root / "s.state.json", record)
    (root / "s.journal").write_bytes(b"")
    old = CSAStreamHost(root, clock=Clock())
    assert old.state("s")["rounds"] == [[1, 1000.0, None, "feedback", None]]
    old.observe("s", 1, True)
    assert old.status("s")["applied"] == 2


def test_carry_over_needs_a_fresh_controller():
    ctrl = SPEC.controller()
    ctrl.decide(0.1)
    with pytest.raises(ValueError, match="issued no rounds"):
        ctrl.carry_over(SPEC.controller())


# --------------------------------------------------------------------------- epochs and diagnostics

# (score, passed) rounds that fire a W = 2, rho = 0.2 Brier monitor on the last one (by hand in
# tests/algorithms/test_csa_diagnostics.py: baseline 0.125, last window 0.40625).
BRIER_ROUNDS = [
    (0.5, True),
    (0.0, True),
    (0.5, False),
    (0.5, True),
    (1.0, False),
    (0.75, True),
    (0.5, False),
]
BRIER_SPEC = StreamSpec(alpha=0.5, delta=0.1, grid=GRID, brier_window=2, brier_threshold=0.2)


def test_brier_alarm_is_a_new_epoch_in_the_audit_file_and_status(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", BRIER_SPEC)
    for s, _ in BRIER_ROUNDS:
        host.decide("s", s)
    host.decide("s", 0.1)  # seq 7: open when the alarm fires
    for seq, (_, passed) in enumerate(BRIER_ROUNDS):
        r = host.observe("s", seq, passed)
    assert r["epoch"] == 2
    status = host.status("s")
    assert status["restarts"] == [
        {"reason": "brier", "epoch": 2, "at_seq": 8, "time": 1000.0, "baseline": 0.125}
        | {"window_brier": 0.40625}
    ]
    assert [(e["epoch"], e["first_seq"], e["reason"]) for e in status["epoch_history"]] == [
        (2, 8, "brier")
    ]
    assert status["brier"]["labels"] == 0 and status["pending"] == 1
    lines = audit(tmp_path)
    assert [r.get("seq") for r in lines] == [*range(7), None]
    assert lines[-1]["event"] == "epoch" and lines[-1]["reason"] == "brier"
    assert lines[-1]["first_seq"] == 8 and lines[-1]["baseline"] == 0.125
    # A restart continues exactly, and the open round still takes its label, outside epoch 2.
    again = reopen(tmp_path)
    assert again.state("s") == host.state("s")
    for h in (host, again):
        h.observe("s", 7, True)
    assert again.state("s") == host.state("s")
    last = audit(tmp_path)[-1]
    assert (last["seq"], last["epoch"], last["in_epoch"]) == (7, 1, False)


def test_warm_start_through_the_host(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC)
    # At alpha 0.5 a pass at s <= 0.1 multiplies the wealth by 1 + min(0.5/0.25, 1) * 0.5 = 1.5
    # (after the first, bet-free one); log(1.5) * 14 >= log(2 * 3/0.1) certifies GRID[0] at 15.
    assert host.warm_start("s", [0.05] * 15, [True] * 15) == 15
    status = host.status("s")
    assert (status["threshold"], status["warm_rounds"], status["applied"]) == (0.4, 15, 0)
    line = audit(tmp_path)[-1]
    assert (line["event"], line["rounds"], line["failures"], line["at_seq"]) == (
        "warm_start",
        15,
        0,
        0,
    )
    assert host.decide("s", 0.05)["release"]
    assert reopen(tmp_path).state("s") == host.state("s")
    with pytest.raises(ValueError, match="warm start"):
        host.warm_start("s", [0.05], [True])


def test_every_epoch_change_keeps_open_rounds_and_the_audit_trail(tmp_path):
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC, policy="p0", scorer="g0")
    scheduled = StreamSpec(alpha=0.5, delta=0.1, grid=GRID, epoch_length=2, label_timeout_s=10.0)
    changes = [
        lambda: host.switch_versions("s", scorer="g1"),  # a surrogate retrain (R5)
        lambda: host.start_new_epoch("s", reason="operator"),
        lambda: host.open_stream("s", scheduled),
        lambda: host.decide("s", 0.1),  # two rounds into the epoch: the schedule opens the next
    ]
    before = b""
    still_open = []
    for change in changes:
        first = host.decide("s", 0.1)["seq"]
        still_open.append(host.decide("s", 0.1)["seq"])
        host.observe("s", first, True)
        epoch = host.status("s")["epoch"]
        change()
        assert host.status("s")["epoch"] == epoch + 1
        trail = (tmp_path / "s.audit.jsonl").read_bytes()
        assert trail.startswith(before)  # the audit file only grows
        before = trail
    status = host.status("s")
    reasons = ["scorer", "operator", "config_changed", "schedule"]
    assert [e["reason"] for e in status["epoch_history"]] == reasons
    assert [(e["epoch"], e["first_seq"]) for e in status["epoch_history"]] == [
        (2, 2),
        (3, 4),
        (4, 6),
        (5, 8),
    ]
    # The rounds left open across each change still take their labels, in no epoch's test.
    still_open.append(8)
    assert status["pending"] == 8  # all but seq 0: the labelled ones wait behind open seq 1
    for seq in still_open:
        host.observe("s", seq, False)
    lines = audit(tmp_path)
    rounds = [r for r in lines if "seq" in r]
    assert sorted(r["seq"] for r in rounds) == list(range(9))
    assert [r["in_epoch"] for r in rounds if r["seq"] in still_open] == [False] * 4 + [True]
    assert [r["reason"] for r in lines if r.get("event") == "epoch"] == reasons
    assert host.status("s")["applied"] == 9


def test_a_snapshot_from_before_the_diagnostics_restores(tmp_path):
    root = tmp_path / "root"
    host = CSAStreamHost(root, clock=Clock())
    host.open_stream("s", SPEC)
    for s in SCORES[:3]:
        host.decide("s", s)
    host.observe("s", 0, True)
    host.close()
    record = read_record(root / "s.state.json")
    ctrl = record["controller"]
    for key in ("drift_budget", "brier_window", "brier_threshold"):
        del record["spec"][key], ctrl["config"][key]
    for key in ("released_nu", "warm_rounds", "brier", "epoch_log"):
        del ctrl[key]
    del record["audited_epochs"]
    write_record(root / "s.state.json", record)
    old = CSAStreamHost(root, clock=Clock())
    assert old.state("s") == host.state("s") and old.status("s")["epoch"] == 1
    # The same spec reopened is no configuration change.
    assert old.open_stream("s", SPEC)["epoch"] == 1


def test_diagnostic_settings_are_part_of_the_spec(tmp_path):
    spec = StreamSpec(alpha=0.3, delta=0.1, grid=GRID, drift_budget=0.05, brier_window=300)
    assert StreamSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="drift_budget"):
        StreamSpec(alpha=0.6, delta=0.1, grid=GRID, drift_budget=0.4)
    with pytest.raises(ValueError, match="Brier window"):
        StreamSpec(alpha=0.3, delta=0.1, grid=GRID, brier_window=0)
    host = CSAStreamHost(tmp_path, clock=Clock())
    host.open_stream("s", SPEC)
    # Turning the diagnostic on changes the rule that places epoch boundaries: a new epoch.
    status = host.open_stream("s", BRIER_SPEC)
    assert status["epoch"] == 2 and status["restarts"][-1]["reason"] == "config_changed"
    assert status["brier"]["baseline"] is None and status["drift_budget"] == 0.0
