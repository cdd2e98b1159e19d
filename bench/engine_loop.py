"""vLLM's engine loop (request by request, continuous batching) against the lock-step batch path,
side by side on one engine: single-turn speed, and multi-turn rollouts whose tool takes time.

    .venv/bin/python bench/engine_loop.py --models tiny smollm2 --prompts 16 --n 4 \
        --max-tokens 128 --repeats 5 --turns 3 --turn-tokens 32 --tool-seconds 1.0

Single-turn: the same requests (prompts x n samples, seeded per request) through
`VLLMBackend.generate(loop="requests")` and `loop="batch"`, one untimed warm-up each, then the
timed calls alternate (requests, batch, batch, requests, ...) so both see the same machine load.
Reports median (and fastest) seconds, median tokens/s, the ratio requests / batch, and whether
both sampled the same tokens, log-probs and finish reasons (they must: the same requests reach
the engine in the same order).

Multi-turn: `--prompts` trajectories of `--turns` turns of at most `--turn-tokens` tokens whose
callback sleeps like a tool call (after turn t, trajectory i waits `--tool-seconds` x
(0.5 + ((i + t) mod 4) / 3), 0.5x to 1.5x) and then appends a fixed observation. `requests` is
`generate_trajectories` (each trajectory's next turn joins the running batch when its tool
answers); `lock-step` is the batch path round by round: one `generate(loop="batch")` of every
trajectory's turn, then all tools at once (in threads), the round waiting for the slowest. Both
sample every turn from the same seeds, so they do the same work. Writes the tables as markdown
and JSON under --out, with the machine's load averages before and after (the engines share
their cores with whatever else runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from generation_throughput import make_prompts  # noqa: E402  (bench/, the script's directory)
from transformers import AutoTokenizer  # noqa: E402

from rlvr.generation import make_backend  # noqa: E402
from rlvr.generation.base import GenerationRequest, SamplingParams  # noqa: E402
from rlvr.generation.trajectories import (  # noqa: E402
    Continue,
    Finish,
    Trajectory,
    TrajectoryResult,
    turn_seed,
)
from rlvr.generation.vllm_backend import VLLMBackend  # noqa: E402
from rlvr.models import resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OBSERVATION = "\nTool result: 42\n"


def timed_alternating(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, dict]:
    """Median seconds and tokens/s of each run, timed in ABBA order after one warm-up each."""
    for run in runs.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, int] = {}
    names = list(runs)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            tokens[name] = runs[name]()
            seconds[name].append(time.perf_counter() - start)
    return {
        name: {
            "seconds": statistics.median(seconds[name]),
            "min_seconds": min(seconds[name]),
            "tokens": tokens[name],
            "tokens_per_s": tokens[name] / statistics.median(seconds[name]),
            "all_seconds": seconds[name],
        }
        for name in runs
    }


def single_turn(engine: VLLMBackend, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    requests = [
        GenerationRequest(p, n=args.n, request_id=str(i), seed=1000 * i)
        for i, p in enumerate(prompts)
    ]
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    outputs = {}

    def run(loop: str) -> Callable[[], int]:
        def call() -> int:
            results = engine.generate(requests, params, loop=loop)
            outputs[loop] = [
                (s.token_ids, s.logprobs, s.finish_reason) for r in results for s in r.samples
            ]
            return sum(len(s.token_ids) for r in results for s in r.samples)

        return call

    rows = timed_alternating({"requests": run("requests"), "batch": run("batch")}, args.repeats)
    rows["same_samples"] = outputs["requests"] == outputs["batch"]
    return rows


class SlowTool:
    """Trajectory `index`'s turn callback: it waits like a tool call, then answers with a fixed
    observation. The call after turn t takes mean x (0.5 + ((index + t) mod 4) / 3): 0.5x to
    1.5x, a different share of trajectories slow at each turn, as tool latencies vary."""

    def __init__(self, index: int, mean: float, observation: list[int], turns: int) -> None:
        self.index = index
        self.mean = mean
        self.observation = observation
        self.turns = turns

    def seconds(self, turn: int) -> float:
        return self.mean * (0.5 + ((self.index + turn) % 4) / 3)

    def __call__(self, trajectory: TrajectoryResult) -> Continue | Finish:
        return self.answer(len(trajectory.turns))

    def answer(self, turns_done: int) -> Continue | Finish:
        time.sleep(self.seconds(turns_done - 1))
        return Finish() if turns_done >= self.turns else Continue(self.observation)


def lock_step(
    engine: VLLMBackend,
    trajectories: list[Trajectory],
    tools: list[SlowTool],
    params: SamplingParams,
) -> list[list[list[int]]]:
    """The batch path round by round: every trajectory's turn in one batch, then every tool at
    once, the next round after the slowest. Returns each trajectory's sampled ids per turn."""
    prompts = [list(t.prompt_ids) for t in trajectories]
    sampled: list[list[list[int]]] = [[] for _ in trajectories]
    with ThreadPoolExecutor(len(trajectories)) as threads:
        for turn in range(tools[0].turns):
            requests = [
                GenerationRequest(prompt, seed=turn_seed(t.seed, turn))
                for prompt, t in zip(prompts, trajectories, strict=True)
            ]
            results = engine.generate(requests, params, loop="batch")
            for i, result in enumerate(results):
                sampled[i].append(result.samples[0].token_ids)
            replies = list(threads.map(SlowTool.answer, tools, [turn + 1] * len(tools)))
            for i, reply in enumerate(replies):
                if isinstance(reply, Continue):
                    prompts[i] += sampled[i][-1] + list(reply.observation_ids)
    return sampled


def multi_turn(engine: VLLMBackend, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    observation = engine.tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    tools = [SlowTool(i, args.tool_seconds, observation, args.turns) for i in range(len(prompts))]
    trajectories = [
        Trajectory(p, seed=1000 * i, next_turn=tool)
        for i, (p, tool) in enumerate(zip(prompts, tools, strict=True))
    ]
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.turn_tokens
    )
    outputs = {}

    def requests() -> int:
        results = engine.generate_trajectories(trajectories, params)
        outputs["requests"] = [[t.sample.token_ids for t in r.turns] for r in results]
        return sum(r.model_tokens for r in results)

    def batch() -> int:
        outputs["lock-step"] = lock_step(engine, trajectories, tools, params)
        return sum(len(ids) for turns in outputs["lock-step"] for ids in turns)

    rows = timed_alternating({"requests": requests, "lock-step": batch}, args.repeats)
    same = [a == b for a, b in zip(outputs["requests"], outputs["lock-step"], strict=True)]
    rows["same_samples"] = sum(same) / len(same)
    # what the tools alone cost each path: the slowest trajectory's own calls, or every round's
    # slowest call
    turns = range(args.turns)
    rows["tool_s_requests"] = max(sum(tool.seconds(t) for t in turns) for tool in tools)
    rows["tool_s_lock_step"] = sum(max(tool.seconds(t) for tool in tools) for t in turns)
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"Engine loop vs batch path, {report['settings']}",
        f"load averages (1, 5, 15 min) before {report['load_before']}, "
        f"after {report.get('load_after')}",
        "",
        "| model | work | path | median s | min s | tokens | tokens/s | ratio to baseline "
        "| tool wait s | same samples |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model, parts in report["models"].items():
        for work, baseline in (("single-turn", "batch"), ("multi-turn + tool", "lock-step")):
            rows = parts[work]
            for path in ("requests", baseline):
                row = rows[path]
                ratio = row["tokens_per_s"] / rows[baseline]["tokens_per_s"]
                wait = rows.get("tool_s_" + path.replace("-", "_"))
                lines.append(
                    f"| {model} | {work} | {path} | {row['seconds']:.2f} | "
                    f"{row['min_seconds']:.2f} | {row['tokens']} | "
                    f"{row['tokens_per_s']:.1f} | {ratio:.2f}x | "
                    f"{'-' if wait is None else f'{wait:.2f}'} | {rows['same_samples']} |"
                )
    lines += [
        "",
        "tool wait: the seconds the simulated tools alone impose on a path (requests: the "
        "slowest trajectory's own calls; lock-step: every round's slowest call).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--prompts", type=int, default=16, help="prompts (trajectories)")
    parser.add_argument("--n", type=int, default=4, help="single-turn samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per turn at most")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per path")
    parser.add_argument("--turns", type=int, default=3, help="turns per multi-turn trajectory")
    parser.add_argument("--turn-tokens", type=int, default=32, help="tokens per turn at most")
    parser.add_argument(
        "--tool-seconds", type=float, default=1.0, help="mean seconds a simulated tool call takes"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "engine_loop")
    args = parser.parse_args()

    report: dict = {"settings": vars(args) | {"out": str(args.out)}, "models": {}}
    report["load_before"] = os.getloadavg()
    for model in args.models:
        path = resolve_model_path(model)
        prompts = make_prompts(path, args.prompts)
        observation = AutoTokenizer.from_pretrained(path)(OBSERVATION, add_special_tokens=False)
        turn = args.turn_tokens + len(observation["input_ids"])
        engine = make_backend(
            "vllm",
            path,
            dtype=args.dtype,
            max_model_len=max(len(p) for p in prompts) + max(args.max_tokens, args.turns * turn),
            kv_cache_gib=1.0,
            enforce_eager=not args.compile,
        )
        try:
            report["models"][model] = {
                "single-turn": single_turn(engine, prompts, args),
                "multi-turn + tool": multi_turn(engine, prompts, args),
            }
        finally:
            engine.close()
        print(markdown(report))
    report["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_loop.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "engine_loop.md").write_text(markdown(report))
    print(f"wrote {args.out / 'engine_loop.md'}")


if __name__ == "__main__":
    main()
