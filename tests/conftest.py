"""Shared fixtures: one Ray cluster per test session, bound to 127.0.0.1, an isolated model cache,
the tiny model, and the TCP addresses a process listens on."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped, with the reason, where no CUDA device is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster (started once: each start costs seconds)."""
    import ray

    from actors.controller import NAMESPACE

    if not ray.is_initialized():
        ray.init(
            address="local",  # never another process's cluster (a run started from a test)
            num_cpus=os.cpu_count() or 2,
            namespace=NAMESPACE,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen2 (head_dim 64, float32, byte-level BPE), built once per session."""
    from rlvr.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def _proc_address(hex_address: str, family: socket.AddressFamily) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order) in text."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((_proc_address(address, family), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or 127.x as an IPv4-mapped IPv6 address."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.fixture
def listening() -> Callable[[int], list[tuple[str, int]]]:
    """`listening(pid)`: the (address, port) pairs process ``pid`` listens on."""
    return listening_addresses


@pytest.fixture
def loopback() -> Callable[[str], bool]:
    """`loopback(address)`: whether a listening address is reachable from this node only."""
    return is_loopback
