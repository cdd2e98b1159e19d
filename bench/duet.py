"""GRPO vs DUET (and its allocator-only / abort-only ablations) and DAPO dynamic sampling at
token budgets b = 1, 0.5, 0.25 on the arithmetic task, for the tiny model or SmolLM2-135M,
each from its DUET preset (configs/tiny-duet.yaml, configs/smollm2-duet.yaml).

Every variant gets its own actors (0.2 CPU reserved, about 1.5 GiB of memory with the tiny
model) and the variants step in turn, step by step, starting with a different one each step, so
all see the same machine load; they share the model, the prompt pool, the seeds and the number
of steps. GRPO at budget b samples 8b rollouts per prompt; DUET spends the budget
b * 8 * sum L_hat on per-prompt counts and stops/aborts rollouts inside the vLLM engine;
`duet-alloc-only` keeps the allocator but no stop rule, `duet-abort-only` the stop rule with
round(8b) rollouts per prompt; DAPO samples 8 per prompt, drops all-equal groups and refills
with fresh prompts (up to 3 rounds), paying for every generated token. The prompt pool is small
so prompts recur (DUET's allocator needs revisits: arXiv:2605.08441, Sec. 2 assumes several
epochs over a fixed prompt pool). Timing medians skip the first `--warmup` steps; held-out
accuracy is greedy after the last step. After it, a probe samples held-out prompts at the
training sampler for every variant: the share of rollouts with no answer marker and, where the
stop rule runs, the share it would abort and how many of those would have been correct had they
run on (`abort_probe`).

Every variant commits each step to its run directory under `<out>/runs/s<seed>/` (policy,
optimizer and controller state, as `rlvr train` does; LoRA checkpoints leave the base weights
out); `--resume` restores each variant's last committed step and goes on after it, so a seed
that takes hours survives a lost machine and ends as an uninterrupted one would.
The actors' output (vLLM, DeepSpeed, Ray workers) goes to `<out>/engine.log`, as `rlvr train`
sends it to its run's, so the console keeps the bench's own lines and the table.

The tiny preset runs all nine variants by default: a 1-step run of all nine took 3.5 min with
startup and peaked at about 14 GiB (2 cores), so the default 12 steps x 3 seeds should take
roughly 20-25 min; `--variants` picks a subset (fewer actors, less memory). The smollm2 preset
defaults to three variants, 4 steps and one seed.

    .venv/bin/python bench/duet.py                                    # tiny: 12 steps, 3 seeds
    .venv/bin/python bench/duet.py --preset smollm2                   # 4 steps, seed 0
    .venv/bin/python bench/duet.py --preset smollm2-long  # 5 variants x 3 seeds
    .venv/bin/python bench/duet.py --steps 2 --seeds 0 --variants "grpo b=1" "duet b=0.5"
    .venv/bin/python bench/duet.py --preset smollm2-long --seeds 1 --out bench/out/duet/s1
    .venv/bin/python bench/duet.py --preset smollm2-long --seeds 1 --out bench/out/duet/s1 --resume
    .venv/bin/python bench/duet.py --preset smollm2-long --merge bench/out/duet/s*/*.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from harness import start_cluster, write_results

from rlvr.config import Config, load_config
from rlvr.methods.duet.config import duet_stop
from rlvr.run.rundir import RunDir
from workflows.cluster import ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
N_REF = 8
# Shared by every variant: a nominal CPU reservation per actor (the variants take turns, and
# torch's threads do not follow it), small enough that all nine variants (0.2 CPU each) fit a
# 2-core cluster; no evaluation inside the run; the last committed step kept for `--resume`.
COMMON = [
    "run.eval_every=0",
    "run.keep_last=1",
    "resources.policy_cpus=0.1",
    "resources.generator_cpus=0.1",
    "resources.num_verifiers=1",
]


@dataclass(frozen=True)
class Preset:
    """A base config and the settings the bench runs it with."""

    label: str
    config: Path
    steps: int
    seeds: list[int]
    n_train: int
    variants: list[str]
    """Default variants (the full list is `VARIANT_NAMES`)."""


PRESETS = {
    # configs/tiny-duet.yaml: the paper's stop-rule and K-window settings scaled down to 48
    # tokens (our choice: grace 4, poll every 2, window 256, refit every 5 steps). 32 prompts at
    # 8 per step: a prompt recurs every 4 steps.
    "tiny": Preset(
        label="Tiny model (configs/tiny-duet.yaml)",
        config=ROOT / "configs" / "tiny-duet.yaml",
        steps=12,
        seeds=[0, 1, 2],
        n_train=32,
        variants=[
            "grpo b=1",
            "grpo b=0.5",
            "grpo b=0.25",
            "duet b=1",
            "duet b=0.5",
            "duet b=0.25",
            "duet-alloc-only b=0.5",
            "duet-abort-only b=0.5",
            "dapo b=1",
        ],
    ),
    # configs/smollm2-duet.yaml: SmolLM2-135M with LoRA, max_tokens 96, the paper's sampling and
    # stop-rule settings scaled by 96 / 3072 (the preset explains each); 45-60 s per step of 64
    # samples on 2 cores, so 4 steps and one seed by default. 16 prompts at 8 per step: every
    # prompt recurs from step 2 on, where the allocator starts to act.
    "smollm2": Preset(
        label="SmolLM2-135M-Instruct (LoRA, configs/smollm2-duet.yaml)",
        config=ROOT / "configs" / "smollm2-duet.yaml",
        steps=4,
        seeds=[0],
        n_train=16,
        variants=["grpo b=1", "grpo b=0.5", "duet b=0.5"],
    ),
    # configs/smollm2-duet-long.yaml: the paper's regime: SmolLM2 warmed up to
    # reason at length and box nearly every answer (bench/duet_warmup.py measures it), max_tokens
    # 256, stop-rule clamps scaled by 256 / 3072. GRPO, DUET at b 1 and 0.5 and both ablations at
    # b 1, three seeds: hours.
    "smollm2-long": Preset(
        label="SmolLM2-135M long-reasoning warm-up (LoRA, configs/smollm2-duet-long.yaml)",
        config=ROOT / "configs" / "smollm2-duet-long.yaml",
        steps=10,
        seeds=[0, 1, 2],
        n_train=16,
        variants=[
            "grpo b=1",
            "duet b=1",
            "duet b=0.5",
            "duet-alloc-only b=1",
            "duet-abort-only b=1",
        ],
    ),
}


def variants() -> dict[str, tuple[str, float, list[str]]]:
    """Every variant: name -> (method, budget fraction b, config overrides).

    Both presets run DUET with its stop-rule settings; GRPO and DAPO take another method and keep
    the rest (sampling, KL, loss aggregation), so every variant trains the same objective."""
    duet = ["algorithm.name=duet", f"algorithm.duet.n_ref={N_REF}"]
    off = "algorithm.name=grpo"
    return {
        "grpo b=1": ("grpo", 1.0, [off, f"generation.group_size={N_REF}"]),
        "grpo b=0.5": ("grpo", 0.5, [off, f"generation.group_size={N_REF // 2}"]),
        "grpo b=0.25": ("grpo", 0.25, [off, f"generation.group_size={N_REF // 4}"]),
        "duet b=1": ("duet", 1.0, [*duet, "algorithm.duet.b=1"]),
        "duet b=0.5": ("duet", 0.5, [*duet, "algorithm.duet.b=0.5"]),
        "duet b=0.25": ("duet", 0.25, [*duet, "algorithm.duet.b=0.25"]),
        **{
            f"duet-{part} b={b:g}": ("duet", b, [*duet, f"algorithm.duet.b={b:g}", switch])
            for b in (1.0, 0.5)
            for part, switch in (
                ("alloc-only", "algorithm.duet.early_stop=false"),
                ("abort-only", "algorithm.duet.allocate=false"),
            )
        },
        "dapo b=1": (
            "dapo",
            1.0,
            [f"generation.group_size={N_REF}", "algorithm.name=dapo"],
        ),
    }


VARIANT_NAMES = list(variants())
BASELINE = "grpo b=1"
"""The variant every other one's accuracy and speed are compared with: full-budget GRPO."""
CONTROLLER_KEYS = ("time_plan", "time_duet_state")
# The post-training abort probe: held-out prompts (x N_REF rollouts) and its sampling seed.
PROBE_PROMPTS = 16
PROBE_SEED = 9_000_001


def variant_runs(
    preset: Preset, seed: int, n_train: int, overrides: list[str], names: list[str], runs_dir: Path
) -> dict[str, tuple[Config, RunDir]]:
    """Each variant's configuration for one seed and its run directory under `runs_dir`."""
    table = variants()
    runs = {}
    for name in names:
        tag = name.replace(" ", "-").replace("=", "")
        cfg = load_config(
            preset.config,
            [
                *COMMON,
                f"task.n_train={n_train}",
                f"run.seed={seed}",
                f"run.name=bench-duet-{tag}-s{seed}",
                *table[name][2],
                *overrides,
            ],
        )
        runs[name] = (cfg, RunDir(runs_dir / f"s{seed}" / tag))
    return runs


def check_resumable(cfg: Config, run_dir: RunDir, resume: bool) -> None:
    """Refuse, before any actor starts, a run directory that holds committed steps unless
    `resume` is set and it was run with the same configuration."""
    if not run_dir.completed_steps():
        return
    if not resume:
        raise SystemExit(
            f"{run_dir.path} holds committed steps of an earlier run: pass --resume to go on "
            "after them, or another --out"
        )
    if run_dir.load_config_dict() != yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False)):
        raise SystemExit(
            f"{run_dir.path} was run with another configuration; --resume needs the same preset, "
            "--n-train and --set"
        )


def run_seed(runs: dict[str, tuple[Config, RunDir]], seed: int, steps: int) -> dict[str, Any]:
    """The variants of one seed (`variant_runs`), stepping in turn, each step committed to the
    variant's run directory; a directory that holds committed steps (`check_resumable`) goes on
    after its last intact one. Per variant: its step metrics as committed, its final eval and
    probe."""
    from transformers import AutoTokenizer

    from workflows.components import start_components
    from workflows.train import Trainer, prepare

    names = list(runs)
    # the answer marker the probe looks for: the DUET variants' (every variant runs one task)
    duets = [cfg.algorithm.duet.domain for cfg, _ in runs.values() if cfg.algorithm.name == "duet"]
    domain = duets[0] if duets else "math"
    trainers: dict[str, Trainer] = {}
    done: dict[str, int] = {}
    try:
        for name, (cfg, run_dir) in runs.items():
            model_dir, train_problems, test_problems = prepare(cfg)
            last = run_dir.last_intact_step()
            run_dir.create(cfg.to_dict())
            run_dir.truncate_logs_after(-1 if last is None else last)
            trainers[name] = Trainer(
                cfg,
                run_dir,
                start_components(cfg, model_dir),
                AutoTokenizer.from_pretrained(model_dir),
                train_problems,
                test_problems,
            )
            done[name] = -1 if last is None else last
            if last is not None:
                trainers[name].restore(last)
                trainers[name].sync_weights()
                print(f"{name}, seed {seed}: resuming after step {last}", flush=True)
        for step in range(steps):
            # rotate who goes first: the first variant of a round may see other caches
            for i in range(len(names)):
                name = names[(step + i) % len(names)]
                if step > done[name]:
                    trainer = trainers[name]
                    trainer.persist(step, trainer.step(step), best_step=None)
        out: dict[str, Any] = {}
        for name, trainer in trainers.items():
            committed = trainer.run.read_metrics()
            out[name] = {
                "steps": committed,
                "eval": trainer.evaluate(steps - 1),
                "probe": abort_probe(trainer, committed[-1], steps - 1, domain),
            }
    finally:
        for trainer in trainers.values():
            trainer.comps.shutdown()
    return out


def abort_probe(trainer: Any, last: dict[str, Any], step: int, domain: str) -> dict[str, float]:
    """What the trained policy's rollouts look like to DUET's stop rule, on held-out prompts.

    PROBE_PROMPTS held-out prompts x N_REF rollouts at the training sampler: the share that end
    with no answer marker (marker-less), and, for variants whose engine runs the stop rule, the
    rollouts it would abort and the share of those that would have been correct. The rule runs
    with the last step's K1/K2 and eps_abort = 1, so every rollout it would abort is kept and runs
    on to EOS or max_tokens instead (flagged eps_kept, arXiv:2605.08441 Eq. 5's keep branch)."""
    import numpy as np

    from rlvr.algorithms.duet.stop import has_marker

    cfg = trainer.cfg
    problems = trainer.test_problems[:PROBE_PROMPTS]
    stop = duet_stop(cfg, last["duet_k1"], last["duet_k2"], step) if "duet_k1" in last else None
    if stop is not None:
        stop["eps_abort"] = 1.0
    rollouts = trainer.services.generate(
        problems,
        {p.id: N_REF for p in problems},
        cfg.generation.sampling_params(PROBE_SEED),
        step,
        duet_stop=stop,
    )
    trainer.services.verify(rollouts)
    correct = rollouts.rewards >= 1.0
    probe = {
        "rollouts": len(rollouts),
        "accuracy": float(correct.mean()),
        "marker_less": float(np.mean([not has_marker(t, domain) for t in rollouts.texts])),
    }
    if stop is not None:
        would = np.array([bool(f.get("eps_kept", False)) for f in rollouts.flags])
        probe["would_abort"] = float(would.mean())
        probe["would_abort_n"] = int(would.sum())
        probe["would_abort_correct_n"] = int(correct[would].sum())
    return probe


def summarize(runs: dict[int, dict[str, Any]], warmup: int) -> dict[str, dict[str, float]]:
    """Per variant: accuracy mean/sd over seeds, medians of per-step figures over seeds and steps."""
    table = variants()
    rows: dict[str, dict[str, float]] = {}
    for name in next(iter(runs.values())):
        method, b, _ = table[name]
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
        probes = [r["probe"] for r in per_seed]
        row["marker_less"] = statistics.mean(pr["marker_less"] for pr in probes)
        if "would_abort" in probes[0]:
            row["would_abort"] = statistics.mean(pr["would_abort"] for pr in probes)
            aborted = sum(pr["would_abort_n"] for pr in probes)
            row["would_abort_n"] = aborted
            right = sum(pr["would_abort_correct_n"] for pr in probes)
            row["would_abort_correct"] = right / aborted if aborted else math.nan
        if method == "duet":
            row["abort_rate"] = statistics.median(m["duet_abort_rate"] for m in timed)
            row["n_std"] = statistics.median(m["duet_n_std"] for m in timed)
        if method == "dapo":
            row["dapo_rounds"] = statistics.median(m["dapo_rounds"] for m in timed)
            row["dapo_dropped"] = statistics.median(m["dapo_dropped_groups"] for m in timed)
        rows[name] = row
    if BASELINE in rows:
        base = [runs[s][BASELINE]["eval"]["eval_accuracy"] for s in sorted(runs)]
        for name, row in rows.items():
            acc = [runs[s][name]["eval"]["eval_accuracy"] for s in sorted(runs)]
            row["accuracy_gap"], row["accuracy_gap_se"] = paired_difference(acc, base)
    full = rows.get(BASELINE, {}).get("step_s", float("nan"))
    for row in rows.values():
        same_b = [r for r in rows.values() if r["method"] == "grpo" and r["b"] == row["b"]]
        row["speedup_same_b"] = same_b[0]["step_s"] / row["step_s"] if same_b else float("nan")
        row["speedup_full"] = full / row["step_s"]
    return rows


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of the per-seed differences a - b (NaN standard error for one
    seed): seeds share prompts and start, so pairing removes their common variation."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return statistics.mean(d), se


def format_table(
    rows: dict[str, dict[str, float]], seeds: list[int], steps: int, label: str
) -> str:
    """Markdown table of `summarize`'s rows (tokens and rollouts count every generated one,
    DAPO's dropped groups included) and the abort probe's columns (`abort_probe`)."""
    lines = [
        f"{label}, arithmetic, {steps} steps, seeds {seeds} (accuracy: mean ± sd over seeds; "
        "its difference to GRPO b=1: mean ± standard error of the per-seed differences; "
        "per-step figures: medians). Probe, after training: "
        f"{PROBE_PROMPTS} held-out prompts x {N_REF} rollouts at the training sampler per seed; "
        "marker-less: share ending with no answer marker; would abort: share the stop rule (last "
        "K1/K2) would abort, and of those, the share correct when run on (n pooled over seeds).",
        "",
        "| variant | held-out acc | acc - GRPO b=1 (paired, ± SE) | tokens/step | rollouts/step "
        "| gen s/step | total s/step "
        "| speedup vs GRPO same b | speedup vs GRPO b=1 | controller % of step | abort rate "
        "| n_q std | DAPO rounds | DAPO dropped groups | marker-less | would abort "
        "| would-abort correct (n) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        duet, dapo = r["method"] == "duet", r["method"] == "dapo"
        lines.append(
            f"| {name} | {r['accuracy']:.3f} ± {r['accuracy_sd']:.3f} | {_gap(r, name)} "
            f"| {r['tokens']:.0f} "
            f"| {r['rollouts']:.0f} | {r['generate_s']:.2f} | {r['step_s']:.2f} "
            f"| {_ratio(r['speedup_same_b'])} | {_ratio(r['speedup_full'])} "
            f"| {100 * r['controller_frac']:.2f} "
            + (f"| {r['abort_rate']:.3f} | {r['n_std']:.2f} " if duet else "| - | - ")
            + (f"| {r['dapo_rounds']:.1f} | {r['dapo_dropped']:.1f} " if dapo else "| - | - ")
            + f"| {r['marker_less']:.3f} "
            + (
                f"| {r['would_abort']:.3f} | {_share(r['would_abort_correct'])} "
                f"({r['would_abort_n']}) |"
                if "would_abort" in r
                else "| - | - |"
            )
        )
    return "\n".join(lines)


def _gap(row: dict[str, float], name: str) -> str:
    """The paired accuracy difference to the baseline; '-' for the baseline itself or without
    one, no SE for one seed."""
    if name == BASELINE or "accuracy_gap" not in row:
        return "-"
    se = row["accuracy_gap_se"]
    return f"{row['accuracy_gap']:+.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")


def _share(x: float) -> str:
    """A share cell; '-' where nothing was counted."""
    return "-" if math.isnan(x) else f"{x:.3f}"


def _ratio(x: float) -> str:
    """A speedup cell; '-' where the run had no baseline to compare with."""
    return "-" if math.isnan(x) else f"{x:.2f}x"


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
    axes[1, 0].tick_params(axis="x", labelrotation=20)  # the variant names overlap level
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


def train_seeds(
    preset: Preset, steps: int, seeds: list[int], args: argparse.Namespace
) -> dict[int, dict[str, Any]]:
    """`run_seed` for each seed on one Ray cluster, once every run directory is checked."""
    import ray

    from workflows.cluster import quiet_driver

    names = args.variants or preset.variants
    n_train = args.n_train or preset.n_train
    runs_dir = Path(args.out) / "runs"
    plans = {s: variant_runs(preset, s, n_train, args.set, names, runs_dir) for s in seeds}
    for runs in plans.values():
        for cfg, run_dir in runs.values():
            check_resumable(cfg, run_dir, args.resume)
    quiet_driver()
    start_cluster(load_config(preset.config, [*COMMON, *args.set]), Path(args.out))
    try:
        return {s: run_seed(plans[s], s, steps) for s in seeds}
    finally:
        ray.shutdown()


def merged_runs(paths: list[Path]) -> tuple[dict[int, dict[str, Any]], int]:
    """The per-seed runs of several earlier outputs (a long preset's seeds run one at a time)
    and their number of steps; they must hold different seeds, the same variants and the same
    number of steps."""
    runs: dict[int, dict[str, Any]] = {}
    for path in paths:
        for seed, run in json.loads(path.read_text())["runs"].items():
            if int(seed) in runs:
                raise SystemExit(f"--merge: seed {seed} appears twice ({path})")
            runs[int(seed)] = run
    shapes = {(tuple(r), len(next(iter(r.values()))["steps"])) for r in runs.values()}
    if len(shapes) != 1:
        raise SystemExit(f"--merge: runs differ in variants or steps: {sorted(shapes)}")
    [(_, steps)] = shapes
    return runs, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model and base config")
    ap.add_argument("--steps", type=int, help="training steps per variant and seed (preset's)")
    ap.add_argument("--seeds", type=int, nargs="+", help="seeds (preset's by default)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of timing medians")
    ap.add_argument("--n-train", type=int, help="prompt pool, small so prompts recur (preset's)")
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANT_NAMES,
        metavar="NAME",
        help=f"variants (preset's default subset); all: {VARIANT_NAMES}",
    )
    ap.add_argument("--set", action="append", default=[], help="config override for all variants")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "duet"), help="output folder")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="go on after each variant's last committed step in <out>/runs (same arguments)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="train nothing: one table from earlier runs' duet_<preset>.json (seeds run apart)",
    )
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    if args.merge:
        runs, steps = merged_runs(args.merge)
        seeds = sorted(runs)
    else:
        steps = args.steps or preset.steps
        seeds = args.seeds or preset.seeds
        runs = train_seeds(preset, steps, seeds, args)
    rows = summarize(runs, args.warmup)
    table = format_table(rows, seeds, steps, preset.label)
    print(table)
    out = Path(args.out)
    stem = f"duet_{args.preset}"
    write_results(out, stem, table, {"rows": rows, "runs": runs})
    plot(runs, rows, out / f"{stem}.png")


if __name__ == "__main__":
    main()
