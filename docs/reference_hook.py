"""MkDocs hook: the site's reference pages, generated from the code at every build, so they cannot go
stale. The configuration references walk the pydantic models of `rlvr train`'s and `rlvr serve`'s
YAML (every key with its type, default, constraints and description, every registered method's
section included); the CLI reference walks the `rlvr` command's argparse parser.

    mkdocs.yml:  hooks: [docs/reference_hook.py]
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

PAGES = {
    "reference/config.md": "config_reference",
    "reference/serve-config.md": "serve_config_reference",
    "reference/cli.md": "cli_reference",
}
"""Generated page -> the function of this module that writes it."""

CONSTRAINTS = (
    (annotated_types.Gt, "gt", "> {}"),
    (annotated_types.Ge, "ge", ">= {}"),
    (annotated_types.Lt, "lt", "< {}"),
    (annotated_types.Le, "le", "<= {}"),
    (annotated_types.MinLen, "min_length", "length >= {}"),
    (annotated_types.MaxLen, "max_length", "length <= {}"),
)


# --- configuration ---------------------------------------------------------------------------


def config_reference() -> str:
    """The training config's reference: every section of `rlvr train`'s YAML, then each
    registered method's section under `algorithm`."""
    from rlvr.config import Config, method_names, method_spec

    lines = [
        "# Training configuration",
        "",
        "Every key of `rlvr train`'s YAML (the presets in `configs/` are examples), generated from "
        "the pydantic models in `rlvr/config/schema.py` and the methods' packages at every build "
        "of this site. A key is set in the YAML, with `--set key=value` on the command line, or "
        "from Python with `rlvr.load_config(preset, {key: value})`. An unknown key, a wrong type "
        "or a value outside its constraints fails at load, naming the key; checks across keys "
        "are given in the descriptions.",
        "",
    ]
    for name, field in Config.model_fields.items():
        lines += section(name, field.annotation)
        if name == "algorithm":
            lines += method_sections(method_names(), method_spec)
    return "\n".join(lines)


def method_sections(names: list[str], spec: Callable[[str], Any]) -> list[str]:
    """`algorithm.<method>` for every registered method that brings a section."""
    lines = [
        "`algorithm.name` picks the method; the method's parameters are the section of the same "
        "name, read only when that method runs (another method's section may stay in a preset, "
        "where it is checked but not used). Methods without a section: "
        + ", ".join(f"`{n}`" for n in names if spec(n).section is None)
        + ".",
        "",
    ]
    for name in names:
        model = spec(name).section
        if model is not None:
            lines += section(f"algorithm.{name}", model, level=3)
    return lines


def serve_config_reference() -> str:
    """`rlvr serve`'s config reference."""
    from rlvr.serving.config import ServeConfig

    lines = [
        "# Serving configuration",
        "",
        "Every key of `rlvr serve`'s YAML (`configs/serve-tiny.yaml` is an example), generated "
        "from the pydantic models in `rlvr/serving/config.py` at every build of this site. Keys "
        "are set as for training: in the YAML, with `--set key=value`, or from Python "
        "(`rlvr.serve(preset, {key: value})`); list items by index (`csa.streams.0.alpha=0.2`).",
        "",
    ]
    top = [(n, f) for n, f in ServeConfig.model_fields.items() if _nested(f.annotation) is None]
    if top:
        lines += ["## Top-level keys", "", *table(top)]
    for name, field in ServeConfig.model_fields.items():
        if _nested(field.annotation) is not None:
            lines += section(name, _nested(field.annotation))
    return "\n".join(lines)


def section(key: str, model: type[BaseModel], level: int = 2) -> list[str]:
    """A section's heading, its description and the table of its keys, then its subsections
    (nested sections, and the items of lists of sections as `key[]`)."""
    lines = [f"{'#' * level} {key}", ""]
    doc = model.__doc__ if "__doc__" in vars(model) else None
    if doc:
        lines += [" ".join(doc.split()), ""]
    fields = [(n, f) for n, f in model.model_fields.items() if not _nested(f.annotation)]
    if fields:
        lines += table(fields)
    for name, field in model.model_fields.items():
        sub = _nested(field.annotation)
        if sub is not None:
            alias = field.alias or name
            many = _model_of(field.annotation) is None  # a list of sections
            lines += section(f"{key}.{alias}{'[]' if many else ''}", sub, min(level + 1, 6))
    return lines


def table(fields: list[tuple[str, FieldInfo]]) -> list[str]:
    """One row per key: its name, type (and constraints below it), default and description."""
    rows = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for name, field in fields:
        kind = " \\| ".join(code(t) for t in type_names(field.annotation))
        bounds = constraints(field)
        if bounds:
            kind += f"<br>{escape(bounds)}"
        description = " ".join((field.description or "").split())
        rows.append(
            f"| {code(field.alias or name)} | {kind} | {code(default(field))} | "
            f"{escape(description)} |"
        )
    return [*rows, ""]


def code(text: str) -> str:
    """A code span for a table cell (a table row is not split at a pipe inside one)."""
    if not text:
        return ""
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


def escape(text: str) -> str:
    """Prose for a table cell: its pipes, and its angle brackets (not HTML), escaped."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def constraints(field: FieldInfo) -> str:
    """The field's bounds, as `> 0, <= 1`."""
    found = []
    for meta in field.metadata:
        for kind, attr, form in CONSTRAINTS:
            if isinstance(meta, kind):
                found.append(form.format(getattr(meta, attr)))
    return ", ".join(found)


def default(field: FieldInfo) -> str:
    """The default as YAML would write it ('required' when there is none)."""
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return ""
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return yaml_text(value)


def yaml_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if value == "" or value.strip() != value else value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def type_names(annotation: Any) -> list[str]:
    """A field's type as a reader writes it, one entry per alternative: `int`, `null`,
    `"a"` and `"b"` for a Literal, `list[str]`, `map[str, float]`, `callable`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_names(args[0])
    if origin is typing.Literal:
        return [json.dumps(a) if isinstance(a, str) else yaml_text(a) for a in args]
    if origin in (typing.Union, types.UnionType):
        return list(dict.fromkeys(name for a in args for name in type_names(a)))
    return [type_name(annotation)]


def type_name(annotation: Any) -> str:
    """One alternative of a type (`type_names`)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is not None and getattr(origin, "__name__", "") == "Callable":
        return "callable"
    if origin in (list, tuple, set):
        return f"list[{' | '.join(type_names(args[0]))}]" if args else "list"
    if origin is dict:
        return f"map[{type_name(args[0])}, {' | '.join(type_names(args[1]))}]"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, if it holds one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _nested(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, or holds a list of."""
    found = _model_of(annotation)
    if found is None and typing.get_origin(annotation) is list:
        found = _model_of(typing.get_args(annotation)[0])
    return found


# --- command line ----------------------------------------------------------------------------


USAGE_PART = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]|\S+")
"""One part of a usage line: an optional group (brackets nested once, as argparse writes
`[--k [K ...]]`), or a word."""


def wrap_usage(usage: str, width: int = 80) -> list[str]:
    """A usage line as the page's code block shows it without scrolling: broken between options,
    never inside one, the continuation lines indented."""
    lines = [""]
    for part in USAGE_PART.findall(usage):
        if lines[-1].strip() and len(lines[-1]) + 1 + len(part) > width:
            lines.append("    ")
        lines[-1] += part if not lines[-1].strip() else f" {part}"
    return lines


def cli_reference() -> str:
    """Every `rlvr` subcommand: its help, usage and options, from the parser itself."""
    from workflows.cli import build_parser

    parser = build_parser()
    lines = [
        "# Command line",
        "",
        f"{parser.description} Generated from the command's argparse parser "
        "(`workflows/cli.py`) at every build of this site; `rlvr COMMAND --help` prints the "
        "same. Configuration errors exit with status 2 before any actor starts.",
        "",
    ]
    for name, sub, text in subcommands(parser):
        lines += [f"## `rlvr {name}`", "", f"{text[0].upper()}{text[1:]}.", ""]
        usage = " ".join(sub.format_usage().split()).removeprefix("usage: ")
        lines += ["```text", *wrap_usage(usage), "```", ""]
        lines += options(sub)
    return "\n".join(lines)


def subcommands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, help) of each subcommand, in the order `rlvr --help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, helps.get(name) or ""


def options(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| Argument | Default | Description |", "|---|---|---|"]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            flags = ", ".join(action.option_strings)
            if action.nargs != 0:
                flags += f" {formatter._format_args(action, formatter._get_default_metavar_for_optional(action))}"
        else:
            flags = formatter._format_args(action, action.dest)
        text = formatter._expand_help(action) if action.help else ""
        if action.required:
            text = f"*required.* {text}"
        shown = "" if action.default in (None, False, [], argparse.SUPPRESS) else action.default
        if isinstance(shown, list):
            shown = " ".join(map(str, shown))
        rows.append(f"| {code(flags)} | {code(str(shown))} | {escape(' '.join(text.split()))} |")
    return [*rows, ""]


# --- the hook ----------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for path, writer in PAGES.items():
        files.append(File.generated(config, path, content=globals()[writer]()))
    return files
