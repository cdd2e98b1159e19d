"""DRO on arithmetic treated as unverifiable: R3 against the verifier reward and the baselines.

The policy never sees the exact verifier's verdict except in the "verifier" variant (the upper
reference); every other variant is rewarded by its certainty of the reference " \\boxed{N}." after
its own CoT. All variants start from the same model (the SFT-warmed tiny one by default), with
the same seeds, steps and held-out problems; the exact verifier only evaluates. One `rlvr filter`
pass on the training corpus (reference model = the start model) gives the retained set the
filtered variants train on.

| variant      | reward      | filter | gates (keyword judge) |
| verifier     | exact 0/1   | yes    | no                    |
| r3           | R3 (DRO)    | yes    | yes                   |
| r3-no-filter | R3          | no     | yes                   |
| r3-no-gates  | R3          | yes    | no                    |
| avg-prob     | Avg Prob    | yes    | no                    |
| avg-logprob  | Avg Logprob | yes    | no                    |

The baselines share r3-no-gates' data and gate setting, so only the reward differs between them.
Reported: held-out exact accuracy (greedy) before / after, the training rollouts' reward-accuracy
correlation, the group rejection rate, seconds per step and the share of it spent in scoring
(R3 prefill + judging + the metrics-only verifier), with plots of the curves.

    .venv/bin/python bench/dro.py --steps 30
    .venv/bin/python bench/dro.py --config configs/smollm2-dro.yaml --steps 6 --eval-every 6 \\
        --seeds 0 1 2 --variants r3-no-gates avg-prob avg-logprob r3 --set task.n_test=64 \\
        --out bench/out/dro-smollm2-fewshot
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path

from harness import start_cluster

from workflows.cluster import ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "configs" / "tiny-dro.yaml"
BASE = ["run.keep_last=1", "task.n_test=32"]
NO_GATES = ["algorithm.dro.gates=false"]
VARIANTS: dict[str, tuple[list[str], bool]] = {
    # name: (overrides, trains on the filtered set)
    "verifier": (["algorithm.dro.reward=verifier", *NO_GATES], True),
    "r3": ([], True),
    "r3-no-filter": ([], False),
    "r3-no-gates": (NO_GATES, True),
    "avg-prob": (["algorithm.dro.reward=avg_prob", *NO_GATES], True),
    "avg-logprob": (["algorithm.dro.reward=avg_logprob", *NO_GATES], True),
}


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.mean(finite) if finite else float("nan")


def run_one(config: Path, name: str, overrides: list[str], out: Path) -> dict:
    from rlvr.config import load_config
    from workflows.train import prepare, train

    cfg = load_config(config, [*BASE, *overrides, f"run.name={name}"])
    shutil.rmtree(out / name, ignore_errors=True)  # a fresh run, never a resume of an old sweep's
    summary = train(cfg, out / name, prepared=prepare(cfg))
    summary["metrics"] = _lines(out / name / "metrics.jsonl")
    summary["evals"] = _lines(out / name / "eval.jsonl")
    return summary


def summarize(name: str, per_seed: list[dict]) -> dict:
    """One table row over seeds: accuracies as mean (and sd after), per-step figures as medians."""
    m = [x for s in per_seed for x in s["metrics"]]
    after = [s["eval_after"]["eval_accuracy"] for s in per_seed]
    return {
        "variant": name,
        "acc_before": statistics.mean(s["eval_before"]["eval_accuracy"] for s in per_seed),
        "acc_after": statistics.mean(after),
        "acc_after_sd": statistics.stdev(after) if len(after) > 1 else 0.0,
        "acc_after_per_seed": after,
        "acc_best": statistics.mean(max(e["eval_accuracy"] for e in s["evals"]) for s in per_seed),
        "reward_acc_corr": _mean([x.get("dro_reward_accuracy_corr") for x in m]),
        "reject_rate": _mean([s["metrics"][-1].get("dro_reject_rate_cum", 0.0) for s in per_seed]),
        "s_per_step": statistics.median(x["time_step"] for x in m),
        "score_s": statistics.median(x["time_verify"] for x in m),
        "score_share": statistics.median(x["time_verify"] / x["time_step"] for x in m),
    }


def format_table(rows: list[dict], seeds: list[int]) -> str:
    head = (
        f"Seeds {seeds}: accuracies are means over seeds (after: ± sd), per-step figures medians.\n\n"
        "| variant | held-out acc before | after | best | reward-acc corr (train) "
        "| rejection rate | s/step (median) | scoring s/step | scoring share of step |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['acc_before']:.3f} | {r['acc_after']:.3f} ± "
            f"{r['acc_after_sd']:.3f} | {r['acc_best']:.3f} | {r['reward_acc_corr']:.3f} "
            f"| {r['reject_rate']:.3f} | {r['s_per_step']:.2f} | {r['score_s']:.3f} "
            f"| {r['score_share']:.1%} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Held-out accuracy, training-rollout accuracy and cumulative rejection over steps, each
    the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_curve(rows: list[list[dict]], key: str, fallback: str = "") -> tuple[list, list]:
        """(steps, per-step mean over seeds of `key`, else of `fallback`, else 0)."""
        steps = [x["step"] for x in rows[0]]
        means = [
            statistics.mean(r[i].get(key, r[i].get(fallback, 0.0)) for r in rows)
            for i in range(len(steps))
        ]
        return steps, means

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, per_seed in results.items():
        axes[0].plot(*mean_curve([s["evals"] for s in per_seed], "eval_accuracy"), ".-", label=name)
        metrics = [s["metrics"] for s in per_seed]
        axes[1].plot(*mean_curve(metrics, "dro_exact_accuracy", "accuracy"), label=name)
        axes[2].plot(*mean_curve(metrics, "dro_reject_rate_cum"), label=name)
    axes[0].set(xlabel="step", ylabel="held-out exact accuracy", title="evaluation (verifier)")
    axes[1].set(xlabel="step", ylabel="exact accuracy of rollouts", title="training rollouts")
    axes[2].set(xlabel="step", ylabel="cumulative rejection rate", title="rubric gates")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(
    results: dict[str, list[dict]], filtered: dict, seeds: list[int], out: Path
) -> None:
    """Table, results and plot over the runs finished so far (variants with none are left out)."""
    done = {name: per_seed for name, per_seed in results.items() if per_seed}
    rows = [summarize(name, per_seed) for name, per_seed in done.items()]
    seeds = seeds[: max(len(per_seed) for per_seed in done.values())]
    (out / "table.md").write_text(format_table(rows, seeds) + "\n")
    (out / "results.json").write_text(
        json.dumps({"filter": filtered, "seeds": seeds, "rows": rows}, indent=2)
    )
    plot(done, out / "curves.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config", type=Path, default=PRESET, help="base DRO config (the tiny model's)"
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="the filter uses the first")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for all")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "dro"))
    args = ap.parse_args()
    from workflows.cluster import quiet_driver

    quiet_driver()
    from rlvr.config import load_config
    from workflows.dro_offline import run_filter
    from workflows.train import prepare

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        *args.set,
        f"run.steps={args.steps}",
        f"run.eval_every={args.eval_every}",
    ]
    first_seed = f"run.seed={args.seeds[0]}"
    base = load_config(args.config, [*BASE, *common, first_seed])
    # every variant starts from this model (SFT-warmed where the config asks), whatever it trains on
    model_dir, _, _ = prepare(base)
    common += [f"model.path={model_dir}", "model.sft_warmup_steps=0"]
    filtered = run_filter(load_config(args.config, [*BASE, *common, first_seed]), out / "filter")
    print(json.dumps({k: v for k, v in filtered.items() if k != "train_with"}, indent=2))
    data = filtered["train_with"]
    start_cluster(base, out)
    results: dict[str, list[dict]] = {name: [] for name in args.variants}
    for seed in args.seeds:
        for name in args.variants:
            overrides, on_filtered = VARIANTS[name]
            extra = data if on_filtered else []
            results[name].append(
                run_one(
                    args.config,
                    name,
                    [*common, f"run.seed={seed}", *extra, *overrides],
                    out / "runs" / f"seed{seed}",
                )
            )
            # rewritten after every run, so a long sweep cut short still leaves its table
            write_report(results, filtered, args.seeds, out)
    print((out / "table.md").read_text())
    print(f"plot: {out / 'curves.png'}")


if __name__ == "__main__":
    main()
