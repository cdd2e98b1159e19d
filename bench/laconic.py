"""LACONIC vs GRPO side by side: held-out accuracy, response length against the budget, tokens.

Every variant is configs/tiny-laconic.yaml (the tiny model SFT-warmed on verbose traces, 0-3
re-check lines per step, so it starts well over budget and can still answer correctly when short;
per-sequence token-mean loss) with LACONIC switched off for GRPO. GRPO runs first; the budget B is
half its starting held-out length; then LACONIC and its two ablations (a fixed lambda, the signed
linear cost) run with the same seeds, data and steps.

    .venv/bin/python bench/laconic.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from harness import start_cluster, write_results

from workflows.cluster import ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "configs" / "tiny-laconic.yaml"
BASE = ["run.eval_every=0", "run.keep_last=1"]
ON = ["algorithm.name=laconic", "algorithm.laconic.lam_max=auto"]
OFF = ["algorithm.name=grpo"]


def variants(budget: int, eta: float) -> dict[str, list[str]]:
    laconic = [*ON, f"algorithm.laconic.budget={budget}", f"algorithm.laconic.eta={eta}"]
    return {
        "laconic": laconic,
        # the paper's fixed-lambda sweep tops out at 0.05 (no dual update; App. B.3, Table 8)
        "fixed-lambda-0.05": [
            *laconic,
            "algorithm.laconic.eta=0",
            "algorithm.laconic.lam_init=0.05",
        ],
        "linear-cost": [*laconic, "algorithm.laconic.cost=linear"],
    }


def run_one(name: str, overrides: list[str], out: Path) -> dict:
    from rlvr.config import load_config
    from workflows.train import prepare, train

    cfg = load_config(PRESET, [*BASE, *overrides, f"run.name={name}"])
    summary = train(cfg, out / name, prepared=prepare(cfg))
    metrics = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    summary["metrics"] = metrics
    return summary


def summarize(name: str, summary: dict, budget: int) -> dict:
    m = summary["metrics"]
    tail = m[-5:]
    after = summary["eval_after"]
    return {
        "variant": name,
        "accuracy_before": summary["eval_before"]["eval_accuracy"],
        "accuracy_after": after["eval_accuracy"],
        "eval_length": after["eval_length_mean"],
        "train_length_last5": statistics.mean(x["length_mean"] for x in tail),
        "length_over_B": statistics.mean(x["length_mean"] for x in tail) / budget,
        "tokens_per_step": statistics.mean(x["tokens_generated"] for x in tail),
        "lambda_final": m[-1].get("laconic_lambda_next", 0.0),
    }


def format_table(rows: list[dict], budget: int) -> str:
    head = (
        f"| variant | acc before | acc after | eval length | train length (last 5) "
        f"| length / B (B={budget}) | tokens/step | final lambda |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} "
            f"| {r['eval_length']:.1f} | {r['train_length_last5']:.1f} | {r['length_over_B']:.2f} "
            f"| {r['tokens_per_step']:.0f} | {r['lambda_final']:.3f} |"
        )
    grpo, lac = rows[0], rows[1]
    lines.append(
        f"\nLACONIC vs GRPO: eval length {100 * (1 - lac['eval_length'] / grpo['eval_length']):.0f}% "
        f"shorter, held-out accuracy {100 * (lac['accuracy_after'] - grpo['accuracy_after']):+.1f} points"
    )
    return "\n".join(lines)


def plot(results: dict[str, dict], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_len, ax_lam) = plt.subplots(1, 2, figsize=(11, 4))
    for name, summary in results.items():
        steps = [x["step"] for x in summary["metrics"]]
        ax_len.plot(steps, [x["length_mean"] for x in summary["metrics"]], label=name)
        if name != "grpo":
            ax_lam.plot(steps, [x["laconic_lambda"] for x in summary["metrics"]], label=name)
    ax_len.axhline(budget, color="k", ls="--", lw=1, label=f"budget B={budget}")
    ax_len.set(xlabel="step", ylabel="mean response length (tokens)", title="length")
    ax_lam.set(xlabel="step", ylabel="lambda", title="dual variable")
    ax_len.legend()
    ax_lam.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=float, default=0.05, help="dual step (short runs need > 0.002)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "laconic"))
    args = ap.parse_args()
    from workflows.cluster import quiet_driver

    quiet_driver()
    from rlvr.config import load_config

    common = [f"run.steps={args.steps}", f"run.seed={args.seed}"]
    out = Path(args.out)
    start_cluster(load_config(PRESET, BASE), out)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["grpo"] = run_one("grpo", [*common, *OFF], Path(tmp))
        budget = max(1, round(results["grpo"]["eval_before"]["eval_length_mean"] / 2))
        for name, overrides in variants(budget, args.eta).items():
            results[name] = run_one(name, [*common, *overrides], Path(tmp))
    rows = [summarize(name, s, budget) for name, s in results.items()]
    table = format_table(rows, budget)
    print(table)
    write_results(out, "table", table, {"budget": budget, "rows": rows})
    plot(results, budget, out / "length_lambda.png")
    print(f"plot: {out / 'length_lambda.png'}")


if __name__ == "__main__":
    main()
