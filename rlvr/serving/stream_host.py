"""Durable named CSA streams (arXiv:2605.20270, Algorithms 1-2), hosted by the StreamsActor.

Pure Python (no Ray), so restarts and corruption are unit-testable. Each stream NAME keeps four
files under the root. `NAME.state.json` is the whole stream, rewritten atomically (write, fsync,
rename, fsync of the directory) after every applied label and every other change but a decision.
`NAME.journal` gets one checksummed line per decision (append + fdatasync, the one sync on the
request path) and is emptied by the next snapshot; snapshot + journal replay restores the stream
exactly. `NAME.marker.json` is a small record of (spec, epoch, seq bound, versions) that outlives a
lost or corrupt snapshot or journal: the stream then restarts as a new epoch past every seq it ever
issued, never as fresh state with the full error budget (that would be repeated testing).
`NAME.audit.jsonl` gets one line per applied round (seq, epoch, versions, the policy that served
it, score, threshold, action, label and its source), synced before the snapshot that applies it: a
crash between the two may repeat a line when the label is sent again, never lose one (readers keep
the last per seq). `NAME.experience.jsonl` keeps, for a round decided with one, the served prompt
and response token ids (what live learning trains on; `closed_round`), synced before its journal
line.
Lines with an "event" key are not rounds: "epoch" marks every epoch start after the first (its
first seq and reason: schedule, scorer, brier, config_changed, operator, snapshot_lost),
"warm_start" a warm start's pre-deployment rounds and "version" a policy or scorer switch (its
first seq and, for a live update, the last seq that trained it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlvr.algorithms.csa import CSAController, CSAError
from rlvr.files import atomic_write_text, fsync_dir

STREAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SEQ_BLOCK = 1024
"""Seqs reserved per marker write: the marker is rewritten once per this many decisions."""
_FORMAT = 1
_STATE_SUFFIX = ".state.json"
_MARKER_SUFFIX = ".marker.json"
_JOURNAL_SUFFIX = ".journal"
_AUDIT_SUFFIX = ".audit.jsonl"
_EXPERIENCE_SUFFIX = ".experience.jsonl"
LABEL_SOURCES = ("feedback", "shadow")
"""Who labels a round, fixed when it is decided: POST /v1/feedback, or the shadow verifier."""


class UnknownStreamError(CSAError):
    """No stream of that name is hosted here (maps to HTTP 404)."""


class LabelSourceError(CSAError):
    """A label from a source other than the one fixed for its round (maps to HTTP 409)."""


class PredictabilityError(CSAError):
    """A round served by a policy trained on its own label or a later one (rule R2 broken)."""


class StreamStateError(RuntimeError):
    """Neither the snapshot nor the marker of a stream can be read: refusing to guess its budget."""


@dataclass(frozen=True)
class StreamSpec:
    """What defines a stream: the CSA configuration (alpha, delta, grid, ...) and its label timeout.

    A change of any field but `label_timeout_s` changes the hypotheses under test, or the rule that
    places the epoch boundaries, so reopening a stream with it starts a new epoch (our choice:
    certificates earned under one configuration say nothing about another; Algorithm 2's reset).
    """

    alpha: float
    delta: float
    grid: tuple[float, ...]
    epoch_length: int | None = None
    sparse_pi_min: float | None = None
    seed: int = 0
    label_timeout_s: float | None = None
    """Seconds a round may wait for its label before it is closed as a failure (None: forever)."""
    drift_budget: float = 0.0
    """nu of Theorem 5.1: the e-processes test alpha + nu, the bound is alpha + nu + slack(N)."""
    brier_window: int | None = None
    """W of the Brier early-reset diagnostic (App. B.5; `BrierMonitor`); None: off."""
    brier_threshold: float = 0.2
    """Relative Brier rise over the warm-up baseline that, sustained, starts a new epoch."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(float(q) for q in self.grid))
        if self.label_timeout_s is not None and not self.label_timeout_s > 0:
            raise ValueError(f"label_timeout_s must be > 0 or None, got {self.label_timeout_s}")
        # The controller validates the CSA fields.
        self.controller()

    def controller(self) -> CSAController:
        """A fresh controller for this spec (epoch 1, no rounds)."""
        return CSAController(
            self.alpha,
            self.delta,
            list(self.grid),
            epoch_length=self.epoch_length,
            sparse_pi_min=self.sparse_pi_min,
            seed=self.seed,
            drift_budget=self.drift_budget,
            brier_window=self.brier_window,
            brier_threshold=self.brier_threshold,
        )

    def controller_config(self) -> dict[str, Any]:
        """The configuration a controller snapshot records (compared on restore)."""
        return self.controller().state_dict()["config"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-plain fields."""
        d = asdict(self)
        d["grid"] = list(self.grid)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamSpec:
        """Inverse of `to_dict`."""
        return cls(**d)


def write_record(path: Path, body: dict[str, Any]) -> None:
    """Durably replace `path` by `body` with a checksum line (torn or altered files are detected)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()
    atomic_write_text(path, f"{digest}\n{text}\n")


def read_record(path: Path) -> dict[str, Any]:
    """The body `write_record` wrote; ValueError if the file is torn, altered or not a record."""
    raw = path.read_text()
    digest, sep, text = raw.partition("\n")
    text = text.rstrip("\n")
    if not sep or hashlib.sha256(text.encode()).hexdigest() != digest:
        raise ValueError(f"{path.name}: checksum mismatch (torn or altered file)")
    body = json.loads(text)
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        raise ValueError(f"{path.name}: not a format-{_FORMAT} CSA stream record")
    return body


def _journal_line(entry: dict[str, Any]) -> bytes:
    text = json.dumps(entry, sort_keys=True, separators=(",", ":"))
    return f"{hashlib.sha256(text.encode()).hexdigest()[:16]}\t{text}\n".encode()


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The decisions a journal holds, in order; ValueError if a line other than the last is bad.

    A torn last line (the write that was in progress at a crash) is dropped: its decision was
    never acknowledged, because the caller only hears back after the line is synced.
    """
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    entries = []
    for i, line in enumerate(lines):
        digest, _, text = line.decode(errors="replace").partition("\t")
        ok = bool(text) and hashlib.sha256(text.encode()).hexdigest()[:16] == digest
        if ok:
            entries.append(json.loads(text))
        elif i < len(lines) - 1:
            raise ValueError(f"{path.name}: line {i + 1} is corrupt")
    return entries


@dataclass(frozen=True)
class _Round:
    """What the host remembers of an open round: when it was decided, at which threshold, and
    who labels it."""

    decided_at: float
    threshold: float | None
    source: str
    policy: str | None = None
    """The policy version that generated the round's answer, as its replica reported it."""


class _Stream:
    """One hosted stream: its controller plus what the host must remember about it."""

    def __init__(self, name: str, spec: StreamSpec, ctrl: CSAController):
        self.name = name
        self.spec = spec
        self.rounds: dict[int, _Round] = {}  # open rounds only, ascending seq
        self.restarts: list[dict[str, Any]] = []
        self.audited_epochs = len(ctrl.epoch_log)  # epoch starts already in the audit file
        self.marker_epoch = 0
        self.seq_bound = 0
        self.ctrl = ctrl

    @property
    def ctrl(self) -> CSAController:
        return self._ctrl

    @ctrl.setter
    def ctrl(self, ctrl: CSAController) -> None:
        ctrl.applied_rounds = []  # drained into the audit file by every mutating call
        self._ctrl = ctrl


class CSAStreamHost:
    """Named CSA streams with durable state; its owner must be the streams' only writer.

    Every mutating call (`open_stream`, `decide`, `observe`, `expire_overdue`, `switch_versions`,
    `start_new_epoch`) persists the stream before it returns, so what a caller was told survives a
    crash. Rounds whose label is overdue (`label_timeout_s`) are closed as failures before every
    call on their stream (our choice: imputing a failure can only raise the increment, so the
    e-processes stay valid). On construction every stream found under `root` is restored; `clock`
    gives wall-clock seconds (the timeouts must survive restarts, so monotonic time will not do).
    """

    def __init__(
        self, root: str | Path, clock: Callable[[], float] = time.time, seq_block: int = SEQ_BLOCK
    ):
        if seq_block < 1:
            raise ValueError(f"seq_block must be >= 1, got {seq_block}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.seq_block = seq_block
        self._streams: dict[str, _Stream] = {}
        self._journals: dict[str, Any] = {}  # open append handles, one per stream
        names = {
            p.name[: -len(suffix)]
            for suffix in (_STATE_SUFFIX, _MARKER_SUFFIX, _JOURNAL_SUFFIX)
            for p in self.root.glob(f"*{suffix}")
        }
        for name in sorted(names):
            if STREAM_NAME.fullmatch(name):
                self._streams[name] = self._restore(name)

    # ----------------------------------------------------------------- streams

    def open_stream(
        self,
        name: str,
        spec: StreamSpec,
        policy: str | None = None,
        scorer: str | None = None,
    ) -> dict[str, Any]:
        """Host stream `name` with `spec` and pin the versions serving its next rounds (idempotent).

        A new name starts at epoch 1. A restored stream keeps its state; if `spec` changes the CSA
        configuration, it continues as a new epoch with its seqs running on, and a new scorer
        also starts one (`CSAController.switch_versions`). Returns `status(name)`.
        """
        if not isinstance(name, str) or not STREAM_NAME.fullmatch(name):
            raise ValueError(
                f"stream name {name!r} must match {STREAM_NAME.pattern} (it names files)"
            )
        stream = self._streams.get(name)
        if stream is None:
            stream = _Stream(name, spec, spec.controller())
            self._streams[name] = stream
        elif spec.controller_config() != stream.spec.controller_config():
            # A new epoch under the new configuration; open rounds keep their seqs and labels.
            old = stream.ctrl
            ctrl = spec.controller()
            ctrl.carry_over(old)
            stream.restarts.append(self._event("config_changed", ctrl, old.metrics()))
            stream.ctrl, stream.spec = ctrl, spec
        else:
            stream.spec = spec
        if policy is not None or scorer is not None:
            current = stream.ctrl.versions
            if (policy is not None and policy != current["policy"]) or (
                scorer is not None and scorer != current["scorer"]
            ):
                stream.ctrl.switch_versions(policy=policy, scorer=scorer)
        self._persist(stream)
        return self.status(name)

    def stream_names(self) -> list[str]:
        """Names of the hosted streams."""
        return sorted(self._streams)

    def close(self) -> None:
        """Close the journal files (everything is already durable)."""
        for f in self._journals.values():
            f.close()
        self._journals.clear()

    # ----------------------------------------------------------------- rounds

    def decide(
        self,
        name: str,
        score: float,
        source: str = "feedback",
        policy: str | None = None,
        experience: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Issue the next seq of stream `name` and decide release for calibrated `score`; only
        `source` (one of LABEL_SOURCES) may label the round.

        `policy` is the version that generated the answer: one trained on labels up to seq k may
        serve only seqs above k (rule R2), else PredictabilityError and nothing is issued.
        `experience` ({"prompt_ids", "response_ids"}: the served answer, and "reference" when
        the shadow verifier labels it) is kept for live learning. Returns seq, release, threshold
        (None = nothing certified), epoch, the versions published for this round and the serving
        policy; the round is durable before this returns.
        """
        if source not in LABEL_SOURCES:
            raise ValueError(f"label source must be one of {LABEL_SOURCES}, got {source!r}")
        stream = self._get(name)
        self._expire(stream)
        if policy is not None:
            trained = stream.ctrl.trained_through(policy)
            next_seq = stream.ctrl.next_seq
            if trained is not None and trained >= next_seq:
                raise PredictabilityError(
                    f"policy {policy} was trained on labels up to seq {trained} and may not "
                    f"serve seq {next_seq} (rule R2)"
                )
        decision = stream.ctrl.decide(score)
        now = self.clock()
        stream.rounds[decision.seq] = _Round(now, decision.threshold, source, policy)
        self._audit(stream)  # sparse mode applies unverified rounds at decision time
        _prune(stream)
        self._cover(stream)
        if experience is not None:
            self._write_lines(
                self.experience_path(name),
                [
                    {
                        "seq": decision.seq,
                        "policy": policy,
                        "prompt_ids": [int(t) for t in experience["prompt_ids"]],
                        "response_ids": [int(t) for t in experience["response_ids"]],
                        "reference": experience.get("reference"),
                    }
                ],
            )
        entry = {"seq": decision.seq, "score": float(score), "time": now, "source": source}
        if policy is not None:
            entry["policy"] = policy
        self._append(stream, entry)
        return {
            "stream": name,
            "seq": decision.seq,
            "release": decision.release,
            "threshold": decision.threshold,
            "epoch": stream.ctrl.epoch,
            "versions": stream.ctrl.versions_at(decision.seq),
            "served_policy": policy,
        }

    def observe(
        self, name: str, seq: int, passed: bool, source: str = "feedback"
    ) -> dict[str, Any]:
        """Apply the label for `seq` from `source` (in seq order, via the reorder buffer).

        UnknownSeqError / AlreadyLabelledError, and LabelSourceError for a source other than the
        round's, leave the stream untouched (a retried label is harmless). Returns the seq, the
        label, and the stream's deployed threshold afterwards.
        """
        stream = self._get(name)
        self._expire(stream)
        open_round = stream.rounds.get(seq) if isinstance(seq, int) else None
        if open_round is not None and open_round.source != source and stream.ctrl.wants_label(seq):
            raise LabelSourceError(
                f"seq {seq} is labelled by {open_round.source}, fixed when it was decided; "
                f"a {source} label is refused"
            )
        stream.ctrl.observe(seq, passed)
        self._persist(stream)
        return {
            "stream": name,
            "seq": seq,
            "passed": bool(passed),
            "threshold": stream.ctrl.threshold,
            "epoch": stream.ctrl.epoch,
        }

    def expire_overdue(self, name: str | None = None) -> list[tuple[str, int]]:
        """Close every round of `name` (or of all streams) whose label is overdue, as a failure."""
        names = self.stream_names() if name is None else [name]
        return [(n, seq) for n in names for seq in self._expire(self._get(n))]

    def switch_versions(
        self,
        name: str,
        policy: str | None = None,
        scorer: str | None = None,
        trained_through: int | None = None,
    ) -> int:
        """Record a policy/scorer switch at the next seq of `name`, with an `"event": "version"`
        line in the audit file; returns that seq (see `CSAController.switch_versions`)."""
        stream = self._get(name)
        self._expire(stream)
        boundary = stream.ctrl.switch_versions(
            policy=policy, scorer=scorer, trained_through=trained_through
        )
        event = {"event": "version", "at_seq": boundary, **stream.ctrl.versions}
        if trained_through is not None:
            event["trained_through"] = trained_through
        self._write_audit(stream, [event | {"time": self.clock()}])
        self._persist(stream)
        return boundary

    def start_new_epoch(self, name: str, reason: str = "operator") -> int:
        """Reset the e-processes of `name` (e.g. on a drift alarm); returns the new epoch.

        Open rounds keep their seqs and take their labels (into the realised-risk counters only);
        the audit file and the version history run on. The stream's Brier diagnostic (App. B.5)
        starts its epochs inside the controller; they are recorded alike, with reason "brier".
        """
        stream = self._get(name)
        self._expire(stream)
        epoch = stream.ctrl.start_new_epoch(reason=reason)
        stream.restarts.append(self._event(reason, stream.ctrl))
        self._persist(stream)
        return epoch

    def warm_start(self, name: str, scores: list[float], passed: list[bool]) -> int:
        """Seed the current epoch of `name` with labelled pre-deployment rounds (calibrated scores
        and verifier labels; App. B.5's warm start, see `CSAController.warm_start`); returns n0."""
        stream = self._get(name)
        self._expire(stream)
        n0 = stream.ctrl.warm_start(scores, passed)
        self._write_audit(
            stream,
            [
                {
                    "event": "warm_start",
                    "epoch": stream.ctrl.epoch,
                    "rounds": n0,
                    "failures": n0 - sum(bool(p) for p in passed),
                    "at_seq": stream.ctrl.next_seq,
                    "time": self.clock(),
                }
            ],
        )
        self._persist(stream)
        return n0

    def publish(self, policy: str, trained_through: int, source: str) -> dict[str, int]:
        """Deploy `policy`, trained on the labels of stream `source` up to seq `trained_through`,
        on every stream at its next seq (rules R1-R2; idempotent: a stream already switched to
        it is left as is). Returns each stream's boundary seq."""
        self._get(source)
        boundaries = {}
        for name in self.stream_names():
            stream = self._get(name)
            if stream.ctrl.versions["policy"] == policy:
                boundaries[name] = next(
                    v["seq"]
                    for v in reversed(stream.ctrl.state_dict()["versions"])
                    if v["policy"] == policy
                )
                continue
            boundaries[name] = self.switch_versions(
                name, policy=policy, trained_through=trained_through if name == source else None
            )
        return boundaries

    def versions(self, name: str) -> dict[str, str | None]:
        """Policy and scorer versions published for the next seq of `name`."""
        return self._get(name).ctrl.versions

    def closed_round(self, name: str, first: int, end: int) -> dict[str, Any] | None:
        """Seqs first..end-1 of `name` once every one of them is applied (None before): their
        labels, the kept prompt/response of each round that passed (Expert Iteration trains on
        those alone; arXiv:2605.20270 Sec. 6.2), and every kept round with a reference (GRPO's
        prompts)."""
        stream = self._get(name)
        self._expire(stream)
        if not 0 <= first < end:
            raise ValueError(f"empty or negative seq range [{first}, {end})")
        if stream.ctrl.next_apply < end:
            return None
        labels = {
            line["seq"]: line["label"]
            for line in _read_lines(self.audit_path(name))
            if "event" not in line and first <= line["seq"] < end
        }
        experience = {
            line["seq"]: line
            for line in _read_lines(self.experience_path(name))
            if first <= line["seq"] < end
        }
        passed = [seq for seq in range(first, end) if labels.get(seq) == "pass"]
        return {
            "labels": {seq: labels.get(seq) for seq in range(first, end)},
            "pairs": [experience[seq] for seq in passed if seq in experience],
            "references": [e for seq, e in sorted(experience.items()) if e.get("reference")],
            "passed_without_experience": [seq for seq in passed if seq not in experience],
        }

    # ----------------------------------------------------------------- inspection

    def status(self, name: str) -> dict[str, Any]:
        """Monitoring view of `name`: the controller's metrics (with the Brier diagnostic), its
        spec, restarts (unscheduled epochs, "brier" among them), epoch starts and versions."""
        stream = self._get(name)
        self._expire(stream)
        metrics = stream.ctrl.metrics()
        # JSON has no infinity: the slack before the first release is reported as None.
        metrics["slack"] = metrics["slack"] if math.isfinite(metrics["slack"]) else None
        state = stream.ctrl.state_dict()
        return {
            "stream": name,
            **metrics,
            "next_seq": state["next_seq"],
            "alpha": stream.spec.alpha,
            "delta": stream.spec.delta,
            "grid": list(stream.spec.grid),
            "label_timeout_s": stream.spec.label_timeout_s,
            "drift_budget": stream.spec.drift_budget,
            "restarts": [dict(r) for r in stream.restarts],
            "epoch_history": state["epoch_log"],
            "version_history": state["versions"],
        }

    def audit_path(self, name: str) -> Path:
        """The append-only record of the applied rounds of `name` (JSON lines)."""
        return self.root / f"{name}{_AUDIT_SUFFIX}"

    def experience_path(self, name: str) -> Path:
        """The served prompts and answers of `name`'s rounds, one JSON line per seq."""
        return self.root / f"{name}{_EXPERIENCE_SUFFIX}"

    def state(self, name: str) -> dict[str, Any]:
        """The stream exactly as persisted (controller snapshot, open-round times, restarts)."""
        return self._record(self._get(name))

    # ----------------------------------------------------------------- internals

    def _get(self, name: str) -> _Stream:
        stream = self._streams.get(name)
        if stream is None:
            raise UnknownStreamError(f"no CSA stream named {name!r}")
        return stream

    def _expire(self, stream: _Stream) -> list[int]:
        timeout = stream.spec.label_timeout_s
        if timeout is None:
            return []
        deadline = self.clock() - timeout
        expired = []
        for seq, open_round in list(stream.rounds.items()):
            if open_round.decided_at <= deadline and stream.ctrl.wants_label(seq):
                stream.ctrl.expire(seq)
                expired.append(seq)
        if expired:
            self._persist(stream)
        return expired

    def _event(
        self, reason: str, ctrl: CSAController, previous: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        event = {
            "reason": reason,
            "epoch": ctrl.epoch,
            "at_seq": ctrl.next_seq,
            "time": self.clock(),
        }
        if previous is not None:
            event["previous"] = {
                k: previous[k] for k in ("epoch", "decided", "applied", "released", "risk")
            }
        return event

    def _record(self, stream: _Stream) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "stream": stream.name,
            "spec": stream.spec.to_dict(),
            "controller": stream.ctrl.state_dict(),
            "rounds": [
                [seq, r.decided_at, r.threshold, r.source, r.policy]
                for seq, r in stream.rounds.items()
            ],
            "restarts": [dict(r) for r in stream.restarts],
            "audited_epochs": stream.audited_epochs,
        }

    def _cover(self, stream: _Stream) -> None:
        """Rewrite the marker if it no longer covers next_seq or the current epoch.

        It must be durable before any caller hears of a seq beyond its bound: a restart after a
        lost snapshot continues from the bound, in a later epoch.
        """
        next_seq = stream.ctrl.next_seq
        if next_seq <= stream.seq_bound and stream.ctrl.epoch <= stream.marker_epoch:
            return
        bound = max(stream.seq_bound, next_seq + self.seq_block)
        write_record(
            self.root / f"{stream.name}{_MARKER_SUFFIX}",
            {
                "format": _FORMAT,
                "stream": stream.name,
                "spec": stream.spec.to_dict(),
                "epoch": stream.ctrl.epoch,
                "seq_bound": bound,
                "versions": stream.ctrl.versions,
            },
        )
        stream.seq_bound, stream.marker_epoch = bound, stream.ctrl.epoch

    def _journal(self, stream: _Stream) -> Any:
        f = self._journals.get(stream.name)
        if f is None:
            path = self.root / f"{stream.name}{_JOURNAL_SUFFIX}"
            created = not path.exists()
            f = self._journals[stream.name] = open(path, "ab")  # noqa: SIM115 (kept open)
            if created:
                fsync_dir(self.root)
        return f

    def _append(self, stream: _Stream, entry: dict[str, Any]) -> None:
        f = self._journal(stream)
        f.write(_journal_line(entry))
        f.flush()
        os.fdatasync(f.fileno())

    def _audit(self, stream: _Stream) -> None:
        """Append (and sync) a line per round the controller applied since the last call, then one
        per epoch it started; a Brier alarm also becomes a restart (shown by `status`)."""
        applied = stream.ctrl.applied_rounds
        epochs = stream.ctrl.epoch_log[stream.audited_epochs :]
        if not applied and not epochs:
            return
        now = self.clock()
        lines = []
        for r in applied:
            open_round = stream.rounds.get(r.seq)
            label = (
                "unverified"
                if r.passed is None
                else "expired"
                if r.expired
                else "pass"
                if r.passed
                else "fail"
            )
            lines.append(
                {
                    "seq": r.seq,
                    "epoch": r.epoch,
                    "in_epoch": r.epoch == stream.ctrl.epoch,
                    "versions": stream.ctrl.versions_at(r.seq),
                    "served_policy": None if open_round is None else open_round.policy,
                    "score": r.score,
                    "threshold": None if open_round is None else open_round.threshold,
                    "action": "release" if r.released else "abstain",
                    "label": label,
                    "source": None if open_round is None else open_round.source,
                    "decided_at": None if open_round is None else open_round.decided_at,
                    "applied_at": now,
                }
            )
        applied.clear()
        for e in epochs:
            start = {
                "reason": e["reason"],
                "epoch": e["epoch"],
                "at_seq": e["first_seq"],
                "time": now,
            }
            if e["reason"] == "brier":
                stream.restarts.append(start | {k: e[k] for k in ("baseline", "window_brier")})
            lines.append({"event": "epoch", **e, "time": now})
        stream.audited_epochs += len(epochs)
        self._write_audit(stream, lines)

    def _write_audit(self, stream: _Stream, lines: list[dict[str, Any]]) -> None:
        """Append records to the audit file of `stream`, one JSON line each, and sync them."""
        self._write_lines(self.audit_path(stream.name), lines)

    @staticmethod
    def _write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
        """Append records to `path`, one JSON line each, and sync them."""
        text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
        with open(path, "a") as f:
            f.write(text)
            f.flush()
            os.fdatasync(f.fileno())

    def _persist(self, stream: _Stream) -> None:
        """Audit lines, marker (if needed), then the snapshot, which makes the journal's lines
        redundant."""
        self._audit(stream)
        _prune(stream)
        self._cover(stream)
        write_record(self.root / f"{stream.name}{_STATE_SUFFIX}", self._record(stream))
        # Not synced: a stale journal line left by a crash has a seq the snapshot already covers.
        self._journal(stream).truncate(0)

    def _restore(self, name: str) -> _Stream:
        state_path = self.root / f"{name}{_STATE_SUFFIX}"
        marker_path = self.root / f"{name}{_MARKER_SUFFIX}"
        marker, marker_err = _try_read(marker_path)
        state, state_err = _try_read(state_path)
        if state is not None:
            try:
                spec = StreamSpec.from_dict(state["spec"])
                stream = _Stream(name, spec, CSAController.from_state_dict(state["controller"]))
                stream.rounds = _read_rounds(state)
                stream.restarts = [dict(r) for r in state["restarts"]]
                stream.audited_epochs = int(state.get("audited_epochs", stream.audited_epochs))
            except (KeyError, TypeError, ValueError) as err:
                state, state_err = None, f"{state_path.name}: unusable snapshot ({err})"
        if state is not None:
            try:
                _replay(stream, read_journal(self.root / f"{name}{_JOURNAL_SUFFIX}"))
            except (KeyError, TypeError, ValueError) as err:
                state, state_err = None, f"{name}{_JOURNAL_SUFFIX}: unusable journal ({err})"
        if state is not None:
            if marker is not None:
                stream.seq_bound, stream.marker_epoch = int(marker["seq_bound"]), marker["epoch"]
            # A missing or stale marker is rewritten now, from the intact snapshot.
            self._persist(stream)
            return stream
        if marker is None:
            raise StreamStateError(
                f"CSA stream {name!r}: snapshot and marker are both unreadable ({state_err}; "
                f"{marker_err}); restarting it fresh would reuse its error budget. Restore a "
                f"backup, or remove the stream's files to start it over deliberately."
            )
        # Lost snapshot: a new epoch that starts after every seq the old state could have issued.
        spec = StreamSpec.from_dict(marker["spec"])
        ctrl = spec.controller()
        ctrl.start_new_epoch(
            int(marker["epoch"]) + 1, next_seq=int(marker["seq_bound"]), reason="snapshot_lost"
        )
        versions = marker.get("versions") or {}
        if versions.get("policy") is not None or versions.get("scorer") is not None:
            ctrl.switch_versions(policy=versions.get("policy"), scorer=versions.get("scorer"))
        stream = _Stream(name, spec, ctrl)
        stream.audited_epochs = 0  # the new epoch's start is not in the audit file yet
        stream.seq_bound, stream.marker_epoch = int(marker["seq_bound"]), int(marker["epoch"])
        stream.restarts.append(self._event("snapshot_lost", ctrl) | {"detail": state_err})
        self._persist(stream)
        return stream


def _replay(stream: _Stream, entries: list[dict[str, Any]]) -> None:
    """Re-decide the journal's rounds the snapshot does not hold (decide is deterministic)."""
    for entry in entries:
        seq = int(entry["seq"])
        expected = stream.ctrl.next_seq
        if seq < expected:
            continue  # already in the snapshot (a crash came before the journal was emptied)
        if seq != expected:
            raise ValueError(f"decision {seq} follows {expected - 1}: decisions are missing")
        decided = stream.ctrl.decide(float(entry["score"]))
        if decided.seq != seq:
            raise ValueError(f"replayed decision got seq {decided.seq}, journal says {seq}")
        source = entry.get("source", "feedback")
        stream.rounds[seq] = _Round(
            float(entry["time"]), decided.threshold, source, entry.get("policy")
        )
        # Rounds sparse mode applies on replay, and scheduled epochs, were audited when first
        # decided (the audit line is synced before the journal line).
        stream.ctrl.applied_rounds.clear()
        stream.audited_epochs = len(stream.ctrl.epoch_log)
        _prune(stream)


def _read_rounds(state: dict[str, Any]) -> dict[int, _Round]:
    """The open rounds of a snapshot (one written before label sources has decision times only:
    its rounds are feedback-labelled, their thresholds unknown)."""
    if "rounds" not in state:
        return {int(s): _Round(float(t), None, "feedback") for s, t in state["decided_at"]}
    rounds = {}
    for seq, t, threshold, source, *policy in state["rounds"]:
        if source not in LABEL_SOURCES:
            raise ValueError(f"round {seq}: unknown label source {source!r}")
        threshold = None if threshold is None else float(threshold)
        rounds[int(seq)] = _Round(float(t), threshold, source, *policy)
    return rounds


def _prune(stream: _Stream) -> None:
    """Forget the applied rounds (those below the apply queue's head)."""
    head = stream.ctrl.blocking_seq
    for seq in [s for s in stream.rounds if head is None or s < head]:
        del stream.rounds[seq]


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of an append-only file (none if it does not exist); a line that does not
    parse (a write a crash interrupted) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _try_read(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(record, "") or (None, why it could not be read)."""
    if not path.exists():
        return None, f"{path.name}: missing"
    try:
        return read_record(path), ""
    except (OSError, ValueError) as err:
        return None, f"{path.name}: {err}"
