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
    .venv/bin/python bench/dro.py --config configs/smollm2-dro.yaml --steps 12 \\
        --variants r3 r3-no-gates avg-prob avg-logprob --out bench/out/dro-smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from workflows.cli import ray_env

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
    summary = train(cfg, out / name, prepared=prepare(cfg))
    summary["metrics"] = _lines(out / name / "metrics.jsonl")
    summary["evals"] = _lines(out / name / "eval.jsonl")
    return summary


def summarize(name: str, summary: dict) -> dict:
    m = summary["metrics"]
    return {
        "variant": name,
        "acc_before": summary["eval_before"]["eval_accuracy"],
        "acc_after": summary["eval_after"]["eval_accuracy"],
        "acc_best": max(e["eval_accuracy"] for e in summary["evals"]),
        "reward_acc_corr": _mean([x.get("dro_reward_accuracy_corr") for x in m]),
        "reject_rate": m[-1].get("dro_reject_rate_cum", 0.0),
        "s_per_step": statistics.median(x["time_step"] for x in m),
        "score_s": statistics.median(x["time_verify"] for x in m),
        "score_share": statistics.median(x["time_verify"] / x["time_step"] for x in m),
    }


def format_table(rows: list[dict]) -> str:
    head = (
        "| variant | held-out acc before | after | best | reward-acc corr (train) "
        "| rejection rate | s/step (median) | scoring s/step | scoring share of step |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['acc_before']:.3f} | {r['acc_after']:.3f} | {r['acc_best']:.3f} "
            f"| {r['reward_acc_corr']:.3f} | {r['reject_rate']:.3f} | {r['s_per_step']:.2f} "
            f"| {r['score_s']:.3f} | {r['score_share']:.1%} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, s in results.items():
        axes[0].plot(
            [e["step"] for e in s["evals"]],
            [e["eval_accuracy"] for e in s["evals"]],
            ".-",
            label=name,
        )
        steps = [x["step"] for x in s["metrics"]]
        axes[1].plot(
            steps, [x.get("dro_exact_accuracy", x["accuracy"]) for x in s["metrics"]], label=name
        )
        axes[2].plot(steps, [x.get("dro_reject_rate_cum", 0.0) for x in s["metrics"]], label=name)
    axes[0].set(xlabel="step", ylabel="held-out exact accuracy", title="evaluation (verifier)")
    axes[1].set(xlabel="step", ylabel="exact accuracy of rollouts", title="training rollouts")
    axes[2].set(xlabel="step", ylabel="cumulative rejection rate", title="rubric gates")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config", type=Path, default=PRESET, help="base DRO config (the tiny model's)"
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for all")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "dro"))
    args = ap.parse_args()
    from rlvr.config import load_config
    from workflows.cli import init_ray
    from workflows.dro_offline import run_filter
    from workflows.train import prepare

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        *args.set,
        f"run.steps={args.steps}",
        f"run.seed={args.seed}",
        f"run.eval_every={args.eval_every}",
    ]
    base = load_config(args.config, [*BASE, *common])
    # every variant starts from this model (SFT-warmed where the config asks), whatever it trains on
    model_dir, _, _ = prepare(base)
    common += [f"model.path={model_dir}", "model.sft_warmup_steps=0"]
    filtered = run_filter(load_config(args.config, [*BASE, *common]), out / "filter")
    print(json.dumps({k: v for k, v in filtered.items() if k != "train_with"}, indent=2))
    data = filtered["train_with"]
    init_ray(base)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            overrides, on_filtered = VARIANTS[name]
            extra = data if on_filtered else []
            results[name] = run_one(args.config, name, [*common, *extra, *overrides], Path(tmp))
    rows = [summarize(name, s) for name, s in results.items()]
    table = format_table(rows)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"filter": filtered, "rows": rows}, indent=2))
    plot(results, out / "curves.png")
    print(f"plot: {out / 'curves.png'}")


if __name__ == "__main__":
    main()
