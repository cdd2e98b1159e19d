"""The project's own imports run downward only: every module of rlvr/, actors/ and workflows/
imports modules of its own layer or of layers below it (`LAYERS`, bottom first), so there is no
import circle, and rlvr/ never imports Ray. Imports are read from the source (ast), every one of
them: at module level, inside functions and under TYPE_CHECKING alike."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rlvr", "actors", "workflows")
LAYERS = (
    # shared pieces with no project imports of their own
    ("rlvr.config.core", "rlvr.memory", "rlvr.files", "rlvr.answers"),
    # the papers' equations
    ("rlvr.algorithms",),
    # the libraries of the run's parts, each above those it uses
    ("rlvr.tasks",),
    ("rlvr.generation",),
    ("rlvr.verifiers",),
    ("rlvr.envs",),
    ("rlvr.models",),
    ("rlvr.training",),
    # the training config's schema, and the methods that extend it
    ("rlvr.config",),
    ("rlvr.methods",),
    # a run's bookkeeping and serving, then the public API
    ("rlvr.run",),
    ("rlvr.serving",),
    ("rlvr",),
    # Ray: actors, then the workflows that drive them
    ("actors",),
    ("workflows",),
)


@cache
def modules() -> dict[str, Path]:
    """Every module of the project's packages by dotted name (a package by its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported_names(name: str, path: Path) -> set[str]:
    """Dotted names a module's import statements mention (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def project_module(dotted: str) -> str | None:
    """The project module a dotted import name lands in (its longest known prefix), if any."""
    known = modules()
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


@cache
def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (itself and its own parent packages left out)."""
    edges = {}
    for name, path in modules().items():
        targets = {project_module(n) for n in imported_names(name, path)}
        edges[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return edges


def layer(module: str) -> int:
    """The index in `LAYERS` of the longest prefix that names the module's layer."""
    best, where = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), index
    if where is None:
        raise AssertionError(f"{module} is in no layer of LAYERS")
    return where


def test_every_import_runs_downward():
    upward = sorted(
        f"{source} (layer {layer(source)}) imports {target} (layer {layer(target)})"
        for source, targets in graph().items()
        for target in targets
        if layer(target) > layer(source)
    )
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph()[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                circles.append(sorted([module, *component]))

    for module in graph():
        if module not in index:
            visit(module)
    assert not circles, circles


def test_the_library_never_imports_ray():
    offenders = sorted(
        name
        for name, path in modules().items()
        if name.split(".")[0] == "rlvr"
        and any(n.split(".")[0] == "ray" for n in imported_names(name, path))
    )
    assert not offenders, offenders
