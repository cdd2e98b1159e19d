"""Decode speed of vLLM's CPU attention with the KV range split (vLLM's default) and unsplit (what
`VLLMBackend` sets so a row's log-probs never depend on its batch neighbours, and M engines
sample exactly what one does).

    .venv/bin/python bench/split_kv.py --config configs/smollm2-arith.yaml --repeats 3

Each repeat starts one engine per setting in its own process (vLLM reads the variable at start),
alternating the order, warms it up with one batch, then times `generate` of `--prompts` training
prompts x `--n` samples at the config's sampling settings. Reports medians of tokens/s, the ratio
unsplit / split, and whether both settings sampled the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"split (vLLM default)": "1", "unsplit (VLLMBackend)": "0"}


def measure(config: str, overrides: list[str], prompts: int, n: int) -> dict:
    """One engine in this process: tokens/s of one timed batch after one warm-up batch."""
    from transformers import AutoTokenizer

    from rlvr.config import load_config
    from rlvr.generation import make_backend
    from rlvr.generation.base import GenerationRequest, SamplingParams
    from rlvr.tasks.prompts import render_prompt
    from workflows.cluster import ray_env
    from workflows.train import prepare

    ray_env()
    cfg = load_config(config, overrides)
    model_dir, problems, _ = prepare(cfg)
    g, tokenizer = cfg.generation, AutoTokenizer.from_pretrained(model_dir)
    requests = [
        GenerationRequest(render_prompt(tokenizer, p, cfg.task.instruction), n=n, seed=i)
        for i, p in enumerate(problems[:prompts])
    ]
    engine = make_backend(
        "vllm",
        model_dir,
        dtype=cfg.model.dtype,
        max_model_len=g.max_model_len,
        kv_cache_gib=g.kv_cache_gib,
        seed=cfg.run.seed,
        enforce_eager=g.enforce_eager,
    )
    params = SamplingParams(
        temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_tokens, seed=0
    )
    engine.generate(requests, params)
    t0 = time.perf_counter()
    results = engine.generate(requests, params)
    seconds = time.perf_counter() - t0
    tokens = [s.token_ids for r in results for s in r.samples]
    return {
        "seconds": seconds,
        "tokens": sum(len(t) for t in tokens),
        "tokens_per_s": sum(len(t) for t in tokens) / seconds,
        "token_ids": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-arith.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/out/split_kv"))
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.config, args.overrides, args.prompts, args.n)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.repeats):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            cmd = [sys.executable, __file__, "--one", "--config", args.config]
            cmd += [f"--set={s}" for s in args.overrides]
            cmd += ["--prompts", str(args.prompts), "--n", str(args.n)]
            env = {**os.environ, "VLLM_CPU_ATTN_SPLIT_KV": SETTINGS[name]}
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {r} {name}: {runs[name][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    split, unsplit = (runs[name] for name in SETTINGS)
    same = all(a["token_ids"] == b["token_ids"] for a, b in zip(split, unsplit, strict=True))
    rows = {
        name: {
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in xs),
            "seconds": statistics.median(x["seconds"] for x in xs),
            "tokens": xs[0]["tokens"],
        }
        for name, xs in runs.items()
    }
    names = list(SETTINGS)
    ratio = rows[names[1]]["tokens_per_s"] / rows[names[0]]["tokens_per_s"]
    lines = [
        f"{args.config}, {args.prompts} prompts x {args.n} samples, medians of {args.repeats} "
        f"alternating repeats; same sampled tokens in both settings: {same}.",
        "",
        "| VLLM_CPU_ATTN_SPLIT_KV | tokens | seconds | tokens/s |",
        "|---|---|---|---|",
        *(
            f"| {name} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} |"
            for name, r in rows.items()
        ),
        "",
        f"unsplit / split throughput: {ratio:.3f}",
    ]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = Path(args.config).stem
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"rows": rows, "same_tokens": same}))


if __name__ == "__main__":
    main()
