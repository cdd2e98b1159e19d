"""A step's rollouts as flat arrays: one row per sampled response, grouped by prompt.

Flattening happens once, right after generation; scoring fills `rewards` (and `statuses`: an
uncomputed reward leaves the trained rows, `Rollouts.computed`), and a method's shaping
(`rlvr.methods.grpo.shaping`, `rlvr.methods.duet.shaping`, ...) turns them into the padded
`TrainBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from rlvr.algorithms.groups import group_rows
from rlvr.envs.base import AGENT_FAILURES
from rlvr.generation.base import GenerationResult
from rlvr.generation.stop_rules import FORCED_EOS
from rlvr.verifiers import VERIFIER_FAILED

UNCOMPUTED = (VERIFIER_FAILED, *AGENT_FAILURES)
"""Reward statuses of a rollout whose reward was never computed: the verifier failed on it, or
its trajectory failed on the environment's side. Its 0.0 is a placeholder that says nothing
about the model: it trains nothing and is left out of its group's statistics (`computed`)."""


@dataclass
class Rollouts:
    """One row per sampled response; `group_ids` is the prompt id the response answers."""

    group_ids: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    golds: list[str]
    finish_reasons: list[str]
    flags: list[dict[str, Any]]
    rewards: np.ndarray = field(default_factory=lambda: np.zeros(0))
    statuses: list[str] = field(default_factory=list)
    reward_parts: list[dict[str, float]] = field(default_factory=list)
    """With several weighted rewards (`verifier.rewards`), each component's reward by name ({} for
    an uncomputed reward); empty otherwise."""
    advantages: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Unweighted group advantages, when the shaping keeps them (DUET's surrogate needs them)."""
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per-rollout loss weights, when a method sets them (DUET: 0 for aborted rollouts)."""
    authorships: list[list[int] | None] = field(default_factory=list)
    """Per rollout, the author of each response token (Tandem: 1 = senior); None if solo."""
    logprobs: list[list[float]] = field(default_factory=list)
    """Per rollout, the engine's log-prob of each response token under the distribution it
    sampled from (`Sample.logprobs`), for the trainer's engine importance correction."""
    model_token_masks: list[list[bool]] = field(default_factory=list)
    """Multi-turn rollouts: per rollout, whether the model wrote each response token (False on
    the observations an environment inserted between turns, which the trainer never trains on);
    empty for single-turn rollouts, whose every response token is the model's."""

    @classmethod
    def from_results(cls, results: list[GenerationResult], golds: dict[str, str]) -> Rollouts:
        rows: dict[str, list] = {k: [] for k in ("g", "p", "r", "t", "gold", "f", "flags")}
        for res in results:
            for s in res.samples:
                rows["g"].append(res.request_id)
                rows["p"].append(res.prompt_ids)
                rows["r"].append(s.token_ids)
                rows["t"].append(s.text)
                rows["gold"].append(golds[res.request_id])
                rows["f"].append(s.finish_reason)
                rows["flags"].append(s.flags)
        out = cls(
            rows["g"], rows["p"], rows["r"], rows["t"], rows["gold"], rows["f"], rows["flags"]
        )
        out.authorships = [s.authorship for res in results for s in res.samples]
        out.logprobs = [list(s.logprobs) for res in results for s in res.samples]
        masks = [s.model_tokens for res in results for s in res.samples]
        if masks and all(m is not None for m in masks):
            out.model_token_masks = [list(m) for m in masks]
        return out

    @property
    def engine_logprobs(self) -> list[list[float]] | None:
        """`logprobs` for `build_batch`, or None when the rollouts carry none."""
        return self.logprobs if len(self.logprobs) == len(self) else None

    @property
    def forced_eos(self) -> list[int | None]:
        """Per rollout, the index of the EOS a stop rule forced (`FORCED_EOS`), None if none."""
        return [f.get(FORCED_EOS) for f in self.flags]

    def __len__(self) -> int:
        return len(self.group_ids)

    def take(self, rows: Sequence[int]) -> Rollouts:
        """The given rows, in that order; per-row fields not filled yet (e.g. rewards before
        scoring) stay empty."""
        rows = list(rows)
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if len(value) == 0:
                values[f.name] = value
            elif len(value) != len(self):
                raise ValueError(f"{f.name} has {len(value)} rows, the rollouts {len(self)}")
            elif isinstance(value, np.ndarray):
                values[f.name] = value[np.asarray(rows, dtype=np.int64)]
            else:
                values[f.name] = [value[i] for i in rows]
        return Rollouts(**values)

    @classmethod
    def concat(cls, parts: Sequence[Rollouts]) -> Rollouts:
        """The rows of `parts` one after another (DAPO's rounds of one step). A per-row field is
        joined when every non-empty part has it filled, and left empty when none has."""
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("nothing to concatenate")
        values = {}
        for f in fields(cls):
            column = [getattr(p, f.name) for p in parts]
            filled = [len(v) == len(p) for v, p in zip(column, parts, strict=True)]
            if not any(filled):
                values[f.name] = column[0]
            elif not all(filled):
                raise ValueError(f"{f.name} is filled in some parts only")
            elif isinstance(column[0], np.ndarray):
                values[f.name] = np.concatenate(column)
            else:
                values[f.name] = [x for v in column for x in v]
        return cls(**values)

    def computed(self) -> Rollouts:
        """The rows whose rewards were computed (status not in UNCOMPUTED), in groups that keep
        at least two of them: a group's baseline is the mean of real rewards only, and a group
        left with one has none (it would train on its raw reward). Itself when every row stays."""
        if len(self.statuses) != len(self):
            raise ValueError(f"{len(self.statuses)} statuses for {len(self)} rollouts")
        rows = []
        for group in group_rows(self.group_ids).values():
            valid = [i for i in group if self.statuses[i] not in UNCOMPUTED]
            if len(valid) >= 2:
                rows += valid
        # all kept: these very rollouts, so that what shaping fills in reaches the step's log
        return self if len(rows) == len(self) else self.take(sorted(rows))

    def rows_of(self, groups: Sequence[str]) -> list[int]:
        """Row indices of the given groups, group by group in that order."""
        by_group = group_rows(self.group_ids)
        return [i for g in groups for i in by_group[g]]

    @property
    def lengths(self) -> list[int]:
        """The tokens the model wrote per rollout (over all its turns, observations left out)."""
        if len(self.model_token_masks) == len(self):
            return [sum(mask) for mask in self.model_token_masks]
        return [len(r) for r in self.response_ids]

    @property
    def loss_masks(self) -> list[list[bool]] | None:
        """`model_token_masks` for `build_batch`, or None when every response token is the
        model's."""
        masks = self.model_token_masks
        return masks if len(masks) == len(self) else None

    def rewards_by_group(self) -> dict[str, list[float]]:
        """Each group's rewards, groups in order of first appearance."""
        if len(self.rewards) != len(self):
            raise ValueError(f"{len(self.rewards)} rewards for {len(self)} rollouts")
        return {
            g: [float(self.rewards[i]) for i in rows]
            for g, rows in group_rows(self.group_ids).items()
        }

    def records(self, step: int, limit: int | None = None) -> list[dict[str, Any]]:
        """Plain dicts for logs and notebooks (prompt ids are omitted; the prompt id names them)."""
        if limit is None or limit >= len(self):
            rows = range(len(self))
        else:  # spread over the step's groups rather than the first few prompts
            rows = np.linspace(0, len(self) - 1, limit).round().astype(int).tolist()
        records, lengths = [], self.lengths
        for i in rows:
            record = {
                "step": step,
                "prompt_id": self.group_ids[i],
                "response": self.texts[i],
                "gold": self.golds[i],
                "reward": float(self.rewards[i]) if len(self.rewards) else None,
                "status": self.statuses[i] if self.statuses else None,
                "length": lengths[i],
                "finish_reason": self.finish_reasons[i],
            }
            if self.flags[i]:
                record["flags"] = dict(self.flags[i])
            if len(self.weights):
                record["weight"] = float(self.weights[i])
            records.append(record)
        return records
