"""The config's `env` section: what it accepts, what it refuses at load (naming the key, before any
actor starts), the methods that run single-turn only, and the settings the engines receive."""

from __future__ import annotations

import pytest

from rlvr.config import ConfigError, config_from_dict

CALCULATOR = "rlvr.envs.builtin_tools:calculate"


def load(env: dict, **sections) -> object:
    return config_from_dict({"env": env, **sections})


def test_the_tool_loop_and_a_class_of_ones_own_load():
    cfg = load({"kind": "tools", "tools": [CALCULATOR], "max_turns": 3})
    settings = cfg.env.settings("Box it.", unsafe_hook=False)
    assert (settings.kind, settings.tools, settings.max_turns) == ("tools", (CALCULATOR,), 3)
    assert settings.instruction == "Box it." and cfg.env.multi_turn
    cfg = load({"kind": "python", "class": "tests.envs.sample_envs:GuessTheAnswer"})
    assert cfg.env.settings("", False).env_class == "tests.envs.sample_envs:GuessTheAnswer"
    assert not config_from_dict({}).env.multi_turn


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"kind": "tools"}, "env.tools: kind 'tools' needs at least one"),
        ({"kind": "tools", "tools": ["no.such.module:fn"]}, "env.tools:"),
        ({"kind": "none", "tools": [CALCULATOR]}, "env.tools: only kind 'tools'"),
        ({"kind": "python"}, "env.class: kind 'python' needs"),
        ({"kind": "python", "class": "no.such.module:Cls"}, "env.class:"),
        ({"kind": "tools", "tools": [CALCULATOR], "class": "a:B"}, "env.class: only kind"),
        ({"kind": "tools", "tools": [CALCULATOR], "max_turns": 0}, "max_turns"),
        ({"kind": "chat"}, "kind"),
    ],
)
def test_a_bad_section_fails_at_load_naming_the_key(env, message):
    with pytest.raises(ConfigError, match=message):
        load(env)


@pytest.mark.parametrize("method", ["duet", "tandem", "dro"])
def test_single_turn_methods_refuse_multi_turn_rollouts_with_the_reason(method):
    with pytest.raises(ConfigError, match=f"env.kind: {method} runs single-turn rollouts only: "):
        load({"kind": "tools", "tools": [CALCULATOR]}, algorithm={"name": method})


@pytest.mark.parametrize(
    "algorithm", [{"name": "grpo"}, {"name": "laconic", "laconic": {"budget": 64}}]
)
def test_group_methods_take_multi_turn_rollouts(algorithm):
    assert load({"kind": "tools", "tools": [CALCULATOR]}, algorithm=algorithm).env.multi_turn


def test_tool_call_warm_up_traces_need_the_tool_loop():
    with pytest.raises(ConfigError, match="model.sft_warmup_traces: tool_calls traces"):
        config_from_dict({"model": {"sft_warmup_traces": "tool_calls"}})
    cfg = load({"kind": "tools", "tools": [CALCULATOR]}, model={"sft_warmup_traces": "tool_calls"})
    assert cfg.model.sft_warmup_traces == "tool_calls"
