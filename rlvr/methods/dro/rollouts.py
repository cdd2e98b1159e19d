"""DRO over one step's rollouts: R3 scoring inputs, group rewards and gates, the training batch.

The pure steps between the actors' calls in a DRO step (arXiv:2506.13351): build each rollout's
teacher-forcing ids `q + c + d + y` and its final answer for the judge, turn the scorer's
reference log-probs and the judge's verdicts into per-group rewards, gates and advantages, and
pack the accepted groups into a `TrainBatch`; plus the step's DRO metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlvr.algorithms import dro
from rlvr.algorithms.groups import group_rows
from rlvr.tasks.base import Problem
from rlvr.training.batch import TrainBatch, build_batch
from rlvr.training.rollouts import Rollouts


def reference_text(problem: Problem, delimiter: str) -> str:
    """The reference answer teacher-forced after a CoT: `problem.reference`, else the tail of
    `problem.solution` after its last `delimiter` (e.g. " \\boxed{7}." after "The answer is")."""
    if problem.reference:
        return problem.reference
    if delimiter and delimiter in problem.solution:
        tail = problem.solution.rsplit(delimiter, 1)[1]
        if tail.strip():
            return tail
    raise ValueError(
        f"problem {problem.id!r} has no reference answer: no `reference` field and no solution "
        f"text after the delimiter {delimiter!r}"
    )


# What commonly precedes a delimiter in text; each may merge with its first characters.
DELIMITER_CONTEXTS = ("", " ", "\n", "$", " $", "(", "[", "{", "*", '"', "'", ".", ":")


@dataclass(frozen=True)
class DroTokens:
    """The token ids DRO splices in: the delimiter's tokenizations in context (`delimiters`, any
    of which ends a CoT), the fixed separator, and the stop tokens to strip."""

    delimiters: list[list[int]]
    separator: list[int]
    stop: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, delimiter: str, separator: str) -> DroTokens:
        """Tokenize the delimiter and separator without special tokens.

        The delimiter is tokenized after each of `DELIMITER_CONTEXTS`; a variant that holds
        another one is dropped (the shorter matches wherever it does).
        """

        def ids(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

        stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        variants: list[list[int]] = []
        for context in DELIMITER_CONTEXTS if delimiter else ():
            v = ids(context + delimiter)
            if v not in variants:
                variants.append(v)
        minimal = [
            v for v in variants if not any(u != v and dro.match_delimiter(v, [u]) for u in variants)
        ]
        return cls(minimal, ids(separator), frozenset(stop))


def reference_ids(tokenizer: Any, text: str) -> list[int]:
    """A reference answer's ids: tokenized once, no special tokens and no EOS appended (our choice:
    the paper does not say; an EOS would score the end of text, not the answer)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"reference answer {text!r} has no tokens")
    return ids


@dataclass(frozen=True)
class ScoringInputs:
    """Per rollout: the scoring sequence, its reference positions, and its final answer ids.

    `answers[i]` is None when the rollout has no final answer for the judge: truncated, or no
    delimiter in it (then the whole completion is the R3 prefix).
    """

    sequences: list[list[int]]
    positions: list[list[int]]
    answers: list[list[int] | None]


def scoring_inputs(
    rollouts: Rollouts, references: dict[str, list[int]], tokens: DroTokens
) -> ScoringInputs:
    """`q + c + d + y` token ids for every rollout (`dro.build_scoring_ids`), never re-tokenized.

    Trailing stop tokens are cut first, so the reference never follows an end of text.
    """
    sequences, positions, answers = [], [], []
    for gid, prompt, response, finish in zip(
        rollouts.group_ids,
        rollouts.prompt_ids,
        rollouts.response_ids,
        rollouts.finish_reasons,
        strict=True,
    ):
        completion = list(response)
        while completion and completion[-1] in tokens.stop:
            completion.pop()
        delimiter = dro.match_delimiter(completion, tokens.delimiters) or []
        seq, pos = dro.build_scoring_ids(
            prompt, completion, delimiter, references[gid], tokens.separator
        )
        _, answer = dro.split_completion(completion, delimiter)
        sequences.append(seq)
        positions.append(list(pos))
        answers.append(None if finish == "length" else answer)
    return ScoringInputs(sequences, positions, answers)


def score_groups(
    rollouts: Rollouts,
    settings: Any,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    judgments: Sequence[np.ndarray] | None = None,
    rewards: np.ndarray | None = None,
) -> dict[str, dro.GroupScore]:
    """Each group's `dro.GroupScore` from its rows (`settings`: the `algorithm.dro` section).

    `ref_logprobs[i]` are rollout i's reference log-probs (reward r3 / avg_prob / avg_logprob);
    with reward "verifier" pass the verifier's `rewards` instead, and the gates always pass.
    `judgments[i]` is rollout i's verdict row over its query's K items (all False without a final
    answer); None when the gates are off.
    """
    scores: dict[str, dro.GroupScore] = {}
    for gid, rows in group_rows(rollouts.group_ids).items():
        if settings.reward == "verifier":
            if rewards is None:
                raise ValueError("reward 'verifier' needs the verifier's rewards")
            r = np.asarray([rewards[i] for i in rows], dtype=np.float64)
            adv = dro.group_advantage(r)
            scores[gid] = dro.GroupScore(r, adv, True, True, float("nan"), float("nan"))
            continue
        if ref_logprobs is None:
            raise ValueError(f"reward {settings.reward!r} needs the reference log-probs")
        satisfied = None if judgments is None else np.stack([judgments[i] for i in rows])
        scores[gid] = dro.score_group(
            np.asarray([ref_logprobs[i] for i in rows], dtype=np.float64),
            satisfied,
            method=settings.reward,
            omega=settings.omega,
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            mu=settings.mu,
            rho_g=settings.rho_g,
            nu=settings.nu,
        )
    return scores


def dro_batch(
    rollouts: Rollouts, scores: dict[str, dro.GroupScore], pad_id: int
) -> tuple[TrainBatch, dict[str, float]]:
    """The training batch of a DRO step: the accepted groups' rows with their advantages.

    Rejected groups are left out: no PG, no KL, no share of the loss normaliser (Sec. 4.1 rejects
    the group; dropping its KL and normaliser share too is our choice). Truncated rollouts stay in
    with no loss tokens, so they count in the normaliser only. When no group is accepted the batch
    holds every row with no loss token, and the step trains nothing.
    Fills `rollouts.rewards`, `advantages`, `weights` (1 = trained) and `statuses`.
    """
    n = len(rollouts)
    rewards = np.zeros(n)
    advantages = np.zeros(n)
    statuses = [""] * n
    kept: list[int] = []
    for gid, rows in group_rows(rollouts.group_ids).items():
        score = scores[gid]
        rewards[rows] = score.rewards
        if score.accepted:
            advantages[rows] = score.advantages
            kept.extend(rows)
        reason = (
            "accepted"
            if score.accepted
            else "no_coverage"
            if not score.coverage
            else "no_consistency"
        )
        for i in rows:
            statuses[i] = reason
    truncated = [f == "length" for f in rollouts.finish_reasons]
    trained = {i for i in kept if not truncated[i]}
    rollouts.rewards, rollouts.advantages, rollouts.statuses = rewards, advantages, statuses
    rollouts.weights = np.zeros(n)
    rollouts.weights[sorted(trained)] = 1.0
    rows = sorted(kept) if kept else list(range(n))
    masks = [[i in trained] * len(rollouts.response_ids[i]) for i in rows]
    engine = rollouts.engine_logprobs
    batch = build_batch(
        [rollouts.prompt_ids[i] for i in rows],
        [rollouts.response_ids[i] for i in rows],
        pad_id,
        loss_masks=masks,
        rollout_logprobs=None if engine is None else [engine[i] for i in rows],
        forced_eos=[rollouts.forced_eos[i] for i in rows],
    )
    batch.advantages = torch.as_tensor(advantages[rows], dtype=torch.float32)
    stats = {
        "advantage_abs_mean": float(np.mean(np.abs(advantages[kept]))) if kept else 0.0,
        "nonzero_advantage_frac": float(np.mean(np.abs(advantages) > 0)),
        "dro_train_sequences": len(kept),
        "dro_trained_rollouts": len(trained),
    }
    return batch, stats


@dataclass
class RejectionTally:
    """Groups seen and rejected since the start of the run (the paper's Fig. 5 curve)."""

    groups: int = 0
    rejected: int = 0

    @classmethod
    def from_history(cls, metrics: Sequence[dict[str, Any]]) -> RejectionTally:
        """Rebuild the tally from a run's committed metrics lines (for resume)."""
        return cls(
            groups=sum(int(m.get("dro_groups", 0)) for m in metrics),
            rejected=sum(int(m.get("dro_groups_rejected", 0)) for m in metrics),
        )


def step_metrics(
    scores: dict[str, dro.GroupScore],
    tally: RejectionTally,
    judge_failures: int = 0,
    ungated_groups: int = 0,
) -> dict[str, float]:
    """DRO's per-step metrics; adds the step's groups to `tally` (call once per step).

    Mean reward (R3 or the chosen baseline), mean raw reference certainty and online sbar (both
    over the groups' G x L matrices), rejection rate of the step and cumulative, gate failures.
    """
    groups = list(scores.values())
    rejected = sum(not g.accepted for g in groups)
    tally.groups += len(groups)
    tally.rejected += rejected
    return {
        "dro_reward_mean": float(np.mean([g.rewards.mean() for g in groups])),
        "dro_prob_mean": float(np.mean([g.mean_prob for g in groups])),
        "dro_sbar_mean": float(np.mean([g.sbar for g in groups])),
        "dro_groups": len(groups),
        "dro_groups_rejected": rejected,
        "dro_reject_rate": rejected / len(groups),
        "dro_reject_rate_cum": tally.rejected / tally.groups,
        "dro_coverage_failures": sum(not g.coverage for g in groups),
        "dro_consistency_failures": sum(not g.consistency for g in groups),
        "dro_judge_failures": judge_failures,
        "dro_ungated_groups": ungated_groups,
    }
