"""Synchronous training against rollouts under a staleness bound (`run.max_staleness: k`):
held-out accuracy at equal steps, generated tokens per second of step time, and each side's busy
share, over seeds.

    .venv/bin/python bench/staleness.py --seeds 0 1 2 --ks 0 1 2 4 --steps 12 --partial-ks 2
    .venv/bin/python bench/staleness.py --seeds 0 --ks 0 1 2 --steps 6 --set generation.top_p=0.95

Every run is the command a user types (`rlvr train --config PRESET --set run.max_staleness=K
--set run.seed=S`, plus `--set run.partial_rollout_tokens=L` for the partial-rollout rows of
`--partial-ks` and the bench's own `--set` overrides); within a seed the modes run one after another in a rotated order, so no mode
always runs first or last on a machine whose load drifts. Step times leave out step 0 (its
engine and policy warm up) and, for k > 0, the first k steps (the pipeline fills) and the last k
(nothing is left to collect ahead); a run too short to leave a steady step (5 steps at k = 4)
reports its accuracy and n/a for its times. The outside-nucleus share is the mean over every
step of `train_engine_outside_frac`, the trained tokens the stale pi_old's top-p nucleus leaves
out (weight 0; always 0 at top_p 1, as the tiny preset samples). On one CPU machine the engines and the policy share
the cores: k > 0 can only recover the time one side waits for the other, never add compute; what a
cluster gains is `bench/async_sim.py`'s question.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from collections.abc import Iterable
from pathlib import Path

from harness import ROOT, markdown_table, run_rlvr, write_results  # bench/, the script's directory

Mode = tuple[int, int]
"""(max_staleness, partial_rollout_tokens)."""


def mode_name(mode: Mode) -> str:
    k, partial = mode
    return f"{k}, partial {partial}" if partial else str(k)


def train(
    preset: Path,
    mode: Mode,
    seed: int,
    steps: int,
    out: Path,
    log: Path,
    overrides: list[str],
) -> Path:
    """One `rlvr train` run with `overrides` (`--set` strings); returns its run directory (a
    finished one is reused, so an interrupted bench picks up where it stopped; its name carries
    a digest of the overrides, so that none is reused under other ones)."""
    k, partial = mode
    name = f"k{k}-p{partial}-seed{seed}" if partial else f"k{k}-seed{seed}"
    if overrides:
        name += "-" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:8]
    if (out / name / "summary.json").is_file():
        return out / name
    argv = [
        "train",
        "--config",
        str(preset),
        f"--set=run.max_staleness={k}",
        f"--set=run.partial_rollout_tokens={partial}",
        f"--set=run.seed={seed}",
        f"--set=run.steps={steps}",
        "--set=run.eval_every=0",
        f"--set=run.output_dir={out}",
        f"--set=run.name={name}",
        *(f"--set={override}" for override in overrides),
    ]
    run_rlvr(argv, log)
    return out / name


def median_or_none(values: Iterable[float | None]) -> float | None:
    """The median, or None when there is nothing to take it of: no steady step, or a seed's run
    without one."""
    values = list(values)
    return None if not values or None in values else statistics.median(values)


def mean_or_none(values: Iterable[float | None]) -> float | None:
    """The mean, or None when a value is missing (a step or a seed's run without it)."""
    values = list(values)
    return None if not values or None in values else statistics.mean(values)


def cell(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + unit


def summarise(run: Path, k: int) -> dict:
    """A run's final held-out accuracy, its steady steps' medians and its outside-nucleus share
    (the mean over every step; None when a step has no engine log-probs to compare); the
    step-time figures are None when the run is too short to have a steady step (5 steps at
    k = 4)."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # past the first max(1, k) steps (warm-up, the pipeline filling) and before the last k (no
    # batch left to collect ahead: the engines idle)
    filled = metrics[max(1, k) :]
    steady = filled[: len(filled) - k]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]

    return {
        "token_staleness_mean": statistics.mean(
            m.get("token_staleness_mean", m["rollout_staleness"]) for m in steady or filled
        ),
        "eval_accuracy_before": evals[0]["eval_accuracy"],
        "eval_accuracy": evals[-1]["eval_accuracy"],
        "time_step": median_or_none(m["time_step"] for m in steady),
        "tokens_per_step_s": median_or_none(m["tokens_generated"] / m["time_step"] for m in steady),
        "busy_share_engines": median_or_none(m["busy_share_engines"] for m in steady),
        "busy_share_policy": median_or_none(m["busy_share_policy"] for m in steady),
        "time_wait_rollouts": median_or_none(m.get("time_wait_rollouts", 0.0) for m in steady),
        "engine_outside_frac": mean_or_none(m.get("train_engine_outside_frac") for m in metrics),
        "staleness": [m["rollout_staleness"] for m in metrics],
    }


def table(results: dict[Mode, list[dict]]) -> str:
    """One row per mode: accuracy (mean and standard error over seeds) and the seeds' medians;
    n/a where the runs were too short for a steady step."""
    rows = []
    sync_step = median_or_none(r["time_step"] for r in results[min(results)])
    for mode, runs in sorted(results.items()):
        acc = [r["eval_accuracy"] for r in runs]
        se = statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1 else float("nan")
        before = statistics.mean(r["eval_accuracy_before"] for r in runs)
        step = median_or_none(r["time_step"] for r in runs)
        speed = None if step is None or sync_step is None else sync_step / step
        rows.append(
            [
                mode_name(mode),
                f"{statistics.mean(r['token_staleness_mean'] for r in runs):.2f}",
                f"{before:.3f}",
                f"{statistics.mean(acc):.3f} ± {se:.3f}",
                cell(step, ".2f"),
                cell(speed, ".2f", "x"),
                cell(median_or_none(r["tokens_per_step_s"] for r in runs), ".0f"),
                cell(median_or_none(r["busy_share_engines"] for r in runs), ".2f"),
                cell(median_or_none(r["busy_share_policy"] for r in runs), ".2f"),
                cell(median_or_none(r["time_wait_rollouts"] for r in runs), ".2f"),
                cell(mean_or_none(r["engine_outside_frac"] for r in runs), ".4f"),
            ]
        )
    header = [
        "max_staleness",
        "token staleness (mean)",
        "held-out accuracy before",
        "after (mean ± se)",
        "step s (median)",
        "speed vs k=0",
        "tokens / step-s",
        "engines busy",
        "policy busy",
        "wait for rollouts s",
        "outside nucleus (mean)",
    ]
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--partial-ks",
        type=int,
        nargs="*",
        default=[],
        help="k values also run with partial rollouts",
    )
    parser.add_argument("--partial-tokens", type=int, default=16)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        help="a config override for every run, as rlvr train's --set",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "staleness")
    args = parser.parse_args()
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    log = args.out / "staleness.log"
    modes = [(k, 0) for k in args.ks] + [(k, args.partial_tokens) for k in args.partial_ks]
    results: dict[Mode, list[dict]] = {mode: [] for mode in modes}
    for i, seed in enumerate(args.seeds):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            run = train(args.config, mode, seed, args.steps, runs_dir, log, args.overrides)
            results[mode].append({"seed": seed, **summarise(run, mode[0])})
            print(f"seed {seed} k {mode_name(mode)}: {results[mode][-1]}", flush=True)
    text = (
        f"`{args.config.resolve().relative_to(ROOT)}`, {args.steps} steps, seeds {args.seeds}"
        + "".join(f", --set {override}" for override in args.overrides)
        + "\n\n"
        + table(results)
    )
    print(text)
    write_results(
        args.out, "staleness", text, {mode_name(mode): runs for mode, runs in results.items()}
    )


if __name__ == "__main__":
    main()
