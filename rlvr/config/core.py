"""The machinery every config of the project shares: typed sections that refuse unknown keys,
YAML 1.2 documents, `--set a.b=c` overrides, shipped presets and errors that name the dotted key.
The training config (`rlvr.config.schema`) and the serving config (`rlvr.serving.config`) are
built on it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration problem, naming the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


Overrides = Sequence[str] | Mapping[str, Any]
"""Config overrides: `--set` strings (`"run.steps=4"`, the value read as YAML) or, from Python, a
mapping of dotted keys to values taken as they are (`{"run.steps": 4, "verifier.function": fn}`)."""


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """A pydantic error as one line per problem, each naming its dotted key (below `prefix`)."""
    lines = []
    for e in err.errors():
        key = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        # a section's check that names a key below it already says where
        names_key = key == "<root>" or msg.startswith(f"{key}.") or msg.startswith(f"{key}:")
        lines.append(msg if names_key else f"{key}: {msg}")
    head = "" if prefix else "invalid config: "
    return head + "; ".join(lines)


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false, so that a setting's
    'off' (training.engine_is, resources.engine_sleep) or a 'yes' stays the string it reads as."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """A config document (or an override's value) as Python data, with YAML 1.2 booleans."""
    return yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader: no arbitrary objects


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split 'a.b=c' into (['a', 'b'], value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    return key.split("."), load_yaml(raw) if raw else ""


def override_items(overrides: Overrides) -> list[tuple[list[str], Any]]:
    """Overrides as (key path, value) pairs, in order; ConfigError for a malformed one."""
    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides: {overrides!r} is one string; give a list of 'key.path=value' strings "
            "or a mapping of dotted keys to values"
        )
    if not isinstance(overrides, Mapping):
        return [parse_override(item) for item in overrides]
    items = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not key or "" in key.split("."):
            raise ConfigError(f"override key {key!r} must be a dotted key such as 'run.steps'")
        items.append((key.split("."), value))
    return items


def apply_overrides(
    data: dict[str, Any],
    overrides: Overrides,
    known: dict[str, Any] | None = None,
    kind: str = "config",
    unknown_key: Callable[[str, list[str]], str] | None = None,
) -> dict[str, Any]:
    """Apply overrides (`--set a.b=c` strings or a mapping, `Overrides`) to raw YAML data; errors
    read "invalid {kind}: KEY: why".

    With `known` (the schema's tree of keys, `key_tree`) a path outside it fails here naming the
    key (`unknown_key` words that error; its sections hold no list items); without, unknown keys
    are left to the caller's validation and list items are addressed by index (serve's
    csa.streams.0.alpha).
    """
    check_keys = known is not None
    sections = dict if check_keys else dict | list
    for path, value in override_items(overrides):
        node: Any = data
        schema = known
        for i, part in enumerate(path):
            dotted = ".".join(path[: i + 1])
            if check_keys:
                if not isinstance(schema, dict) or part not in schema:
                    why = unknown_key(dotted, path) if unknown_key else f"{dotted}: unknown key"
                    raise ConfigError(f"invalid {kind}: {why}")
                schema = schema[part]
            key: str | int = part
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"invalid {kind}: {dotted}: no such list item")
                key = int(part)
            if i == len(path) - 1:
                node[key] = value
            else:
                node = node[key] if isinstance(node, list) else node.setdefault(part, {})
                if not isinstance(node, sections):
                    raise ConfigError(f"invalid {kind}: {dotted}: is not a section")
    return data


def key_tree(model: type[BaseModel]) -> dict[str, Any]:
    """Every key of a config model, nested by section (a leaf is None): what `apply_overrides`
    accepts."""
    tree: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        nested = isinstance(kind, type) and issubclass(kind, BaseModel)
        tree[field.alias or name] = key_tree(kind) if nested else None
    return tree


def presets() -> dict[str, Path]:
    """The presets shipped with the package, by name (`tiny` -> .../configs/tiny.yaml)."""
    from importlib.resources import files

    root = Path(str(files("configs")))
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def resolve_config_path(path: str | Path, kind: str = "config") -> Path:
    """`path` when that file exists, else the shipped preset of that name (`tiny`, `tiny.yaml`,
    `configs/tiny.yaml`: the same preset from any directory); ConfigError naming the presets."""
    path = Path(path)
    if path.is_file():
        return path
    shipped = presets()
    name = path.stem if path.suffix in (".yaml", ".yml") else path.name
    if path.parent in (Path("."), Path("configs")) and name in shipped:
        return shipped[name]
    raise ConfigError(f"{kind} file not found: {path} (shipped presets: {', '.join(shipped)})")


def read_yaml_sections(path: str | Path | None, kind: str = "config") -> dict[str, Any]:
    """The mapping of sections in a YAML file or shipped preset ({} for none), or a ConfigError
    saying why not."""
    if path is None:
        return {}
    path = resolve_config_path(path, kind)
    loaded = load_yaml(path.read_text())
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return loaded or {}


def vllm_on_cpu(backend: str, gpus: float = 0.0) -> bool:
    """Whether generation runs on vLLM's CPU backend: vLLM engines given no GPU (vLLM then finds
    no CUDA device in the engine's process)."""
    return backend == "vllm" and not gpus
