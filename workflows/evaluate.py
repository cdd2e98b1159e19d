"""`rlvr evaluate`: accuracy of any checkpoint on any dataset, in this process (no Ray).

n seeded samples per problem from the checkpoint (a run directory, a step checkpoint, an HF
directory or an adapter), each scored by the verifier: accuracy (the mean over all samples, the
unbiased pass@1), unbiased pass@k (Chen et al. 2021, arXiv:2107.03374, Eq. 1) for each k <= n,
mean response length and the share cut at max_tokens; per-item records as JSON lines and a PNG.
A run with an `env` section is evaluated with its tools or environment (multi-turn, the
environment's reward where it gives one, as in training) unless told not to. As in training, a
trajectory that failed on the environment's side has an uncomputed reward: it counts in neither
accuracy nor pass@k, and the summary counts it by status.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlvr.algorithms.pass_at_k import pass_at_k
from rlvr.answers import extract_answer
from rlvr.config import Config, ConfigError
from rlvr.envs.rollout import (
    AGENT_FLAGS,
    AgentRequest,
    Agents,
    EnvSettings,
    trajectory_verdicts,
)
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, GenerationResult, SamplingParams
from rlvr.run.metrics import agent_stats
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt
from rlvr.training.rollouts import UNCOMPUTED
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


def summarise(
    correct: list[list[bool | None]], lengths: list[list[int]], cut: list[list[bool]]
) -> dict:
    """Accuracy, unbiased pass@k for k = 1, 2, 4, ... <= n, mean length and the truncated share,
    from per-problem lists of per-sample results. A None in `correct` is an uncomputed reward:
    accuracy and pass@k take each problem's scored samples (pass@k those with at least k of
    them, the estimator's n >= k) and leave out a problem with none; length and truncation
    count every sample."""
    n = len(correct[0])
    scored = [[c for c in cs if c is not None] for cs in correct]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= n]
    return {
        "problems": len(correct),
        "problems_scored": sum(1 for c in scored if c),
        "samples_per_problem": n,
        "accuracy": _mean([float(np.mean(c)) for c in scored if c]),
        "pass_at_k": {
            str(k): _mean([pass_at_k(len(c), sum(c), k) for c in scored if len(c) >= k]) for k in ks
        },
        "mean_length": float(np.mean([np.mean(x) for x in lengths])),
        "truncated_frac": float(np.mean([np.mean(x) for x in cut])),
    }


def _mean(values: list[float]) -> float | None:
    """The mean, None when nothing was scored."""
    return float(np.mean(values)) if values else None


def collect(
    problems: list[Problem], results: list[GenerationResult], verdicts: list[tuple]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, per-item records) from each problem's result (its samples in order) and every
    sample's verdict (reward, status, ...) in the same order. A verdict whose status is
    uncomputed (`UNCOMPUTED`) is neither right nor wrong (None in the record's `correct`); the
    summary counts them, `uncomputed_by_status` by status."""
    items, correct, lengths, cut = [], [], [], []
    start = 0
    for problem, result in zip(problems, results, strict=True):
        mine = verdicts[start : start + len(result.samples)]
        start += len(result.samples)
        correct.append([None if v[1] in UNCOMPUTED else v[0] >= 1.0 for v in mine])
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
    if start != len(verdicts):
        raise ValueError(f"{len(verdicts)} verdicts for {start} samples")
    uncomputed = Counter(v[1] for v in verdicts if v[1] in UNCOMPUTED)
    summary = summarise(correct, lengths, cut)
    summary |= {"uncomputed": sum(uncomputed.values()), "uncomputed_by_status": dict(uncomputed)}
    return summary, items


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
    summary, items = collect(problems, results, verdicts)
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
    reward, where it gave one, replaces the verifier's (status "environment"). A trajectory that
    failed on the environment's side is not verified (its last message is no answer): its
    verdict is (0.0, its end reason), an uncomputed reward, as in training."""
    samples = [s for r in results for s in r.samples]
    golds = [p.answer for p in problems for _ in range(n)]
    prompt_texts = [p.prompt for p in problems for _ in range(n)]
    metadata = [dict(p.metadata) for p in problems for _ in range(n)]

    def verify_rows(rows: list[int]) -> list[tuple]:
        with make_verifier(**(verifier or {}), timeout=timeout_s) as scorer:
            return scorer.verify_batch(
                [samples[i].text for i in rows],
                [golds[i] for i in rows],
                prompts=[prompt_texts[i] for i in rows],
                metadata=[metadata[i] for i in rows],
            )

    return trajectory_verdicts([s.flags for s in samples], verify_rows)


def plot(summary: dict[str, Any], items: list[dict[str, Any]], out: Path) -> Path:
    """evaluation.png: pass@k against k, and the response lengths by correctness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    scored = {int(k): v for k, v in summary["pass_at_k"].items() if v is not None}
    ks = list(scored) or [1]
    left.plot(list(scored), list(scored.values()), marker="o")
    left.set(xscale="log", xticks=ks, xticklabels=ks, ylim=(0, 1), xlabel="k", ylabel="pass@k")
    accuracy = "n/a" if summary["accuracy"] is None else f"{summary['accuracy']:.3f}"
    left.set_title(f"accuracy {accuracy} on {summary['problems_scored']} scored problems")
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
    if right.get_legend_handles_labels()[0]:
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
