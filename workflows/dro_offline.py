"""DRO's offline passes, run once before training: the variance query filter and the rubric cache.

`rlvr filter --config X` samples G rollouts per training query from the reference model, scores the
reference answer after each CoT and keeps the queries with the highest top-10% token std (sbar)
plus the hard-case fill (DRO, arXiv:2506.13351, Sec. 4.2); it writes the scored table, the retained
dataset and a histogram. `rlvr rubrics --config X` writes and validates each query's rubrics
(Sec. 4.1, App. E) into the cache training reads. Both run in this process, without Ray.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr.algorithms import dro
from rlvr.algorithms.groups import group_rows
from rlvr.config import Config
from rlvr.files import atomic_write_text
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest
from rlvr.methods.dro.method import ensure_rubrics, rubric_cache_path
from rlvr.methods.dro.rollouts import (
    DroTokens,
    reference_ids,
    reference_text,
    scoring_inputs,
)
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt
from rlvr.training.rollouts import Rollouts
from workflows.components import generator_kwargs
from workflows.services import start_reference
from workflows.train import prepare

log = logging.getLogger(__name__)

FILTER_CHUNK = 64
"""Queries generated and scored together (bounds the memory of one pass)."""
FILTER_SEED_STRIDE = 10_007


def filter_out_dir(cfg: Config) -> Path:
    """Default output directory of `rlvr filter`: `<run.output_dir>/<run.name>-filter`."""
    return Path(cfg.run.output_dir).expanduser() / f"{cfg.run.name}-filter"


def score_queries(
    backend: Any, problems: list[Problem], cfg: Config
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sbar, mean certainty, all-token mean sigma) per query under the backend's model.

    G = `algorithm.dro.filter.group_size` rollouts per query with the training sampler, R3's
    scoring ids (the same slicing as training), and the filter statistic of each G x L matrix.
    """
    d, g = cfg.algorithm.dro, cfg.generation
    tokenizer = backend.tokenizer
    tokens = DroTokens.from_tokenizer(tokenizer, d.delimiter, d.separator)
    refs = {p.id: reference_ids(tokenizer, reference_text(p, d.delimiter)) for p in problems}
    params = g.sampling_params(cfg.run.seed)
    sbar, mean_prob, mean_sigma = [], [], []
    for start in range(0, len(problems), FILTER_CHUNK):
        chunk = problems[start : start + FILTER_CHUNK]
        requests = [
            GenerationRequest(
                render_prompt(tokenizer, p, cfg.task.instruction, cfg.task.chat_template),
                n=d.filter.group_size,
                request_id=p.id,
                seed=cfg.run.seed + FILTER_SEED_STRIDE * (start + i),
            )
            for i, p in enumerate(chunk)
        ]
        rollouts = Rollouts.from_results(
            backend.generate(requests, params), {p.id: p.answer for p in chunk}
        )
        inputs = scoring_inputs(rollouts, refs, tokens)
        logps = backend.score_logprobs(inputs.sequences, inputs.positions)
        for rows in group_rows(rollouts.group_ids).values():
            probs = np.exp(np.asarray([logps[i] for i in rows], dtype=np.float64))
            sbar.append(dro.filter_score(probs, d.filter.token_frac))
            mean_prob.append(float(probs.mean()))
            mean_sigma.append(dro.mean_token_std(probs))
        log.info("filter: scored %d / %d queries", start + len(chunk), len(problems))
    return np.asarray(sbar), np.asarray(mean_prob), np.asarray(mean_sigma)


def _reference_record(problem: Problem, delimiter: str) -> dict[str, str]:
    """A `load_reference_problems` row: the reference resolved, the gold answer kept if any."""
    record = {
        "id": problem.id,
        "prompt": problem.prompt,
        "reference": reference_text(problem, delimiter),
    }
    if problem.answer:
        record["answer"] = problem.answer
    if problem.solution:
        record["solution"] = problem.solution
    return record


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def plot_scores(sbar: np.ndarray, kept_by_score: np.ndarray, path: Path) -> None:
    """Histogram of sbar with the lowest score kept by the filter marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(sbar, bins=min(50, max(10, len(sbar) // 5)), color="tab:blue", alpha=0.8)
    if kept_by_score.size:
        ax.axvline(sbar[kept_by_score].min(), color="tab:red", ls="--", label="kept by sbar")
        ax.legend()
    ax.set_xlabel("sbar (mean of the top-10% token std across rollouts)")
    ax.set_ylabel("queries")
    ax.set_title(f"DRO query filter: {len(sbar)} queries")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_filter(cfg: Config, out: Path | None = None) -> dict[str, Any]:
    """Score every training query under the reference model and write, into `out`:
    scores.parquet (id, sbar, mean_prob, mean_sigma, kept_by), train.jsonl (the retained queries,
    loadable with task.name=reference_file), test.jsonl (the held-out split) and sbar_hist.png."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out) if out is not None else filter_out_dir(cfg)
    model_dir, train, test = prepare(cfg)
    engine = generator_kwargs(cfg, model_dir)
    name, path = engine.pop("backend"), engine.pop("model_path")
    torch.set_num_threads(engine.pop("threads"))
    backend = make_backend(name, path, **engine)
    try:
        sbar, mean_prob, mean_sigma = score_queries(backend, train, cfg)
    finally:
        backend.close()
    f = cfg.algorithm.dro.filter
    selection = dro.select_queries(sbar, mean_prob, f.query_frac, f.retention)
    kept_by = np.full(len(train), "", dtype=object)
    kept_by[selection.by_score] = "score"
    kept_by[selection.hard] = "hard"
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": [p.id for p in train],
            "sbar": sbar,
            "mean_prob": mean_prob,
            "mean_sigma": mean_sigma,
            "kept_by": kept_by.tolist(),
        }
    )
    pq.write_table(table, out / "scores.parquet")
    delimiter = cfg.algorithm.dro.delimiter
    _write_jsonl(
        out / "train.jsonl", [_reference_record(train[i], delimiter) for i in selection.kept]
    )
    _write_jsonl(out / "test.jsonl", [_reference_record(p, delimiter) for p in test])
    plot_scores(sbar, selection.by_score, out / "sbar_hist.png")
    summary = {
        "out": str(out),
        "queries": len(train),
        "kept": int(selection.kept.size),
        "kept_by_score": int(selection.by_score.size),
        "kept_hard": int(selection.hard.size),
        "zero_signal": int((sbar == 0).sum()),
        "sbar_mean": float(sbar.mean()),
        "sbar_cutoff": float(sbar[selection.by_score].min()) if selection.by_score.size else None,
        "train_with": [
            "task.name=reference_file",
            f"task.train_path={out / 'train.jsonl'}",
            f"task.test_path={out / 'test.jsonl'}",
        ],
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def run_rubrics(cfg: Config, out: Path | None = None) -> dict[str, Any]:
    """Write the training queries' rubrics into the cache training reads (or `out`); queries
    already cached are kept as they are."""
    model_dir, train, _ = prepare(cfg)
    path = Path(out) if out is not None else rubric_cache_path(cfg, model_dir)
    reference = start_reference(cfg, model_dir, None, use_actors=False)
    try:
        rubrics = ensure_rubrics(path, train, cfg, reference)
    finally:
        reference.close()
    gated = [r for r in rubrics.values() if not r.ungated]
    return {
        "path": str(path),
        "queries": len(rubrics),
        "ungated": len(rubrics) - len(gated),
        "items_mean": float(np.mean([len(r.items) for r in gated])) if gated else 0.0,
        "dropped_items": sum(r.dropped for r in rubrics.values()),
        "regenerated": sum(r.attempts > 1 for r in rubrics.values()),
        "rubrics_path_setting": f"algorithm.dro.rubrics_path={path}",
    }
