"""`ray job submit` of the tiny preset to a local `ray start --head` cluster (127.0.0.1 only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.integration.bounds import HANG_S

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_job_submit_to_local_head(tmp_path, pick_free_ports):
    # Ray's socket paths must fit AF_UNIX's 107 bytes: keep its temp dir short
    ray_tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",  # the job's driver must find `rlvr`
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": ray_tmp,
    }
    env.pop("RAY_ADDRESS", None)
    # Every port the head binds is a free one: the test session's own cluster already holds Ray's
    # defaults (its dashboard agent listens on 52365), and an agent that cannot bind never registers.
    gcs_port, dash_port, agent_port, metrics_port = pick_free_ports(4)
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash_port}",
            f"--dashboard-agent-listen-port={agent_port}",
            f"--metrics-export-port={metrics_port}",
            "--num-cpus=2",
            f"--temp-dir={ray_tmp}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        address = f"http://127.0.0.1:{dash_port}"
        deadline = time.monotonic() + 3 * HANG_S
        while True:  # wait for the dashboard's job API
            probe = subprocess.run(
                [str(BIN / "ray"), "job", "list", "--address", address],
                env=env,
                capture_output=True,
                text=True,
            )
            if probe.returncode == 0:
                break
            assert head.poll() is None, head.stdout.read()
            assert time.monotonic() < deadline, probe.stderr
            time.sleep(2)
        out = tmp_path / "runs"
        submit = [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            str(ROOT),
            "--",
            "rlvr",
            "train",
            "--config",
            "configs/tiny.yaml",
            "--set=task.n_test=8",
            "--set=generation.prompts_per_step=2",
            "--set=generation.group_size=2",
            "--set=generation.max_tokens=16",
            "--set=run.steps=1",
            "--set=resources.num_verifiers=1",
            f"--set=run.output_dir={out}",
            "--set=run.name=job",
        ]
        deadline = time.monotonic() + 3 * HANG_S  # a loaded machine starts the agent slowly
        while True:  # the head's job agent registers a little after the job API answers
            job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=900)
            if job.returncode == 0 or "No available agent" not in job.stderr:
                break
            assert time.monotonic() < deadline, job.stderr
            time.sleep(2)
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
        assert "succeeded" in job.stdout
        metrics = [json.loads(x) for x in (out / "job" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [0]
        assert (out / "job" / "final" / "model.safetensors").is_file()
    finally:
        # `ray start --block` tears its cluster down on SIGTERM; `ray stop` would also kill the
        # test session's own cluster.
        head.terminate()
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
