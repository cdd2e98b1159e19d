"""Tool calls run in the code sandbox, one fresh sandbox per call: the result comes back as text,
and every failure (unknown tool, bad arguments, an exception, a timeout, a memory blow-up, an
output flood, a result that is not plain data, a process that dies) is a result with its status
and a message for the model, never an exception. The hostile calls use a 2 s timeout and 128 MB."""

from __future__ import annotations

import sys

import pytest

from rlvr.envs.tools import ERROR_STATUSES, TOOL_STATUSES, ToolBox
from rlvr.verifiers.sandbox import available_mode

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

SAMPLE = "tests.envs.sample_tools"
NAMES = [
    "add",
    "describe",
    "fails",
    "sleeps",
    "hoards",
    "floods",
    "chatters",
    "returns_object",
    "returns_subclass",
    "exits",
]
BUILTIN = ["rlvr.envs.builtin_tools:calculate", "rlvr.envs.builtin_tools:python"]


def make_box(timeout_s: float) -> ToolBox:
    # The strongest isolation this machine has; where it is only the audit hook, that is the one
    # these (non-escaping) tools are tested under.
    return ToolBox(
        [f"{SAMPLE}:{n}" for n in NAMES] + BUILTIN,
        timeout_s=timeout_s,
        memory_mb=128,
        output_kb=64,
        max_result_chars=300,
        mode=available_mode(),
    )


@pytest.fixture(scope="module")
def box() -> ToolBox:
    return make_box(timeout_s=2.0)


@pytest.fixture(scope="module")
def patient_box() -> ToolBox:
    """For the failures that are not timeouts: a sandboxed process starting on a loaded machine
    must not run into the 2 s limit first."""
    return make_box(timeout_s=30.0)


def test_a_call_runs_in_the_sandbox_and_answers_with_text(box):
    result = box.call("add", {"a": 2, "b": 40})
    assert (result.status, result.content) == ("ok", "42")
    assert result.message() == {"role": "tool", "name": "add", "content": "42"}
    assert not result.failed


def test_a_structured_result_is_json_text(box):
    result = box.call("describe", {"word": "hi", "times": 2, "style": "loud", "tags": ["x"]})
    assert result.status == "ok"
    assert result.content == '{"text": "HI HI", "tags": ["x"], "weights": {}}'


@pytest.mark.parametrize(
    ("name", "arguments", "status", "says"),
    [
        ("nope", {}, "unknown_tool", "no tool named 'nope' (tools: add, describe"),
        ("add", {"a": 1}, "bad_arguments", "add(): missing argument(s) 'b'"),
        ("add", {"a": 1, "b": 2, "c": 3}, "bad_arguments", "unexpected argument(s) 'c'"),
        ("add", {"a": 1, "b": "2"}, "bad_arguments", "argument 'b' must be integer"),
        ("fails", {"reason": "no"}, "tool_error", "fails() raised ValueError: no"),
        ("sleeps", {"seconds": 30}, "timeout", "sleeps() ran past 2 s"),
        ("hoards", {"megabytes": 1024}, "memory_limit", "hoards() ran out of memory (128 MB)"),
        ("floods", {"kilobytes": 4096}, "output_limit", "floods()'s result is over 64 KiB"),
        ("returns_object", {"label": "x"}, "not_plain_data", "'Opaque' object is not plain"),
        ("returns_subclass", {"label": "x"}, "not_plain_data", "'Sly' object is not plain"),
        ("exits", {"code": 3}, "crashed", "exits() exited without a result"),
    ],
)
def test_every_failure_is_an_error_observation_with_its_status(
    box, patient_box, name, arguments, status, says
):
    result = (box if status == "timeout" else patient_box).call(name, arguments)
    assert result.status == status
    assert result.failed and status in ERROR_STATUSES
    assert result.content.startswith("Error: ")
    assert says in result.content
    assert result.message()["role"] == "tool"


def test_a_long_result_is_cut_with_a_note(box):
    result = box.call("floods", {"kilobytes": 1})
    assert result.status == "truncated" and not result.failed
    assert result.content == "x" * 300 + "\n[... 724 more characters cut]"


def test_what_a_tool_prints_is_not_its_result(box):
    # 10 MB of prints go to the sandbox's stderr, which is read and dropped
    assert box.call("chatters", {"lines": 100_000}).content == "done"


def test_every_status_is_known():
    assert set(ERROR_STATUSES) < set(TOOL_STATUSES)


@pytest.mark.parametrize(
    ("expression", "value"),
    [("(12 + 7) * 31", "589"), ("-3 * -(4 - 10)", "-18"), ("7 / 2", "3.5"), ("8 / 4", "2")],
)
def test_the_calculator(box, expression, value):
    assert box.call("calculate", {"expression": expression}).content == value


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("__import__('os').system('id')", "only integers, + - * / and parentheses"),
        ("2 ** 1000000", "only integers"),
        ("1.5 * 2", "only integers"),
        ("1 / (3 - 3)", "division by zero"),
        ("1 +", "not an arithmetic expression"),
    ],
)
def test_the_calculator_evaluates_arithmetic_and_nothing_else(box, expression, says):
    result = box.call("calculate", {"expression": expression})
    assert result.status == "tool_error"
    assert says in result.content


def test_the_python_tool_returns_what_the_snippet_prints(box):
    result = box.call("python", {"code": "x = 6 * 7\nprint(x)\nprint(1 / 0)"})
    assert result.status == "ok"
    assert result.content.startswith("42\nTraceback (most recent call last):\n")
    assert result.content.rstrip().endswith("ZeroDivisionError: division by zero")


def test_the_python_tool_is_bounded_like_any_tool(box):
    assert box.call("python", {"code": "while True: pass"}).status == "timeout"
    flood = box.call("python", {"code": "for i in range(20_000): print(i)"})
    # the snippet's own output is capped at 4000 characters; the tool's text then at 300
    assert flood.status == "truncated"
    assert flood.content.startswith("0\n1\n2\n")


def test_calls_share_no_state(box):
    box.call("python", {"code": "import builtins\nbuiltins.leaked = 1"})
    seen = box.call("python", {"code": "import builtins\nprint(hasattr(builtins, 'leaked'))"})
    assert seen.content.strip() == "False"


@pytest.mark.parametrize("mode", ["namespaces", "hook"])
def test_a_call_runs_in_either_isolation_mode(mode):
    if mode == "namespaces" and available_mode() != "namespaces":
        pytest.skip("no namespaces here: only the hook mode runs")
    box = ToolBox([f"{SAMPLE}:add"], timeout_s=5.0, mode=mode)
    assert box.call("add", {"a": 1, "b": 2}).content == "3"


def test_a_tool_sees_none_of_the_hosts_files(box):
    if box.mode != "namespaces":
        pytest.skip("only the namespaces mode hides the host's files")
    here = __file__  # the tool's own module came as source, not as a file
    code = f"import os\nprint(os.path.exists({here!r}), os.path.exists('/root'), os.getcwd())"
    assert box.call("python", {"code": code}).content == "False False /tmp/run\n"
