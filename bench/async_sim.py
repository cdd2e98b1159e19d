"""Timeline model of synchronous against asynchronous rollouts: G devices split into engines and
trainers, driven by per-sample generation lengths and per-step costs.

An engine decodes all its running requests together (continuous batching): one decode step costs
`decode_step_s + running * decode_token_s` and advances every running request by one token, so
with few tokens in flight an engine's time is governed by its longest sample; admitting a request
costs `prefill_s` of engine time. A group (one prompt's samples) runs on one engine and is done
when its last sample is. The trainer trains a batch of `groups_per_step` groups in
`train_step_s + train_sample_s * samples + train_token_s * tokens`, then the weights move to the
engines in `sync_s` (trainer and engines both held).

- sync: each step the engines generate the batch, the trainers train it, then the weights sync.
- async, staleness k: engines keep admitting groups while fewer than (v + k + 1) batches were
  admitted (v: the engines' policy version, dropped groups not counted); the trainer's step t
  takes the first completed groups (in completion order) whose policy version is >= t - k and
  drops older ones. Without partial rollouts a weight update waits until the engines have
  drained their in-flight requests (admitting none meanwhile); with partial rollouts the engines
  pause between decode steps, load the weights and continue them (a group's version is its
  oldest token's). At k = 0 this is the synchronous schedule exactly.

- batches, staleness k (what `run.max_staleness` runs, `workflows/rollout_pipeline.py`): the
  engines collect whole batches in step order, batch t once version max(0, t - k) exists and the
  batch before is collected; step t trains once batch t is collected. With partial rollouts of L
  tokens (`run.partial_rollout_tokens`), batch t samples every request's first L tokens with
  that version, then, once version max(0, t - k + 1) exists, the rest, its requests' prefill
  recomputed. The weight sync's seconds make a version exist; the engines' loads are in them.

Not modelled: a KV-cache limit on running requests, stragglers, network contention, and the
2-core case where engines and trainers share CPUs (see `validate`).

    .venv/bin/python bench/async_sim.py validate /tmp/runs/tiny-k0 /tmp/runs/tiny-k1
    .venv/bin/python bench/async_sim.py project --rollouts bench/out/agent_learning/runs/*/rollouts.jsonl
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import statistics
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # rlvr.run.mfu when run as a script

from harness import markdown_table, write_results  # noqa: E402

OUT = ROOT / "bench" / "out" / "async_sim"
PUBLISHED = (
    "AReaL 2.77x (arXiv 2505.24298), verl fully_async 1.72-2.67x on 32-128 GPUs, "
    "ROLL Flash 2.24x (arXiv 2510.11345); each against the same system's synchronous mode"
)


@dataclass(frozen=True)
class Costs:
    """Seconds of each unit of work (engines: per engine; trainer: the whole trainer pool)."""

    decode_step_s: float
    decode_token_s: float
    prefill_s: float
    train_token_s: float
    train_sample_s: float
    train_step_s: float
    sync_s: float

    def decode_step(self, running: int) -> float:
        """Seconds of one decode step of an engine with `running` requests."""
        return self.decode_step_s + running * self.decode_token_s

    def train(self, lengths: np.ndarray) -> float:
        """Seconds for the trainer pool to train on samples of these response lengths."""
        return (
            self.train_step_s
            + self.train_sample_s * lengths.size
            + self.train_token_s * float(lengths.sum())
        )


@dataclass(frozen=True)
class Layout:
    """How many engines share the generation, and the batch a step trains on."""

    engines: int
    groups_per_step: int
    group_size: int


class Lengths:
    """Response lengths of group j, the same for every schedule: row j of `rows` (measured
    groups in the order they were generated), or drawn in order by `draw(rng, groups)`."""

    def __init__(
        self,
        rows: np.ndarray | None = None,
        draw: Callable[[np.random.Generator, int], np.ndarray] | None = None,
        seed: int = 0,
    ):
        if (rows is None) == (draw is None):
            raise ValueError("give measured rows or a draw function, not both")
        self.rows, self.draw, self.rng = rows, draw, np.random.default_rng(seed)
        if rows is not None and (rows < 1).any():
            raise ValueError("every response length must be >= 1 token")

    def group(self, j: int) -> np.ndarray:
        """The lengths of group j's samples."""
        if self.draw is not None and (self.rows is None or j >= len(self.rows)):
            more = self.draw(self.rng, max(j + 1, 64))
            self.rows = more if self.rows is None else np.concatenate([self.rows, more])
        if j >= len(self.rows):
            raise IndexError(f"group {j}: only {len(self.rows)} measured groups")
        return self.rows[j]


@dataclass
class Timeline:
    """What a simulated run did: each step's end, and the busy seconds summed over engines and
    over the trainer up to each step's end (so any window of steps has its shares)."""

    engines: int
    step_ends: list[float] = field(default_factory=list)
    engine_busy: list[float] = field(default_factory=list)
    trainer_busy: list[float] = field(default_factory=list)
    syncs: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    dropped: int = 0
    engines_sync: bool = True
    """Whether the engines stop for the weight sync (False: they load snapshots on their own)."""

    def window(self, warmup: int) -> dict[str, float]:
        """Mean step time and busy / sync / idle shares over steps warmup .. end."""
        if not 0 <= warmup < len(self.step_ends):
            raise ValueError(f"warm-up {warmup} of {len(self.step_ends)} steps")

        def before(series: list[float]) -> float:
            return series[warmup - 1] if warmup else 0.0

        span = self.step_ends[-1] - before(self.step_ends)
        steps = len(self.step_ends) - warmup
        sync = self.syncs[-1] - before(self.syncs)
        engine = (self.engine_busy[-1] - before(self.engine_busy)) / (self.engines * span)
        trainer = (self.trainer_busy[-1] - before(self.trainer_busy)) / span
        return {
            "step_s": span / steps,
            "engine_busy": engine,
            "engine_idle": 1.0 - engine - (sync / span if self.engines_sync else 0.0),
            "trainer_busy": trainer,
            "trainer_idle": 1.0 - trainer - sync / span,
            "sync": sync / span,
        }

    def record(self, now: float, engine_busy: float, trainer_busy: float, sync_s: float) -> None:
        self.step_ends.append(now)
        self.engine_busy.append(engine_busy)
        self.trainer_busy.append(trainer_busy)
        self.syncs.append((self.syncs[-1] if self.syncs else 0.0) + sync_s)


def engine_seconds(groups: Sequence[np.ndarray], costs: Costs) -> float:
    """Seconds for one engine to generate `groups` admitted together: every request's prefill,
    then decode steps while requests finish, the longest last."""
    lengths = np.sort(np.concatenate(groups)) if groups else np.zeros(0)
    seconds, done = costs.prefill_s * lengths.size, 0.0
    for i, length in enumerate(lengths):
        seconds += (length - done) * costs.decode_step(lengths.size - i)
        done = length
    return float(seconds)


def simulate_sync(lengths: Lengths, layout: Layout, costs: Costs, steps: int) -> Timeline:
    """The synchronous schedule in closed form: per step, the engines' slowest batch (group j on
    engine j mod E), then training, then the weight sync."""
    timeline, now, engine_busy, trainer_busy = Timeline(layout.engines), 0.0, 0.0, 0.0
    b = layout.groups_per_step
    for t in range(steps):
        groups = [lengths.group(t * b + i) for i in range(b)]
        per_engine = [
            engine_seconds(groups[e :: layout.engines], costs) for e in range(layout.engines)
        ]
        train = costs.train(np.concatenate(groups))
        now += max(per_engine) + train + costs.sync_s
        engine_busy += sum(per_engine)
        trainer_busy += train
        timeline.staleness += [0] * b
        timeline.record(now, engine_busy, trainer_busy, costs.sync_s)
    return timeline


def simulate_batches(
    lengths: Lengths,
    layout: Layout,
    costs: Costs,
    steps: int,
    max_staleness: int,
    partial_tokens: int = 0,
) -> Timeline:
    """The fixed-lag schedule of whole batches (see the module doc), in closed form; group i of a
    batch runs on engine i mod E and a batch is collected when its slowest engine is done."""
    if max_staleness < 0 or partial_tokens < 0:
        raise ValueError("max_staleness and partial_tokens must be >= 0")
    b, k = layout.groups_per_step, max_staleness
    timeline = Timeline(layout.engines, engines_sync=False)
    exists = [0.0]  # when each policy version exists
    engines_free = step_end = engine_busy = trainer_busy = 0.0

    def collect(groups: list[np.ndarray], start: float) -> float:
        nonlocal engine_busy
        per_engine = [
            engine_seconds(groups[e :: layout.engines], costs) for e in range(layout.engines)
        ]
        engine_busy += sum(per_engine)
        return start + max(per_engine)

    for t in range(steps):
        groups = [lengths.group(t * b + i) for i in range(b)]
        first = max(0, t - k)
        start = max(engines_free, exists[first])
        if partial_tokens:
            head = [np.minimum(g, partial_tokens) for g in groups]
            tail = [g[g > partial_tokens] - partial_tokens for g in groups]
            paused = collect(head, start)
            engines_free = collect(tail, max(paused, exists[max(0, t - k + 1)]))
        else:
            engines_free = collect(groups, start)
        train = costs.train(np.concatenate(groups))
        step_end = max(step_end, engines_free) + train + costs.sync_s
        exists.append(step_end)
        trainer_busy += train
        timeline.staleness += [t - first] * b
        timeline.record(step_end, engine_busy, trainer_busy, costs.sync_s)
    return timeline


class Engine:
    """One engine's running requests, advanced in closed form between events: all running
    requests gain a token per decode step, so `progress` (tokens each has gained since the
    engine started) and each request's finishing progress say when the next one ends."""

    def __init__(self, costs: Costs):
        self.costs = costs
        self.clock = 0.0  # time up to which progress is integrated
        self.ready_at = 0.0  # no decoding before (prefills in progress)
        self.progress = 0.0
        self.running: list[tuple[float, int, int]] = []  # (finishing progress, seq, group)
        self.paused = False
        self.busy = 0.0
        self.stamp = 0  # events scheduled for an older stamp are stale

    def advance(self, now: float) -> float:
        """Integrate decoding up to `now` (no request may finish before it); returns the busy
        seconds added."""
        added = 0.0
        if self.running and not self.paused:
            start = max(self.clock, self.ready_at)
            if now > start:
                self.progress += (now - start) / self.costs.decode_step(len(self.running))
                added = now - start
        self.clock = max(self.clock, now)
        self.busy += added
        return added

    def admit(self, now: float, group: int, lengths: np.ndarray, seq: int) -> float:
        """Start a group's requests; returns the prefill seconds added."""
        prefill = self.costs.prefill_s * lengths.size
        self.ready_at = max(self.ready_at, now) + prefill
        for i, length in enumerate(lengths):
            heapq.heappush(self.running, (self.progress + float(length), seq + i, group))
        self.busy += prefill
        return prefill

    def finished(self) -> list[int]:
        """Pop the requests whose last token is done; returns their groups."""
        done = []
        while self.running and self.running[0][0] <= self.progress * (1 + 1e-12) + 1e-9:
            done.append(heapq.heappop(self.running)[2])
        return done

    def next_finish(self) -> float:
        """When the next running request ends (inf while paused or empty)."""
        if not self.running or self.paused:
            return math.inf
        start = max(self.clock, self.ready_at)
        left = max(self.running[0][0] - self.progress, 0.0)
        return start + left * self.costs.decode_step(len(self.running))


def simulate_async(
    lengths: Lengths,
    layout: Layout,
    costs: Costs,
    steps: int,
    max_staleness: int,
    partial: bool,
) -> Timeline:
    """The asynchronous schedule with staleness bound `max_staleness`, by discrete events
    (request ends, training ends, weight syncs end); see the module doc for its rules."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
    b, k = layout.groups_per_step, max_staleness
    engines = [Engine(costs) for _ in range(layout.engines)]
    timeline = Timeline(layout.engines)
    events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, engine, stamp)
    order = 0
    version = 0  # the engines' policy version = trainer steps synced
    admitted = 0  # groups admitted so far (group ids 0, 1, ...)
    group_version: dict[int, int] = {}
    group_left: dict[int, int] = {}
    group_lengths: dict[int, np.ndarray] = {}
    completed: deque[int] = deque()
    trainer = {"state": "idle", "busy": 0.0}  # idle | train | wait (for the drain) | sync
    engine_busy = 0.0

    def push(time: float, kind: str, engine: int = -1, stamp: int = 0) -> None:
        nonlocal order
        heapq.heappush(events, (time, order, kind, engine, stamp))
        order += 1

    def reschedule(e: int) -> None:
        engines[e].stamp += 1
        when = engines[e].next_finish()
        if when < math.inf:
            push(when, "finish", e, engines[e].stamp)

    def admit_more(now: float) -> None:
        nonlocal admitted, engine_busy
        if trainer["state"] in ("wait", "sync"):
            return  # draining for (or in) a weight sync
        while admitted - timeline.dropped < (version + k + 1) * b:
            e = admitted % layout.engines
            engine_busy += engines[e].advance(now)
            group_lengths[admitted] = lengths.group(admitted)
            group_version[admitted] = version
            group_left[admitted] = group_lengths[admitted].size
            engine_busy += engines[e].admit(
                now, admitted, group_lengths[admitted], admitted * 10**6
            )
            reschedule(e)
            admitted += 1

    def try_train(now: float) -> None:
        step = len(timeline.step_ends)
        if trainer["state"] != "idle" or step == steps:
            return
        fresh = [g for g in completed if group_version[g] >= step - k]
        if len(fresh) < len(completed):  # past the bound: they can only get staler
            timeline.dropped += len(completed) - len(fresh)
            completed.clear()
            completed.extend(fresh)
            admit_more(now)  # a drop frees room under the bound
        if len(completed) < b:
            return
        batch = [completed.popleft() for _ in range(b)]
        for g in batch:
            timeline.staleness.append(step - group_version[g])
        seconds = costs.train(np.concatenate([group_lengths[g] for g in batch]))
        trainer["busy"] += seconds
        trainer["state"] = "train"
        push(now + seconds, "trained")

    def start_sync(now: float) -> None:
        nonlocal engine_busy
        for e, engine in enumerate(engines):
            engine_busy += engine.advance(now)
            engine.paused = True
            reschedule(e)
        trainer["state"] = "sync"
        push(now + costs.sync_s, "synced")

    def drained() -> bool:
        return not any(engine.running for engine in engines)

    admit_more(0.0)
    while len(timeline.step_ends) < steps:
        if not events:
            raise RuntimeError("the schedule stalled (no event left): a bug in the model")
        now, _, kind, e, stamp = heapq.heappop(events)
        if kind == "finish":
            if stamp != engines[e].stamp:
                continue
            engine_busy += engines[e].advance(now)
            for g in engines[e].finished():
                group_left[g] -= 1
                if group_left[g] == 0:
                    completed.append(g)
            reschedule(e)
            if trainer["state"] == "wait" and drained():
                start_sync(now)
            admit_more(now)
            try_train(now)
        elif kind == "trained":
            if partial or drained():
                start_sync(now)
            else:
                trainer["state"] = "wait"
        elif kind == "synced":
            version += 1
            for i, engine in enumerate(engines):
                engine.clock = max(engine.clock, now)
                engine.ready_at = max(engine.ready_at, now)
                engine.paused = False
                reschedule(i)
            timeline.record(now, engine_busy, trainer["busy"], costs.sync_s)
            if len(timeline.step_ends) == steps:
                break
            trainer["state"] = "idle"
            admit_more(now)
            try_train(now)
    return timeline


def simulate(
    lengths: Lengths,
    layout: Layout,
    costs: Costs,
    steps: int,
    max_staleness: int | None,
    partial: bool = False,
) -> Timeline:
    """`max_staleness` None: the synchronous schedule; else the asynchronous one."""
    if max_staleness is None:
        return simulate_sync(lengths, layout, costs, steps)
    return simulate_async(lengths, layout, costs, steps, max_staleness, partial)


# --- validation against this machine's measured runs -----------------------------------------


@dataclass
class MeasuredRun:
    """A run directory's per-step timings and its groups' response lengths, in generation order."""

    name: str
    max_staleness: int
    metrics: list[dict]
    groups: np.ndarray  # [groups, group_size]
    partial_tokens: int = 0

    @classmethod
    def load(cls, run_dir: Path) -> MeasuredRun:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        group_size = int(config["generation"]["group_size"])
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").open()]
        lengths = [max(int(r["length"]), 1) for r in sorted(rows, key=lambda r: r["step"])]
        if len(lengths) % group_size:
            raise ValueError(f"{run_dir}: {len(lengths)} rollouts are not whole groups")
        return cls(
            run_dir.name,
            # run directories written before run.max_staleness recorded run.off_policy_steps
            int(config["run"].get("max_staleness", config["run"].get("off_policy_steps", 0))),
            metrics,
            np.asarray(lengths).reshape(-1, group_size),
            int(config["run"].get("partial_rollout_tokens", 0)),
        )

    @property
    def groups_per_step(self) -> int:
        return len(self.groups) // len(self.metrics)

    def collect_s(self, step: int) -> float:
        """Seconds the engine spent collecting step `step`'s batch (generation + scoring)."""
        m = self.metrics[step]
        # partial rollouts: the engines' wait for the newer version is inside time_generate
        return m["time_generate"] - m.get("time_wait_version", 0.0) + m.get("time_verify", 0.0)

    def window(self) -> range:
        """The steady steps: after the first (warm-up) or the first k (the pipeline fills), and
        before the last k (nothing more to collect ahead)."""
        edge = max(1, self.max_staleness)
        return range(edge, len(self.metrics) - edge)

    def measured(self) -> dict[str, float]:
        """Mean step time and shares over steps k .. n-1-k (the first warms up or fills the
        pipeline; the last k collect nothing ahead). The engine's work in step t is batch t's
        collection, or batch t+k's when it was collected ahead."""
        steps, ahead = self.window(), self.max_staleness
        span = sum(self.metrics[t]["time_step"] for t in steps)
        engine = sum(self.collect_s(t + ahead) for t in steps) / span
        trainer = sum(self.metrics[t]["time_train"] for t in steps) / span
        sync = sum(self.metrics[t]["time_sync"] for t in steps) / span
        return {
            "step_s": span / len(steps),
            "engine_busy": engine,
            "engine_idle": 1 - engine - sync,
            "trainer_busy": trainer,
            "trainer_idle": 1 - trainer - sync,
            "sync": sync,
        }

    def fit_costs(self) -> Costs:
        """Per-step costs fitted to this run's components (non-negative least squares): collection
        ~ decode_step_s * longest sample + decode_token_s * tokens; training ~ train_step_s +
        train_token_s * tokens; the weight sync (with the step's plan and overhead) its mean."""
        from scipy.optimize import nnls

        b, steps = self.groups_per_step, self.window()
        batches = [self.groups[t * b : (t + 1) * b] for t in steps]
        longest = np.array([x.max() for x in batches], dtype=float)
        tokens = np.array([x.sum() for x in batches], dtype=float)
        collect = np.array([self.collect_s(t) for t in steps])
        train = np.array([self.metrics[t]["time_train"] for t in steps])
        (step_s, token_s), _ = nnls(np.stack([longest, tokens], 1), collect)
        (fixed_s, train_token_s), _ = nnls(np.stack([np.ones_like(tokens), tokens], 1), train)
        between = [
            m["time_sync"] + m.get("time_plan", 0.0) + m.get("time_overhead", 0.0)
            for m in (self.metrics[t] for t in steps)
        ]
        return Costs(step_s, token_s, 0.0, train_token_s, 0.0, fixed_s, statistics.mean(between))

    def predict(self, costs: Costs, batches: bool = False) -> dict[str, float]:
        """The model's step time and shares for this run's lengths and `costs`, on the
        streaming schedule or (`batches`) the fixed-lag batches the pipeline runs."""
        layout = Layout(1, self.groups_per_step, self.groups.shape[1])
        # the model admits up to k batches past the run's last step; those never reach the
        # measured window, so the run's first batches stand in for them
        extra = self.groups[: (self.max_staleness + 1) * self.groups_per_step]
        lengths = Lengths(rows=np.concatenate([self.groups, extra]))
        steps, k = len(self.metrics) - 1, self.max_staleness
        if batches:
            timeline = simulate_batches(lengths, layout, costs, steps, k, self.partial_tokens)
        else:
            timeline = simulate(lengths, layout, costs, steps, k if k else None)
        return timeline.window(warmup=1)


def validate(run_dirs: Sequence[Path], out: Path) -> str:
    """Predicted against measured step times and idle shares of each run, with costs fitted to
    the run itself (does the schedule hold?) and to the synchronous run (does a cluster-style
    projection from synchronous costs hold here?)."""
    runs = [MeasuredRun.load(Path(d)) for d in run_dirs]
    sync_runs = [r for r in runs if not r.max_staleness]
    if not sync_runs:
        raise ValueError("validation needs a run with run.max_staleness 0 among the run dirs")
    rows, data = [], []
    for run in runs:
        measured = run.measured()
        for source in [run, *[s for s in sync_runs if s is not run]]:
            predicted = run.predict(source.fit_costs())
            batched = run.predict(source.fit_costs(), batches=True)
            error = predicted["step_s"] / measured["step_s"] - 1
            batched_error = batched["step_s"] / measured["step_s"] - 1
            rows.append(
                [
                    run.name,
                    run.max_staleness,
                    run.partial_tokens,
                    source.name,
                    f"{measured['step_s']:.2f}",
                    f"{predicted['step_s']:.2f} / {batched['step_s']:.2f}",
                    f"{error:+.0%} / {batched_error:+.0%}",
                    f"{measured['engine_idle']:.2f} / {predicted['engine_idle']:.2f} / "
                    f"{batched['engine_idle']:.2f}",
                    f"{measured['trainer_idle']:.2f} / {predicted['trainer_idle']:.2f} / "
                    f"{batched['trainer_idle']:.2f}",
                ]
            )
            data.append(
                {
                    "run": run.name,
                    "costs_from": source.name,
                    "measured": measured,
                    "predicted": predicted,
                    "predicted_batches": batched,
                    "costs": source.fit_costs().__dict__,
                }
            )
    header = [
        "run",
        "max_staleness",
        "partial tokens",
        "costs from",
        "step s",
        "predicted stream / batches",
        "error stream / batches",
        "engine idle meas / stream / batches",
        "trainer idle meas / stream / batches",
    ]
    text = (
        "Measured against predicted (steady steps: after the first max(1, k) and before the "
        "last max(1, k); one engine, one trainer)\n\n" + markdown_table(header, rows)
    )
    write_results(out, "validation", text, data)
    return text


# --- projections for clusters -----------------------------------------------------------------

QWEN3_4B = {  # the DUET paper's larger model (Qwen3-4B): the shape the projected costs come from
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
}
H100_BF16 = 989e12  # dense bf16 FLOP/s (datasheet, as rlvr.run.mfu)
H100_HBM = 3.35e12  # bytes/s
PROMPT_TOKENS = 256


def cluster_costs(engines: int, trainers: int) -> Costs:
    """Costs of a Qwen3-4B step on H100s (one GPU per engine; the trainer pool data-parallel over
    `trainers` GPUs), from the model's FLOPs and bytes and assumed efficiencies: decode steps read
    the bf16 weights once (+1 ms launch overhead), each running token costs 2N FLOPs at 40% of
    peak plus its KV cache read (~800 tokens of context); training runs 6N + a 2N old-log-prob
    pass per token at 40% MFU; the weight sync takes 2 s."""
    from rlvr.run.mfu import TransformerShape

    shape = TransformerShape.from_hf_config(QWEN3_4B)
    n = shape.matmul_params
    kv_bytes = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2 * 800
    train_token = 8 * n / (0.4 * H100_BF16 * trainers)
    return Costs(
        decode_step_s=2 * n / H100_HBM + 1e-3,
        decode_token_s=2 * n / (0.4 * H100_BF16) + kv_bytes / H100_HBM,
        prefill_s=PROMPT_TOKENS * 2 * n / (0.5 * H100_BF16),
        train_token_s=train_token,
        train_sample_s=PROMPT_TOKENS * train_token,
        train_step_s=0.5,
        sync_s=2.0,
    )


def long_tail(rng: np.random.Generator, groups: int, group_size: int = 8) -> np.ndarray:
    """DUET's 3,072-token regime as a lognormal clipped at 3,072: median 511 and mean 665, the
    GRPO lengths of its Fig. 5c (sigma = sqrt(2 ln(665 / 511)) = 0.726)."""
    sigma = math.sqrt(2 * math.log(665 / 511))
    x = rng.lognormal(math.log(511), sigma, (groups, group_size))
    return np.clip(np.rint(x), 1, 3072)


def empirical(lengths: np.ndarray, group_size: int = 8) -> Callable:
    """Groups resampled (with replacement) from measured response lengths."""

    def draw(rng: np.random.Generator, groups: int) -> np.ndarray:
        return rng.choice(lengths, size=(groups, group_size))

    return draw


MODES: tuple[tuple[str, int | None, bool], ...] = (
    ("sync", None, False),
    ("k=1", 1, False),
    ("k=2", 2, False),
    ("k=4", 4, False),
    ("k=1 partial", 1, True),
    ("k=2 partial", 2, True),
    ("k=4 partial", 4, True),
)
"""Streaming schedules: (name, max_staleness or None for sync, partial rollouts)."""
BATCH_MODES: tuple[tuple[str, int, int], ...] = (
    ("batches k=1", 1, 0),
    ("batches k=2", 2, 0),
    ("batches k=2, partial 256", 2, 256),
)
"""What the rollout pipeline runs: (name, max_staleness, partial rollout tokens)."""
SPLITS = (0.25, 0.5, 0.75)  # engines' share of the GPUs; each mode gets its best split


def project(distributions: dict[str, Callable], gpus: Sequence[int], steps: int, out: Path) -> str:
    """Trained samples per second of every mode (best engine/trainer split) against the split
    synchronous mode and against a colocated synchronous mode (all GPUs generate, then all train)."""
    rows, data = [], []
    for dist, draw in distributions.items():
        for g in gpus:
            b = 16 * g  # DUET's 128 prompts x 8 per step on 8 GPUs, scaled with the GPUs
            colocated = simulate_sync(
                Lengths(draw=draw, seed=0), Layout(g, b, 8), cluster_costs(g, g), steps
            ).window(2)["step_s"]
            best: dict[str, tuple[float, float, dict]] = {}  # step s, engine share, window
            schedules = [
                (name, functools.partial(simulate, max_staleness=k, partial=partial))
                for name, k, partial in MODES
            ] + [
                (name, functools.partial(simulate_batches, max_staleness=k, partial_tokens=n))
                for name, k, n in BATCH_MODES
            ]
            for name, schedule in schedules:
                for share in SPLITS:
                    e = max(1, round(g * share))
                    timeline = schedule(
                        Lengths(draw=draw, seed=0), Layout(e, b, 8), cluster_costs(e, g - e), steps
                    )
                    w = timeline.window(2) | {"dropped_per_step": timeline.dropped / steps}
                    if name not in best or w["step_s"] < best[name][0]:
                        best[name] = (w["step_s"], share, w)
            sync_s = best["sync"][0]
            for name, (step_s, share, w) in best.items():
                rows.append(
                    [
                        dist,
                        g,
                        name,
                        f"{share:.2f}",
                        f"{step_s:.1f}",
                        f"{w['dropped_per_step']:.1f}",
                        f"{sync_s / step_s:.2f}x",
                        f"{colocated / step_s:.2f}x",
                        f"{w['engine_idle']:.2f}",
                        f"{w['trainer_idle']:.2f}",
                    ]
                )
                data.append(
                    {
                        "lengths": dist,
                        "gpus": g,
                        "mode": name,
                        "engine_share": share,
                        "step_s": step_s,
                        "colocated_sync_step_s": colocated,
                        **w,
                    }
                )
    header = [
        "lengths",
        "GPUs",
        "mode",
        "engine share",
        "step s",
        "dropped groups/step",
        "vs sync (split)",
        "vs sync (colocated)",
        "engine idle",
        "trainer idle",
    ]
    text = (
        f"Qwen3-4B on H100s, 16 prompts x 8 samples per GPU per step, mean step time over steps 2.."
        f"{steps - 1}; published: {PUBLISHED}\n\n" + markdown_table(header, rows)
    )
    write_results(out, "projection", text, data)
    plot(data, out / "projection.png")
    return text


def plot(data: list[dict], path: Path) -> None:
    """Speed-up against the colocated synchronous mode per GPU count, one panel per length set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = sorted({d["lengths"] for d in data})
    fig, axes = plt.subplots(1, len(dists), figsize=(6 * len(dists), 4), squeeze=False)
    for ax, dist in zip(axes[0], dists, strict=True):
        for name in [m[0] for m in MODES + BATCH_MODES]:
            pts = [d for d in data if d["lengths"] == dist and d["mode"] == name]
            ax.plot(
                [d["gpus"] for d in pts],
                [d["colocated_sync_step_s"] / d["step_s"] for d in pts],
                "o--" if name.startswith("batches") else "o-",
                label=name,
            )
        for label, lo, hi in (("AReaL", 2.77, 2.77), ("verl", 1.72, 2.67), ("ROLL", 2.24, 2.24)):
            ax.axhspan(lo - 0.01, hi + 0.01, alpha=0.15)
            ax.text(8, hi, f" {label}", fontsize=8, va="bottom")
        ax.set(xscale="log", xlabel="GPUs", ylabel="throughput / colocated sync", title=dist)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Timeline model of synchronous against asynchronous rollouts (see the "
        "module doc): validate it on measured runs, or project clusters."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="predict measured runs' step times and idle shares")
    v.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        help="run directories (metrics.jsonl, rollouts.jsonl, config.yaml); one with "
        "run.max_staleness 0 gives the costs of the cross-mode prediction",
    )
    p = sub.add_parser("project", help="sync against async throughput for 8, 64, 512 GPUs")
    p.add_argument(
        "--rollouts",
        nargs="+",
        type=Path,
        required=True,
        help="rollouts.jsonl files whose response lengths are 'ours'",
    )
    p.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 512])
    p.add_argument("--steps", type=int, default=10, help="steps simulated per mode")
    for s in (v, p):
        s.add_argument("--out", type=Path, default=OUT, help="where tables and plots go")
    args = parser.parse_args()
    if args.command == "validate":
        print(validate(args.run_dirs, args.out))
        return
    lengths = np.array(
        [max(int(json.loads(line)["length"]), 1) for path in args.rollouts for line in path.open()]
    )
    dists = {
        f"ours (n={lengths.size}, mean {lengths.mean():.0f}, max {lengths.max()})": empirical(
            lengths
        ),
        "long tail (DUET 3,072)": long_tail,
    }
    print(project(dists, args.gpus, args.steps, args.out))


if __name__ == "__main__":
    main()
