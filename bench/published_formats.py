"""A checkpoint evaluated on data files in two published layouts, loaded with no preprocessing.

Writes a GSM8K-style file (`question`; `answer` a worked solution ending in `#### N`, with GSM8K's
`<<a+b=c>>` calculator marks) and a MATH-style file (`problem`; `solution` ending in `\\boxed{N}`;
`level` and `type` columns, which become the problems' metadata), both of single-step additions
and subtractions like the demo's task but worded as those datasets word them. Then runs `rlvr
evaluate` of `--checkpoint` on each as a user would, and tabulates accuracy, pass@k and lengths.

    .venv/bin/python bench/published_formats.py --checkpoint runs/smollm2-demo
    .venv/bin/python bench/published_formats.py --checkpoint runs/smollm2-demo --n 4 --temperature 0.7
    .venv/bin/python bench/published_formats.py --checkpoint ~/.cache/rlvr/models/smollm2-135m-instruct \
        --config smollm2-arith --out bench/out/published_formats/base
Writes gsm8k.jsonl, math.jsonl, eval-*/, results.md and results.json to `--out`
(bench/out/published_formats).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from workflows.cli import main as rlvr

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "published_formats"
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo")
THINGS = ("apples", "marbles", "stickers", "books", "shells", "coins")


def gsm8k_rows(n: int, rng: random.Random) -> list[dict[str, str]]:
    """GSM8K's layout: a word problem and a worked answer ending in '#### N'."""
    rows = []
    for _ in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 10), rng.randint(1, 10)
        if rng.random() < 0.5:
            q = f"{name} has {a} {thing} and finds {b} more. How many {thing} does {name} have now?"
            work = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}."
            result = a + b
        else:
            a = a + b
            q = f"{name} has {a} {thing} and gives {b} away. How many {thing} are left?"
            work = f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {thing} left."
            result = a - b
        rows.append({"question": q, "answer": f"{work}\n#### {result}"})
    return rows


def math_rows(n: int, rng: random.Random) -> list[dict[str, str]]:
    """MATH's layout: a LaTeX problem, a solution ending in \\boxed{N}, level and type."""
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 10), rng.randint(1, 10)
        op, value = ("+", a + b) if rng.random() < 0.5 else ("-", a - b)
        rows.append(
            {
                "problem": f"Compute ${a} {op} {b}$.",
                "solution": f"We have ${a} {op} {b} = \\boxed{{{value}}}$.",
                "level": "Level 1",
                "type": "Prealgebra",
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def evaluate(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    """`rlvr evaluate` on one file; its summary (the JSON it prints and writes)."""
    out = args.out / f"eval-{data.stem}"
    argv = ["evaluate", "--checkpoint", args.checkpoint, "--data", str(data), "--out", str(out)]
    argv += ["--n", str(args.n), "--temperature", str(args.temperature), "--seed", "0"]
    if args.config:
        argv += ["--config", args.config]
    if rlvr(argv) != 0:
        raise SystemExit(f"rlvr {' '.join(argv)} failed")
    return json.loads((out / "evaluation.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="what `rlvr evaluate` accepts")
    p.add_argument("--problems", type=int, default=64, help="problems per file")
    p.add_argument("--n", type=int, default=1, help="samples per problem")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--config", help="for a bare model directory: the preset whose prompts to use")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    files = {"gsm8k": args.out / "gsm8k.jsonl", "math": args.out / "math.jsonl"}
    write_jsonl(files["gsm8k"], gsm8k_rows(args.problems, rng))
    write_jsonl(files["math"], math_rows(args.problems, rng))
    results = {name: evaluate(args, path) for name, path in files.items()}
    lines = [
        f"`rlvr evaluate --checkpoint {args.checkpoint}`, n={args.n}, T={args.temperature}",
        "",
        "| layout | problems | accuracy | pass@k | mean length |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        passes = ", ".join(f"{k}: {v:.3f}" for k, v in r.get("pass_at_k", {}).items()) or "-"
        lines.append(
            f"| {name} | {r['problems']} | {r['accuracy']:.3f} | {passes} "
            f"| {r['mean_length']:.1f} |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
