"""DUET's hooks in the step loop: planned counts, the in-engine stop rule, weighted shaping and
the per-prompt state update."""

from __future__ import annotations

from typing import Any

from rlvr.algorithms.duet import control as duet_control
from rlvr.config import Config
from rlvr.methods.base import ControllerState, Method, StepServices, register, timed
from rlvr.methods.duet.config import DuetConfig, check_duet, duet_controller, duet_stop
from rlvr.methods.duet.shaping import shape_duet
from rlvr.methods.duet.state import DuetState
from rlvr.training.batch import TrainBatch
from rlvr.training.rollouts import Rollouts


@register("duet")
class Duet(Method):
    """DUET (arXiv:2605.08441, Alg. 1): per-prompt rollout counts from the controller's
    allocation (Eq. 4), the marker-gated stop rule inside the engine (Eq. 5), importance-weighted
    advantages (Eq. 6), and the per-prompt surrogate (Eq. 3) updated from the step's log-prob
    sums."""

    section = DuetConfig
    engine_state = True  # the stop rule's trackers, read by a logits processor in the engine
    single_turn = (
        "its stop rule aborts a completion by its answer marker, and its allocation prices a "
        "rollout by one completion's length"
    )
    needs_logprob_sums = True
    overlaps_generation = False  # each step's counts and stop rule come from the last's update

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        check_duet(cfg)

    def controller_state(self) -> ControllerState:
        return DuetState(**duet_controller(self.cfg))

    def trainable(self, rollouts: Rollouts) -> Rollouts:
        """Every row: its shaping reads each prompt's rows by the plan's counts, and its own
        weights take rows out of the loss (single-turn, so no environment fails here; a reward
        the verifier failed on stays in its group as a 0.0)."""
        return rollouts

    def rollout_options(self, plan: dict[str, Any], step: int) -> dict[str, Any]:
        stop = duet_stop(self.cfg, plan["duet"]["k1"], plan["duet"]["k2"], step)
        return {"duet_stop": stop} if stop is not None else {}

    def shape(
        self, run: StepServices, rollouts: Rollouts, plan: dict[str, Any], step: int
    ) -> tuple[TrainBatch, dict[str, Any]]:
        du = self.cfg.algorithm.duet
        batch, stats = shape_duet(
            rollouts, plan["duet"]["counts"], self.cfg, pad_id=run.tokenizer.pad_token_id
        )
        stats.update(
            duet_control.step_metrics(
                plan["duet"], rollouts.flags, rollouts.weights, rollouts.lengths, du.n_min, du.n_max
            )
        )
        return batch, stats

    def observe(
        self,
        run: StepServices,
        rollouts: Rollouts,
        step: int,
        logprob_sums: list[float] | None,
        times: dict[str, float],
    ) -> dict[str, Any]:
        """Fold the step's rollouts into DUET's per-prompt state and K1/K2 window (once)."""
        kept = [not f.get("aborted", False) for f in rollouts.flags]
        with timed(times, "time_duet_state"):
            return run.update_method_state(
                step,
                prompt_ids=rollouts.group_ids,
                advantages=rollouts.advantages.tolist(),
                logprob_sums=logprob_sums or [0.0] * len(rollouts),
                lengths=rollouts.lengths,
                kept=kept,
                epoch_end=run.epoch_ends_after(step),
            )
