"""Synchronous training against rollouts under a staleness bound (`run.max_staleness: k`):
held-out accuracy at equal steps, generated tokens per second of step time, and each side's busy
share, over seeds.

    .venv/bin/python bench/staleness.py --seeds 0 1 2 --ks 0 1 2 4 --steps 12

Every run is the command a user types (`rlvr train --config PRESET --set run.max_staleness=K
--set run.seed=S`); within a seed the values of k run one after another in a rotated order, so no
k always runs first or last on a machine whose load drifts. Step times leave out step 0 (its
engine and policy warm up) and, for k > 0, the first k steps (the pipeline fills). On one CPU
machine the engines and the policy share the cores: k > 0 can only recover the time one side
waits for the other, never add compute; what a cluster gains is `bench/async_sim.py`'s question.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from harness import ROOT, markdown_table, run_rlvr, write_results  # bench/, the script's directory


def train(preset: Path, k: int, seed: int, steps: int, out: Path, log: Path) -> Path:
    """One `rlvr train` run; returns its run directory (a finished one is reused, so an
    interrupted bench picks up where it stopped)."""
    name = f"k{k}-seed{seed}"
    if (out / name / "summary.json").is_file():
        return out / name
    argv = [
        "train",
        "--config",
        str(preset),
        f"--set=run.max_staleness={k}",
        f"--set=run.seed={seed}",
        f"--set=run.steps={steps}",
        "--set=run.eval_every=0",
        f"--set=run.output_dir={out}",
        f"--set=run.name={name}",
    ]
    run_rlvr(argv, log)
    return out / name


def summarise(run: Path, k: int) -> dict:
    """A run's final held-out accuracy and its steady steps' medians."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = metrics[max(1, k) :]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]

    def median(key: str) -> float:
        return statistics.median(m[key] for m in steady)

    return {
        "eval_accuracy_before": evals[0]["eval_accuracy"],
        "eval_accuracy": evals[-1]["eval_accuracy"],
        "time_step": median("time_step"),
        "tokens_per_step_s": statistics.median(
            m["tokens_generated"] / m["time_step"] for m in steady
        ),
        "busy_share_engines": median("busy_share_engines"),
        "busy_share_policy": median("busy_share_policy"),
        "time_wait_rollouts": statistics.median(m.get("time_wait_rollouts", 0.0) for m in steady),
        "staleness": [m["rollout_staleness"] for m in metrics],
    }


def table(results: dict[int, list[dict]]) -> str:
    """One row per k: accuracy (mean and standard error over seeds) and the seeds' medians."""
    rows = []
    sync_step = statistics.median(r["time_step"] for r in results[min(results)])
    for k, runs in sorted(results.items()):
        acc = [r["eval_accuracy"] for r in runs]
        se = statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1 else float("nan")
        before = statistics.mean(r["eval_accuracy_before"] for r in runs)
        step = statistics.median(r["time_step"] for r in runs)
        rows.append(
            [
                k,
                f"{before:.3f}",
                f"{statistics.mean(acc):.3f} ± {se:.3f}",
                f"{step:.2f}",
                f"{sync_step / step:.2f}x",
                f"{statistics.median(r['tokens_per_step_s'] for r in runs):.0f}",
                f"{statistics.median(r['busy_share_engines'] for r in runs):.2f}",
                f"{statistics.median(r['busy_share_policy'] for r in runs):.2f}",
                f"{statistics.median(r['time_wait_rollouts'] for r in runs):.2f}",
            ]
        )
    header = [
        "max_staleness",
        "held-out accuracy before",
        "after (mean ± se)",
        "step s (median)",
        "speed vs k=0",
        "tokens / step-s",
        "engines busy",
        "policy busy",
        "wait for rollouts s",
    ]
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "staleness")
    args = parser.parse_args()
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    log = args.out / "staleness.log"
    results: dict[int, list[dict]] = {k: [] for k in args.ks}
    for i, seed in enumerate(args.seeds):
        order = args.ks[i % len(args.ks) :] + args.ks[: i % len(args.ks)]
        for k in order:
            run = train(args.config, k, seed, args.steps, runs_dir, log)
            results[k].append({"seed": seed, **summarise(run, k)})
            print(f"seed {seed} k {k}: {results[k][-1]}", flush=True)
    text = f"`{args.config.relative_to(ROOT)}`, {args.steps} steps, seeds {args.seeds}\n\n" + table(
        results
    )
    print(text)
    write_results(args.out, "staleness", text, results)


if __name__ == "__main__":
    main()
