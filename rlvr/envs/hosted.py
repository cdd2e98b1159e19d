"""A user's environment class, "pkg.module:Cls" (or, from Python, the class itself), run in a
process of its own for each trajectory (`HostedEnvironment`), so that an environment that raises,
hangs, leaks or dies fails its own trajectory with a status (rlvr.envs.base.ENV_FAILURES) and
never the caller's step.

What an environment's author can rely on: one fresh process per trajectory (a worker process of
rlvr.verifiers.worker, as reward plug-ins use) that imports the class, makes one instance with
the configured keyword arguments, and calls `reset(problem)` (the instance is made inside that
call), then `step(text)` per turn and `close()` at the end. Each call has `timeout_s` seconds
(the import at start, 120 s); the process has `memory_limit_mb` of address space. Problems, the
model's messages, observations and rewards cross as JSON; what the environment prints goes to the
log, never into the protocol (it writes on a private copy of stdout), so neither the
environment's prints nor the model's text echoed in them can forge an answer. Its results are
checked here (rlvr.envs.base: `check_messages`, `check_step_result`).

What it cannot: the process is trusted code, like reward plug-ins: it runs with the user's
privileges, files and network. An environment that runs model-written code runs it through the
sandbox (rlvr.verifiers.sandbox, or a ToolBox of rlvr.envs.tools), not in its own process.
Its cost: a Python start and the module's import per trajectory (measured on a 2-core machine
for tests/envs/sample_envs.py: 0.23 s to the first messages, 34 MB resident).

A class passed as an object reaches the process as reward functions reach theirs
(rlvr.verifiers.python): pickled by cloudpickle (by value when it was defined in a notebook or a
script, by reference when it lives in a module), on the process's input as it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import numbers
import pickle
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import cloudpickle

from rlvr.envs.base import (
    PROMPT_ROLES,
    EnvironmentFailed,
    Message,
    StepResult,
    check_messages,
    check_step_result,
)
from rlvr.tasks.base import Problem
from rlvr.verifiers.worker import Worker, WorkerLost, import_object, plugin_name, read_payload

__all__ = [
    "HostedEnvironment",
    "check_environment_class",
    "problem_data",
    "problem_from_data",
]

_SERVE = "rlvr.envs.hosted:_serve"
_SERVE_PICKLED = "rlvr.envs.hosted:_serve_pickled"
CLOSE_TIMEOUT_S = 5.0


def check_environment_class(spec: str | type) -> type:
    """The class `spec` ("pkg.module:Cls", or the class itself) names, checked to have
    `reset(problem)` and `step(message)`, and, passed as an object, to pickle; ValueError saying
    why it cannot be used (for config load)."""
    if isinstance(spec, str):
        try:
            cls = import_object(spec)
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
            raise ValueError(f"environment {spec!r}: cannot import it: {why}") from None
    else:
        cls = spec
    name = plugin_name(spec)
    if not isinstance(cls, type):
        raise ValueError(f"environment {name!r} is a {type(cls).__name__!r}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {name!r} has no {' or '.join(missing)} method")
    for method in ("reset", "step"):
        if not _takes_one_argument(cls, method):
            raise ValueError(
                f"environment {name!r}: {method} must take one argument, as "
                f"{method}({'problem' if method == 'reset' else 'message'})"
            )
    if not isinstance(spec, str):
        try:
            cloudpickle.dumps(cls)
        except Exception as err:
            raise ValueError(
                f"environment {name!r} cannot be sent to its processes: cloudpickle fails on it "
                f"({type(err).__name__}: {err})"
            ) from None
    return cls


def _takes_one_argument(cls: type, method: str) -> bool:
    """Whether an instance's `method` can be called with one positional argument."""
    try:
        signature = inspect.signature(getattr(cls, method))
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return True
    bound_already = isinstance(inspect.getattr_static(cls, method), (staticmethod, classmethod))
    arguments = (None,) if bound_already else (None, None)  # self, then the argument
    try:
        signature.bind(*arguments)
    except TypeError:
        return False
    return True


def problem_data(problem: Problem) -> dict[str, Any]:
    """A problem as JSON-ready data."""
    return dataclasses.asdict(problem)


def problem_from_data(data: dict[str, Any]) -> Problem:
    """The problem `problem_data` gave `data` for."""
    return Problem(
        **{
            **data,
            "messages": tuple(tuple(m) for m in data["messages"]),
            "metadata": tuple(tuple(kv) for kv in data["metadata"]),
        }
    )


def _step_data(result: Any) -> Any:
    """A step's return as JSON-ready data (its shape is checked by the caller)."""
    if isinstance(result, StepResult):
        result = [result.observations, result.reward, result.done, result.info]
    if type(result) not in (tuple, list):
        return {"type": type(result).__name__}
    values = list(result)
    if len(values) > 1 and isinstance(values[1], numbers.Real) and not isinstance(values[1], bool):
        values[1] = float(values[1])  # a numpy reward
    return values


def _serve(arg: str) -> Callable[[str, Any], dict[str, Any]]:
    """The worker's handler for the environment class `arg` names: ("reset", problem data),
    ("step", text) and ("close", None), each answered with a dict."""
    config = json.loads(arg)
    return _episodes(import_object(config["class"]), config["kwargs"])


def _serve_pickled(arg: str) -> Callable[[str, Any], dict[str, Any]]:
    """`_serve` for the class its `HostedEnvironment` sent pickled."""
    return _episodes(pickle.loads(read_payload()), json.loads(arg)["kwargs"])


def _episodes(cls: type, kwargs: dict[str, Any]) -> Callable[[str, Any], dict[str, Any]]:
    """The handler that plays one episode of `cls(**kwargs)` (see `_serve`)."""
    episode: dict[str, Any] = {}

    def handle(op: str, payload: Any) -> dict[str, Any]:
        try:
            if op == "reset":
                env = episode["env"] = cls(**kwargs)
                messages = env.reset(problem_from_data(payload))
                reply = {"messages": messages, "tools": list(getattr(env, "tools", ()))}
            elif op == "step":
                reply = {"step": _step_data(episode["env"].step(payload))}
            else:
                env = episode.pop("env", None)
                if env is not None and callable(getattr(env, "close", None)):
                    env.close()
                reply = {"closed": True}
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            return {"raised": f"{type(err).__name__}: {err}"[:2000]}
        try:
            json.dumps(reply)
        except (TypeError, ValueError) as err:
            return {"not_json": str(err)[:500]}
        return reply

    return handle


class HostedEnvironment:
    """The environment class `spec` ("pkg.module:Cls" or the class) with `kwargs` (JSON data),
    in its own process for one trajectory: `reset`, `step`, `close` as
    rlvr.envs.base.Environment's, each within `timeout_s`. A failure raises EnvironmentFailed
    (its status one of ENV_FAILURES) and kills the process; every later call raises it again."""

    def __init__(
        self,
        spec: str | type,
        kwargs: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
        memory_limit_mb: int | None = 4096,
    ):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.spec = plugin_name(spec)
        self.kwargs = dict(kwargs or {})
        self.config = json.dumps({"class": self.spec, "kwargs": self.kwargs})  # JSON or TypeError
        self._serve, self._payload = (
            (_SERVE, None) if isinstance(spec, str) else (_SERVE_PICKLED, cloudpickle.dumps(spec))
        )
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.tools: list[dict[str, Any]] = []
        self._worker: Worker | None = None
        self._failure: EnvironmentFailed | None = None
        self._started = False

    def _fail(self, status: str, message: str) -> NoReturn:
        self._kill()
        self._failure = EnvironmentFailed(status, f"environment {self.spec}: {message}")
        raise self._failure

    def _kill(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def _call(self, op: str, payload: Any, timeout_s: float) -> dict[str, Any]:
        if self._failure is not None:
            raise self._failure
        if self._worker is None:
            raise RuntimeError(f"environment {self.spec}: {op} before reset, or after close")
        try:
            reply = self._worker.call([op, payload], timeout_s)
        except WorkerLost as lost:
            if lost.timed_out:
                self._fail("env_timeout", f"{op} ran past {timeout_s:g} s")
            self._fail("env_crashed", f"its process died during {op}")
        except ValueError:  # a reply line that is not JSON: the process broke its protocol
            self._fail("env_crashed", f"its process sent no readable reply to {op}")
        if type(reply) is not dict:
            self._fail("env_crashed", f"its process sent no readable reply to {op}")
        if "raised" in reply:
            self._fail("env_error", f"{op} raised {reply['raised']}")
        if "not_json" in reply:
            self._fail(
                "env_bad_result", f"{op} returned what is not JSON data: {reply['not_json']}"
            )
        return reply

    def reset(self, problem: Problem) -> list[Message]:
        """Start the process and the episode; the first messages."""
        if self._started:
            raise RuntimeError(f"environment {self.spec}: one HostedEnvironment, one trajectory")
        self._started = True
        self._worker = Worker(self._serve, self.config, self.memory_limit_mb, self._payload)
        weakref.finalize(self, self._worker.kill)
        try:
            self._worker.wait_ready()
        except RuntimeError as err:
            why = err.__cause__ or err  # WorkerLost: "timeout" or "worker died"
            self._fail("env_error", f"could not start ({why}); its traceback is in the log")
        reply = self._call("reset", problem_data(problem), self.timeout_s)
        try:
            messages = check_messages(reply.get("messages"), PROMPT_ROLES, "reset")
            tools = reply.get("tools")
            if type(tools) is not list or not all(type(t) is dict for t in tools):
                raise ValueError("its tools are not a list of tool schemas (dicts)")
        except ValueError as err:
            self._fail("env_bad_result", str(err))
        if not messages:
            self._fail("env_bad_result", "reset gave no messages")
        self.tools = tools
        return messages

    def step(self, assistant_message: str) -> StepResult:
        """The environment's answer to the model's message."""
        reply = self._call("step", assistant_message, self.timeout_s)
        value = reply.get("step")
        try:
            if type(value) is dict:
                raise ValueError(f"step gave a {value['type']!r}, not a StepResult")
            return check_step_result(value, "step")
        except (ValueError, KeyError, TypeError) as err:
            self._fail("env_bad_result", str(err))

    def close(self) -> None:
        """End the episode: the environment's `close` (within a few seconds), then the process."""
        if self._worker is not None and self._failure is None:
            # The episode is over either way; a close that fails is in the process's log.
            with contextlib.suppress(EnvironmentFailed):
                self._call("close", None, min(self.timeout_s, CLOSE_TIMEOUT_S))
        self._kill()
