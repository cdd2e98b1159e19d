"""A run across two Ray nodes on this machine: STRICT_SPREAD with per-role node resources puts the
policy and the generator on different nodes; the driver is killed after a committed step and the
resumed run finishes there."""

from __future__ import annotations

import json
import signal
import time

import pytest
from ray.cluster_utils import Cluster

pytestmark = pytest.mark.ray

ACROSS = [
    "run.steps=3",
    "resources.policy_cpus=0.5",
    "resources.generator_cpus=0.5",
    "resources.policy_resources={rlvr_train: 1}",
    "resources.generator_resources={rlvr_rollout: 1}",
    "resources.placement_strategy=STRICT_SPREAD",
]


@pytest.fixture
def two_nodes(monkeypatch):
    """A head node with `rlvr_train` and a second node with `rlvr_rollout`, one CPU each."""
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "resources": {"rlvr_train": 1},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    try:
        rollout = cluster.add_node(
            num_cpus=1, resources={"rlvr_rollout": 1}, node_ip_address="127.0.0.1"
        )
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        yield cluster.head_node.node_id, rollout.node_id
    finally:
        cluster.shutdown()


def test_policy_and_generator_on_two_nodes_run_kill_resume(
    two_nodes, tmp_path, run_cli, tiny_train_args
):
    head, rollout = two_nodes
    run = tmp_path / "full"
    proc = run_cli(tiny_train_args(tmp_path, *ACROSS))
    committed = run / "checkpoints" / "step_000000"
    deadline = time.monotonic() + 900
    while not committed.is_dir():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    layout = json.loads((run / "layout.json").read_text())["actors"]
    assert layout["PolicyActor 0"]["node_id"] == head
    assert layout["GeneratorActor 0"]["node_id"] == rollout
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    resumed = run_cli(["train", "--resume", str(run)])
    log, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, log[-4000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert (run / "final" / "model.safetensors").is_file()
