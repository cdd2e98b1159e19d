"""DAPO's hook in the step loop: dynamic sampling rounds in place of one generate + score."""

from __future__ import annotations

from typing import Any

from rlvr.algorithms import dapo
from rlvr.generation.base import SamplingParams
from rlvr.methods.base import Collected, Method, StepServices, register, timed
from rlvr.methods.dapo.config import DapoConfig
from rlvr.tasks.base import Problem
from rlvr.training.rollouts import Rollouts


@register("dapo")
class Dapo(Method):
    """DAPO's dynamic sampling (arXiv:2503.14476, Sec. 3.2) for GRPO: drop groups whose rewards
    are all equal and refill with fresh prompts until the step holds `prompts_per_step`
    informative groups or `max_rounds` rounds ran, paying for every generated token. Clip-higher
    and the token-level loss are `training` settings (`clip_high`, `loss_agg`), not part of this
    method; overlong reward shaping is not implemented."""

    section = DapoConfig

    def collect(
        self,
        run: StepServices,
        problems: list[Problem],
        plan: dict[str, Any],
        params: SamplingParams,
        step: int,
        times: dict[str, float],
    ) -> Collected:
        ds, group_size = self.cfg.algorithm.dapo, self.cfg.generation.group_size
        pool = run.train_problems
        index = {p.id: i for i, p in enumerate(pool)}
        drawn, batch = list(problems), list(problems)
        rounds: list[Rollouts] = []
        kept: list[str] = []
        dropped = 0
        times["time_generate"] = times["time_verify"] = 0.0
        for r in range(ds.max_rounds):
            with timed(times, "time_generate"):
                part = run.generate(
                    batch,
                    {p.id: group_size for p in batch},
                    params,
                    step,
                    first_index=len(drawn) - len(batch),
                )
            with timed(times, "time_verify"):
                run.verify(part)
            rounds.append(part)
            valid = self.trainable(part)  # an uncomputed reward neither makes nor breaks a group
            outcome = dapo.sift_round(
                valid.rewards, valid.group_ids, len(kept), len(problems), r, ds.max_rounds
            )
            kept += outcome.kept
            dropped += len(set(part.group_ids)) - len(outcome.kept)  # failed groups too
            idx = dapo.refill_indices(
                len(pool),
                outcome.refill,
                [index[p.id] for p in drawn],
                self.cfg.run.seed,
                step,
                r + 1,
            )
            if not idx:
                break
            batch = [pool[i] for i in idx]
            drawn += batch
        every = Rollouts.concat(rounds)
        trained = self.trainable(every)
        stats = {
            "dapo_rounds": len(rounds),
            "dapo_kept_groups": len(kept),
            "dapo_dropped_groups": dropped,
        }
        return Collected(every, trained.take(trained.rows_of(kept)), stats)
