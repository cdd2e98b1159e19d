"""DRO's hooks in the step loop: the reference model's worker and rubrics, R3 scoring with rubric
judging, the accepted-groups batch and the held-out R3 that picks the best checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlvr.algorithms import dro
from rlvr.algorithms.groups import group_rows
from rlvr.config import Config
from rlvr.generation.base import SamplingParams
from rlvr.methods.base import Method, ReferenceModel, StepServices, register
from rlvr.methods.dro.config import DroConfig, check_dro
from rlvr.methods.dro.rollouts import (
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
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import prompt_messages
from rlvr.training.batch import TrainBatch
from rlvr.training.rollouts import Rollouts
from rlvr.verifiers.rubric import JudgeRequest, RubricQuery, RubricSet, load_rubrics, save_rubrics

log = logging.getLogger(__name__)


def needs_reference_model(cfg: Config) -> bool:
    """Whether a DRO run needs the frozen reference model's worker (judge or R3 scorer)."""
    d = cfg.algorithm.dro
    return d.gates or d.scorer == "reference"


def rubric_cache_path(cfg: Config, model_dir: Path) -> Path:
    """`algorithm.dro.rubrics_path`, else a file keyed by task, reference model and judge: beside
    the training file for dataset tasks, in the rlvr cache for procedural ones."""

    d = cfg.algorithm.dro
    if d.rubrics_path:
        return Path(os.path.expanduser(d.rubrics_path))
    key = json.dumps(
        {
            "task": cfg.task.cache_key(),
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

    return prompt_messages(problem, instruction)[-1]["content"]


def ensure_rubrics(
    path: Path, problems: list[Problem], cfg: Config, reference: ReferenceModel
) -> dict[str, RubricSet]:
    """Rubric sets of `problems`: read from the cache, the missing ones written, validated and
    added to it by the reference model (arXiv:2506.13351, Sec. 4.1 and App. E: once per query,
    before training)."""

    cached = load_rubrics(path)
    missing = [p for p in problems if p.id not in cached]
    if missing:
        delimiter, instruction = cfg.algorithm.dro.delimiter, cfg.task.instruction
        log.info("writing rubrics for %d queries into %s", len(missing), path)
        built = reference.build_rubrics(
            [
                RubricQuery(query_text(p, instruction), reference_text(p, delimiter).strip())
                for p in missing
            ]
        )
        cached.update({p.id: r for p, r in zip(missing, built, strict=True)})
        save_rubrics(path, cached)
    return {p.id: cached[p.id] for p in problems}


@register("dro")
class Dro(Method):
    """DRO (arXiv:2506.13351): the reward of a CoT is the policy's R3 certainty of the reference
    answer after it (Eq. 2), read by default on the rollout weights before the weight sync (our
    choice: the paper leaves the scoring model ambiguous); groups that fail the rubric gates are
    dropped (Sec. 4.1); DRO's loss with the 80/20 entropy cut and k3 KL coefficient beta; best
    checkpoint by validation reward (App. F.2), here the held-out mean R3."""

    section = DroConfig
    single_turn = (
        "R3 scores the policy's certainty of the reference answer after one chain of thought"
    )
    best_metric = "eval_r3"
    policy_loss = "dro"
    overlaps_generation = False  # R3 may be read through the policy, which is training then

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.settings = cfg.algorithm.dro
        self.reference: ReferenceModel | None = None
        self.rubrics: dict[str, RubricSet] = {}
        self.tally = RejectionTally()
        self._scores: dict[str, dro.GroupScore] = {}
        self._stats: dict[str, Any] = {}

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        check_dro(cfg)

    def kl_coef(self) -> float:
        return self.settings.beta

    def loss_options(self) -> dict[str, Any]:
        return {"rho_ent": self.settings.rho_ent}

    def start(self, run: StepServices) -> None:
        """Start the reference model's worker, load (or write) the training queries' rubrics,
        and rebuild the rejection tally from the run's committed metrics on resume."""

        d = self.settings
        if needs_reference_model(self.cfg):
            self.reference = run.reference()
        if d.gates:
            path = rubric_cache_path(self.cfg, run.model_dir)
            self.rubrics = ensure_rubrics(path, run.train_problems, self.cfg, self.reference)
        self.tally = RejectionTally.from_history(run.history())
        self.tokenizer = run.tokenizer
        self.tokens = DroTokens.from_tokenizer(run.tokenizer, d.delimiter, d.separator)
        problems = run.train_problems + run.test_problems
        self.problems = {p.id: p for p in problems}
        self.references = {
            p.id: reference_ids(run.tokenizer, reference_text(p, d.delimiter)) for p in problems
        }

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

    def trainable(self, rollouts: Rollouts) -> Rollouts:
        """Every row: DRO's rewards are its own R3 scores, set group by group in `score` (the
        verifier only measures exact accuracy, unless `algorithm.dro.reward: verifier`), and its
        gates take whole groups out of the loss (single-turn, so no environment fails here)."""
        return rollouts

    def score(self, run: StepServices, rollouts: Rollouts, step: int) -> None:
        """Rewards, gate verdicts and advantages of every group; R3 scoring and rubric judging run
        at once, the exact verifier too when the task has gold answers (metrics only). The
        time_dro_* metrics are the seconds from the start of scoring until each part was in hand."""

        d = self.settings
        t0 = time.perf_counter()
        score_pending = judge_pending = None
        inputs = scoring_inputs(rollouts, self.references, self.tokens)
        if d.reward != "verifier":
            score_pending = run.score_logprobs(d.scorer, inputs.sequences, inputs.positions)
        rows: list[np.ndarray | None] = []
        if d.gates:
            rows, requests, where = self._judge_requests(rollouts, inputs.answers)
            if requests:
                judge_pending = self.reference.judge_answers(requests)
        verified = None
        if d.reward == "verifier" or all(rollouts.golds):
            verified = run.verify_texts(rollouts.texts, rollouts.golds)
        t_verify = time.perf_counter() - t0
        ref_logprobs = None if score_pending is None else score_pending.result(step)
        t_score = time.perf_counter() - t0
        failures = 0
        if judge_pending is not None:
            verdicts, failures = judge_pending.result(step)
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

    def shape(
        self, run: StepServices, rollouts: Rollouts, plan: dict[str, Any], step: int
    ) -> tuple[TrainBatch, dict[str, Any]]:
        """The step's training batch (accepted groups only) and its DRO metrics."""

        batch, stats = dro_batch(rollouts, self._scores, run.tokenizer.pad_token_id)
        stats.update(self._stats)
        return batch, stats

    def evaluate(
        self, run: StepServices, problems: list[Problem], params: SamplingParams, step: int
    ) -> dict[str, float]:
        """Held-out reference certainty after the policy's own CoTs, `group_size` rollouts per
        query drawn with the training sampler: mean Avg Prob per rollout, and mean R3 per group,
        the validation reward that picks the best checkpoint (arXiv:2506.13351, App. F.2)."""

        g = self.cfg.generation
        train_params = g.sampling_params(params.seed)
        rollouts = run.generate(
            problems, {p.id: g.group_size for p in problems}, train_params, step
        )
        inputs = scoring_inputs(rollouts, self.references, self.tokens)
        logps = run.score_logprobs(self.settings.scorer, inputs.sequences, inputs.positions).result(
            step
        )
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
