"""Tools and environment classes passed from Python as the objects themselves (defined here, in a
test module the sandbox cannot import, or inside a test as in a notebook): they load as the string
form does, run where the string form runs with the same results, and each kind of bad object is a
ConfigError naming its key at load, before anything starts."""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import pytest

from rlvr.config import ConfigError, config_from_dict
from rlvr.envs.base import StepResult
from rlvr.envs.hosted import HostedEnvironment
from rlvr.envs.tools import ToolBox, load_tool
from rlvr.tasks.base import Problem
from rlvr.verifiers.sandbox import available_mode
from tests.envs import sample_envs, sample_tools

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

OFFSET = 1000
"""A global a tool refers to: it travels with the tool, by value."""


def _shifted(value: int) -> int:
    return value + OFFSET


def add_shifted(a: int, b: int) -> int:
    """Add two integers, then a thousand.

    Args:
        a: The first number.
        b: The second number.
    """
    return _shifted(a + b) + math.floor(0.5)


def uses_numpy(a: int) -> int:
    """Sum with numpy.

    Args:
        a: A number.
    """
    return int(np.sum([a]))


def imports_numpy(a: int) -> int:
    """Sum with numpy, imported when called.

    Args:
        a: A number.
    """
    import numpy

    return int(numpy.sum([a]))


def unhinted(a) -> int:
    """No type hint.

    Args:
        a: A number.
    """
    return a


class NoStep:
    def reset(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.prompt}]


class ResetWithoutProblem:
    def reset(self) -> list[dict]:
        return []

    def step(self, assistant_message: str) -> StepResult:
        return StepResult([], 1.0, True)


PROBLEM = Problem(id="p", prompt="Name a prime.", answer="7")


def tools(*tools_: object) -> dict:
    return {"env": {"kind": "tools", "tools": list(tools_)}}


def environment(cls: object) -> dict:
    return {"env": {"kind": "python", "class": cls}}


def test_objects_load_and_are_saved_by_name():
    cfg = config_from_dict(tools(add_shifted, "rlvr.envs.builtin_tools:calculate"))
    assert cfg.env.settings("", False).tools[0] is add_shifted
    assert cfg.to_dict()["env"]["tools"] == [
        f"{__name__}:add_shifted",
        "rlvr.envs.builtin_tools:calculate",
    ]
    cfg = config_from_dict({**environment(sample_envs.GuessTheAnswer)})
    assert cfg.env.settings("", False).env_class is sample_envs.GuessTheAnswer
    assert cfg.to_dict()["env"]["class"] == "tests.envs.sample_envs:GuessTheAnswer"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (tools(3), "env.tools.0: 3 is neither 'package.module:name' nor callable"),
        (tools(print), "env.tools: tool 'builtins:print': a 'builtin_function_or_method' object"),
        (tools(unhinted), "env.tools: tool '.*:unhinted': parameter 'a' has no type hint"),
        (tools(uses_numpy), "env.tools: tool '.*:uses_numpy': it refers to module 'numpy'"),
        (tools(imports_numpy), "env.tools: tool '.*:imports_numpy': it refers to module 'numpy'"),
        (
            tools(sample_tools.add, "tests.envs.sample_tools:add"),
            "env.tools: tool 'tests.envs.sample_tools:add': its name 'add' is also",
        ),
        (environment(42), "env.class: 42 is neither 'package.module:name' nor callable"),
        (environment(add_shifted), "env.class: environment '.*:add_shifted' is a 'function'"),
        (environment(NoStep), "env.class: environment '.*:NoStep' has no step method"),
        (
            environment(ResetWithoutProblem),
            r"env.class: environment '.*:ResetWithoutProblem': reset must take one argument",
        ),
    ],
)
def test_a_bad_object_is_a_config_error_naming_its_key(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(section)


def test_a_class_that_cannot_be_pickled_is_a_config_error_naming_its_key():
    class HoldsALock(sample_envs.Echo):  # defined here: pickled by value, its lock with it
        lock = threading.Lock()

    with pytest.raises(ConfigError, match="env.class: environment .*HoldsALock' cannot be sent"):
        config_from_dict(environment(HoldsALock))


@linux_only
def test_a_tool_object_runs_in_the_sandbox_as_its_string_form_does():
    scale = 3  # captured: a tool defined inside a function travels with what it refers to

    def times(a: int) -> int:
        """Multiply by the scale.

        Args:
            a: A number.
        """
        return a * scale

    box = ToolBox([add_shifted, times, sample_tools.describe], mode=available_mode())
    by_name = ToolBox([f"{sample_tools.__name__}:describe"], mode=available_mode())
    assert box.call("add_shifted", {"a": 2, "b": 40}).content == "1042"
    assert box.call("times", {"a": 14}).content == "42"
    arguments = {"word": "hi", "times": 2, "style": "loud", "tags": ["x"]}
    assert box.call("describe", arguments) == by_name.call("describe", arguments)
    assert box.schemas[2] == by_name.schemas[0]
    assert box.call("times", {"a": "x"}).status == "bad_arguments"  # checked as the string form


def test_a_tool_object_is_pickled_by_value_leaving_its_module_by_reference():
    import cloudpickle

    tool = load_tool(add_shifted)
    assert tool.spec == f"{__name__}:add_shifted" and tool.pickled
    assert __name__ not in cloudpickle.list_registry_pickle_by_value()
    assert cloudpickle.loads(cloudpickle.dumps(add_shifted)) is add_shifted


def test_an_environment_class_object_plays_its_episode_in_its_own_process():
    class Countdown:  # defined here, as in a notebook: it reaches its process by value
        def __init__(self, start: int):
            self.left = start

        def reset(self, problem: Problem) -> list[dict]:
            return [{"role": "user", "content": f"{problem.prompt} ({self.left} tries)"}]

        def step(self, assistant_message: str) -> StepResult:
            self.left -= 1
            done = assistant_message == "7" or self.left == 0
            return StepResult([{"role": "user", "content": "No."}], float(done), done)

    env = HostedEnvironment(Countdown, {"start": 2}, timeout_s=10.0)
    try:
        assert env.spec.endswith(".<locals>.Countdown")
        assert env.reset(PROBLEM)[0]["content"] == "Name a prime. (2 tries)"
        assert env.step("4") == StepResult([{"role": "user", "content": "No."}], 0.0, False)
        assert env.step("7").done
    finally:
        env.close()
    by_object, by_name = (
        HostedEnvironment(cls, {"tries": 3}, timeout_s=10.0)
        for cls in (sample_envs.GuessTheAnswer, "tests.envs.sample_envs:GuessTheAnswer")
    )
    try:
        assert by_object.reset(PROBLEM) == by_name.reset(PROBLEM)
        assert by_object.step("3") == by_name.step("3")
        assert by_object.step("7") == by_name.step("7")
    finally:
        by_object.close()
        by_name.close()
