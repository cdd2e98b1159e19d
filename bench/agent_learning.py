"""Does an agent learn to use its tool? Held-out accuracy with the calculator against the same
model without it, before RL (the base model and the warmed-up one) and after RL, over seeds, plus
the per-step tool statistics of each training run.

    .venv/bin/python bench/agent_learning.py --seeds 0 1 2

Every number comes from the commands a user runs: `rlvr train --config PRESET --set
run.seed=S`, then `rlvr evaluate` of each model with the run's tools and with `--no-env`
(n samples per held-out problem at the preset's temperature). The warm-up (model.sft_warmup_*,
seed-independent and cached) is shared by the seeds. Writes agent_learning.{md,json} and each
run's training.png (`rlvr plot`) under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from harness import ROOT, markdown_table, run_rlvr, write_results  # bench/, the script's directory

STEP_COLUMNS = ("agent_tool_calls_per_trajectory", "agent_tool_error_share", "agent_turns_mean")


def evaluate(checkpoint: Path, args: argparse.Namespace, out: Path, tools: bool) -> dict:
    """The summary of `rlvr evaluate` of `checkpoint` with the preset's tools or without."""
    target = out / ("tools" if tools else "no-tools")
    if not (target / "evaluation.json").is_file():
        argv = ["evaluate", "--checkpoint", str(checkpoint), "--config", str(args.config)]
        argv += ["--n", str(args.n), "--temperature", str(args.temperature), "--out", str(target)]
        run_rlvr(argv + ([] if tools else ["--no-env"]), args.out / "commands.log")
    return json.loads((target / "evaluation.json").read_text())


def starting_models(config: Path) -> dict[str, Path]:
    """The base model and the warmed-up one RL starts from (warming it up if not cached)."""
    from rlvr.config import load_config
    from rlvr.models import resolve_model_path
    from workflows.train import prepare

    cfg = load_config(config)
    base = resolve_model_path(cfg.model.path, seed=cfg.model.seed)
    return {"base": base, "warmed up": prepare(cfg)[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/smollm2-calculator.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="RL steps (default: the preset's)")
    parser.add_argument("--n", type=int, default=4, help="samples per held-out problem")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/agent_learning")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    rows, data = [], {"settings": vars(args) | {"out": str(args.out)}, "models": {}, "steps": {}}

    def record(label: str, checkpoint: Path, out: Path) -> None:
        with_tools, without = (evaluate(checkpoint, args, out, t) for t in (True, False))
        agent = with_tools.get("agent", {})
        data["models"][label] = {"tools": with_tools, "no tools": without}
        rows.append(
            [
                label,
                f"{with_tools['accuracy']:.3f}",
                f"{without['accuracy']:.3f}",
                f"{agent.get('agent_tool_calls_per_trajectory', 0.0):.2f}",
                f"{agent.get('agent_tool_error_share', 0.0):.2f}",
            ]
        )

    for label, model in starting_models(args.config).items():
        record(label, model, args.out / label.replace(" ", "-"))
    for seed in args.seeds:
        runs = args.out / "runs"
        run_dir = runs / f"seed{seed}"
        if not (run_dir / "final").is_dir():
            argv = ["train", "--config", str(args.config), "--set", f"run.seed={seed}"]
            argv += ["--set", f"run.output_dir={runs}", "--set", f"run.name=seed{seed}"]
            argv += ["--set", f"run.steps={args.steps}"] if args.steps else []
            run_rlvr(argv, args.out / "commands.log")
            run_rlvr(["plot", str(run_dir)], args.out / "commands.log")
        record(f"after RL, seed {seed}", run_dir, run_dir / "eval")
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        data["steps"][seed] = [{k: m.get(k) for k in ("step", *STEP_COLUMNS)} for m in metrics]

    after = [data["models"][f"after RL, seed {s}"] for s in args.seeds]
    means = {
        key: statistics.mean(m[key]["accuracy"] for m in after) for key in ("tools", "no tools")
    }
    header = ["model", "accuracy, tools", "accuracy, no tools", "calls / trajectory", "tool errors"]
    text = markdown_table(header, rows)
    text += f"\n\nafter RL, mean of {len(after)} seeds: tools {means['tools']:.3f}, "
    text += f"no tools {means['no tools']:.3f}\n\nper step (calls / trajectory, tool-error share, "
    text += "turns):\n\n"
    steps = sorted({s["step"] for per in data["steps"].values() for s in per})
    text += markdown_table(
        ["step", *(f"seed {s}" for s in args.seeds)],
        [
            [step]
            + [
                " / ".join(
                    f"{x['agent_tool_calls_per_trajectory']:.2f}, "
                    f"{x['agent_tool_error_share']:.2f}, {x['agent_turns_mean']:.2f}"
                    for x in data["steps"][s]
                    if x["step"] == step
                )
                for s in args.seeds
            ]
            for step in steps
        ],
    )
    print(text)
    write_results(args.out, "agent_learning", text, data)


if __name__ == "__main__":
    main()
