"""Where a run's own processes listen: one address each, never every interface.

A run's listeners are its rendezvous stores (the policy ranks' process group, the weight sync's
group) and the gloo / NCCL groups of the policy ranks, the weight sync and the vLLM engines. The
address (`run_addresses`) is the loopback when every model process of the run is on one node,
else each process's own node IP (the one its peers reach it at).

torch's TCPStore server listens on every interface whatever host it is given (``host_name`` is
where clients connect), unless it is handed a socket already bound (``master_listen_fd``), which
`master_store` does. gloo and NCCL take an interface, not an address: gloo listens on the
interface GLOO_SOCKET_IFNAME names (else on the address the hostname resolves to) and NCCL's
bootstrap on NCCL_SOCKET_IFNAME's (else on the first interface it finds), so `bind_collectives`
names the interface that carries the address.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
from collections.abc import Mapping
from pathlib import Path

import psutil
import torch.distributed as dist

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
"""What a launcher (torchrun, `workflows.policy_group.rank_environments`) tells a rank."""


def run_addresses(node_ips: Mapping[str, str]) -> dict[str, str]:
    """Each process's listening address, by name, from the node IP of each: the loopback when
    they all share one node (no peer is elsewhere), else its own node IP."""
    one_node = len(set(node_ips.values())) <= 1
    return {name: LOOPBACK if one_node else ip for name, ip in node_ips.items()}


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RENDEZVOUS_PORTS = range(20000, 32768)
"""Where `free_port` looks: above Ray's worker ports (10002-19999 by default) and below Linux's
default ephemeral range (32768-60999)."""


def ephemeral_ports(path: Path = EPHEMERAL_RANGE_FILE) -> range:
    """The ports the kernel hands out on its own (a bind to port 0, a connect's local end):
    Linux's ``ip_local_port_range``; empty where the file is not there to say."""
    try:
        low, high = map(int, path.read_text().split())
    except (OSError, ValueError):
        return range(0)
    return range(low, high + 1)


def free_port(address: str, attempts: int = 64) -> int:
    """A port free on ``address`` now, for a rendezvous whose port every rank must know before
    rank 0 starts its store there.

    It comes from `RENDEZVOUS_PORTS` outside the kernel's ephemeral range, so that in the seconds
    until rank 0 binds it no outgoing connection of the node (Ray's own make many) can be given
    it as its local port; a port the OS picks is the fallback when none is found there.
    """
    ephemeral = ephemeral_ports()
    candidates = [p for p in RENDEZVOUS_PORTS if p not in ephemeral]
    # not the seeded module-level generator: two runs seeded alike would probe the same ports
    for port in random.SystemRandom().sample(candidates, min(attempts, len(candidates))):
        with socket.socket(_family(address)) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(_family(address)) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def master_store(
    address: str, port: int, world_size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """A TCPStore server listening on ``address`` alone, on ``port`` (0: one the OS picks, read
    back as ``store.port``, which no other process can take in between)."""
    listener = socket.socket(_family(address))
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen()
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()  # the store owns the socket from here
    try:
        return dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that carries ``address`` (None: none)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def bind_collectives(address: str) -> str | None:
    """Make the gloo and NCCL groups this process starts from now on listen on ``address``'s
    interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME; values already set are kept). Returns the
    interface, None when no interface carries the address (the libraries then choose)."""
    name = interface_of(address)
    if name is None:
        log.warning("no network interface carries %s; gloo and NCCL choose their own", address)
        return None
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", f"={name}")  # "=": this name, not a prefix
    return name
