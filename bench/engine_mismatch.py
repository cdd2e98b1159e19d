"""Engine/trainer log-prob mismatch on a run config's own prompts, with and without the temperature.

    .venv/bin/python bench/engine_mismatch.py --config configs/smollm2-arith.yaml --prompts 16 --n 8
    .venv/bin/python bench/engine_mismatch.py --config configs/tiny.yaml --dtype bfloat16

Samples `--n` rollouts for each of `--prompts` training prompts with vLLM at the config's sampling
settings and weights dtype (`generation.dtype`), then recomputes the sampled tokens' log-probs
the trainer's way (`trainer_logprobs`, over the same weights in `model.dtype`) three times: at
the sampling temperature within its top-p nucleus (what the trainer's importance weight
compares), over the full tempered softmax (which adds the nucleus mass to the ratio) and at
temperature 1 (the raw logits). Prints, for each, the statistics of the trainer's engine
importance weight (`grpo.engine_is_weights`, with the tokens outside pi_old's nucleus at ratio 0):
rho = pi_old / mu (mean, max), the share of tokens past the importance cap, KL(mu || pi_old), the
share outside the nucleus, and the largest |log-prob difference| inside it; writes them as JSON
beside the table. ``--dtype`` sets both sides' weights dtype (``bfloat16``: the ratio at
identical bf16 weights, the run's own under a bf16 config).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import markdown_table, write_results
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr.config import load_config
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest
from rlvr.tasks.prompts import render_prompt
from rlvr.training.engine_mismatch import mismatch, results_batch, trainer_logprobs
from workflows.cluster import ray_env
from workflows.train import prepare

COLUMNS = (
    "engine_ratio_mean",
    "engine_ratio_max",
    "engine_capped_frac",
    "engine_kl",
    "engine_outside_frac",
    "max_abs_logp_diff",
)


def dtype_overrides(dtype: str | None) -> list[str]:
    """The `--set` overrides that give the engine and the trainer the weights dtype `dtype`
    (none: the config's)."""
    return [] if dtype is None else [f"model.dtype={dtype}", f"generation.dtype={dtype}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="weights dtype of both the engine and the trainer (default: the config's)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/engine_mismatch"))
    args = parser.parse_args()
    ray_env()
    cfg = load_config(args.config, [*args.overrides, *dtype_overrides(args.dtype)])
    model_dir, train_problems, _ = prepare(cfg)
    g = cfg.generation
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = train_problems[: args.prompts]
    requests = [
        GenerationRequest(render_prompt(tokenizer, p, cfg.task.instruction), n=args.n, seed=i)
        for i, p in enumerate(problems)
    ]
    engine = make_backend(
        "vllm",
        model_dir,
        dtype=cfg.engine_dtype,
        max_model_len=g.max_model_len,
        kv_cache_gib=g.kv_cache_gib,
        enforce_eager=True,
    )
    params = g.sampling_params(None)
    results = engine.generate(requests, params)
    engine.close()
    batch = results_batch(results, tokenizer.pad_token_id or 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=cfg.model.dtype).eval()
    rows = {}
    for label, temperature, top_p in (
        (
            f"trainer at T = {g.temperature:g}, top-p = {g.top_p:g} (sampling)",
            g.temperature,
            g.top_p,
        ),
        (f"trainer at T = {g.temperature:g}, full softmax", g.temperature, 1.0),
        ("trainer at T = 1 (raw logits)", 1.0, 1.0),
    ):
        logp, outside = trainer_logprobs(model, batch, temperature, top_p)
        rows[label] = mismatch(batch, logp, outside, cfg.training.engine_is_cap)
    title = (
        f"{cfg.model.path}: {len(problems)} prompts x {args.n} rollouts, T = {g.temperature:g}, "
        f"top-p = {g.top_p:g}, engine {cfg.engine_dtype} / trainer {cfg.model.dtype}, "
        f"{int(batch.response_mask.sum())} tokens, "
        f"cap C = {cfg.training.engine_is_cap:g}"
    )
    cells = [[label, *(f"{stats[c]:.6g}" for c in COLUMNS)] for label, stats in rows.items()]
    table = f"{title}\n\n" + markdown_table(["log-probs", *COLUMNS], cells)
    print(table)
    write_results(args.out, Path(args.config).stem, table, {"title": title, "rows": rows})


if __name__ == "__main__":
    main()
