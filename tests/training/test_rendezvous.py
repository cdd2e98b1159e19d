"""Where a run's processes listen: the address choice, the store bound to one address, gloo
following the interface it is given, and two ranks set up as a run sets them up listening on
the loopback alone."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from rlvr.training import rendezvous
from rlvr.training.rendezvous import (
    LOOPBACK,
    RENDEZVOUS_PORTS,
    bind_collectives,
    ephemeral_ports,
    free_port,
    interface_of,
    master_store,
    run_addresses,
)

TIMEOUT = datetime.timedelta(seconds=30)
NOWHERE = "203.0.113.77"  # TEST-NET-3: on no interface of a test machine


def test_one_node_listens_on_the_loopback_and_several_on_their_node_ips():
    assert run_addresses({"PolicyActor 0": "10.0.0.5", "GeneratorActor 0": "10.0.0.5"}) == {
        "PolicyActor 0": LOOPBACK,
        "GeneratorActor 0": LOOPBACK,
    }
    spread = {
        "PolicyActor 0": "10.0.0.5",
        "PolicyActor 1": "10.0.0.5",
        "GeneratorActor 0": "10.0.0.6",
    }
    assert run_addresses(spread) == spread
    assert run_addresses({}) == {}


def test_torch_store_listens_everywhere_and_master_store_on_its_address_alone(listening):
    """The reason for `master_store`: given 127.0.0.1, torch's own server binds every interface."""
    own = dist.TCPStore(LOOPBACK, 0, 1, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    assert {a for a, port in listening(os.getpid()) if port == own.port} <= {"0.0.0.0", "::"}

    store = master_store(LOOPBACK, 0, 2, TIMEOUT)
    assert [a for a, port in listening(os.getpid()) if port == store.port] == [LOOPBACK]
    client = dist.TCPStore(LOOPBACK, store.port, 2, timeout=TIMEOUT)
    client.set("k", "v")
    assert store.get("k") == b"v"

    port = free_port(LOOPBACK)
    assert master_store(LOOPBACK, port, 1, TIMEOUT).port == port
    with pytest.raises(OSError):
        master_store(LOOPBACK, store.port, 1, TIMEOUT)  # taken: fails, leaks nothing


def test_bind_collectives_names_the_interface_and_keeps_the_users(monkeypatch, caplog):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    name = interface_of(LOOPBACK)
    assert name is not None
    assert bind_collectives(LOOPBACK) == name
    assert os.environ["GLOO_SOCKET_IFNAME"] == name
    assert os.environ["NCCL_SOCKET_IFNAME"] == f"={name}"

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    bind_collectives(LOOPBACK)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"

    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with caplog.at_level(logging.WARNING, logger="rlvr.training.rendezvous"):
        assert bind_collectives(NOWHERE) is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert f"no network interface carries {NOWHERE}" in caplog.text


def _outside_address() -> str | None:
    """An IPv4 address of this machine other than the loopback (None: it has none)."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


@pytest.mark.parametrize("where", ["loopback", "outside"])
def test_a_gloo_group_listens_on_the_interface_bind_collectives_names(
    monkeypatch, listening, where
):
    """The env var is read when each group starts, so setting it in a running process works."""
    address = LOOPBACK if where == "loopback" else _outside_address()
    if address is None:
        pytest.skip("this machine has no address but the loopback")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    bind_collectives(address)
    before = set(listening(os.getpid()))
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, TIMEOUT)
    opened = set(listening(os.getpid())) - before
    assert opened and {a for a, _ in opened} == {address}
    del group


@pytest.mark.two_ranks
def test_two_ranks_set_up_as_a_run_listen_on_the_loopback_alone(listening, loopback):
    """DeepSpeed's process group and the weight sync's group across two processes, every
    listener of each (stores, gloo) on the loopback; none on 0.0.0.0 or [::]."""
    worker = Path(__file__).with_name("rendezvous_worker.py")
    port = free_port(LOOPBACK)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(worker)],
            env={
                **env,
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        for proc in ranks:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.strip() == "READY":
                    break
            assert lines and lines[-1].strip() == "READY", "".join(lines)[-3000:]
        found = {rank: listening(proc.pid) for rank, proc in enumerate(ranks)}
        assert (LOOPBACK, port) in found[0]  # DeepSpeed's rendezvous store
        assert len(found[0]) >= 3 and found[1]  # + the weight store, gloo's listeners
        exposed = {r: [x for x in got if not loopback(x[0])] for r, got in found.items()}
        assert exposed == {0: [], 1: []}
    finally:
        for proc in ranks:
            proc.stdin.close()
        for proc in ranks:
            output = proc.stdout.read()
            assert proc.wait(timeout=60) == 0, output[-3000:]


def test_free_port_is_outside_the_kernels_ephemeral_range(tmp_path):
    """Outgoing connections take their local ports from the ephemeral range, so a port probed
    there can be gone by the time rank 0 binds it."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_ports(ranges) == range(32768, 61000)
    assert ephemeral_ports(tmp_path / "absent") == range(0)
    port = free_port(LOOPBACK)
    assert port in RENDEZVOUS_PORTS and port not in ephemeral_ports()


def test_free_port_falls_back_to_one_the_os_picks(monkeypatch):
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        only = taken.getsockname()[1]
        monkeypatch.setattr(rendezvous, "RENDEZVOUS_PORTS", range(only, only + 1))
        monkeypatch.setattr(rendezvous, "ephemeral_ports", lambda: range(0))
        port = free_port(LOOPBACK)
    assert port != only
