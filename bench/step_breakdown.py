"""Median GRPO step time, its split, and the overhead of the actor layer and of scale-out layouts.

The same step code (`workflows.train.Trainer.step`) runs through Ray actors and with the same
backends called in this process; all modes run alternately, step by step, so they see the same
machine load. Overhead = (actor step - in-process step) / actor step, on medians. `--layouts`
adds actor runs with R policy ranks and E engines ("2x2"); every layout must generate the same
tokens and reach the same reward as the others (on a 2-core machine this shows their overhead and
correctness, not a speed-up).

    .venv/bin/python bench/step_breakdown.py --preset tiny --steps 6
    .venv/bin/python bench/step_breakdown.py --preset tiny --steps 4 --layouts 1x1 2x2
    .venv/bin/python bench/step_breakdown.py --preset smollm2 --steps 4
    .venv/bin/python bench/step_breakdown.py --preset smollm2 --steps 4 --off-policy 1 2

`--off-policy` adds modes that generate step t+1 while step t trains (`run.max_staleness: 1`),
their actors with the given torch threads each (1 on 2 cores: generation and training split the
cores); in such a step "generate" ran during the step before and is not part of its time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from workflows.cluster import announce_engine_log, quiet_driver, ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
PRESETS = {
    "tiny": ROOT / "configs" / "tiny.yaml",
    "smollm2": ROOT / "configs" / "smollm2-arith.yaml",
}
PARTS = (
    "time_generate",
    "time_verify",
    "time_train",
    "time_wait_rollouts",
    "time_sync",
    "time_overhead",
    "time_step",
)


def layout_overrides(layout: str, share: float) -> list[str]:
    """Config overrides of an "RxE" layout: R policy ranks and E engines, `share` CPUs each."""
    ranks, engines = (int(x) for x in layout.split("x"))
    return [
        f"resources.policy_ranks={ranks}",
        f"resources.generator_engines={engines}",
        f"resources.policy_cpus={share:g}",
        f"resources.generator_cpus={share:g}",
    ]


def run(
    preset: str,
    steps: int,
    warmup: int,
    overrides: list[str],
    layouts: list[str],
    off_policy_threads: list[int],
    engine_log: Path,
) -> dict[str, dict[str, float]]:
    """Per mode: each phase's median time over `steps` steps after `warmup`, the tokens generated
    and the mean reward; the actors' output goes to `engine_log`."""
    import ray
    from transformers import AutoTokenizer

    from rlvr.config import load_config
    from rlvr.run.rundir import RunDir
    from workflows.cluster import init_ray
    from workflows.components import start_components
    from workflows.train import Trainer, prepare

    cfg = load_config(PRESETS[preset], ["run.eval_every=0", *overrides])
    model_dir, train_problems, test_problems = prepare(cfg)
    init_ray(cfg, engine_log)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    modes = {"actors": cfg, "in-process": cfg}
    if layouts or off_policy_threads:
        # every mode's actors live at once: they share the machine's CPUs in the reservations
        bundles = 2 + sum(int(r) + int(e) for r, e in (x.split("x") for x in layouts))
        share = (os.cpu_count() or 1) / (bundles + 2 * len(off_policy_threads))
        base = ["run.eval_every=0", *overrides]
        modes["actors"] = load_config(PRESETS[preset], [*base, *layout_overrides("1x1", share)])
        for layout in layouts:
            # its own run name: actor and placement group names are per run
            modes[f"actors {layout}"] = load_config(
                PRESETS[preset],
                [*base, *layout_overrides(layout, share), f"run.name={cfg.run.name}-{layout}"],
            )
        for threads in off_policy_threads:
            # step t+1 generated during step t's training, each actor with `threads` threads
            modes[f"off-policy {threads}t"] = load_config(
                PRESETS[preset],
                [
                    *base,
                    *layout_overrides("1x1", share),
                    "run.max_staleness=1",
                    f"resources.torch_threads={threads}",
                    f"run.name={cfg.run.name}-off-policy-{threads}t",
                ],
            )
    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, mode_cfg in modes.items():
            run_dir = RunDir(Path(tmp) / mode.replace(" ", "-"))
            run_dir.create(mode_cfg.to_dict())
            comps = start_components(mode_cfg, model_dir, use_actors=mode != "in-process")
            trainers[mode] = Trainer(
                mode_cfg, run_dir, comps, tokenizer, train_problems, test_problems
            )
        samples: dict[str, list[dict]] = {m: [] for m in trainers}
        for step in range(warmup + steps):
            for mode, trainer in trainers.items():
                metrics = trainer.step(step)
                if step >= warmup:
                    samples[mode].append(metrics)
        for trainer in trainers.values():
            trainer.comps.shutdown()
            if trainer.pipeline:
                trainer.pipeline.close()  # batches ahead of the last step wait for nothing more
    ray.shutdown()
    return {
        mode: {
            **{p: statistics.median(m.get(p, 0.0) for m in ms) for p in PARTS},
            "tokens_generated": sum(m["tokens_generated"] for m in ms),
            "reward_mean": statistics.fmean(m["reward_mean"] for m in ms),
        }
        for mode, ms in samples.items()
    }


def format_table(preset: str, result: dict[str, dict[str, float]]) -> str:
    head = (
        f"{'model':8s} {'mode':13s} "
        + " ".join(f"{p.removeprefix('time_'):>9s}" for p in PARTS)
        + "   tokens  reward"
    )
    lines = [head]
    for mode, r in result.items():
        lines.append(
            f"{preset:8s} {mode:13s} "
            + " ".join(f"{r[p]:9.2f}" for p in PARTS)
            + f" {r['tokens_generated']:8.0f} {r['reward_mean']:7.4f}"
        )
    a, b = result["actors"]["time_step"], result["in-process"]["time_step"]
    lines.append(
        f"{preset:8s} actor overhead: {a - b:+.2f} s per step = {100 * (a - b) / a:+.1f}% of the actor step"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per mode (median)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured first steps per mode")
    ap.add_argument("--set", action="append", default=[], help="config override")
    ap.add_argument(
        "--layouts", nargs="*", default=[], help='scale-out layouts "RxE" (policy ranks x engines)'
    )
    ap.add_argument(
        "--off-policy",
        type=int,
        nargs="*",
        default=[],
        metavar="THREADS",
        help="modes with run.max_staleness=1 and THREADS torch threads per actor (1: split cores)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"), help="where the JSON result goes")
    args = ap.parse_args()
    quiet_driver()
    out = Path(args.out)
    result = run(
        args.preset,
        args.steps,
        args.warmup,
        args.set,
        args.layouts,
        args.off_policy,
        announce_engine_log(out),
    )
    table = format_table(args.preset, result)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step_breakdown_{args.preset}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
