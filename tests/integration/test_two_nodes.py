"""A run across two Ray nodes on this machine: STRICT_SPREAD with per-role node resources puts the
policy and the generator on different nodes; the generator's node is removed mid-run and the run
recovers on the node that replaces it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import psutil
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


def rollout_node(cluster: Cluster):
    return cluster.add_node(num_cpus=1, resources={"rlvr_rollout": 1}, node_ip_address="127.0.0.1")


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
        rollout = rollout_node(cluster)
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        yield SimpleNamespace(cluster=cluster, head=cluster.head_node.node_id, rollout=rollout)
    finally:
        cluster.shutdown()


def test_a_lost_node_is_recovered_on_its_replacement(
    two_nodes, tmp_path, run_cli, tiny_train_args, run_control
):
    """The policy and the generator start on their own nodes. The rollout node disappears after
    step 0 commits (its raylet and every process on it killed) and a new one joins, as an
    autoscaler would bring: the run restarts its actors, places the generator on the new node and
    finishes, each recovery recorded."""
    run = tmp_path / "full"
    proc = run_cli(tiny_train_args(tmp_path, *ACROSS))
    run_control.wait_for_commit(proc, run / "checkpoints" / "step_000000", poll_s=0.01)
    layout = json.loads((run / "layout.json").read_text())["actors"]
    assert layout["PolicyActor 0"]["node_id"] == two_nodes.head
    assert layout["GeneratorActor 0"]["node_id"] == two_nodes.rollout.node_id
    driver = psutil.Process(proc.pid)
    driver.suspend()  # a tiny step is fast: hold the driver while the node goes
    try:
        two_nodes.cluster.remove_node(two_nodes.rollout, allow_graceful=False)
    finally:
        driver.resume()
    replacement = rollout_node(two_nodes.cluster)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    recoveries = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    # One recovery, or two when the first restart is scheduled before Ray has marked the old
    # node dead (an actor is then cancelled there while the run starts): both within
    # run.max_failures (3). A cause names whichever lost actor the driver met first (the
    # controller and the verifiers take no CPU, so Ray may have put them there too).
    assert 1 <= len(recoveries) <= 2, recoveries
    assert all("Actor" in r["cause"] and " failed" in r["cause"] for r in recoveries), recoveries
    layout = json.loads((run / "layout.json").read_text())["actors"]
    assert layout["GeneratorActor 0"]["node_id"] == replacement.node_id
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
