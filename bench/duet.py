"""GRPO vs DUET at full (b = 1) and half (b = 0.5) token budget on the arithmetic task.

Every variant gets its own actors (a small CPU reservation each; about 3 GiB of memory per
variant) and the variants step in turn, step by step, starting with a different one each step, so
all see the same machine load; they share the model, the prompt pool, the seeds and the number of
steps. GRPO at budget b samples 8b rollouts per prompt; DUET spends the budget
b * 8 * sum L_hat on per-prompt counts and stops/aborts rollouts inside the vLLM engine. The
prompt pool is small so prompts recur (DUET's allocator needs revisits; digest section 10.21).
Timing medians skip the first `--warmup` steps; held-out accuracy is greedy after the last step.

    .venv/bin/python bench/duet.py --steps 12 --seeds 0 1 2
    .venv/bin/python bench/duet.py --steps 2 --seeds 0          # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from workflows.cli import ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny.yaml"
N_REF = 8
# Shared by every variant: a small reservation per actor (the variants take turns), a prompt pool
# that recurs every few steps, no evaluation inside the run.
COMMON = [
    "run.eval_every=0",
    "resources.policy_cpus=0.25",
    "resources.generator_cpus=0.25",
    "resources.num_verifiers=1",
]
# The digest's small-scale settings (section 11 F2), scaled to the tiny preset's 48 tokens.
DUET = [
    "algorithm.duet.enabled=true",
    f"algorithm.duet.n_ref={N_REF}",
    "algorithm.duet.grace=4",
    "algorithm.duet.poll_every=2",
    "algorithm.duet.length_window=256",
    "algorithm.duet.refit_every=5",
    "algorithm.duet.k1_min=8",
    "algorithm.duet.k2_gap=8",
]
VARIANTS: dict[str, tuple[str, float, list[str]]] = {
    "grpo b=1": ("grpo", 1.0, [f"generation.group_size={N_REF}"]),
    "grpo b=0.5": ("grpo", 0.5, [f"generation.group_size={N_REF // 2}"]),
    "duet b=1": ("duet", 1.0, [*DUET, "algorithm.duet.b=1"]),
    "duet b=0.5": ("duet", 0.5, [*DUET, "algorithm.duet.b=0.5"]),
}
CONTROLLER_KEYS = ("time_plan", "time_duet_state")


def run_seed(
    seed: int, steps: int, n_train: int, overrides: list[str], variants: list[str]
) -> dict[str, Any]:
    """The variants for one seed, stepping in turn; per variant its step metrics and final eval."""
    from transformers import AutoTokenizer

    from rlvr.config import load_config
    from rlvr.rundir import RunDir
    from workflows.components import start_components
    from workflows.train import Trainer, prepare

    trainers: dict[str, Trainer] = {}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in variants:
                extra = VARIANTS[name][2]
                tag = name.replace(" ", "-").replace("=", "")
                cfg = load_config(
                    CONFIG,
                    [
                        *COMMON,
                        f"task.n_train={n_train}",
                        f"run.seed={seed}",
                        f"run.name=bench-duet-{tag}-s{seed}",
                        *extra,
                        *overrides,
                    ],
                )
                model_dir, train_problems, test_problems = prepare(cfg)
                run_dir = RunDir(Path(tmp) / tag)
                run_dir.create(cfg.to_dict())
                trainers[name] = Trainer(
                    cfg,
                    run_dir,
                    start_components(cfg, model_dir),
                    AutoTokenizer.from_pretrained(model_dir),
                    train_problems,
                    test_problems,
                )
            out = {name: {"steps": []} for name in trainers}
            for step in range(steps):
                # rotate who goes first: the first variant of a round may see other caches
                for i in range(len(variants)):
                    name = variants[(step + i) % len(variants)]
                    out[name]["steps"].append(trainers[name].step(step))
            for name, trainer in trainers.items():
                out[name]["eval"] = trainer.evaluate(steps - 1)
        finally:
            for trainer in trainers.values():
                trainer.comps.shutdown()
    return out


def summarize(runs: dict[int, dict[str, Any]], warmup: int) -> dict[str, dict[str, float]]:
    """Per variant: accuracy mean/sd over seeds, medians of per-step figures over seeds and steps."""
    rows: dict[str, dict[str, float]] = {}
    for name in next(iter(runs.values())):
        method, b, _ = VARIANTS[name]
        per_seed = [runs[s][name] for s in sorted(runs)]
        timed = [m for r in per_seed for m in r["steps"][warmup:]] or [
            m for r in per_seed for m in r["steps"]
        ]
        acc = [r["eval"]["eval_accuracy"] for r in per_seed]
        row = {
            "method": method,
            "b": b,
            "accuracy": statistics.mean(acc),
            "accuracy_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "tokens": statistics.median(m["tokens_generated"] for m in timed),
            "rollouts": statistics.median(m["rollouts"] for m in timed),
            "generate_s": statistics.median(m["time_generate"] for m in timed),
            "step_s": statistics.median(m["time_step"] for m in timed),
            "controller_frac": statistics.median(
                sum(m.get(k, 0.0) for k in CONTROLLER_KEYS) / m["time_step"] for m in timed
            ),
        }
        if method == "duet":
            row["abort_rate"] = statistics.median(m["duet_abort_rate"] for m in timed)
            row["n_std"] = statistics.median(m["duet_n_std"] for m in timed)
        rows[name] = row
    full = rows.get("grpo b=1", {}).get("step_s", float("nan"))
    for row in rows.values():
        same_b = [r for r in rows.values() if r["method"] == "grpo" and r["b"] == row["b"]]
        row["speedup_same_b"] = same_b[0]["step_s"] / row["step_s"] if same_b else float("nan")
        row["speedup_full"] = full / row["step_s"]
    return rows


def format_table(rows: dict[str, dict[str, float]], seeds: list[int], steps: int) -> str:
    """Markdown table of `summarize`'s rows."""
    lines = [
        f"Tiny model, arithmetic, {steps} steps, seeds {seeds} (accuracy: mean ± sd over seeds; "
        "per-step figures: medians).",
        "",
        "| variant | held-out acc | tokens/step | rollouts/step | gen s/step | total s/step "
        "| speedup vs GRPO same b | speedup vs GRPO b=1 | controller % of step | abort rate "
        "| n_q std |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        duet = r["method"] == "duet"
        lines.append(
            f"| {name} | {r['accuracy']:.3f} ± {r['accuracy_sd']:.3f} | {r['tokens']:.0f} "
            f"| {r['rollouts']:.0f} | {r['generate_s']:.2f} | {r['step_s']:.2f} "
            f"| {r['speedup_same_b']:.2f}x | {r['speedup_full']:.2f}x "
            f"| {100 * r['controller_frac']:.2f} "
            + (f"| {r['abort_rate']:.3f} | {r['n_std']:.2f} |" if duet else "| - | - |")
        )
    return "\n".join(lines)


def plot(runs: dict[int, dict[str, Any]], rows: dict[str, dict[str, float]], path: Path) -> None:
    """2x3 panels: tokens, generation and step seconds per step; accuracy; DUET's n_q spread and
    abort rate; DUET's K1/K2; curves are means over seeds."""
    from matplotlib.figure import Figure

    def curve(name: str, key: str) -> list[float]:
        per_seed = [[m[key] for m in runs[s][name]["steps"]] for s in sorted(runs)]
        return [statistics.mean(v) for v in zip(*per_seed, strict=True)]

    fig = Figure(figsize=(15, 8), layout="constrained")
    axes = fig.subplots(2, 3)
    for ax, key, title in (
        (axes[0, 0], "tokens_generated", "tokens generated per step"),
        (axes[0, 1], "time_generate", "generation s per step"),
        (axes[0, 2], "time_step", "total s per step"),
    ):
        for name in rows:
            ax.plot(curve(name, key), label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0, 0].legend()
    names = list(rows)
    axes[1, 0].bar(
        names,
        [rows[n]["accuracy"] for n in names],
        yerr=[rows[n]["accuracy_sd"] for n in names],
    )
    axes[1, 0].set_title("held-out accuracy after training")
    duets = [n for n in rows if rows[n]["method"] == "duet"]
    for name in duets:
        axes[1, 1].plot(curve(name, "duet_n_std"), label=f"{name}: n_q std")
        axes[1, 1].plot(curve(name, "duet_abort_rate"), "--", label=f"{name}: abort rate")
        axes[1, 2].plot(curve(name, "duet_k2"), label=f"{name}: K2")
        axes[1, 2].plot(curve(name, "duet_k1"), ":", label=f"{name}: K1")
    axes[1, 1].set_title("DUET allocation spread and abort rate")
    axes[1, 2].set_title("DUET stop thresholds (tokens)")
    for ax in axes[1, 1:]:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="training steps per variant and seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of timing medians")
    ap.add_argument("--n-train", type=int, default=32, help="prompt pool (small: prompts recur)")
    ap.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="NAME"
    )
    ap.add_argument("--set", action="append", default=[], help="config override for all variants")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "duet"), help="output folder")
    args = ap.parse_args()

    import ray

    from rlvr.config import load_config
    from workflows.cli import init_ray

    init_ray(load_config(CONFIG, [*COMMON, *args.set]))
    try:
        runs = {
            s: run_seed(s, args.steps, args.n_train, args.set, args.variants) for s in args.seeds
        }
    finally:
        ray.shutdown()
    rows = summarize(runs, args.warmup)
    table = format_table(rows, args.seeds, args.steps)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "duet_tiny.md").write_text(table + "\n")
    (out / "duet_tiny.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    plot(runs, rows, out / "duet_tiny.png")


if __name__ == "__main__":
    main()
