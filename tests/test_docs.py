"""The documentation site: it builds with `mkdocs build --strict` (a broken link, reference or
docstring fails), and its generated reference pages hold every key of the training and serving
configs (every registered method's section included) and every option of the `rlvr` command."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from rlvr.config import Config, key_tree, method_names, method_spec
from rlvr.serving.config import ServeConfig
from workflows.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "docs" / "reference_hook.py"


def _hook():
    spec = importlib.util.spec_from_file_location("reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _hook()


def documented_keys(page: str) -> dict[str, str]:
    """{dotted key: its table row} of a generated config page: each row's key below the section
    heading above it (a list of sections reads `key[]`, its items' keys below that)."""
    keys: dict[str, str] = {}
    section = ""
    for line in page.splitlines():
        heading = re.match(r"#+ (.+)$", line)
        if heading:  # a title of words ("Top-level keys") holds top-level keys
            section = "" if " " in heading.group(1) else heading.group(1)
            if section:
                keys[section.removesuffix("[]")] = line
        row = re.match(r"\| `([^`]+)` \|", line)
        if row:
            keys[f"{section}.{row.group(1)}" if section else row.group(1)] = line
    return keys


def leaves(tree: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a `key_tree`."""
    out = []
    for key, sub in tree.items():
        out += leaves(sub, f"{prefix}{key}.") if sub else [f"{prefix}{key}"]
    return out


def list_sections(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel]]:
    """Fields holding a list of sections, by dotted key (their items' keys are documented too)."""
    found = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        sub = hook._nested(field.annotation)
        if sub is not None:
            if hook._model_of(field.annotation) is None:
                found[key] = sub
            found |= list_sections(sub, f"{key}.")
    return found


def expected_keys(model: type[BaseModel]) -> list[str]:
    keys = leaves(key_tree(model))
    for key, item in list_sections(model).items():
        keys += [f"{key}[].{k}" for k in leaves(key_tree(item))]
    return keys


@pytest.mark.parametrize("method", method_names())
def test_the_config_reference_documents_every_key_of_every_method(method):
    from rlvr.config import config_model

    page = hook.config_reference()
    documented = documented_keys(page)
    missing = [k for k in expected_keys(config_model(method)) if k not in documented]
    assert not missing
    # every field's description is shown, whitespace aside
    text = " ".join(page.split())
    section = method_spec(method).section
    for model in (Config, *([section] if section else [])):
        for field in model.model_fields.values():
            if field.description:
                assert hook.escape(" ".join(field.description.split())) in text


def test_a_config_row_shows_type_constraints_default_and_description():
    rows = documented_keys(hook.config_reference())
    assert rows["training.lr"] == ("| `lr` | `float`<br>> 0.0 | `1e-05` | AdamW learning rate. |")
    assert rows["training.loss_agg"].startswith(
        '| `loss_agg` | `"token-mean"` \\| `"seq-mean-token-mean"` \\| `"seq-mean-token-sum-norm"`'
        " | `token-mean` |"
    )
    assert rows["model.lora.target_modules"].startswith(
        '| `target_modules` | `list[str]` | `["q_proj", "k_proj", "v_proj", "o_proj", '
    )
    assert "| `function` | `str` \\| `callable` \\| `null` | `null` |" in rows["verifier.function"]
    assert rows["env.class"].startswith("| `class` | `str` \\| `callable` \\| `null` | `null` |")
    assert rows["algorithm.laconic.budget"].startswith("| `budget` |")
    assert rows["task.difficulty.operators"].startswith("| `operators` | `str`<br>length >= 1 |")


def test_the_serve_config_reference_documents_every_key():
    documented = documented_keys(hook.serve_config_reference())
    missing = [k for k in expected_keys(ServeConfig) if k not in documented]
    assert not missing
    assert "csa.streams[].alpha" in documented


def test_the_cli_reference_documents_every_command_and_option():
    page = hook.cli_reference()
    for name, sub, _ in hook.subcommands(build_parser()):
        assert f"## `rlvr {name}`" in page
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings or [action.dest]:
                assert re.search(rf"\| `{re.escape(flag)}[ `]", page), (name, flag)
    # argparse's %-escapes are expanded, as --help prints them
    assert "claims 90% of the memory" in page


def test_the_site_builds_strict(tmp_path):
    """mkdocs build --strict, as `make docs` runs it: the generated pages, the API reference
    (mkdocstrings reads the docstrings of workflows.api) and every internal link resolve."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    site = tmp_path / "site"
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "max_uncomputed_share" in config and "algorithm.duet" in config
    assert "--engine-logs" in (site / "reference" / "cli" / "index.html").read_text()
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("train", "TrainingRun.stop", "evaluate", "serve", "Deployment"):
        assert f'id="workflows.api.{name}"' in api, name
    assert 'id="rlvr.config.schema.load_config"' in api
    assert "One training step" in (site / "concepts" / "index.html").read_text()


def test_usage_lines_fit_the_page_and_keep_every_option_whole():
    usage = (
        "rlvr x [-h] --checkpoint CHECKPOINT [--data DATA] [--k K [K ...]] [--backend {vllm,hf}]"
    )
    lines = hook.wrap_usage(usage, width=40)
    assert lines == [
        "rlvr x [-h] --checkpoint CHECKPOINT",
        "    [--data DATA] [--k K [K ...]]",
        "    [--backend {vllm,hf}]",
    ]
    page = hook.cli_reference()
    for block in re.findall(r"```text\n(.*?)```", page, re.S):
        assert all(len(line) <= 80 for line in block.splitlines()), block
