"""The long-reasoning start model of DUET's regime (arXiv:2605.08441): warm up a config's model
(model.sft_warmup_*, cached by content, exactly the model `rlvr train` then starts from) and
measure it on held-out prompts at the config's sampling: the share of rollouts that write
`\\boxed{}` before max_tokens (target >= 0.95), accuracy, and token lengths of correct / wrong
responses. Sampling is transformers' (temperature, top-p of the config), K samples per prompt.

    nice -n 15 .venv/bin/python bench/duet_warmup.py                 # configs/smollm2-duet-long.yaml
    .venv/bin/python bench/duet_warmup.py --config configs/tiny.yaml --prompts 8 --samples 2

Writes bench/out/duet_warmup/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from rlvr.answers import last_boxed
from rlvr.config import load_config
from rlvr.models.sft import MARKER, boxed_answer_matches, completions
from rlvr.tasks.base import Problem

ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def sample_stats(
    model_dir: Path,
    problems: list[Problem],
    samples: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    instruction: str,
    chat_template: bool = True,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Marker rate, accuracy and length distribution of `samples` sampled rollouts per problem."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jobs = [p for p in problems for _ in range(samples)]
    rows: list[dict[str, Any]] = []
    sampled = completions(
        model_dir,
        jobs,
        instruction,
        max_tokens,
        batch_size,
        chat_template,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
    )
    for problem, ids in sampled:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        rows.append(
            {
                "tokens": len(ids),
                "marker": last_boxed(text) is not None,
                "correct": boxed_answer_matches(text, problem.answer),
            }
        )
    return summarize(rows)


def _dist(lengths: list[int]) -> dict[str, float | None]:
    if not lengths:
        return {"n": 0, "median": None, "p90": None}
    ordered = sorted(lengths)
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Marker rate, accuracy and correct / wrong length distributions of per-rollout rows."""
    n = len(rows)
    return {
        "rollouts": n,
        "marker_rate": sum(r["marker"] for r in rows) / n,
        "accuracy": sum(r["correct"] for r in rows) / n,
        "correct_tokens": _dist([r["tokens"] for r in rows if r["correct"]]),
        "wrong_tokens": _dist([r["tokens"] for r in rows if not r["correct"]]),
    }


def _loss(sft: dict[str, Any] | None) -> str:
    """The warm-up's last batch loss as the report shows it; '-' without a warm-up record."""
    return f"{sft['final_loss']:.3f}" if sft else "-"


def main() -> None:
    from workflows.train import prepare

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-duet-long.yaml"))
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts")
    ap.add_argument("--samples", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "duet_warmup"))
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    config = Path(args.config).resolve()
    shown = str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config)
    t0 = time.perf_counter()
    model_dir, _, test = prepare(cfg)
    sft_s = time.perf_counter() - t0
    gen = cfg.generation
    stats = sample_stats(
        model_dir,
        test[: args.prompts],
        args.samples,
        gen.temperature,
        gen.top_p,
        gen.max_tokens,
        cfg.task.instruction,
        cfg.task.chat_template,
    )
    marker = model_dir / MARKER
    result = {
        "config": shown,
        "model_dir": str(model_dir),
        "prepare_s": round(sft_s, 1),
        "sft": json.loads(marker.read_text()) if marker.is_file() else None,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "max_tokens": gen.max_tokens,
        **stats,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    c, w = stats["correct_tokens"], stats["wrong_tokens"]
    (out / "results.md").write_text(
        f"# Long-reasoning warm-up ({shown})\n\n"
        f"{stats['rollouts']} rollouts ({args.prompts} held-out prompts x {args.samples}) at "
        f"T {gen.temperature}, top-p {gen.top_p}, max_tokens {gen.max_tokens}; warm-up (or cache "
        f"hit) {sft_s:.0f} s, final SFT loss {_loss(result['sft'])}.\n\n"
        "| marker rate | accuracy | correct: n / median / p90 tokens | wrong: n / median / p90 |\n"
        "|---|---|---|---|\n"
        f"| {stats['marker_rate']:.3f} | {stats['accuracy']:.3f} | {c['n']} / {c['median']} / "
        f"{c['p90']} | {w['n']} / {w['median']} / {w['p90']} |\n"
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
