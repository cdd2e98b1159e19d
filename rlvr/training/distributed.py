"""Joining the data-parallel process group a DeepSpeed engine needs: the launcher's variables
(Ray placement group or torchrun) or a one-process group, gloo on CPU and the accelerator's
backend (NCCL) on GPUs, over a store that listens on the loopback or the rank's own address."""

from __future__ import annotations

import os

import torch.distributed as dist

from rlvr.training.lean_import import without_modules
from rlvr.training.rendezvous import LOOPBACK, master_store

# `import deepspeed` imports its autotuner, which imports mlflow whenever it is installed (the
# `loggers` extra): 105 MiB more in every policy rank, for autotuning this project never runs.
with without_modules("mlflow"):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder


def init_distributed() -> None:
    """Join the process group DeepSpeed needs, starting a one-process group when none is set up.

    A launcher (Ray placement group, torchrun) sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT; without them this process is rank 0 of 1 on 127.0.0.1 and a port the OS picks.
    CPU uses gloo (DeepSpeed would pick oneCCL if its bindings were installed); GPUs use the
    accelerator's backend (nccl).
    """
    skip_shared_memory_all_reduce()
    if dist.is_initialized():
        # Another component of this process (e.g. an in-process vLLM engine) already set up a group;
        # DeepSpeed reuses it but still insists on the launcher's rank variables.
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        return
    for key, value in (
        ("MASTER_ADDR", LOOPBACK),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    accelerator = get_accelerator()
    device_id = None
    if accelerator.device_name() == "cpu":
        backend = "gloo"
    else:
        backend = accelerator.communication_backend_name()
        local_rank = int(os.environ["LOCAL_RANK"])
        accelerator.set_device(local_rank)
        if int(os.environ["WORLD_SIZE"]) > 1:
            device_id = local_rank  # as DeepSpeed's own init binds it (eager NCCL, comm splits)
    join_default_group(backend, device_id)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def join_default_group(backend: str, device_id: int | None) -> None:
    """Start torch's default process group as the launcher's variables say, over a store that
    rank 0 serves on MASTER_ADDR alone (torch's env:// store listens on every interface); rank 0
    without MASTER_PORT takes a port the OS picks and records it."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = os.environ["MASTER_ADDR"]
    if rank == 0:
        store = master_store(
            address, int(os.environ.get("MASTER_PORT", 0)), world_size, default_pg_timeout
        )
        os.environ["MASTER_PORT"] = str(store.port)
    else:
        port = int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, world_size, timeout=default_pg_timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=default_pg_timeout,
        device_id=device_id,
    )


def skip_shared_memory_all_reduce() -> None:
    """Keep DeepSpeed from JIT-building its CPU shared-memory all-reduce at init.

    That op serves only inference tensor parallelism (`inference_all_reduce`), which training never
    calls; building or loading it takes a file lock in the torch extensions folder, and a process
    killed while holding it (a stopped run, a killed actor) leaves the lock behind, on which every
    later DeepSpeed start then waits forever.
    """
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
