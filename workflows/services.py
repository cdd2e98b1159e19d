"""`StepServices` over a run's workers: what a method's hooks call, as typed methods.

The step loop and the methods never name an actor method by string; this module is the one place
that turns their calls into calls on the PolicyGroup, GeneratorPool, verifier pool, controller
and (for DRO) the frozen reference model's actor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from actors.controller import NAMESPACE
from actors.reference import ReferenceActor
from rlvr.config import Config
from rlvr.envs.rollout import AgentRequest, trajectory_verdicts
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.methods.base import ReferenceModel
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt
from rlvr.tasks.sampler import PromptSampler
from rlvr.training.rollouts import Rollouts
from workflows.components import Components, generator_kwargs, torch_threads
from workflows.workers import FanOut, Worker

REQUEST_SEED_STRIDE = 10_007


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


class ReferenceClient:
    """Typed calls on the frozen reference model's worker (`ReferenceModel`); `close` stops it."""

    def __init__(self, worker: Worker, close: Callable[[], None]) -> None:
        self.worker, self.close = worker, close

    def build_rubrics(self, queries: list[Any]) -> list[Any]:
        return self.worker.run("build_rubrics", queries)

    def judge_answers(self, requests: list[Any]) -> FanOut:
        return self.worker.submit("judge_answers", requests)

    def score_logprobs(self, sequences: list[list[int]], positions: list[list[int]]) -> FanOut:
        return self.worker.submit("score_logprobs", sequences, positions)


def start_reference(
    cfg: Config, model_dir: Path, comps: Components | None, use_actors: bool
) -> ReferenceClient:
    """The ReferenceActor (a Ray actor, or in this process); its shutdown joins `comps`' when
    given, else the caller closes it."""
    kwargs = reference_actor_kwargs(cfg, model_dir)
    if use_actors:
        handle = (
            ray.remote(ReferenceActor)
            .options(name=f"rlvr-reference-{cfg.run.name}", namespace=NAMESPACE, num_cpus=0)
            .remote(**kwargs)
        )
        client = ReferenceClient(
            Worker(handle, "ReferenceActor"), lambda: ray.kill(handle, no_restart=True)
        )
    else:
        actor = ReferenceActor(**kwargs)
        client = ReferenceClient(Worker(actor, "ReferenceActor"), actor.close)
    if comps is not None:
        comps._cleanup.append(client.close)
    if use_actors:
        client.worker.run("ready")
    return client


@dataclass
class RunServices:
    """The run's workers and inputs as the method hooks see them (`StepServices`)."""

    cfg: Config
    model_dir: Path
    comps: Components
    tokenizer: Any
    train_problems: list[Problem]
    test_problems: list[Problem]
    use_actors: bool = True
    committed_metrics: list[dict[str, Any]] = field(default_factory=list)
    sampler: PromptSampler | None = None
    """The run's prompt sampler (which step ends a pass over the prompts)."""
    _reference: ReferenceClient | None = None
    _prompt_cache: dict[str, list[int]] = field(default_factory=dict)
    _problems: dict[str, Problem] = field(default_factory=dict)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The problem's prompt ids as every pass renders them (task.instruction, chat_template)."""
        if problem.id not in self._prompt_cache:
            task = self.cfg.task
            self._prompt_cache[problem.id] = render_prompt(
                self.tokenizer, problem, task.instruction, task.chat_template
            )
        return self._prompt_cache[problem.id]

    def generate(
        self,
        problems: list[Problem],
        n: dict[str, int],
        params: SamplingParams,
        step: int,
        duet_stop: dict[str, Any] | None = None,
        tandem: bool = False,
        first_index: int = 0,
    ) -> Rollouts:
        """Sample n[id] responses per problem; `duet_stop` runs DUET's stop rule in the engine;
        `tandem` co-writes every response with the frozen junior. `first_index` is the step-wide
        index of the first problem (DAPO's refill rounds continue the step's seed streams)."""
        base = params.seed if params.seed is not None else 0
        # each prompt its own seed stream: sample j of prompt i draws from base + STRIDE * i + j
        requests = [
            GenerationRequest(
                self.prompt_ids(p),
                n=n[p.id],
                request_id=p.id,
                seed=base + REQUEST_SEED_STRIDE * (first_index + i),
            )
            for i, p in enumerate(problems)
        ]
        golds = {p.id: p.answer for p in problems}
        if self.cfg.env.multi_turn:
            agents = [
                AgentRequest(p, r.n, r.seed, r.request_id)
                for p, r in zip(problems, requests, strict=True)
            ]
            env = self.cfg.env.settings(
                self.cfg.task.instruction, self.cfg.verifier.unsafe_hook_sandbox
            )
            results = self.comps.generator.generate_agents(agents, params, env, step=step)
            return Rollouts.from_results(results, golds)
        extra: dict[str, Any] = {"duet_stop": duet_stop} if duet_stop is not None else {}
        if tandem:
            extra["tandem"] = True
        results = self.comps.generator.generate(requests, params, step=step, **extra)
        return Rollouts.from_results(results, golds)

    def verify(self, rollouts: Rollouts) -> None:
        """Rewards and statuses of `rollouts` (`trajectory_verdicts`: a trajectory that failed on
        the environment's side is uncomputed, as the verifier's own failures are)."""

        def verify_rows(rows: list[int]) -> list[tuple]:
            context = {}
            if "python" in self.cfg.verifier.kinds():  # plug-ins read the problem; others do not
                problems = [self._problem(rollouts.group_ids[i]) for i in rows]
                context = {
                    "prompts": [p.prompt if p else "" for p in problems],
                    "metadata": [dict(p.metadata) if p else {} for p in problems],
                }
            texts, golds = [rollouts.texts[i] for i in rows], [rollouts.golds[i] for i in rows]
            return self.comps.verifier.score(texts, golds, **context)

        scored = trajectory_verdicts(rollouts.flags, verify_rows)
        rollouts.rewards = np.array([s[0] for s in scored], dtype=np.float64)
        rollouts.statuses = [s[1] for s in scored]
        if self.cfg.verifier.rewards:
            rollouts.reward_parts = [s[2] if len(s) > 2 else {} for s in scored]

    def _problem(self, problem_id: str) -> Problem | None:
        """The train or test problem of that id (None for a text scored without one)."""
        if not self._problems:
            self._problems = {p.id: p for p in (*self.train_problems, *self.test_problems)}
        return self._problems.get(problem_id)

    def verify_texts(self, texts: list[str], golds: list[str]) -> list[tuple[float, str]]:
        return [(s[0], s[1]) for s in self.comps.verifier.score(texts, golds)]

    def score_logprobs(
        self, scorer: str, sequences: list[list[int]], positions: list[list[int]]
    ) -> FanOut:
        if scorer == "reference":
            return self.reference().score_logprobs(sequences, positions)
        group = {"generator": self.comps.generator, "trainer": self.comps.policy}[scorer]
        return group.score_logprobs(sequences, positions)

    def reference(self) -> ReferenceModel:
        if self._reference is None:
            self._reference = start_reference(self.cfg, self.model_dir, self.comps, self.use_actors)
        return self._reference

    def update_method_state(self, step: int, **observation: Any) -> Any:
        return self.comps.controller.update_method_state(step, **observation)

    def epoch_ends_after(self, step: int) -> bool:
        return self.sampler.epoch_of(step + 1) > self.sampler.epoch_of(step)

    def history(self) -> list[dict[str, Any]]:
        return self.committed_metrics
