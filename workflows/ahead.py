"""Rollouts collected one step ahead (`run.off_policy_steps: 1`): step t+1's generation and scoring
run in a driver thread while step t trains, on the engines' weights from before step t's update.

The engines must not change weights while they generate, so the step waits for the collection
before its weight sync; a committed step's checkpoint holds the next step's finished rollouts, so
a resumed run trains on exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rlvr.generation.base import SamplingParams
from rlvr.methods.base import Collected, Method, StepServices
from rlvr.tasks.base import Problem

AHEAD_FILE = "ahead.pkl"


@dataclass
class Ahead:
    """Step `step`'s rollouts: `n` per prompt id, the seconds of their phases, and the result (a
    future while the collection runs)."""

    step: int
    n: dict[str, int]
    times: dict[str, float] = field(default_factory=dict)
    collected: Collected | None = None
    future: Future | None = None

    def finish(self) -> None:
        """Wait for the collection (re-raising its error) and keep its result."""
        if self.future is not None:
            self.collected, self.future = self.future.result(), None


class AheadCollector:
    """Runs a method's `collect` for the next step in one background thread."""

    def __init__(self, method: Method, services: StepServices):
        self.method, self.services = method, services
        self.pending: Ahead | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collect-ahead")

    def launch(
        self, step: int, problems: list[Problem], params: SamplingParams, group_size: int
    ) -> None:
        """Start collecting `step`'s rollouts with the fixed group size (all that a method that
        `overlaps_generation` takes from the plan)."""
        n = {p.id: group_size for p in problems}
        ahead = Ahead(step, n)
        plan = {"step": step, "n": n}
        ahead.future = self._pool.submit(
            self.method.collect, self.services, problems, plan, params, step, ahead.times
        )
        self.pending = ahead

    def wait(self) -> None:
        """Block until the collection in flight (if any) is done: before the engines change."""
        if self.pending is not None:
            self.pending.finish()

    def take(self, step: int, plan_n: dict[str, int]) -> Ahead | None:
        """The finished rollouts of `step`, if they were collected ahead; None otherwise."""
        ahead, self.pending = self.pending, None
        if ahead is None or ahead.step != step:
            return None
        ahead.finish()
        if ahead.n != plan_n:
            raise RuntimeError(
                f"step {step}: the controller planned {plan_n} rollouts but {ahead.n} were "
                "collected ahead"
            )
        return ahead

    def save(self, directory: Path) -> None:
        """Write the finished next step's rollouts into a checkpoint being committed."""
        if self.pending is None:
            return
        self.wait()  # finished: no future left to pickle
        (directory / AHEAD_FILE).write_bytes(pickle.dumps(self.pending))

    def load(self, directory: Path) -> None:
        """Take back the rollouts a committed checkpoint holds for its next step (none: the
        next step collects its own)."""
        path = directory / AHEAD_FILE
        self.pending = pickle.loads(path.read_bytes()) if path.is_file() else None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
