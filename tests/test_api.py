"""The Python API's surface without a run: `import rlvr` stays light (no Ray, no workflows), its
names resolve lazily to the functions the command uses, and bad input fails with the command's
ConfigErrors before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import rlvr
from rlvr.run.rundir import RunDir
from workflows import api, cli

ROOT = Path(__file__).resolve().parent.parent


def test_import_rlvr_loads_nothing_else():
    probe = (
        "import sys, rlvr; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'workflows', 'actors', "
        "'torch', 'transformers', 'rlvr.config'}); "
        "print(heavy, [m for m in sys.modules if m.startswith('rlvr.')])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[] []"


def test_the_public_names_are_the_api_s_and_resolve_on_use():
    assert rlvr.train is api.train and rlvr.evaluate is api.evaluate and rlvr.serve is api.serve
    assert rlvr.TrainingRun is api.TrainingRun and rlvr.Deployment is api.Deployment
    from rlvr.config import Config, ConfigError, load_config

    assert (rlvr.Config, rlvr.ConfigError, rlvr.load_config) == (Config, ConfigError, load_config)
    assert set(rlvr.__all__) <= set(dir(rlvr))
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        rlvr.trian  # noqa: B018


def test_the_api_refuses_bad_input_as_the_command_does(tmp_path):
    with pytest.raises(rlvr.ConfigError, match="^invalid config: run.nope: unknown key$"):
        rlvr.train("tiny", {"run.nope": 1})
    assert cli.main(["train", "--config", "tiny", "--set", "run.nope=1"]) == 2
    with pytest.raises(rlvr.ConfigError, match="resume=True continues the run its config names"):
        rlvr.train(resume=True)
    with pytest.raises(rlvr.ConfigError, match="not a run directory"):
        rlvr.train("tiny", resume=tmp_path)
    with pytest.raises(rlvr.ConfigError, match="config file not found"):
        rlvr.serve("no-such-serve-config")
    with pytest.raises(rlvr.ConfigError, match="evaluation input"):
        rlvr.evaluate(tmp_path / "nothing-here")


def _reward(prompts, responses, golds, metadata):
    return [0.0] * len(responses)


def test_a_resume_must_keep_the_run_s_config(tmp_path):
    cfg = rlvr.load_config(
        "tiny",
        {"run.output_dir": str(tmp_path), "verifier.kind": "python", "verifier.function": _reward},
    )
    run_dir = tmp_path / cfg.run.name
    RunDir(run_dir).create(cfg.to_dict())  # as a run saves it: the function by its name
    api.same_run(cfg, run_dir)  # the same config, the function passed again as an object
    changed = api.as_config(cfg, {"training.lr": 3e-4, "run.steps": 3})
    assert cfg.training.lr != 3e-4  # the original is left as it was
    with pytest.raises(rlvr.ConfigError, match=r"at run.steps \(3 here, 12 there\), training.lr"):
        api.same_run(changed, run_dir)


def test_a_run_started_with_python_objects_resumes_only_with_its_config(tmp_path):
    class Guess:  # defined here, as in a notebook: config.yaml can only name it
        def reset(self, problem):
            return [{"role": "user", "content": problem.prompt}]

        def step(self, message):
            return [], 1.0, True

    cfg = rlvr.load_config(
        "tiny", {"run.output_dir": str(tmp_path), "env.kind": "python", "env.class": Guess}
    )
    run_dir = tmp_path / cfg.run.name
    RunDir(run_dir).create(cfg.to_dict())
    api.same_run(cfg, run_dir)  # the config that holds the class resumes it
    named = r"started with Python objects \(tests\.test_api:test_a_run.*<locals>\.Guess\)"
    with pytest.raises(rlvr.ConfigError, match=named):
        rlvr.train(resume=run_dir)
    with pytest.raises(rlvr.ConfigError, match=named):
        rlvr.evaluate(run_dir)


def test_a_plug_in_from_a_module_the_actors_cannot_import_crosses_by_value(tmp_path, monkeypatch):
    from ray import cloudpickle as ray_pickle

    from workflows.cluster import send_plugins_by_value

    (tmp_path / "notebook_helpers.py").write_text(
        "HALF = 0.5\n\n"
        "def half_reward(prompts, responses, golds, metadata):\n"
        "    return [HALF] * len(responses)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # on this driver's path only, as a notebook's
    import notebook_helpers

    cfg = rlvr.load_config(
        "tiny", {"verifier.kind": "python", "verifier.function": notebook_helpers.half_reward}
    )
    load = (
        "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); "
        "print(f([''], ['x'], [''], [{}]))"
    )
    try:
        by_reference = subprocess.run(
            [sys.executable, "-c", load],
            input=ray_pickle.dumps(cfg.verifier.function),
            capture_output=True,
            cwd=ROOT,
        )
        assert b"No module named 'notebook_helpers'" in by_reference.stderr
        send_plugins_by_value(cfg)
        by_value = subprocess.run(
            [sys.executable, "-c", load],
            input=ray_pickle.dumps(cfg.verifier.function),
            capture_output=True,
            cwd=ROOT,
            check=True,
        )
        assert by_value.stdout.strip() == b"[0.5]"
    finally:
        ray_pickle.unregister_pickle_by_value(notebook_helpers)
