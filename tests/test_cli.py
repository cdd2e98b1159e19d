"""The `rlvr` command's own decisions, without training: where a demo writes, where the actors'
output goes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlvr.config import load_config
from workflows import cli

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["resources.policy_cpus=0.1", "resources.generator_cpus=0.1", "resources.num_verifiers=1"]


def test_fresh_run_name_skips_taken_names(tmp_path):
    assert cli.fresh_run_name(tmp_path, "demo") == "demo"
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo-2").mkdir()
    assert cli.fresh_run_name(tmp_path, "demo") == "demo-3"


def test_demo_keeps_an_earlier_run(tmp_path, capsys):
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=demo"])
    assert cli.demo_run_path(cfg, overwrite=False) == tmp_path / "demo"
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "metrics.jsonl").write_text("{}\n")
    path = cli.demo_run_path(cfg, overwrite=False)
    assert path == tmp_path / "demo-2" and cfg.run.name == "demo-2"
    assert (tmp_path / "demo" / "metrics.jsonl").read_text() == "{}\n"
    assert "runs as demo-2" in capsys.readouterr().err


def test_demo_overwrite_deletes_and_says_so(tmp_path, capsys):
    (tmp_path / "demo").mkdir()
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=demo"])
    assert cli.demo_run_path(cfg, overwrite=True) == tmp_path / "demo"
    assert not (tmp_path / "demo").exists() and cfg.run.name == "demo"
    assert f"deleting the earlier run {tmp_path / 'demo'}" in capsys.readouterr().err


def test_demo_and_train_flags(capsys, tmp_path):
    parser = cli.build_parser()
    for command in ("train", "demo"):
        assert not parser.parse_args([command]).engine_logs
        assert parser.parse_args([command, "--engine-logs"]).engine_logs
    assert parser.parse_args(["demo", "--overwrite"]).overwrite
    assert not parser.parse_args(["demo"]).overwrite
    assert cli.announce_engine_log(tmp_path) == tmp_path / cli.ENGINE_LOG
    assert str(tmp_path / cli.ENGINE_LOG) in capsys.readouterr().err


def test_init_ray_sends_worker_output_to_the_engine_log(tmp_path, monkeypatch):
    import ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, SMALL)
    cli.init_ray(cfg, tmp_path / "run" / cli.ENGINE_LOG)
    cli.init_ray(cfg)
    quiet, loud = calls
    assert quiet["log_to_driver"] is False and quiet["logging_level"] == logging.WARNING
    env = quiet["runtime_env"]
    assert env["env_vars"] == {cli.ENGINE_LOG_ENV: str(tmp_path / "run" / cli.ENGINE_LOG)}
    module, name = env["worker_process_setup_hook"].rsplit(".", 1)
    assert getattr(sys.modules[module], name) is cli.redirect_worker_output
    assert loud["log_to_driver"] is True and "runtime_env" not in loud


def test_redirect_worker_output_takes_the_file_descriptors(tmp_path):
    """Python prints, logging and child processes all land in the file, none on the console."""
    log = tmp_path / "run" / cli.ENGINE_LOG
    script = textwrap.dedent(
        """
        import logging, os, subprocess, sys
        from workflows.cli import redirect_worker_output
        redirect_worker_output()
        print("python stdout")
        logging.getLogger("vllm").warning("python logging")
        subprocess.run(["sh", "-c", "echo child stdout; echo child stderr >&2"], check=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, cli.ENGINE_LOG_ENV: str(log)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "" and done.stderr == ""
    text = log.read_text()
    for line in ("python stdout", "python logging", "child stdout", "child stderr"):
        assert line in text


def test_quiet_driver_silences_library_start_up_notes():
    """DeepSpeed's accelerator note and transformers' progress bars stay off the console."""
    script = textwrap.dedent(
        """
        from workflows.cli import quiet_driver
        quiet_driver()
        from deepspeed.accelerator import get_accelerator
        from transformers.utils import logging
        get_accelerator()
        assert not logging.is_progress_bar_enabled()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout == "" and "accelerator" not in done.stderr


@pytest.mark.ray
def test_actor_output_reaches_the_engine_log_not_the_console(tmp_path):
    """A real cluster started as `rlvr train` starts it: an actor's prints go to the run's file,
    also from an actor with environment variables of its own (a model actor on jemalloc: Ray
    merges them with the run's)."""
    log = tmp_path / "run" / cli.ENGINE_LOG
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        import ray
        from rlvr.config import ResourcesConfig, load_config
        from workflows.cli import init_ray
        from workflows.components import allocator_env

        class Talker:
            def talk(self):
                from rlvr.memory import jemalloc_active

                print("actor says hello", flush=True)
                print("actor warns", file=sys.stderr, flush=True)
                return jemalloc_active()

        def talk(**options):
            talker = ray.remote(Talker).options(num_cpus=0, **options).remote()
            return ray.get(talker.talk.remote())

        init_ray(load_config(None, {SMALL!r}), Path({str(log)!r}))
        assert talk() is False
        env = allocator_env(ResourcesConfig(allocator="jemalloc"))
        assert talk(runtime_env={{"env_vars": env}}) is True
        ray.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "actor says" not in done.stdout + done.stderr
    assert "actor warns" not in done.stdout + done.stderr
    text = log.read_text()
    assert text.count("actor says hello") == 2 and text.count("actor warns") == 2


CALIBRATE = ["calibrate", "--checkpoint", "tiny", "--data", str(ROOT / "configs" / "tiny.yaml")]


def test_calibrate_sizes_its_engine_as_told(monkeypatch):
    """Left to size itself, vLLM on CPU claims 90% of the memory and refuses to start when other
    processes hold more than a tenth of it; calibrate always fixes the KV cache."""
    import workflows.calibrate
    from workflows.calibrate import EngineOptions

    seen = {}

    def fake_run_calibrate(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(workflows.calibrate, "run_calibrate", fake_run_calibrate)
    with pytest.raises(SystemExit):
        cli.main(CALIBRATE)
    assert seen["engine"] == EngineOptions("float32", 1024, 1.0, enforce_eager=False, threads=None)
    sized = ["--dtype", "bfloat16", "--max-model-len", "128", "--kv-cache-gib", "0.5"]
    with pytest.raises(SystemExit):
        cli.main([*CALIBRATE, *sized, "--enforce-eager", "--threads", "1"])
    assert seen["engine"] == EngineOptions("bfloat16", 128, 0.5, enforce_eager=True, threads=1)


def test_engine_options_are_the_backends_keywords():
    from workflows.calibrate import EngineOptions

    options = EngineOptions("bfloat16", 128, 0.5, enforce_eager=True, threads=2)
    assert options.backend_kwargs("vllm") == {
        "dtype": "bfloat16",
        "max_model_len": 128,
        "kv_cache_gib": 0.5,
        "enforce_eager": True,
        "cpu_threads": 2,
    }
    assert options.backend_kwargs("hf") == {"dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--kv-cache-gib", "0"], "--kv-cache-gib must be a number > 0, got 0.0"),
        (["--kv-cache-gib", "nan"], "--kv-cache-gib must be a number > 0, got nan"),
        (["--kv-cache-gib", "1e6"], "--kv-cache-gib 1e+06 exceeds the"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
        (["--max-model-len", "200"], "--max-tokens must be < --max-model-len"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    ],
)
def test_calibrate_names_a_bad_engine_option_before_loading_anything(
    bad, message, monkeypatch, capsys
):
    import workflows.calibrate

    def never(*args, **kwargs):
        raise AssertionError("a model was resolved despite a bad option")

    monkeypatch.setattr(workflows.calibrate, "resolve_model_path", never)
    monkeypatch.setattr(workflows.calibrate, "_on_gpu", lambda: False)
    try:
        assert cli.main([*CALIBRATE, *bad]) == 2
    except SystemExit as err:  # argparse's own refusal
        assert err.code == 2
    assert message in capsys.readouterr().err


def test_a_kv_cache_larger_than_free_memory_is_vllm_on_cpu_only(monkeypatch):
    """The hf backend has no KV cache to size, and a GPU holds vLLM's."""
    import workflows.calibrate
    from workflows.calibrate import EngineOptions

    huge = EngineOptions(kv_cache_gib=1e6)
    huge.check("hf")
    monkeypatch.setattr(workflows.calibrate, "_on_gpu", lambda: True)
    huge.check("vllm")
