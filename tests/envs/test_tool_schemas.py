"""A tool's schema comes from its name, docstring and type hints in the OpenAI / Hugging Face
format; what JSON arguments cannot fill is refused at load naming the tool; arguments are checked
against the schema before anything runs."""

from __future__ import annotations

import pytest

from rlvr.envs.tools import ToolLoadError, argument_errors, load_tool, load_tools

SAMPLE = "tests.envs.sample_tools"
BAD = "tests.envs.bad_tools"


def test_a_simple_function_gives_the_openai_tool_format():
    tool = load_tool(f"{SAMPLE}:add")
    assert tool.name == "add"
    assert tool.module == SAMPLE
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
        },
    }
    assert "def add(a: int, b: int)" in tool.source  # what the sandbox imports


def test_defaults_literals_lists_dicts_and_optionals():
    parameters = load_tool(f"{SAMPLE}:describe").schema["function"]["parameters"]
    assert parameters["required"] == ["word"]
    properties = parameters["properties"]
    assert properties["times"]["type"] == "integer"
    assert properties["style"] == {
        "type": "string",
        "enum": ["plain", "loud"],
        "description": "How to write it.",
    }
    assert properties["tags"]["items"] == {"type": "string"}
    assert properties["tags"]["nullable"] is True
    assert properties["weights"]["additionalProperties"] == {"type": "number"}


def test_the_builtin_tools_load():
    calculate, python = load_tools(
        ["rlvr.envs.builtin_tools:calculate", "rlvr.envs.builtin_tools:python"]
    )
    assert calculate.schema["function"]["parameters"]["required"] == ["expression"]
    assert python.schema["function"]["parameters"]["properties"]["code"]["type"] == "string"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("takes_object", "parameter 'point': Point is not a type a JSON argument has"),
        ("takes_tuple", "parameter 'pair': tuple"),
        ("int_keys", "non-str keys"),
        ("star_args", "named arguments only"),
        ("star_kwargs", "named arguments only"),
        ("positional_only", "positional-only"),
        ("no_hint", "parameter 'a' has no type hint"),
        ("undocumented_argument", "no JSON schema: .*'b'"),
        ("no_docstring", "no JSON schema"),
        ("asynchronous", "async and generator functions"),
        ("unnamed", "a lambda"),
        ("borrowed", "name the function where defined"),
        ("Point", "not a plain function"),
        ("missing", "cannot import it: AttributeError"),
    ],
)
def test_an_unsupported_function_fails_at_load_naming_the_tool(name, why):
    with pytest.raises(ToolLoadError, match=f"tool '{BAD}:{name}': .*{why}"):
        load_tool(f"{BAD}:{name}")


def test_a_module_that_imports_outside_the_standard_library_is_refused():
    with pytest.raises(ToolLoadError, match="imports 'numpy', which is not in the standard"):
        load_tool("tests.envs.third_party_tools:mean")


def test_a_spec_must_name_a_module_and_a_function():
    with pytest.raises(ToolLoadError, match="not of the form"):
        load_tool("tests.envs.sample_tools.add")


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ToolLoadError, match="its name 'add' is also"):
        load_tools([f"{SAMPLE}:add", "tests.envs.more_tools:add"])


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"word": "hi"}, None),
        ({"word": "hi", "times": 2, "style": "loud", "tags": None, "weights": {"a": 1}}, None),
        ({"word": "hi", "weights": {"a": 0.5, "b": -2}}, None),
        ({}, "missing argument(s) 'word'"),
        ({"word": "hi", "colour": "red"}, "unexpected argument(s) 'colour'"),
        ({"word": 3}, "argument 'word' must be string, not 3"),
        ({"word": "hi", "times": 2.5}, "argument 'times' must be integer"),
        ({"word": "hi", "times": True}, "argument 'times' must be integer"),
        ({"word": "hi", "style": "shout"}, "argument 'style' must be one of"),
        ({"word": "hi", "tags": ["a", 1]}, "argument 'tags'[1] must be string"),
        ({"word": "hi", "weights": {"a": "x"}}, "argument 'weights'['a'] must be number"),
        (["hi"], "the arguments must be a JSON object"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments, error):
    found = argument_errors(load_tool(f"{SAMPLE}:describe"), arguments)
    assert found == error if error is None else found.startswith(error), found
