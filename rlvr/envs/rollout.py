"""Multi-turn rollouts through an environment: each trajectory's environment side as the turn
callback of the engine loop (`rlvr.generation.trajectories`), and the trajectory it leaves as the
one sample per rollout that scoring and the trainer read.

Per trajectory: the environment's `reset(problem)` gives the first messages, rendered with the
tools it announces (`ChatRenderer`); after every model turn its `step(text)` answers, and the
observation is spliced in as token ids after the model's own, so the trainer's sequence is the
prompt, then each turn's sampled ids and observation ids, positions continuous. An environment
that fails (raises, hangs, dies, answers in the wrong shape: `EnvironmentFailed`) ends only its
trajectory, with its status as the end reason, as does a turn callback the engine loop gave up on;
such a trajectory's reward is uncomputed (`agent_failure`). Tool failures are observations the
model sees (`ToolEnvironment`). Every message an environment gives (its prompt, its observations,
tool results among them) enters the conversation here, repaired (`repair_messages`: what the
tokenizer cannot encode becomes U+FFFD) and counted in the trajectory's record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlvr.envs.base import (
    AGENT_FAILURES,
    EnvironmentFailed,
    Message,
    StepResult,
    repair_messages,
)
from rlvr.envs.chat import ChatRenderer
from rlvr.envs.hosted import HostedEnvironment
from rlvr.envs.tool_env import ToolEnvironment
from rlvr.envs.tools import ERROR_STATUSES, ToolBox
from rlvr.generation.base import (
    GenerationRequest,
    GenerationResult,
    Sample,
    SamplingParams,
    sample_seed,
)
from rlvr.generation.segments import POLICY_VERSIONS, Segments, joined_runs
from rlvr.generation.trajectories import (
    Continue,
    Finish,
    Trajectory,
    TrajectoryBackend,
    TrajectoryLimits,
    TrajectoryResult,
    TurnReply,
)
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION, prompt_messages
from rlvr.verifiers.worker import plugin_name

AGENT_FLAGS = "agent"
"""`Sample.flags` key of a trajectory's record (turns, tool calls, end reason, env reward, code
points of the environment's text repaired)."""
ENVIRONMENT_STATUS = "environment"
"""The reward status of a trajectory its environment rewarded (in place of the verifier)."""


def agent_failure(flags: dict[str, Any]) -> str | None:
    """The end reason of a trajectory that failed on the environment's side (`AGENT_FAILURES`),
    whose reward is uncomputed rather than the verifier's score of its last message; None for a
    trajectory the model ended (or a single-turn rollout)."""
    reason = flags.get(AGENT_FLAGS, {}).get("end_reason")
    return reason if reason in AGENT_FAILURES else None


def environment_reward(flags: dict[str, Any]) -> float | None:
    """The reward a trajectory's environment gave it (the sum over its steps), which replaces
    the verifier's; None where it gave none or the rollout is single-turn."""
    return flags.get(AGENT_FLAGS, {}).get("env_reward")


def trajectory_verdicts(
    flags: Sequence[dict[str, Any]], verify: Callable[[list[int]], list[tuple]]
) -> list[tuple]:
    """Each rollout's verdict (reward, status, ...), training's and evaluation's alike: a
    trajectory that failed on the environment's side is not verified (its last message is no
    answer) and gets (0.0, its end reason, {}), an uncomputed reward; `verify(rows)` scores the
    others, whose environment's own reward, where it gave one, replaces the verifier's."""
    verdicts: list[tuple] = [(0.0, reason, {}) for reason in map(agent_failure, flags)]
    rows = [i for i, v in enumerate(verdicts) if v[1] is None]
    for i, verdict in zip(rows, verify(rows) if rows else [], strict=True):
        reward = environment_reward(flags[i])
        verdicts[i] = verdict if reward is None else (reward, ENVIRONMENT_STATUS, *verdict[2:])
    return verdicts


@dataclass(frozen=True)
class EnvSettings:
    """How rollouts run in an environment (the config's `env` section, as plain data that crosses
    to the engines' processes)."""

    kind: str
    """'tools' (the built-in tool-calling loop) or 'python' (a class of the user's own)."""
    tools: tuple[str | Callable[..., Any], ...] = ()
    """Tool functions, by "pkg.module:fn" or the functions themselves."""
    env_class: str | type | None = None
    """The environment class, by "pkg.module:Cls" or the class itself."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    parser: str = "hermes"
    max_turns: int = 4
    max_tool_calls: int = 4
    token_budget: int | None = None
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 256
    env_timeout_s: float = 30.0
    instruction: str = DEFAULT_INSTRUCTION
    unsafe_hook: bool = False

    def described(self) -> dict[str, Any]:
        """The settings as JSON data, tools and class by name (`plugin_name`)."""
        return {
            **asdict(self),
            "tools": [plugin_name(t) for t in self.tools],
            "env_class": None if self.env_class is None else plugin_name(self.env_class),
        }

    def limits(self, max_tokens: int, max_model_len: int | None) -> TrajectoryLimits:
        """What ends a trajectory besides its environment; an environment's own deadline bounds
        each callback, so the loop's is a backstop above it."""
        return TrajectoryLimits(
            max_turns=self.max_turns,
            max_tokens=self.token_budget or self.max_turns * max_tokens,
            max_context=max_model_len,
            callback_timeout_s=2 * self.env_timeout_s + self.max_tool_calls * self.tool_timeout_s,
        )


@dataclass(frozen=True)
class AgentRequest:
    """`n` trajectories of one problem; trajectory j is seeded like sample j of a
    `GenerationRequest` with the same `seed` (`sample_seed`)."""

    problem: Problem
    n: int = 1
    seed: int | None = None
    request_id: str = ""


class Session:
    """One trajectory's environment side: its conversation so far, the turn callback, and what
    the environment reported."""

    def __init__(self, env: Any, renderer_for: Any, problem: Problem):
        self.env = env
        self.renderer_for = renderer_for
        self.problem = problem
        self.messages: list[Message] = []
        self.renderer: ChatRenderer | None = None
        self.failure: str | None = None
        self.rewards: list[float] = []
        self.tool_statuses: list[str] = []
        self.repaired_chars = 0

    def repaired(self, messages: list[Message]) -> list[Message]:
        """The environment's messages as the conversation takes them (`repair_messages`),
        their repaired code points counted."""
        messages, count = repair_messages(messages)
        self.repaired_chars += count
        return messages

    def prompt_ids(self) -> list[int] | None:
        """The first turn's prompt, or None when the environment failed to start."""
        try:
            self.messages = self.repaired(self.env.reset(self.problem))
        except EnvironmentFailed as err:
            self.failure = err.status
            return None
        self.renderer = self.renderer_for(getattr(self.env, "tools", []))
        return self.renderer.prompt_ids(self.messages)

    def __call__(self, trajectory: TrajectoryResult) -> TurnReply:
        turn = trajectory.turns[-1]
        text = turn.sample.text
        try:
            result: StepResult = self.env.step(text)
        except EnvironmentFailed as err:
            self.failure = err.status
            return Finish({"env_failure": err.status})
        if result.reward is not None:
            self.rewards.append(float(result.reward))
        calls = result.info.get("tool_calls", [])
        self.tool_statuses += [c["status"] for c in calls]
        info = {"tool_calls": calls} if calls else {}
        if result.done:
            return Finish(info)
        conversation = [*self.messages, {"role": "assistant", "content": text}]
        observations = self.repaired(result.observations)
        observation_ids = self.renderer.observation_ids(
            conversation, turn.sample.token_ids, observations
        )
        self.messages = [*conversation, *observations]
        return Continue(observation_ids, info)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # an environment's close never fails a rollout
            self.env.close()

    def end_reason(self, trajectory: TrajectoryResult | None) -> str:
        """Why it ended: the environment's failure, else the loop's status."""
        if self.failure is not None:
            return self.failure
        return "env_error" if trajectory is None else str(trajectory.status)

    def sample(self, trajectory: TrajectoryResult | None) -> Sample:
        """The trajectory as one sample after its first prompt: every turn's sampled ids, then its
        observation ids, with the model's own marked (`Sample.model_tokens`) and the engine's
        log-prob on each (0.0 on an observation); the text is its last message, the one a
        verifier scores."""
        turns = [] if trajectory is None else trajectory.turns
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[bool] = []
        for turn in turns:
            ids += turn.sample.token_ids + turn.observation_ids
            logprobs += list(turn.sample.logprobs) + [0.0] * len(turn.observation_ids)
            mask += [True] * len(turn.sample.token_ids) + [False] * len(turn.observation_ids)
        calls = len(self.tool_statuses)
        record = {
            "turns": len(turns),
            "tool_calls": calls,
            "tool_errors": sum(s in ERROR_STATUSES for s in self.tool_statuses),
            "end_reason": self.end_reason(trajectory),
            "env_reward": sum(self.rewards) if self.rewards else None,
            "repaired_chars": self.repaired_chars,
        }
        flags: dict[str, Any] = {AGENT_FLAGS: record}
        if any(POLICY_VERSIONS in turn.sample.flags for turn in turns):
            flags[POLICY_VERSIONS] = joined_runs(*(t.sample.flags[POLICY_VERSIONS] for t in turns))
        return Sample(
            token_ids=ids,
            text=turns[-1].sample.text if turns else "",
            logprobs=logprobs,
            finish_reason=turns[-1].sample.finish_reason if turns else "abort",
            flags=flags,
            model_tokens=mask,
        )


class Agents:
    """Runs multi-turn rollouts on one engine's process: one environment per trajectory (tool
    calls share one ToolBox), rendered with `tokenizer`'s chat template."""

    def __init__(self, settings: EnvSettings, tokenizer: Any):
        self.settings = settings
        self.tokenizer = tokenizer
        self.toolbox = None
        if settings.kind == "tools":
            self.toolbox = ToolBox(
                list(settings.tools),
                timeout_s=settings.tool_timeout_s,
                memory_mb=settings.tool_memory_mb,
                unsafe_hook=settings.unsafe_hook,
            )
        elif settings.kind != "python":
            raise ValueError(f"env kind must be 'tools' or 'python', got {settings.kind!r}")

    def environment(self) -> Any:
        s = self.settings
        if self.toolbox is not None:
            return ToolEnvironment(self.toolbox, s.parser, s.instruction, s.max_tool_calls)
        return HostedEnvironment(s.env_class, s.kwargs, timeout_s=s.env_timeout_s)

    def renderer(self, tools: Sequence[dict[str, Any]]) -> ChatRenderer:
        return ChatRenderer(self.tokenizer, tools, self.settings.parser)

    def generate(
        self,
        backend: TrajectoryBackend,
        requests: Sequence[AgentRequest],
        params: SamplingParams,
        max_model_len: int | None = None,
        schedule: Any = None,
        segments: Segments | None = None,
    ) -> list[GenerationResult]:
        """Every trajectory on `backend`, as one `GenerationResult` of one sample each, in request
        then trajectory order, its request id the request's (an environment may give every
        trajectory of a problem its own prompt). A trajectory whose environment failed to start
        has no tokens after the problem's plain prompt."""
        sessions: list[tuple[AgentRequest, Session, list[int] | None]] = []
        trajectories: list[Trajectory] = []
        for request in requests:
            seeds = GenerationRequest([], n=request.n, seed=request.seed)
            for j in range(request.n):
                session = Session(self.environment(), self.renderer, request.problem)
                prompt = session.prompt_ids()
                sessions.append((request, session, prompt))
                if prompt is not None:
                    trajectories.append(
                        Trajectory(
                            prompt_ids=prompt,
                            seed=sample_seed(seeds, params, j),
                            next_turn=session,
                            trajectory_id=str(len(sessions) - 1),
                        )
                    )
        limits = self.settings.limits(params.max_tokens, max_model_len)
        try:
            done = backend.generate_trajectories(trajectories, params, limits, schedule, segments)
        finally:
            for _, session, _ in sessions:
                session.close()
        by_id = {r.trajectory_id: r for r in done}
        results = []
        for k, (request, session, prompt) in enumerate(sessions):
            if prompt is None:
                plain = prompt_messages(request.problem, self.settings.instruction)
                prompt = self.renderer([]).prompt_ids(plain)
            sample = session.sample(by_id.get(str(k)))
            results.append(GenerationResult(request.request_id, prompt, [sample]))
        return results
