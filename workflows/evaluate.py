"""`rlvr evaluate`: accuracy of any checkpoint on any dataset, in this process (no Ray).

n seeded samples per problem from the checkpoint (a run directory, a step checkpoint, an HF
directory or an adapter), each scored by the verifier: accuracy (the mean over all samples, the
unbiased pass@1), unbiased pass@k (Chen et al. 2021, arXiv:2107.03374, Eq. 1) for each k <= n,
mean response length and the share cut at max_tokens; per-item records as JSON lines and a PNG.
A run with an `env` section is evaluated with its tools or environment (multi-turn, the
environment's reward where it gives one, as in training) unless told not to.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlvr.algorithms.pass_at_k import pass_at_k
from rlvr.answers import extract_answer
from rlvr.config import Config, ConfigError
from rlvr.envs.rollout import (
    AGENT_FLAGS,
    ENVIRONMENT_STATUS,
    AgentRequest,
    Agents,
    EnvSettings,
    environment_reward,
)
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, GenerationResult, SamplingParams
from rlvr.run.metrics import agent_stats
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt
from rlvr.verifiers.factory import make_verifier
from workflows.checkpoints import resolve_checkpoint, run_config

log = logging.getLogger(__name__)

SEED_STRIDE = 10_007
"""Problem i samples from seed + SEED_STRIDE * i: its samples do not depend on the others."""


@dataclass(frozen=True)
class Sampling:
    """How each problem is sampled: n samples at (temperature, top_p), max_tokens each."""

    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError("need --n >= 1 and --max-tokens >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need --temperature >= 0 and 0 < --top-p <= 1")


def summarise(correct: list[list[bool]], lengths: list[list[int]], cut: list[list[bool]]) -> dict:
    """Accuracy, unbiased pass@k for k = 1, 2, 4, ... <= n, mean length and the truncated share,
    from per-problem lists of per-sample results."""
    n = len(correct[0])
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= n]
    return {
        "problems": len(correct),
        "samples_per_problem": n,
        "accuracy": float(np.mean([np.mean(c) for c in correct])),
        "pass_at_k": {
            str(k): float(np.mean([pass_at_k(n, sum(c), k) for c in correct])) for k in ks
        },
        "mean_length": float(np.mean([np.mean(x) for x in lengths])),
        "truncated_frac": float(np.mean([np.mean(x) for x in cut])),
    }


def evaluate(
    model_dir: Path,
    problems: list[Problem],
    sampling: Sampling,
    *,
    instruction: str,
    chat_template: bool,
    backend: str,
    backend_kwargs: dict[str, Any],
    verifier: dict[str, Any] | None = None,
    verifier_timeout_s: float = 5.0,
    env: EnvSettings | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, per-item records) of `model_dir` on `problems`, scored by the verifier that
    `make_verifier(**verifier)` builds (kind, function, rewards; default math); with `env`,
    multi-turn in that environment, whose own reward replaces the verifier's where it gives one."""
    engine = make_backend(backend, model_dir, **backend_kwargs)
    try:
        params = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_tokens)
        seeds = [sampling.seed + SEED_STRIDE * i for i in range(len(problems))]
        if env is not None:
            agents = [
                AgentRequest(p, sampling.n, seed, p.id)
                for p, seed in zip(problems, seeds, strict=True)
            ]
            max_model_len = backend_kwargs.get("max_model_len")
            results = Agents(env, engine.tokenizer).generate(engine, agents, params, max_model_len)
        else:
            results = engine.generate(
                [
                    GenerationRequest(
                        render_prompt(engine.tokenizer, p, instruction, chat_template),
                        sampling.n,
                        p.id,
                        seed,
                    )
                    for p, seed in zip(problems, seeds, strict=True)
                ],
                params,
            )
    finally:
        engine.close()
    verdicts = score(results, problems, sampling.n, verifier, verifier_timeout_s)
    items, correct, lengths, cut = [], [], [], []
    if env is not None:  # one result per trajectory: regroup them by problem
        n = sampling.n
        results = [
            GenerationResult(
                p.id,
                results[i * n].prompt_ids,
                [r.samples[0] for r in results[i * n : (i + 1) * n]],
            )
            for i, p in enumerate(problems)
        ]
    for i, (problem, result) in enumerate(zip(problems, results, strict=True)):
        mine = verdicts[i * sampling.n : (i + 1) * sampling.n]
        correct.append([v[0] >= 1.0 for v in mine])
        lengths.append([len(s.token_ids) for s in result.samples])
        cut.append([s.finish_reason == "length" for s in result.samples])
        items.append(
            {
                "id": problem.id,
                "gold": problem.answer,
                "correct": correct[-1],
                "samples": [
                    {
                        "text": s.text,
                        "answer": extract_answer(s.text),
                        "status": status,
                        "length": len(s.token_ids),
                        "finish_reason": s.finish_reason,
                    }
                    | ({AGENT_FLAGS: s.flags[AGENT_FLAGS]} if AGENT_FLAGS in s.flags else {})
                    for s, (_, status, *_) in zip(result.samples, mine, strict=True)
                ],
            }
        )
    summary = summarise(correct, lengths, cut)
    if env is not None:
        summary["agent"] = agent_stats([s.flags for r in results for s in r.samples])
    return summary, items


def score(
    results: list[GenerationResult],
    problems: list[Problem],
    n: int,
    verifier: dict[str, Any] | None,
    timeout_s: float,
) -> list[tuple]:
    """Each sample's verdict (reward, status, ...) in result order; a multi-turn environment's
    reward, where it gave one, replaces the verifier's (status "environment")."""
    samples = [s for r in results for s in r.samples]
    golds = [p.answer for p in problems for _ in range(n)]
    prompt_texts = [p.prompt for p in problems for _ in range(n)]
    metadata = [dict(p.metadata) for p in problems for _ in range(n)]
    with make_verifier(**(verifier or {}), timeout=timeout_s) as scorer:
        verdicts = scorer.verify_batch(
            [s.text for s in samples], golds, prompts=prompt_texts, metadata=metadata
        )
    for i, sample in enumerate(samples):
        reward = environment_reward(sample.flags)
        if reward is not None:
            verdicts[i] = (reward, ENVIRONMENT_STATUS, *verdicts[i][2:])
    return verdicts


def plot(summary: dict[str, Any], items: list[dict[str, Any]], out: Path) -> Path:
    """evaluation.png: pass@k against k, and the response lengths by correctness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ks = [int(k) for k in summary["pass_at_k"]]
    left.plot(ks, list(summary["pass_at_k"].values()), marker="o")
    left.set(xscale="log", xticks=ks, xticklabels=ks, ylim=(0, 1), xlabel="k", ylabel="pass@k")
    left.set_title(f"accuracy {summary['accuracy']:.3f} on {summary['problems']} problems")
    for ok, label in ((True, "correct"), (False, "wrong")):
        lens = [
            s["length"]
            for item in items
            for s, c in zip(item["samples"], item["correct"], strict=True)
            if c == ok
        ]
        if lens:
            right.hist(lens, bins=30, alpha=0.6, label=f"{label} ({len(lens)})")
    right.set(xlabel="response tokens", ylabel="samples")
    right.legend()
    fig.tight_layout()
    path = out / "evaluation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_evaluate(
    checkpoint: str,
    data: str | None = None,
    config: Config | str | None = None,
    out: str | None = None,
    backend: str = "vllm",
    use_env: bool = True,
    **sampling: Any,
) -> tuple[Path, dict[str, Any]]:
    """The `rlvr evaluate` command: resolve the checkpoint, the problems (`data`: a preset's
    held-out split or a dataset file; default the run's own held-out split), the config (`config`:
    a Config, a YAML file or preset; default the run's) and the sampling
    (max_tokens defaults to the run's); evaluate; write evaluation.json, items.jsonl and
    evaluation.png into `out` (default `<run>/eval-<checkpoint>`). Bad inputs: ConfigError."""
    from workflows.calibrate import load_cal_problems
    from workflows.train import prepare

    path = Path(checkpoint).expanduser()
    cfg, run_dir = run_config(path, config)
    base_dir, _, held_out = prepare(cfg)
    instruction, chat_template = cfg.task.instruction, cfg.task.chat_template
    try:
        if data is not None:
            problems, instruction, chat_template, _ = load_cal_problems(data)
        else:
            problems = held_out
        model_dir = resolve_checkpoint(path, base_dir, cfg)
        settings = Sampling(**({"max_tokens": cfg.generation.max_tokens} | sampling))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"invalid evaluation input: {err}") from None
    if not problems:
        raise ConfigError("invalid evaluation input: no problems to evaluate")
    g = cfg.generation
    kwargs: dict[str, Any] = {"dtype": cfg.engine_dtype}
    if backend == "vllm":
        kwargs |= {
            "max_model_len": g.max_model_len,
            "kv_cache_gib": g.kv_cache_gib,
            "enforce_eager": g.enforce_eager,
            "engine_loop": g.engine_loop,
        }
    env = None
    if use_env and cfg.env.multi_turn:
        env = cfg.env.settings(instruction, cfg.verifier.unsafe_hook_sandbox)
    log.info("evaluating %s on %d problems, %d samples each", model_dir, len(problems), settings.n)
    summary, items = evaluate(
        model_dir,
        problems,
        settings,
        instruction=instruction,
        chat_template=chat_template,
        backend=backend,
        backend_kwargs=kwargs,
        verifier=cfg.verifier.verifier_kwargs(),
        verifier_timeout_s=cfg.verifier.timeout_s,
        env=env,
    )
    summary |= {
        "checkpoint": checkpoint,
        "data": data or "the run's held-out split",
        "sampling": asdict(settings),
        "env": cfg.env.kind if env is not None else "none",
    }
    target = Path(out) if out else (run_dir or model_dir) / f"eval-{path.name}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "evaluation.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(target / "items.jsonl", "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
    plot(summary, items, target)
    return target, summary
