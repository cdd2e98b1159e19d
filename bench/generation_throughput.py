"""Generation throughput, vLLM vs transformers, on the same model and the same batch of prompts.

    .venv/bin/python bench/generation_throughput.py --model tiny|smollm2|PATH --batch 16 \
        --max-tokens 128 --repeats 3

Prints generated tokens/s per backend (median over repeats, after one untimed warm-up call each)
and the vLLM/HF ratio. Both engines live in this process (with torch's default thread count) and
the timed calls alternate (hf, vllm, hf, vllm, ...) so that both see the same machine load. On a
CPU shared with other busy processes, OMP_NUM_THREADS=1 can be an order of magnitude faster for
both backends than the default (OpenMP threads spin-wait for descheduled siblings).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers import AutoTokenizer  # noqa: E402

from rlvr.generation import make_backend  # noqa: E402
from rlvr.generation.base import GenerationBackend, GenerationRequest, SamplingParams  # noqa: E402
from rlvr.models import resolve_model_path  # noqa: E402

QUESTIONS = [
    "What is {a} + {b}? Put your final answer in \\boxed{{}}.",
    "Compute {a} - {b} step by step.",
    "A shop sells {a} apples in the morning and {b} in the afternoon. How many in total?",
    "Write a short sentence about the number {a}.",
]


def make_prompts(model_path: Path, batch: int) -> list[list[int]]:
    """`batch` distinct chat-formatted prompts (plain text when the tokenizer has no template)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = []
    for i in range(batch):
        text = QUESTIONS[i % len(QUESTIONS)].format(a=17 + 3 * i, b=5 + i)
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        prompts.append(list(ids))
    return prompts


def measure(
    backends: dict[str, GenerationBackend],
    prompts: list[list[int]],
    params: SamplingParams,
    repeats: int,
) -> dict[str, tuple[float, float, int]]:
    """Per backend: (median tokens/s, median seconds, tokens of the last repeat)."""
    requests = [GenerationRequest(p, request_id=str(i)) for i, p in enumerate(prompts)]
    for backend in backends.values():
        backend.generate(requests, params)  # warm-up: first-call allocations and compilation
    rates: dict[str, list[float]] = {name: [] for name in backends}
    seconds: dict[str, list[float]] = {name: [] for name in backends}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, backend in backends.items():
            start = time.perf_counter()
            results = backend.generate(requests, params)
            elapsed = time.perf_counter() - start
            tokens[name] = sum(len(s.token_ids) for r in results for s in r.samples)
            rates[name].append(tokens[name] / elapsed)
            seconds[name].append(elapsed)
    return {
        name: (statistics.median(rates[name]), statistics.median(seconds[name]), tokens[name])
        for name in backends
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or an HF directory")
    parser.add_argument("--batch", type=int, default=16, help="prompts per generate() call")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per response at most")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per backend")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (greedy) makes both backends produce the same tokens, so they do the same work",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM compile the model (slow start on CPU) instead of running eagerly",
    )
    args = parser.parse_args()

    model_path = resolve_model_path(args.model)
    prompts = make_prompts(model_path, args.batch)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    backends: dict[str, GenerationBackend] = {
        "hf": make_backend("hf", model_path, dtype=args.dtype)
    }
    start = time.perf_counter()
    backends["vllm"] = make_backend(
        "vllm",
        model_path,
        dtype=args.dtype,
        max_model_len=max(len(p) for p in prompts) + args.max_tokens + 1,
        kv_cache_gib=1.0,
        enforce_eager=not args.compile,
    )
    vllm_start = time.perf_counter() - start
    rows = measure(backends, prompts, params, args.repeats)
    for backend in backends.values():
        backend.close()

    print(
        f"model={model_path} batch={args.batch} max_tokens={args.max_tokens} "
        f"temperature={args.temperature} dtype={args.dtype} repeats={args.repeats} "
        f"vllm_start={vllm_start:.1f}s compile={args.compile}"
    )
    print(f"{'backend':<8} {'tokens/s':>10} {'seconds':>9} {'tokens':>8}")
    for name, (rate, seconds, tokens) in rows.items():
        print(f"{name:<8} {rate:>10.1f} {seconds:>9.2f} {tokens:>8}")
    print(f"ratio vllm/hf: {rows['vllm'][0] / rows['hf'][0]:.2f}x")


if __name__ == "__main__":
    main()
