"""The `rlvr` command's own decisions, without training: where a demo writes, where the actors'
output goes, how a run answers Ctrl-C and SIGTERM, and that its cluster ends with its driver."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from rlvr.config import load_config
from workflows import cli, cluster, reaper, stopping

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
    assert cluster.announce_engine_log(tmp_path) == tmp_path / cluster.ENGINE_LOG
    assert str(tmp_path / cluster.ENGINE_LOG) in capsys.readouterr().err


def test_init_ray_sends_worker_output_to_the_engine_log(tmp_path, monkeypatch):
    import ray

    calls = []

    def init(**kw):
        calls.append(kw)
        return SimpleNamespace(address_info={"session_dir": "/tmp/ray/session_x"})

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(cluster, "mark_environment", lambda: calls.append("mark"))
    monkeypatch.setattr(cluster, "start_reaper", lambda session: calls.append(("reaper", session)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, SMALL)
    cluster.init_ray(cfg, tmp_path / "run" / cluster.ENGINE_LOG)
    cluster.init_ray(cfg)
    # Each local cluster starts with the driver's mark, and its reaper knows its session.
    reaper_of = ("reaper", "/tmp/ray/session_x")
    assert calls[0] == calls[3] == "mark" and calls[2] == calls[5] == reaper_of
    quiet, loud = calls[1], calls[4]
    assert quiet["log_to_driver"] is False and quiet["logging_level"] == logging.WARNING
    env = quiet["runtime_env"]
    assert env["env_vars"] == {cluster.ENGINE_LOG_ENV: str(tmp_path / "run" / cluster.ENGINE_LOG)}
    module, name = env["worker_process_setup_hook"].rsplit(".", 1)
    assert getattr(sys.modules[module], name) is cluster.redirect_worker_output
    assert loud["log_to_driver"] is True and "runtime_env" not in loud


def test_redirect_worker_output_takes_the_file_descriptors(tmp_path):
    """Python prints, logging and child processes all land in the file, none on the console."""
    log = tmp_path / "run" / cluster.ENGINE_LOG
    script = textwrap.dedent(
        """
        import logging, os, subprocess, sys
        from workflows.cluster import redirect_worker_output
        redirect_worker_output()
        print("python stdout")
        logging.getLogger("vllm").warning("python logging")
        subprocess.run(["sh", "-c", "echo child stdout; echo child stderr >&2"], check=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, cluster.ENGINE_LOG_ENV: str(log)},
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
        from workflows.cluster import quiet_driver
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
    log = tmp_path / "run" / cluster.ENGINE_LOG
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        import ray
        from rlvr.config import ResourcesConfig, load_config
        from workflows.cluster import init_ray
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


# --------------------------------------------------------------------------- signals


def test_ctrl_c_asks_for_a_stop_at_the_next_step_boundary(capsys):
    """The first Ctrl-C only asks (and says so): the step in progress goes on, and the run stops
    where the next would begin. A second one, or SIGTERM, stops at once. The handlers that were
    there before come back after the run."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stopping.stopping_on_signals():
        stopping.stop_if_asked(0)  # nothing asked: the run goes on
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # a step in progress: the handler runs, and returns
        assert "stopping after the current step (Ctrl-C again" in capsys.readouterr().err
        with pytest.raises(stopping.RunStopped) as info:
            stopping.stop_if_asked(1)
        assert (info.value.signal_name, info.value.at_boundary, info.value.exit_code) == (
            "SIGINT",
            True,
            130,
        )
        with pytest.raises(stopping.RunStopped) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert not info.value.at_boundary
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    stopping.stop_if_asked(2)  # a new run starts with nothing asked
    with stopping.stopping_on_signals():
        with pytest.raises(stopping.RunStopped) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert (info.value.signal_name, info.value.at_boundary, info.value.exit_code) == (
            "SIGTERM",
            False,
            143,
        )
        # While the actors are stopped, another SIGTERM takes the default way out.
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_server_s_stop_event_is_set_by_ctrl_c_or_sigterm():
    """`rlvr serve`'s loop ends at a flag the signals set (not at a KeyboardInterrupt, which a Ray
    call can drop): Ctrl-C or SIGTERM sets it, a second Ctrl-C raises; off the main thread no
    handler is set; the handlers that were there before come back after."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for signum in (signal.SIGINT, signal.SIGTERM):
        with stopping.stop_event_on_signals() as stop:
            assert not stop.is_set()
            os.kill(os.getpid(), signum)
            assert stop.wait(timeout=30)  # seconds at most; the bound only catches a hang
            if signum == signal.SIGINT:
                with pytest.raises(KeyboardInterrupt):
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    seen = []

    def elsewhere() -> None:
        with stopping.stop_event_on_signals() as stop:
            seen.append((stop.is_set(), signal.getsignal(signal.SIGINT)))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [(False, before[0])]


def test_a_requested_stop_waits_for_its_step_and_the_earliest_request_wins():
    """`request_stop(after_step=k)` lets steps up to k commit and stops at the boundary before
    k + 1; a plain request, or an earlier step, overrides a later one; a new run starts clean."""
    with stopping.stopping_on_request():
        stopping.request_stop(after_step=2)
        for step in range(3):
            stopping.stop_if_asked(step)  # steps 0..2 go on
        with pytest.raises(stopping.RunStopped) as info:
            stopping.stop_if_asked(3)
        assert info.value.at_boundary
    with stopping.stopping_on_request():
        stopping.stop_if_asked(5)  # the request above ended with its run
        stopping.request_stop(after_step=4)
        stopping.request_stop(after_step=1)
        stopping.request_stop(after_step=3)  # later than the pending one: ignored
        stopping.stop_if_asked(1)
        with pytest.raises(stopping.RunStopped):
            stopping.stop_if_asked(2)
    with stopping.stopping_on_request():
        stopping.request_stop(after_step=4)
        stopping.request_stop()  # now, as a first Ctrl-C
        stopping.request_stop(after_step=9)  # cannot postpone it
        with pytest.raises(stopping.RunStopped):
            stopping.stop_if_asked(0)


def test_the_reaper_stops_what_a_killed_driver_started_and_nothing_else(tmp_path):
    """Once a driver is SIGKILLed, its reaper stops and names what carries a mark of its cluster:
    a child, a grandchild that left the driver's tree (as Ray's agents outlive their raylet),
    and a process without the environment mark that writes in the session directory (as Ray's
    agents, whose titles overwrite their environment). A process the driver started before its
    mark, and one that only reads a file of the session, are left alone."""
    session = tmp_path / "session"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "agent.log").write_text("")
    script = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from workflows.reaper import MARK_ENV, mark_environment, start_reaper

        def python(code, **kw):
            return subprocess.Popen([sys.executable, "-c", code], **kw)

        sleep = "import time; time.sleep(600)"
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        unmarked = python(sleep, **quiet)
        mark_environment()
        start_reaper({str(session)!r})
        child = python(sleep)
        detach = (
            "import subprocess, sys; print(subprocess.Popen(sys.argv[1:], "
            "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
        )
        grandchild = subprocess.run(
            [sys.executable, "-c", detach, sys.executable, "-c", sleep],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        clean = {{k: v for k, v in os.environ.items() if k != MARK_ENV}}
        log = {str(session / "logs" / "agent.log")!r}
        writer = python(f"f = open({{log!r}}, 'a'); {{sleep}}", env=clean)
        reader = python(f"f = open({{log!r}}); {{sleep}}", env=clean, **quiet)
        time.sleep(1)  # both have opened the log
        print(child.pid, grandchild, writer.pid, unmarked.pid, reader.pid, flush=True)
        time.sleep(600)
        """
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    *cluster, unmarked, reader = map(int, driver.stdout.readline().split())
    spared = [psutil.Process(unmarked), psutil.Process(reader)]
    started = [psutil.Process(pid) for pid in cluster]
    try:
        [the_reaper] = [
            p for p in psutil.Process(driver.pid).children() if "workflows.reaper" in p.cmdline()
        ]
        marks = the_reaper.cmdline()[-2:]
        assert sorted(p.pid for p in reaper.marked(*marks)) == sorted(cluster)
        driver.kill()
        driver.wait()
        the_reaper.wait(timeout=120)
        assert reaper.marked(*marks) == []
        assert all(p.is_running() for p in spared)
        said = driver.stderr.read().decode()
        assert f"the driver (pid {driver.pid}) has ended; stopped what was left" in said
        for pid in cluster:
            assert f"python (pid {pid})" in said or f"python3.11 (pid {pid})" in said
    finally:
        driver.kill()
        for proc in spared + started:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


@pytest.mark.ray
def test_sigterm_stops_a_driver_waiting_on_an_actor_at_once(tmp_path):
    """A driver blocked in `ray.get` on a step, as `rlvr train` is, after Ray installed its own
    handlers (which abort the process on SIGTERM, and drop any exception but KeyboardInterrupt
    that a handler raises inside `ray.get`): SIGTERM stops it at once, though the actor sleeps on
    for 600 s, and says where the run resumes. The actor sends the signal mid-step, so no race
    decides where it lands. Nothing of the cluster is left once the driver has ended."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        from pathlib import Path
        import psutil, ray
        from rlvr.config import load_config
        from workflows.cli import report_stop
        from workflows.cluster import init_ray
        from workflows.stopping import RunStopped, stop_if_asked, stopping_on_signals

        class Step:
            def run(self, driver, signum, seconds):
                if signum:
                    os.kill(driver, signum)
                time.sleep(seconds)

        init_ray(load_config(None, {SMALL!r}))
        [reaper] = [p for p in psutil.Process().children() if "workflows.reaper" in p.cmdline()]
        print("reaper", *reaper.cmdline()[-2:], flush=True)
        step_actor = ray.remote(Step).options(num_cpus=0).remote()
        ray.get(step_actor.run.remote(0, 0, 0))
        try:
            with stopping_on_signals():
                for step in range(3):
                    stop_if_asked(step)
                    signum = signal.SIGTERM if step == 1 else 0
                    ray.get(step_actor.run.remote(os.getpid(), signum, 600 * (step == 1)))
                    print(f"committed {{step}}", flush=True)
        except RunStopped as stop:
            sys.exit(report_stop(stop, Path({str(run)!r})))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = driver.communicate(timeout=300)  # the reaper holds the pipe until it is done
    assert driver.returncode == 143, out[-4000:]
    [marks] = [line.split()[1:] for line in out.splitlines() if line.startswith("reaper ")]
    lines = [line for line in out.splitlines() if line.startswith(("committed", "rlvr:"))]
    hint = f"its last committed step is 3: `rlvr train --resume {run}` continues from there"
    assert lines[:2] == ["committed 0", f"rlvr: stopped by SIGTERM at once; {hint}"]
    assert reaper.marked(*marks) == []
