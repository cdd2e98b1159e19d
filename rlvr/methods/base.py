"""A training method as the step loop sees it: one object whose hooks the loop calls in a fixed
order, registered by name so that `algorithm.name` picks it.

One step (`workflows.train.Trainer.step`) is: the controller's plan (`plan_step`) -> `collect`
(generate and score) -> `shape` (rewards -> advantages -> batch) -> policy update -> weight sync
-> `observe`; `evaluate` adds the method's validation figures to the held-out pass. A method
overrides the hooks it changes and inherits GRPO's for the rest. Hooks reach the run's workers
only through `StepServices`, which the workflow implements over the actors, so this module and
every method stay free of Ray.

A method is one package under `rlvr/methods/` holding its hooks, its shaping and a `Method`
subclass decorated with `@register("name")`; its paper's equations live below, in
`rlvr/algorithms/` (docs/methods.md, "Adding a method"). `tests/integration/test_method_registry.py`
runs a toy one through the actors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from rlvr.config import Config, MethodSpec, Section, import_builtin_methods, register_method_spec
from rlvr.methods.state import ControllerState

if TYPE_CHECKING:
    from rlvr.generation.base import SamplingParams
    from rlvr.tasks.base import Problem
    from rlvr.training.batch import TrainBatch
    from rlvr.training.rollouts import Rollouts

T = TypeVar("T")


class Pending(Protocol[T]):
    """A call in flight on a worker; `result` waits for it (errors name the worker and step)."""

    def result(self, step: int | None = None) -> T: ...


class ReferenceModel(Protocol):
    """The frozen reference model's worker (DRO's rubric author, judge and R3 scorer)."""

    def build_rubrics(self, queries: Sequence[Any]) -> list[Any]: ...

    def judge_answers(self, requests: Sequence[Any]) -> Pending[tuple[list[Any], int]]: ...

    def score_logprobs(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> Pending[list[list[float]]]: ...


class StepServices(Protocol):
    """What a method's hooks may use: the run's inputs and typed calls on its workers."""

    cfg: Config
    model_dir: Path
    tokenizer: Any
    train_problems: list[Problem]
    test_problems: list[Problem]

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
        """n[id] responses per problem (`first_index`: step-wide index of the first problem)."""

    def verify(self, rollouts: Rollouts) -> None:
        """Fill `rollouts.rewards` and `statuses` (and, with several weighted rewards,
        `reward_parts`) from the verifier pool."""

    def verify_texts(self, texts: list[str], golds: list[str]) -> list[tuple[float, str]]:
        """The verifier pool's (reward, status) per response."""

    def score_logprobs(
        self, scorer: str, sequences: list[list[int]], positions: list[list[int]]
    ) -> Pending[list[list[float]]]:
        """Teacher-forced log-probs at `positions` by 'generator' (the rollout weights, before the
        step's sync), 'trainer' (the policy) or 'reference' (the frozen initial model)."""

    def reference(self) -> ReferenceModel:
        """The frozen reference model's worker, started on first use."""

    def update_method_state(self, step: int, **observation: Any) -> Any:
        """The method's `ControllerState.update` on the controller, once per step (a retry is a
        no-op); returns what it returns."""

    def epoch_ends_after(self, step: int) -> bool:
        """Whether `step` is the last step of a pass over the training prompts."""

    def history(self) -> list[dict[str, Any]]:
        """The run's committed step metrics (a resumed method rebuilds running tallies)."""


@dataclass
class Collected:
    """A step's rollouts: every generated one (metrics, logs, controller) and those it trains on."""

    rollouts: Rollouts
    trained: Rollouts
    stats: dict[str, Any] = field(default_factory=dict)


class Method:
    """GRPO (arXiv:2402.03300, Sec. 4.1.2): a fixed group per prompt, verifier rewards, group-
    normalised advantages on every response token. Other methods override what they change."""

    name: ClassVar[str] = "grpo"
    section: ClassVar[type[Section] | None] = None
    """Its parameters, `algorithm.<name>` in the config (None: it has none of its own)."""
    engine_state: ClassVar[bool] = False
    single_turn: ClassVar[str | None] = None
    """Why it cannot run multi-turn rollouts (`env`), if it cannot: the config refuses them."""
    """Whether it keeps per-sample state in the engine's process (a stop rule, an author
    schedule): tensor-parallel engines cannot run it."""
    best_metric: ClassVar[str] = "eval_accuracy"
    """Held-out metric that picks the best checkpoint (higher is better)."""
    policy_loss: ClassVar[str] = "grpo"
    """The registered policy loss it trains with (`rlvr.training.losses`)."""
    needs_logprob_sums: ClassVar[bool] = False
    """Whether `observe` needs each rollout's summed trainer log-prob from the update."""
    overlaps_generation: ClassVar[bool] = True
    """Whether later steps' rollouts may be collected while step t trains (`run.max_staleness`):
    its `collect` needs only the fixed group size from the plan, never state `observe` updates."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Checks across the config's sections, once it is otherwise valid (raise ValueError
        naming the key)."""

    def controller_state(self) -> ControllerState | None:
        """Its state on the training controller (None: it keeps none)."""
        return None

    # --- set-up -----------------------------------------------------------------------------
    def start(self, run: StepServices) -> None:
        """Once, before the first step or a resume: start workers, load caches."""

    def kl_coef(self) -> float:
        """Coefficient of the k3 KL to the reference policy in the loss."""
        return self.cfg.training.kl_coef

    def loss_options(self) -> dict[str, Any]:
        """Options of the method's policy loss (`TrainerSettings.loss_options`)."""
        return {}

    def loss_module(self) -> str | None:
        """The module a policy rank imports before looking `policy_loss` up: a method defined
        outside the project registers its loss beside itself; the built-in ones need none."""
        module = type(self).__module__
        return None if module.split(".")[0] == "rlvr" else module

    def generator_settings(self, model_dir: Path) -> dict[str, Any]:
        """Extra GeneratorActor arguments the method needs (e.g. Tandem's junior)."""
        return {}

    def companion_engine(self) -> bool:
        """Whether each generation engine gets an engine of its own beside it (Tandem's
        separate junior), placed like the engines and handed to it as `companion`."""
        return False

    def companion_settings(self, model_dir: Path) -> dict[str, Any]:
        """GeneratorActor arguments of a companion engine that replace the engines' own."""
        return {}

    # --- one step ---------------------------------------------------------------------------
    def rollout_options(self, plan: dict[str, Any], step: int) -> dict[str, Any]:
        """Keyword arguments of `StepServices.generate` for the step's training rollouts."""
        return {}

    def collect(
        self,
        run: StepServices,
        problems: list[Problem],
        plan: dict[str, Any],
        params: SamplingParams,
        step: int,
        times: dict[str, float],
    ) -> Collected:
        """Generate the planned rollouts and score them; `times` gets generate/verify seconds."""
        with timed(times, "time_generate"):
            rollouts = run.generate(
                problems, plan["n"], params, step, **self.rollout_options(plan, step)
            )
        with timed(times, "time_verify"):
            self.score(run, rollouts, step)
        return Collected(rollouts, self.trainable(rollouts))

    def trainable(self, rollouts: Rollouts) -> Rollouts:
        """The scored rollouts it may train on: those whose rewards were computed, in groups
        that keep at least two (`Rollouts.computed`); a failed environment or verifier is no
        signal about the model."""
        return rollouts.computed()

    def score(self, run: StepServices, rollouts: Rollouts, step: int) -> None:
        """Rewards of the step's rollouts: the verifier's."""
        run.verify(rollouts)

    def shape(
        self, run: StepServices, rollouts: Rollouts, plan: dict[str, Any], step: int
    ) -> tuple[TrainBatch, dict[str, Any]]:
        """The training batch (advantages on response tokens) and shaping metrics."""
        from rlvr.methods.grpo.shaping import shape_grpo

        return shape_grpo(rollouts, self.cfg, pad_id=run.tokenizer.pad_token_id)

    def observe(
        self,
        run: StepServices,
        rollouts: Rollouts,
        step: int,
        logprob_sums: list[float] | None,
        times: dict[str, float],
    ) -> dict[str, Any]:
        """After the update: fold the step into the method's running state; returns metrics."""
        return {}

    def evaluate(
        self,
        run: StepServices,
        problems: list[Problem],
        params: SamplingParams,
        step: int,
    ) -> dict[str, float]:
        """The method's validation figures beside held-out accuracy (`params`: eval sampling)."""
        return {}


_REGISTRY: dict[str, type[Method]] = {}


def register(name: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator: make `algorithm.name: <name>` select this method."""

    def add(cls: type[Method]) -> type[Method]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method {name!r} is already registered by {_REGISTRY[name]}")
        cls.name = name
        _REGISTRY[name] = cls
        spec = MethodSpec(
            cls.section,
            cls.check_config,
            cls.overlaps_generation,
            cls.engine_state,
            cls.single_turn,
        )
        register_method_spec(name, spec)
        return cls

    return add


register("grpo")(Method)


def method_class(name: str) -> type[Method]:
    """The registered method `name` (the built-in ones are imported on first lookup)."""
    import_builtin_methods()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r}; registered: {', '.join(sorted(_REGISTRY))}"
        ) from None


def build_method(cfg: Config) -> Method:
    """The method `cfg.algorithm.name` names, bound to the run's config."""
    return method_class(cfg.algorithm.name)(cfg)


def registered() -> list[str]:
    """Names of every registered method."""
    import_builtin_methods()
    return sorted(_REGISTRY)


class timed:
    """Context manager adding the seconds of its block to `times[key]`."""

    def __init__(self, times: dict[str, float], key: str) -> None:
        self.times, self.key = times, key

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.times[self.key] = self.times.get(self.key, 0.0) + time.perf_counter() - self._t0
