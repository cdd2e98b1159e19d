"""DRO's phases of a training step over the actors: score (R3 and rubric judging at once), shape,
and the held-out reference certainty.

`workflows.train.Trainer` hands its score, shape and evaluate phases to a `DroStep` when
`algorithm.dro.enabled`. Scoring reads the reference log-probs on the weights that generated the
rollouts, before the weight sync (`dro.md` section 3); the frozen reference model judges the final
answers in the ReferenceActor meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from actors.controller import NAMESPACE
from actors.reference import ReferenceActor
from rlvr.algorithms import dro
from rlvr.algorithms.groups import group_rows
from rlvr.config import Config
from rlvr.dro_rollouts import (
    DroTokens,
    RejectionTally,
    dro_batch,
    reference_ids,
    reference_text,
    score_groups,
    scoring_inputs,
    step_metrics,
)
from rlvr.models import cache_dir
from rlvr.rollouts import Rollouts
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import prompt_messages
from rlvr.training.batch import TrainBatch
from rlvr.verifiers.rubric import JudgeRequest, RubricQuery, RubricSet, load_rubrics, save_rubrics
from workflows.components import Components, generator_kwargs, torch_threads
from workflows.workers import Worker

log = logging.getLogger(__name__)


def needs_reference_actor(cfg: Config) -> bool:
    """Whether the run needs the frozen reference model's actor (judge or R3 scorer)."""
    d = cfg.algorithm.dro
    return d.gates or d.scorer == "reference"


def reference_actor_kwargs(cfg: Config, model_dir: Path) -> dict[str, Any]:
    """ReferenceActor settings: the keyword judge alone, or the initial checkpoint on the
    configured generation backend (same engine settings as the GeneratorActor)."""
    d = cfg.algorithm.dro
    kw: dict[str, Any] = {
        "judge": d.judge,
        "threads": torch_threads(cfg),
        "max_tokens": d.judge_max_tokens,
        "max_model_len": cfg.generation.max_model_len,
        "seed": cfg.run.seed,
    }
    if d.judge == "reference":
        engine = generator_kwargs(cfg, model_dir)
        for key in ("max_model_len", "seed", "threads"):
            engine.pop(key, None)
        kw.update(engine)
    return kw


def start_reference(
    cfg: Config, model_dir: Path, comps: Components | None, use_actors: bool
) -> Worker:
    """The ReferenceActor (a Ray actor, or in this process); its shutdown joins `comps`'."""
    kwargs = reference_actor_kwargs(cfg, model_dir)
    if not use_actors:
        actor = ReferenceActor(**kwargs)
        if comps is not None:
            comps._cleanup.append(actor.close)
        return Worker(actor, "ReferenceActor")
    handle = (
        ray.remote(ReferenceActor)
        .options(name=f"rlvr-reference-{cfg.run.name}", namespace=NAMESPACE, num_cpus=0)
        .remote(**kwargs)
    )
    if comps is not None:
        comps._cleanup.append(lambda: ray.kill(handle, no_restart=True))
    worker = Worker(handle, "ReferenceActor")
    worker.run("ready")
    return worker


def rubric_cache_path(cfg: Config, model_dir: Path) -> Path:
    """`algorithm.dro.rubrics_path`, else a file keyed by task, reference model and judge: beside
    the training file for dataset tasks, in the rlvr cache for procedural ones."""
    d = cfg.algorithm.dro
    if d.rubrics_path:
        return Path(os.path.expanduser(d.rubrics_path))
    key = json.dumps(
        {
            "task": cfg.task.model_dump(mode="json"),
            "model": str(Path(model_dir).resolve()),
            "judge": d.judge,
            "delimiter": d.delimiter,
        },
        sort_keys=True,
    )
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    if cfg.task.train_path:
        # cached with the dataset file
        train = Path(os.path.expanduser(cfg.task.train_path))
        return train.with_name(f"{train.stem}.rubrics-{digest}.json")
    return cache_dir() / "dro" / f"rubrics-{digest}.json"


def query_text(problem: Problem, instruction: str) -> str:
    """The query with its task description, as the policy sees it (the judge's input)."""
    return prompt_messages(problem, instruction)[0]["content"]


def ensure_rubrics(
    path: Path, problems: list[Problem], cfg: Config, reference: Worker
) -> dict[str, RubricSet]:
    """Rubric sets of `problems`: read from the cache, the missing ones written, validated and
    added to it by the reference model (`dro.md` 2.4, offline and once per query)."""
    cached = load_rubrics(path)
    missing = [p for p in problems if p.id not in cached]
    if missing:
        delimiter, instruction = cfg.algorithm.dro.delimiter, cfg.task.instruction
        log.info("writing rubrics for %d queries into %s", len(missing), path)
        built = reference.run(
            "build_rubrics",
            [
                RubricQuery(query_text(p, instruction), reference_text(p, delimiter).strip())
                for p in missing
            ],
        )
        cached.update({p.id: r for p, r in zip(missing, built, strict=True)})
        save_rubrics(path, cached)
    return {p.id: cached[p.id] for p in problems}


class DroStep:
    """The DRO score / shape / evaluate phases of `workflows.train.Trainer`."""

    def __init__(
        self,
        cfg: Config,
        comps: Components,
        tokenizer: Any,
        problems: list[Problem],
        reference: Worker | None = None,
        rubrics: dict[str, RubricSet] | None = None,
        tally: RejectionTally | None = None,
    ) -> None:
        d = cfg.algorithm.dro
        self.cfg, self.settings, self.comps = cfg, d, comps
        self.tokenizer = tokenizer
        self.reference = reference
        self.rubrics = rubrics or {}
        if needs_reference_actor(cfg) and reference is None:
            raise ValueError("rubric gates and scorer='reference' need the ReferenceActor")
        self.tally = tally or RejectionTally()
        self.tokens = DroTokens.from_tokenizer(tokenizer, d.delimiter, d.separator)
        self.problems = {p.id: p for p in problems}
        self.references = {
            p.id: reference_ids(tokenizer, reference_text(p, d.delimiter)) for p in problems
        }
        self.scorer = {
            "generator": comps.generator,
            "trainer": comps.policy,
            "reference": reference,
        }[d.scorer]
        self._scores: dict[str, dro.GroupScore] = {}
        self._stats: dict[str, Any] = {}

    @classmethod
    def start(
        cls,
        cfg: Config,
        model_dir: Path,
        comps: Components,
        tokenizer: Any,
        train_problems: list[Problem],
        test_problems: list[Problem],
        use_actors: bool = True,
        history: list[dict[str, Any]] | None = None,
    ) -> DroStep:
        """Start the reference model's actor, load (or write) the training queries' rubrics, and
        rebuild the rejection tally from the run's committed metrics (`history`) on resume."""
        reference = (
            start_reference(cfg, model_dir, comps, use_actors)
            if needs_reference_actor(cfg)
            else None
        )
        rubrics = None
        if cfg.algorithm.dro.gates:
            path = rubric_cache_path(cfg, model_dir)
            rubrics = ensure_rubrics(path, train_problems, cfg, reference)
        return cls(
            cfg,
            comps,
            tokenizer,
            train_problems + test_problems,
            reference=reference,
            rubrics=rubrics,
            tally=RejectionTally.from_history(history or []),
        )

    def _judge_requests(
        self, rollouts: Rollouts, answers: list[list[int] | None]
    ) -> tuple[list[np.ndarray | None], list[JudgeRequest], list[int]]:
        """Verdict rows known without a judge (no final answer: all "No"; ungated: empty), and the
        requests for the rest with their row indices."""
        rows: list[np.ndarray | None] = []
        requests, where = [], []
        instruction = self.cfg.task.instruction
        for i, (gid, answer) in enumerate(zip(rollouts.group_ids, answers, strict=True)):
            items = self.rubrics[gid].items
            if answer is None or not items:
                rows.append(np.zeros(len(items), dtype=bool))
                continue
            rows.append(None)
            where.append(i)
            text = self.tokenizer.decode(answer, skip_special_tokens=True).strip()
            requests.append(JudgeRequest(query_text(self.problems[gid], instruction), text, items))
        return rows, requests, where

    def score(self, rollouts: Rollouts, step: int | None = None) -> None:
        """Rewards, gate verdicts and advantages of every group; R3 scoring and rubric judging run
        at once, the exact verifier too when the task has gold answers (metrics only). The
        time_dro_* metrics are the seconds from the start of scoring until each part was in hand."""
        d = self.settings
        t0 = time.perf_counter()
        score_future = judge_future = None
        inputs = scoring_inputs(rollouts, self.references, self.tokens)
        if d.reward != "verifier":
            score_future = self.scorer.call("score_logprobs", inputs.sequences, inputs.positions)
        rows: list[np.ndarray | None] = []
        if d.gates:
            rows, requests, where = self._judge_requests(rollouts, inputs.answers)
            if requests:
                judge_future = self.reference.call("judge_answers", requests)
        verified = None
        if d.reward == "verifier" or all(rollouts.golds):
            verified = self.comps.verifier.score(rollouts.texts, rollouts.golds)
        t_verify = time.perf_counter() - t0
        ref_logprobs = None
        if score_future is not None:
            ref_logprobs = self.scorer.get(score_future, step)
        t_score = time.perf_counter() - t0
        failures = 0
        if judge_future is not None:
            verdicts, failures = self.reference.get(judge_future, step)
            for i, verdict in zip(where, verdicts, strict=True):
                rows[i] = verdict
        t_judge = time.perf_counter() - t0
        exact = None if verified is None else np.array([r for r, _ in verified], dtype=np.float64)
        self._scores = score_groups(
            rollouts,
            d,
            ref_logprobs=ref_logprobs,
            judgments=rows if d.gates else None,
            rewards=exact,
        )
        ungated = sum(
            not self.rubrics[g].items for g in dict.fromkeys(rollouts.group_ids) if d.gates
        )
        self._stats = step_metrics(self._scores, self.tally, failures, ungated)
        rollouts.rewards = np.zeros(len(rollouts))
        for gid, idx in group_rows(rollouts.group_ids).items():
            rollouts.rewards[idx] = self._scores[gid].rewards
        if exact is not None:
            rollouts.statuses = [s for _, s in verified]
            self._stats.update(_accuracy_stats(rollouts.rewards, exact))
        self._stats.update(time_dro_verify=t_verify, time_dro_score=t_score, time_dro_judge=t_judge)

    def shape(self, rollouts: Rollouts) -> tuple[TrainBatch, dict[str, Any]]:
        """The step's training batch (accepted groups only) and its DRO metrics."""
        batch, stats = dro_batch(rollouts, self._scores, self.tokenizer.pad_token_id)
        stats.update(self._stats)
        return batch, stats

    def evaluate(self, rollouts: Rollouts) -> dict[str, float]:
        """Held-out reference certainty after the policy's own CoTs, a group of rollouts per
        query: mean Avg Prob per rollout, and mean R3 per group, the validation reward that
        picks the best checkpoint (arXiv:2506.13351, App. F.2)."""
        inputs = scoring_inputs(rollouts, self.references, self.tokens)
        logps = self.scorer.run("score_logprobs", inputs.sequences, inputs.positions)
        d = self.settings
        r3 = [
            dro.r3_rewards(
                np.exp(np.asarray([logps[i] for i in rows])), d.omega, d.clip_low, d.clip_high
            ).mean()
            for rows in group_rows(rollouts.group_ids).values()
        ]
        return {
            "eval_ref_prob": float(np.mean([np.exp(row).mean() for row in logps])),
            "eval_r3": float(np.mean(r3)),
        }


def _accuracy_stats(rewards: np.ndarray, correct: np.ndarray) -> dict[str, float]:
    """Exact accuracy of the step's rollouts and its correlation with the DRO reward."""
    corr = float("nan")
    if rewards.std() > 0 and correct.std() > 0:
        corr = float(np.corrcoef(rewards, correct)[0, 1])
    return {"dro_exact_accuracy": float(correct.mean()), "dro_reward_accuracy_corr": corr}
