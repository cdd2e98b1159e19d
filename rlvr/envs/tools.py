"""Tools for agent rollouts: plain Python functions named "pkg.module:fn" (or, from Python, the
functions themselves), their JSON schemas, and a `ToolBox` that runs each call isolated in the code
sandbox (rlvr.verifiers.sandbox).

A tool is a module-level function whose name, docstring (a description and a Google-style
`Args:` section) and type hints are its schema, in the OpenAI / Hugging Face tool format
(`{"type": "function", "function": {"name", "description", "parameters"}}`, made by
transformers' `get_json_schema`). Its parameters take what a JSON argument can be: str, int,
float, bool, None, list[...], dict[str, ...], Literal[...], Any, and unions of them; anything else
(a class, a tuple that would arrive as a list, *args, **kwargs, positional-only) fails at load
with an error naming the tool. These hints are checked here before `get_json_schema` runs, which
would describe an unknown class as a bare "object" instead of refusing it.

Tools are loaded (imported, checked, schema'd) in the trusted process; they RUN elsewhere: each call
is a fresh sandbox (`python -I -S`, no network, no host files, a memory limit, a deadline, a
throwaway directory; rlvr/envs/tool_process.py is its program), never the caller's process. The
tool's module reaches the sandbox as source, sent with the call and imported from memory under its
own name, so it must be one file that imports only the standard library (checked at load: the
sandbox has no site-packages, and neither the module's package nor its siblings are there). A tool
passed as the function itself (defined in a notebook, a script or a test module) reaches the sandbox
pickled by value by cloudpickle, with the globals it refers to, and is loaded there by cloudpickle's
own module, sent as source like the harness; what it refers to or imports must be in the standard
library (checked at load on the pickle itself); loading cloudpickle's module costs such a call about
15 ms more (`add` of tests/envs/sample_tools.py, median of 10: 0.080 s passed as an object, 0.065 s
by name, namespaces sandbox, 2-core machine). Arguments cross as JSON, validated against the schema
before anything runs; the result crosses back as strict plain data (rlvr.verifiers.harness: builtin
types only, no objects of the tool's classes) and becomes text: a str as it is, anything else as
JSON (repr where JSON cannot hold it). A new sandbox per call means no call sees another's state; it
costs about 0.12 s (the calculator, median of 10, 2-core machine).

Code a tool runs shares its sandbox process (the `python` tool runs the model's snippet): it can
write the reply line itself, so it decides its own result text and status and nothing else; no
reward is read from a tool.

Every failure is a `ToolResult` with an error `status` and a message the model reads, never an
exception: see `TOOL_STATUSES`.
"""

from __future__ import annotations

import ast
import base64
import dis
import inspect
import io
import json
import math
import pickle
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import cloudpickle

from rlvr.envs import tool_process
from rlvr.verifiers import harness
from rlvr.verifiers.sandbox import Limits, SandboxResult, resolve_mode, run_python
from rlvr.verifiers.worker import import_object, plugin_name

__all__ = [
    "ERROR_STATUSES",
    "TOOL_STATUSES",
    "Tool",
    "ToolBox",
    "ToolLoadError",
    "ToolResult",
    "argument_errors",
    "load_tool",
    "load_tools",
]

TOOL_STATUSES = (
    "ok",
    "truncated",  # ran; its text was longer than max_result_chars and was cut
    "parse_error",  # the call itself could not be read (rlvr.envs.parsers)
    "too_many_calls",  # past the per-turn limit: not run
    "unknown_tool",
    "bad_arguments",  # missing, extra or mistyped arguments: not run
    "tool_error",  # the function raised (or its module failed to import in the sandbox)
    "timeout",
    "memory_limit",
    "output_limit",  # its result was larger than the sandbox's output limit
    "not_plain_data",  # it returned an object that is not plain data
    "crashed",  # its process died without a result
)
"""Status of one tool call, for metrics: "ok" and "truncated" ran and answered, the rest failed."""
ERROR_STATUSES = frozenset(TOOL_STATUSES) - {"ok", "truncated"}

_PROGRAM = Path(tool_process.__file__).read_text(encoding="utf-8")
_HARNESS = Path(harness.__file__).read_text(encoding="utf-8")
_UNPICKLER = cloudpickle.cloudpickle.__name__
"""The module whose functions rebuild a function cloudpickle pickled by value; its source (standard
library only) goes with each call of a tool passed as an object."""
_UNPICKLER_SOURCE = Path(cloudpickle.cloudpickle.__file__).read_text(encoding="utf-8")
_SCALARS = (str, int, float, bool, type(None))


class ToolLoadError(ValueError):
    """A tool that cannot be used, with the reason, naming the tool."""


@dataclass(frozen=True)
class Tool:
    """A loaded tool: what the model calls it, its schema, and the source the sandbox imports."""

    spec: str
    """"pkg.module:fn", as configured (a function passed as an object: where it was defined)."""
    name: str
    """The function's name: what the model calls."""
    schema: dict[str, Any]
    """OpenAI / Hugging Face tool format, for the chat template's `tools=`."""
    module: str
    source: str
    """The module's source, imported from memory inside each call's sandbox."""
    pickled: bytes | None = None
    """A function passed as an object, pickled by value (`module` is then cloudpickle's, which
    unpickles it); None: `module` defines the function `spec` names."""


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: its status (`TOOL_STATUSES`) and the text the model reads."""

    name: str
    status: str
    content: str

    @property
    def failed(self) -> bool:
        return self.status in ERROR_STATUSES

    def message(self) -> dict[str, str]:
        """The observation: a `tool` message."""
        return {"role": "tool", "name": self.name, "content": self.content}


def _fail(spec: str, why: str) -> ToolLoadError:
    return ToolLoadError(f"tool {spec!r}: {why}")


def _json_hint_problem(hint: Any) -> str | None:
    """Why a type hint is not one a JSON argument can satisfy as is; None when it is."""
    if hint is Any or hint in _SCALARS or hint in (list, dict):
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        bad = [a for a in args if type(a) not in _SCALARS]
        return f"Literal values {bad} are not JSON scalars" if bad else None
    if origin in (Union, types.UnionType):
        problems = [p for p in map(_json_hint_problem, args) if p]
        return problems[0] if problems else None
    if origin is list and len(args) == 1:
        return _json_hint_problem(args[0])
    if origin is dict and len(args) == 2:
        if args[0] is not str:
            return f"{_hint_name(hint)} has non-str keys (JSON object keys are strings)"
        return _json_hint_problem(args[1])
    return f"{_hint_name(hint)} is not a type a JSON argument has"


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint)


def _check_function(spec: str, fn: Any) -> None:
    """Refuse what cannot be a tool: not a plain function, or parameters JSON cannot fill."""
    if not inspect.isfunction(fn):
        raise _fail(spec, f"a {type(fn).__name__!r} object is not a plain function")
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
        raise _fail(spec, "async and generator functions cannot be tools: return a value")
    if fn.__name__ == "<lambda>":
        raise _fail(spec, "a lambda has no name to call it by")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:
        raise _fail(spec, f"its type hints do not resolve: {type(err).__name__}: {err}") from None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise _fail(spec, f"*{param.name} / **{param.name}: a tool takes named arguments only")
        if param.kind is param.POSITIONAL_ONLY:
            raise _fail(spec, f"parameter {param.name!r} is positional-only")
        if param.name not in hints:
            raise _fail(spec, f"parameter {param.name!r} has no type hint")
        problem = _json_hint_problem(hints[param.name])
        if problem:
            raise _fail(
                spec,
                f"parameter {param.name!r}: {problem} (use str, int, float, bool, None, "
                "list[...], dict[str, ...], Literal[...], Any or unions of them)",
            )


def _module_source(spec: str, module_name: str) -> str:
    """The module's source, checked to import nothing but the standard library."""
    module = sys.modules[module_name]
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        raise _fail(spec, f"module {module_name!r} has no Python source file to run in a sandbox")
    source = Path(path).read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise _fail(spec, f"{path}: a relative import; the sandbox holds this one file")
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        for name in names:
            top = name.split(".")[0]
            if top != "__future__" and top not in sys.stdlib_module_names:
                raise _fail(
                    spec,
                    f"{path} imports {name!r}, which is not in the standard library; a tool's "
                    "module runs in a sandbox that has the standard library only",
                )
    return source


def load_tool(spec: str | Callable[..., Any]) -> Tool:
    """The tool `spec` ("pkg.module:fn", or the function itself) names, imported and checked;
    ToolLoadError saying why it cannot be one."""
    if not isinstance(spec, str):
        return _object_tool(spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or "." in attr:
        raise _fail(spec, "not of the form 'pkg.module:fn' (a module-level function)")
    try:
        fn = import_object(spec)
    except Exception as err:
        raise _fail(spec, f"cannot import it: {type(err).__name__}: {err}") from None
    _check_function(spec, fn)
    if fn.__name__ != attr or fn.__module__ != module_name:
        raise _fail(spec, f"it is {fn.__module__}.{fn.__name__}; name the function where defined")
    return Tool(spec, attr, _schema(spec, fn), module_name, _module_source(spec, module_name))


def _object_tool(fn: Any) -> Tool:
    """A tool passed as the function itself: checked, its schema, and pickled by value for the
    sandbox."""
    spec = plugin_name(fn)
    _check_function(spec, fn)
    schema = _schema(spec, fn)
    pickled = _pickled_by_value(fn)
    _check_sandbox_imports(spec, pickled)
    return Tool(spec, fn.__name__, schema, _UNPICKLER, _UNPICKLER_SOURCE, pickled)


def _schema(spec: str, fn: Any) -> dict[str, Any]:
    """The function's schema in the OpenAI / Hugging Face tool format."""
    from transformers.utils import get_json_schema  # the HF convention, and a heavy import

    try:
        schema = get_json_schema(fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException
        raise _fail(spec, f"no JSON schema: {err}") from None
    schema["function"].pop("return", None)  # not part of the OpenAI format
    if not schema["function"].get("description"):
        raise _fail(spec, "its docstring has no description (the model reads it)")
    return schema


def _pickled_by_value(fn: Any) -> bytes:
    """`fn` pickled with its code and the globals it refers to, also when its module is
    importable here (a test module, a package): the sandbox cannot import it."""
    module = sys.modules.get(fn.__module__)
    temporary = (
        module is not None
        and module.__name__ != "__main__"
        and module.__name__ not in cloudpickle.list_registry_pickle_by_value()
    )
    if temporary:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        if temporary:
            cloudpickle.unregister_pickle_by_value(module)


class _ModuleRecorder(pickle.Unpickler):
    """Unpickles a cloudpickle'd function here, noting every module it refers to (its pickled
    globals, the modules its globals are) and every module its code imports."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.modules: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.modules.add(module)
        found = super().find_class(module, name)
        if found is cloudpickle.cloudpickle.subimport:  # a module the function's globals hold
            return lambda module_name: (self.modules.add(module_name), found(module_name))[1]
        if found is cloudpickle.cloudpickle._builtin_type:  # types.CodeType: a function's code
            return lambda type_name: self._code if type_name == "CodeType" else found(type_name)
        return found

    def _code(self, *args: Any) -> types.CodeType:
        code = types.CodeType(*args)
        for instruction in dis.get_instructions(code):
            if instruction.opname == "IMPORT_NAME":
                self.modules.add(instruction.argval or ".")  # "": a relative import
        return code


def _check_sandbox_imports(spec: str, pickled: bytes) -> None:
    """Refuse a pickled tool that refers to or imports a module outside the standard library:
    the sandbox has the standard library only."""
    recorder = _ModuleRecorder(pickled)
    try:
        recorder.load()
    except Exception as err:
        raise _fail(spec, f"it does not unpickle: {type(err).__name__}: {err}") from None
    for module in sorted(recorder.modules):
        top = module.split(".")[0]
        if top not in sys.stdlib_module_names and top != "cloudpickle":
            raise _fail(
                spec,
                f"it refers to module {module!r}, which is not in the standard library; a tool "
                "runs in a sandbox that has the standard library only",
            )


def load_tools(specs: Sequence[str | Callable[..., Any]]) -> list[Tool]:
    """`load_tool` for each spec; ToolLoadError also when two share a name."""
    tools = [load_tool(s) for s in specs]
    seen: dict[str, str] = {}
    for tool in tools:
        if tool.name in seen:
            raise _fail(tool.spec, f"its name {tool.name!r} is also {seen[tool.name]!r}'s")
        seen[tool.name] = tool.spec
    return tools


_JSON_TYPES = {
    "string": lambda v: type(v) is str,
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float) and math.isfinite(v),
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
    "array": lambda v: type(v) is list,
    "object": lambda v: type(v) is dict,
}


def _value_error(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """Why `value` does not fit `schema` (the subset get_json_schema writes); None when it does."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if all(_value_error(value, s, where) for s in schema["anyOf"]):
            return f"{where} fits none of its allowed types"
        return None
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_JSON_TYPES[k](value) for k in kinds):
            return f"{where} must be {' or '.join(kinds)}, not {json.dumps(value)[:60]}"
    if "enum" in schema and not any(value == e and type(value) is type(e) for e in schema["enum"]):
        return f"{where} must be one of {json.dumps(schema['enum'])}"
    if type(value) is list and "items" in schema:
        for i, item in enumerate(value):
            if error := _value_error(item, schema["items"], f"{where}[{i}]"):
                return error
    if type(value) is dict and "additionalProperties" in schema:
        for key, item in value.items():
            if error := _value_error(item, schema["additionalProperties"], f"{where}[{key!r}]"):
                return error
    return None


def argument_errors(tool: Tool, arguments: Any) -> str | None:
    """What is wrong with a call's arguments against the tool's schema (missing, unexpected or
    mistyped ones); None when they fit."""
    if type(arguments) is not dict:
        return "the arguments must be a JSON object"
    parameters = tool.schema["function"]["parameters"]
    properties = parameters.get("properties", {})
    missing = [p for p in parameters.get("required", []) if p not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(map(repr, missing))}"
    extra = [a for a in arguments if a not in properties]
    if extra:
        return (
            f"unexpected argument(s) {', '.join(map(repr, extra))}; it takes "
            f"{', '.join(map(repr, properties)) or 'none'}"
        )
    for name, value in arguments.items():
        if error := _value_error(value, properties[name], f"argument {name!r}"):
            return error
    return None


_REPLIES = {"value": object, "raised": str, "message": str, "not_plain": str, "import_failed": str}


def _reply(line: str) -> dict[str, Any] | None:
    """The sandbox's reply line as tool_process writes it; None for anything else."""
    try:
        reply = json.loads(line)
    except (ValueError, RecursionError):
        return None
    shapes = ({"value"}, {"raised", "message"}, {"not_plain"}, {"import_failed"})
    if type(reply) is not dict or set(reply) not in shapes:
        return None
    if any(not isinstance(v, _REPLIES[k]) for k, v in reply.items()):
        return None
    return reply


def _as_text(value: Any) -> str:
    """A tool's value as the text the model reads: a str as it is, else JSON (else repr)."""
    if type(value) is str:
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # sets, tuples as keys, bytes, complex, NaN
        return repr(value)


class ToolBox:
    """Loaded tools and the sandbox settings their calls run under: `call` runs one, in a fresh
    sandbox, within `timeout_s` seconds and `memory_mb` of memory, its result at most
    `output_kb` KiB as plain data and `max_result_chars` characters as text (longer text is cut,
    status "truncated"). `mode` / `unsafe_hook`: the sandbox's isolation
    (rlvr.verifiers.sandbox); resolved here, so a machine without namespaces fails now unless
    the audit-hook mode is accepted. Thread-safe: calls share nothing."""

    def __init__(
        self,
        specs: Sequence[str | Callable[..., Any]],
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        output_kb: int = 256,
        max_result_chars: int = 4000,
        mode: str = "auto",
        unsafe_hook: bool = False,
    ):
        if timeout_s <= 0 or max_result_chars < 1:
            raise ValueError("timeout_s must be > 0 and max_result_chars >= 1")
        self.tools = {t.name: t for t in load_tools(specs)}
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self.limits = Limits(
            cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb, output_kb=output_kb
        )
        self.mode = resolve_mode(mode, unsafe_hook)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the chat template's `tools=`."""
        return [t.schema for t in self.tools.values()]

    def call(self, name: str, arguments: Any) -> ToolResult:
        """Run the tool `name` on `arguments` (a JSON object) in its own sandbox; every failure
        is a result with an error status and a message for the model, never an exception."""
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(
                name, "unknown_tool", f"Error: no tool named {name!r} (tools: {known})"
            )
        problem = argument_errors(tool, arguments)
        if problem:
            return ToolResult(name, "bad_arguments", f"Error: {name}(): {problem}")
        request = {
            "harness": _HARNESS,
            "modules": {tool.module: tool.source},
            "function": tool.spec,
            "arguments": arguments,
        }
        if tool.pickled is not None:
            request["pickled"] = base64.b64encode(tool.pickled).decode("ascii")
        program = f"{_PROGRAM}\nmain({json.dumps(request)!r})\n"
        run = run_python(program, timeout=self.timeout_s, limits=self.limits, mode=self.mode)
        return self._result(tool.name, run)

    def _result(self, name: str, run: SandboxResult) -> ToolResult:
        """The ToolResult of a finished sandbox run of tool `name`."""
        if run.timed_out:
            return ToolResult(name, "timeout", f"Error: {name}() ran past {self.timeout_s:g} s")
        line, newline, _ = run.stdout.partition("\n")
        if not newline:
            if run.truncated:
                limit = f"{self.limits.output_kb} KiB"
                return ToolResult(name, "output_limit", f"Error: {name}()'s result is over {limit}")
            if "MemoryError" in run.stderr or run.returncode in (137, -9):  # 137: SIGKILL, OOM
                return self._memory(name)
            return ToolResult(
                name, "crashed", f"Error: {name}() exited without a result ({run.returncode})"
            )
        reply = _reply(line)
        if reply is None:  # only code in the sandbox could have written it
            return ToolResult(name, "crashed", f"Error: {name}() gave no usable result")
        if "value" in reply:
            try:
                text = _as_text(harness.decode(reply["value"]))
            except (ValueError, RecursionError):
                return ToolResult(name, "not_plain_data", f"Error: {name}() gave no usable result")
            if len(text) > self.max_result_chars:
                cut = len(text) - self.max_result_chars
                text = f"{text[: self.max_result_chars]}\n[... {cut} more characters cut]"
                return ToolResult(name, "truncated", text)
            return ToolResult(name, "ok", text)
        if reply.get("raised") == "MemoryError":
            return self._memory(name)
        if "raised" in reply:
            what = f"{reply['raised']}: {reply['message']}"
            return ToolResult(name, "tool_error", f"Error: {name}() raised {what}")
        if "not_plain" in reply:
            what = reply["not_plain"]
            return ToolResult(
                name, "not_plain_data", f"Error: {name}() returned what is not plain data ({what})"
            )
        what = reply["import_failed"]
        return ToolResult(name, "tool_error", f"Error: {name}() could not be loaded: {what}")

    def _memory(self, name: str) -> ToolResult:
        limit = f"{self.limits.memory_mb} MB"
        return ToolResult(name, "memory_limit", f"Error: {name}() ran out of memory ({limit})")
