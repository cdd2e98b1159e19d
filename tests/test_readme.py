"""README.md and the documentation pages (docs/) are executable: every command of their ```bash
blocks is accepted by the code as written, and their ```python blocks run up to the call that
would start a run, whose arguments must be valid.

`rlvr train` / `rlvr demo` lines load their config with their `--set` overrides exactly as the CLI
does and run the CLI's pre-actor `prepare_training` (loggers' packages, model, task, SFT warm-up:
built once, then cached); other `rlvr`, `ray` and `bench/*.py` lines go through their own argument
parsers; `make` targets are dry-run; every repository file the README names must exist. A README
line no check knows fails, so a new example cannot go untested.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import runpy
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import Config, apply_overrides, load_config, override_keys
from rlvr.serving.config import ServeConfig, load_serve_config
from workflows.cli import DEMO_CONFIG, build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README = "\n".join(page.read_text() for page in PAGES)
"""Every page's text, as one: each check below holds for all of them."""
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
DEMO_BENCH = ROOT / "bench" / "out" / "staleness-smollm2" / "staleness.json"
"""The committed runs of the demo's preset (configs/smollm2-arith.yaml) that the pages quote."""
DEMO_PAGES = ["README.md", "docs/index.md", "docs/quickstart.md"]
REPO_PATH = re.compile(r"\b(?:configs|bench|notebooks)/[\w.-]+\.\w+")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def commands(block: str) -> list[list[str]]:
    """The block's commands as argument lists: continuations joined, comments and blanks dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    return [words for line in lines if (words := shlex.split(line, comments=True))]


def program(words: list[str]) -> tuple[str, list[str]]:
    """(program name, its arguments), past leading VAR=value assignments and a `.venv/bin/`."""
    while ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    return Path(words[0]).name, words[1:]


COMMANDS = list({shlex.join(w): w for block in BLOCKS for w in commands(block)}.values())
"""Each distinct command once, in the order the pages show them."""


def marked(words: list[str]) -> Any:
    """A command as a test parameter; SmolLM2 runs are `slow` (unpacking it takes half a minute,
    once: it is cached)."""
    name, args = program(words)
    smollm2 = name == "rlvr" and any("smollm2" in a for a in args)
    return pytest.param(words, marks=[pytest.mark.slow] if smollm2 else [])


def parse_rlvr(argv: list[str]) -> argparse.Namespace:
    """`rlvr`'s own parser on `argv`; a rejected line fails the test with argparse's message."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"rlvr rejects {shlex.join(argv)} (exit {err.code})")


def check_rlvr(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse; a training line also loads, validates and prepares its config as the CLI would, up
    to the SFT warm-up: that trains for a minute on the tiny presets (tests/models/test_sft.py
    covers it), and only its arguments are checked here."""
    import workflows.train
    from workflows.train import prepare_training

    def warmup_arguments_only(model_dir, problems, out_dir, *, steps, **kwargs):
        assert model_dir.is_dir() and problems and steps > 0
        return model_dir

    args = parse_rlvr(argv)
    if args.command in ("train", "demo") and not getattr(args, "resume", None):
        monkeypatch.setattr(workflows.train, "sft_warmup", warmup_arguments_only)
        prepare_training(load_config(args.config or DEMO_CONFIG, args.set))
    elif args.command in ("filter", "rubrics"):
        load_config(args.config, args.set)
    elif args.command == "serve":
        load_serve_config(args.config, args.set)
    elif args.command == "calibrate":
        assert Path(args.data).is_file(), f"--data {args.data} is not a file"


def check_ray(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's click parser on `argv`; `ray job submit -- ENTRYPOINT` checks the entrypoint too."""
    import click
    from ray.scripts.scripts import cli

    command, rest = cli, argv
    while isinstance(command, click.Group) and rest and rest[0] in command.commands:
        command, rest = command.commands[rest[0]], rest[1:]
    try:
        ctx = command.make_context(command.name, list(rest))
    except click.ClickException as err:
        pytest.fail(f"ray rejects {shlex.join(argv)}: {err.format_message()}")
    entrypoint = ctx.params.get("entrypoint")
    if entrypoint:
        check(list(entrypoint), monkeypatch)


class Parsed(Exception):
    """Raised in place of running a script once its arguments have parsed."""


def check_script(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a bench script up to its `parse_args` (the arguments must parse), and no further."""
    script = ROOT / argv[0]
    assert script.is_file(), f"{argv[0]} does not exist"
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [str(script), *argv[1:]])
    monkeypatch.syspath_prepend(str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as err:
        pytest.fail(f"{argv[0]} rejects {shlex.join(argv[1:])} (exit {err.code})")
    except Parsed:
        return
    pytest.fail(f"{argv[0]} never parsed its arguments")


def check_make(targets: list[str]) -> None:
    """A dry run (`make -n`): each target exists and its recipe expands."""
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), *targets], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def check(words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch one README command to the check of its program."""
    name, args = program(words)
    if name == "rlvr":
        check_rlvr(args, monkeypatch)
    elif name == "ray":
        check_ray(args, monkeypatch)
    elif name == "make":
        check_make(args)
    elif name == "python":
        check_script(args, monkeypatch)
    elif name == "export":
        assert all(ENV_ASSIGNMENT.match(a) for a in args), shlex.join(words)
    else:
        pytest.fail(f"no check for the README command {shlex.join(words)}; add one")


@pytest.mark.parametrize("words", [marked(w) for w in COMMANDS], ids=lambda w: shlex.join(w)[:80])
def test_readme_command(words, monkeypatch):
    monkeypatch.chdir(ROOT)  # README commands run from the repository root
    assert not [w for w in words if re.fullmatch(r"<[^>]*>", w)], "placeholders do not run"
    check(words, monkeypatch)


def test_readme_blocks_are_bash():
    for block in BLOCKS:
        done = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert done.returncode == 0, f"{done.stderr}\n{block}"


def test_readme_names_existing_files():
    missing = sorted({p for p in REPO_PATH.findall(README) if not (ROOT / p).exists()})
    assert not missing


def test_readme_override_examples_name_real_keys():
    """Inline `a.b=c` examples (e.g. `algorithm.duet.allocate=false`) name existing keys: of the
    training config (the keys `--set` accepts; every method's section is among them), or of the
    serve config for its own sections (e.g. `http.`). Only the keys: an inline example is a
    fragment of a config, which alone need not validate."""
    examples = re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+=[^`\s]+)`", README)
    assert examples
    serve_only = set(ServeConfig.model_fields) - set(Config.model_fields)
    serve = [e for e in examples if e.split(".")[0] in serve_only]
    training = [e for e in examples if e not in serve]
    apply_overrides({}, training, known=override_keys("grpo"))
    load_serve_config(None, serve)


def test_readme_serves_what_it_calibrates(monkeypatch):
    """The calibration lands where the served config reads it, and its answers fit the context."""
    monkeypatch.chdir(ROOT)
    parsed = [parse_rlvr(program(w)[1]) for w in COMMANDS if program(w)[0] == "rlvr"]
    (cal,) = [a for a in parsed if a.command == "calibrate"]
    (serve,) = [a for a in parsed if a.command == "serve"]
    cfg = load_serve_config(serve.config, serve.set)
    if cfg.csa.calibration is None:
        assert cal.out is None and Path(cal.checkpoint) == Path(cfg.model.adapter or cfg.model.path)
    else:
        assert Path(cal.out) == Path(cfg.csa.calibration)
    assert cal.max_tokens < cfg.generation.max_model_len


def test_rlvr_entry_point_runs():
    done = subprocess.run(
        [str(Path(sys.executable).parent / "rlvr"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "train" in done.stdout and "serve" in done.stdout


class Reached(Exception):
    """A documented Python example reached a call that would start a run, with valid arguments."""


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.strip().splitlines()[-1][:60])
def test_docs_python_examples_run_up_to_their_runs(block, monkeypatch):
    """Each ```python block runs for real (its configs load and validate, its reward functions
    pickle) until it calls rlvr.train, rlvr.evaluate or rlvr.serve: that call's config must be
    valid, and the example stops there."""
    import rlvr
    from workflows.api import as_config

    def train(config=None, overrides=None, **options):
        as_config(config, overrides)
        raise Reached

    def evaluate(checkpoint, **options):
        raise Reached

    def serve(config=None, overrides=None, **options):
        load_serve_config(config, overrides)
        raise Reached

    for name, fn in (("train", train), ("evaluate", evaluate), ("serve", serve)):
        monkeypatch.setattr(rlvr, name, fn)
    monkeypatch.chdir(ROOT)
    with contextlib.suppress(Reached):
        exec(compile(block, "<docs>", "exec"), {"__name__": "__main__"})


def test_readme_is_a_front_page():
    """The README stays a front page: the manual lives in docs/, each page linked from here."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), link


def demo_figures() -> list[str]:
    """The demo's figures as the pages word them, read from `DEMO_BENCH`'s k = 0 runs (the
    demo's own setting, stopped early): its steps, held-out accuracy before training (one model
    whatever the seed) and the seeds' range after, and the median step in whole seconds."""
    runs = json.loads(DEMO_BENCH.read_text())["0"]
    [before] = {r["eval_accuracy_before"] for r in runs}
    after = sorted(r["eval_accuracy"] for r in runs)
    seeds = sorted(r["seed"] for r in runs)
    [steps] = {len(r["staleness"]) for r in runs}  # one token staleness per step
    step_s = statistics.median(r["time_step"] for r in runs)
    return [
        f"stopped at {steps} steps",
        f"from {before:.3f} to {after[0]:.3f}-{after[-1]:.3f} over seeds {seeds[0]}-{seeds[-1]}",
        f"about {step_s:.0f} s a step",
    ]


@pytest.mark.parametrize("page", DEMO_PAGES)
def test_demo_figures_are_the_committed_bench_s(page):
    """Each page's demo figures are those of the committed bench it names, not a run's memory."""
    text = " ".join((ROOT / page).read_text().split())
    assert DEMO_BENCH.relative_to(ROOT).as_posix() in text
    for figure in demo_figures():
        assert figure in text, f"{page} does not quote {figure!r} ({DEMO_BENCH.name})"
