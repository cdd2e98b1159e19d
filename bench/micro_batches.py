"""Training step time with row micro-batches against token-budget micro-batches
(`training.micro_batch_tokens`), each with and without the LM head at loss tokens only
(`training.lm_head_chunk`) and with and without shared-prefix packing (`training.shared_prefix`),
side by side in one process on one rollout batch.

    .venv/bin/python bench/micro_batches.py --config configs/smollm2-arith.yaml \
        --rollouts runs/smollm2-arith/rollouts.jsonl --budgets 1024 2048 --repeats 3

The batch is one step's rollouts: ``--rollouts`` (a run's rollouts.jsonl: its first step's
responses, re-tokenised, each after its own prompt) or, without it, response lengths drawn
uniformly from 1..max_tokens (seeded). Every setting gets its own PolicyTrainer from the same
seed; the repeats alternate the settings' order and each times one `train_step` of the same
batch. Reports medians of seconds per step, the padded tokens the forwards ran (rows x longest
row, or packs x longest pack, summed over micro-batches) against the real ones, the micro-batch
count, the largest micro-batch's padded tokens, and the fp32 logits held at once: the largest
micro-batch's over every position, with the chunked head one chunk's, with packing alone the
largest micro-batch's loss tokens (what bounds a step's peak memory; the trainers share one
process, whose resident size says nothing per setting). `--only` keeps the named settings (full
fine-tuning holds an optimizer per setting); `--profile` adds one torch.profiler step per setting:
self CPU seconds by kind of op, and each setting's costliest ops in a text file beside the table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "out" / "micro_batches"


def rollout_batch(cfg, tokenizer, problems, rollouts: Path | None, seed: int):
    """Prompt and response token ids of one step: ``prompts_per_step x group_size`` rows."""
    from rlvr.tasks.prompts import render_prompt

    g = cfg.generation
    rows = g.prompts_per_step * g.group_size
    by_id = {p.id: p for p in problems}
    if rollouts is not None:
        records = [json.loads(line) for line in rollouts.read_text().splitlines()]
        first = [r for r in records if r["step"] == records[0]["step"]][:rows]
        prompts = [
            render_prompt(tokenizer, by_id[r["prompt_id"]], cfg.task.instruction) for r in first
        ]
        responses = [
            tokenizer(r["response"], add_special_tokens=False)["input_ids"][: g.max_tokens]
            for r in first
        ]
        return prompts, [resp or [tokenizer.eos_token_id] for resp in responses]
    rng = random.Random(seed)
    chosen = [problems[i // g.group_size] for i in range(rows)]
    prompts = [render_prompt(tokenizer, p, cfg.task.instruction) for p in chosen]
    responses = [
        [rng.randrange(100, tokenizer.vocab_size) for _ in range(rng.randint(1, g.max_tokens))]
        for _ in range(rows)
    ]
    return prompts, responses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-arith.yaml")
    parser.add_argument("--rollouts", type=Path, default=None)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--head-chunk",
        type=int,
        default=1024,
        help="also each setting with training.lm_head_chunk at this size (0: not)",
    )
    parser.add_argument(
        "--shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also each setting with training.shared_prefix",
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="run only these settings (names as in the table)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one step of each setting (torch.profiler; op tables to files)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from rlvr.config import load_config
    from rlvr.training.batch import build_batch
    from rlvr.training.policy_trainer import PolicyTrainer
    from rlvr.training.shared_prefix import packed_length, prompt_groups
    from workflows.cluster import ray_env
    from workflows.components import trainer_settings
    from workflows.train import prepare

    ray_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    model_dir, problems, _ = prepare(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, responses = rollout_batch(cfg, tokenizer, problems, args.rollouts, cfg.run.seed)
    batch = build_batch(prompts, responses, tokenizer.pad_token_id or tokenizer.eos_token_id)
    gen = torch.Generator().manual_seed(cfg.run.seed)
    batch.advantages = torch.randn(len(batch), generator=gen)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    real = sum(lengths)

    t, lora = cfg.training, cfg.model.lora
    # the run's trainer, each setting below switching on what it measures
    base = replace(
        trainer_settings(cfg),
        micro_batch_tokens=0,
        lm_head_chunk=0,
        shared_prefix=False,
        gradient_checkpointing=False,
    )
    rows = f"rows ({t.micro_batch_size} per micro-batch)"
    settings = {rows: {"micro_batch_tokens": 0}}
    settings.update({f"tokens (budget {b})": {"micro_batch_tokens": b} for b in args.budgets})
    if args.head_chunk:
        head = {"lm_head_chunk": args.head_chunk}
        chunked = {f"{name} + head at loss tokens": {**kw, **head} for name, kw in settings.items()}
        settings.update(chunked)
    if args.shared_prefix:
        packed = {
            f"{name} + shared prefix": {**kw, "shared_prefix": True}
            for name, kw in settings.items()
        }
        settings.update(packed)
    if args.only:
        unknown = sorted(set(args.only) - set(settings))
        if unknown:
            parser.error(f"--only: no setting named {unknown}; the settings are {list(settings)}")
        settings = {name: settings[name] for name in args.only}
    trainers = {name: PolicyTrainer(model_dir, base, **extra) for name, extra in settings.items()}
    names = list(trainers)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # one warm-up step each (first-call allocations, thread pools)
        trainers[name].train_step(batch)
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            start = time.perf_counter()
            trainers[name].train_step(batch)
            seconds[name].append(time.perf_counter() - start)
            print(f"repeat {repeat} {name}: {seconds[name][-1]:.2f} s", flush=True)

    lines = [
        f"{len(batch)} rows, {real} real tokens (prompt + response), "
        f"{'rollouts ' + str(args.rollouts) if args.rollouts else 'synthetic response lengths'}; "
        f"medians of {args.repeats} alternating steps after one warm-up each",
        "",
        "| micro-batches | count | tokens run | run / real | largest (tokens) | "
        "logits held MiB | s/step | x rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base_s = statistics.median(seconds[names[0]])
    vocab = trainers[names[0]].engine.module.get_output_embeddings().weight.shape[0]
    for name in names:
        plan = trainers[name]._micro_batches(batch)
        if settings[name].get("shared_prefix"):
            packs = [
                [packed_length(mb, g) for g in prompt_groups(mb)] for mb in map(batch.rows, plan)
            ]
        else:
            packs = [[lengths[r] for r in rows] for rows in plan]
        sizes = [len(p) * max(p) for p in packs]
        chunk = settings[name].get("lm_head_chunk", 0)
        if chunk:
            held = min(chunk, batch.num_loss_tokens)
        elif settings[name].get("shared_prefix"):  # the head runs at loss tokens, in one chunk
            held = max(batch.rows(rows).num_loss_tokens for rows in plan)
        else:
            held = max(sizes)
        s = statistics.median(seconds[name])
        lines.append(
            f"| {name} | {len(plan)} | {sum(sizes)} | {sum(sizes) / real:.2f} | "
            f"{max(sizes)} | {held * vocab * 4 / 2**20:.0f} | {s:.2f} | {base_s / s:.2f} |"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    kind = "lora" if lora.enabled else "full"
    stem = f"{Path(args.config).stem}-{kind}"
    if args.profile:
        lines += ["", *profile_table(trainers, batch, OUT / f"{stem}-profile")]
    table = "\n".join(lines)
    print(table)
    (OUT / f"{stem}.md").write_text(table + "\n")


OP_KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention", ("scaled_dot_product", "aten::_softmax", "aten::softmax")),
    ("log-softmax / logsumexp", ("log_softmax", "logsumexp", "aten::gather", "aten::exp")),
    ("optimizer", ("adam", "_foreach", "aten::addcdiv", "aten::addcmul", "aten::lerp")),
    ("copies", ("aten::copy_", "aten::to", "aten::clone", "aten::cat", "aten::contiguous")),
    ("communication", ("gloo", "c10d", "all_reduce", "reduce_scatter", "allgather")),
    ("elementwise", ("aten::mul", "aten::add", "aten::silu", "aten::rsqrt", "aten::pow")),
)


def op_kind(name: str) -> str:
    """Which kind of work a profiler op is (its first matching pattern), else "other"."""
    low = name.lower()
    for kind, patterns in OP_KINDS:
        if any(p.lower() in low for p in patterns):
            return kind
    return "other"


def profile_table(trainers: dict, batch, stem: Path) -> list[str]:
    """One profiled `train_step` per setting: self CPU seconds by kind of op (a table), and the
    25 costliest ops of each setting in `stem`-N.txt."""
    from torch.profiler import ProfilerActivity, profile

    kinds = [k for k, _ in OP_KINDS] + ["other"]
    lines = [
        "Self CPU seconds of one profiled step, by kind of op:",
        "",
        "| setting | " + " | ".join(kinds) + " | total |",
        "|---|" + "---|" * (len(kinds) + 1),
    ]
    for i, (name, trainer) in enumerate(trainers.items()):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(batch)
        averages = prof.key_averages()
        by_kind = dict.fromkeys(kinds, 0.0)
        for event in averages:
            by_kind[op_kind(event.key)] += event.self_cpu_time_total / 1e6
        table = averages.table(sort_by="self_cpu_time_total", row_limit=25)
        Path(f"{stem}-{i}.txt").write_text(f"{name}\n{table}\n")
        cells = " | ".join(f"{by_kind[k]:.2f}" for k in kinds)
        lines.append(f"| {name} | {cells} | {sum(by_kind.values()):.2f} |")
    return lines


if __name__ == "__main__":
    main()
