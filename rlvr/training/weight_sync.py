"""Bucketed weight transfer from the policy to the generation engines: broadcast and hand-over.

The weights travel over a process group of their own (rank 0: the policy's rank 0; ranks 1..M: the
engines), built from a `torch.distributed.TCPStore` and never touching the default process group,
which DeepSpeed (policy) and vLLM (engine) already own in those processes: gloo on CPU, NCCL on
GPUs, one code path. One `Bucket` plan, cut from the sender's manifest of (name, shape, dtype),
goes to both sides; each bucket is one flat buffer in the engines' dtype, so memory holds one
bucket at a time (and the tensor in hand), never the model: the sender packs from a stream of
exported tensors and the receiver hands each bucket's tensors to the loader as it asks for them.

Colocated (policy rank i and engine i on one device), the same buckets pass by hand-over instead
(`share_buffer`, `SharedBucketReceiver`): each rank packs a bucket and shares it, a CUDA IPC
handle on a GPU (the engine maps the rank's memory, no host copy) or the tensor itself on CPU
(Ray's shared memory on the node), and the engine copies it out before asking for the next.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from math import prod
from types import TracebackType

import torch
import torch.distributed as dist

from rlvr.training.rendezvous import master_store

ROOT = 0
"""The sender's rank (policy rank 0); engines are ranks 1..M."""

DEFAULT_TIMEOUT_S = 600.0
"""Seconds the rendezvous and each broadcast may take before the group gives up."""


@dataclass(frozen=True)
class TensorSpec:
    """One exported weight: its HF name, full shape and the dtype the sender holds it in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Consecutive weights sent as one flat buffer of ``dtype``, each at its element offset."""

    specs: tuple[TensorSpec, ...]
    dtype: torch.dtype

    @property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for spec in self.specs:
            out.append(at)
            at += spec.numel
        return out

    @property
    def numel(self) -> int:
        return sum(spec.numel for spec in self.specs)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(
    specs: Iterable[TensorSpec], dtype: torch.dtype, bucket_bytes: int
) -> list[Bucket]:
    """Cut ``specs`` (in order) into buckets of at most ``bucket_bytes``, sized in ``dtype``.

    A weight larger than a bucket travels alone in an oversize bucket of its own rather than split
    across buckets: the loader takes whole tensors and the sender holds the whole (gathered)
    tensor anyway, so splitting would lower neither side's peak, which is max(bucket_bytes,
    largest weight).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        nbytes = spec.numel * dtype.itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(current), dtype))
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(Bucket(tuple(current), dtype))
    return buckets


def pack(
    bucket: Bucket, named_tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device
) -> torch.Tensor:
    """Take exactly the bucket's tensors from ``named_tensors`` (a stream shared by all buckets)
    into one flat buffer on ``device``, cast to the bucket's dtype; checks names and shapes."""
    buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        name, tensor = next(named_tensors, (None, None))
        if name != spec.name or tensor is None or tuple(tensor.shape) != spec.shape:
            got = "nothing" if tensor is None else f"{name} {tuple(tensor.shape)}"
            raise ValueError(f"weight stream out of step with the plan: expected {spec}, got {got}")
        buffer[offset : offset + spec.numel].copy_(tensor.reshape(-1))
    return buffer


def unpack(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket's named tensors as views into ``buffer`` (no copy)."""
    return [
        (spec.name, buffer[offset : offset + spec.numel].view(spec.shape))
        for spec, offset in zip(bucket.specs, bucket.offsets, strict=True)
    ]


def local_device() -> torch.device:
    """This process's accelerator (the current CUDA device) or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def serve_store(host: str, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on ``host`` alone (the address the engines join:
    `rendezvous.run_addresses`), on a port the OS picks (``store.port``). ``timeout_s`` bounds the
    rendezvous and, through `open_group`, every broadcast."""
    return master_store(host, 0, world_size, datetime.timedelta(seconds=timeout_s))


def join_store(
    host: str, port: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dist.TCPStore:
    """An engine's connection to rank 0's `serve_store`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def open_group(
    rank: int, world_size: int, device: torch.device, store: dist.Store
) -> dist.ProcessGroup:
    """Join the weight group as ``rank`` over ``store`` (blocks until all ranks have joined).

    The backend follows ``device``: NCCL for CUDA, gloo otherwise, with the store's timeout.
    Every rank must agree; each checks all the others' choice through the store, so a CPU engine
    facing a GPU policy fails on every rank, with the reason, instead of hanging.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    store.set(f"backend/{rank}", backend)
    backends = [store.get(f"backend/{r}").decode() for r in range(world_size)]
    if len(set(backends)) > 1:
        raise RuntimeError(
            f"weight group ranks disagree on the backend ({', '.join(backends)} for ranks "
            f"0..{world_size - 1}): policy and engines must all be on GPUs or all on CPU"
        )
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = store.timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, store.timeout)


def _broadcast(group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    """Broadcast ``buffer`` from `ROOT` in place, as bytes (any dtype, either backend)."""
    group.broadcast(buffer.view(torch.uint8), ROOT).wait()


@dataclass
class SendStats:
    """What one `send_weights` moved and where its time went."""

    bytes: int = 0
    buckets: int = 0
    export_s: float = 0.0
    """Pulling tensors from the export stream and packing them."""
    transport_s: float = 0.0
    """Inside broadcasts (the wire, and waiting for the slowest engine to ask for the bucket)."""


def send_weights(
    group: dist.ProcessGroup,
    buckets: Sequence[Bucket],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
) -> SendStats:
    """Rank 0: pack each bucket from the stream as it comes and broadcast it to every engine."""
    stream = iter(named_tensors)
    stats = SendStats()
    for bucket in buckets:
        start = time.perf_counter()
        buffer = pack(bucket, stream, device)
        sent = time.perf_counter()
        _broadcast(group, buffer)
        stats.export_s += sent - start
        stats.transport_s += time.perf_counter() - sent
        stats.bytes += bucket.nbytes
        stats.buckets += 1
    extra = next(stream, None)
    if extra is not None:
        raise ValueError(f"weight stream longer than the plan: {extra[0]} was not sent")
    return stats


class BucketReceiver:
    """Ranks 1..M: the broadcast weights as a lazy stream of (name, tensor).

    Iterating receives a bucket only when the consumer asks for its first tensor, so a loader that
    iterates (vLLM's ``reload_weights``) holds one bucket at a time. Use it as a context manager:
    leaving receives whatever the consumer did not ask for (a failed load), because every rank
    must take part in every broadcast or the sender and the other engines wait until the timeout.
    """

    def __init__(
        self, group: dist.ProcessGroup, buckets: Sequence[Bucket], device: torch.device
    ) -> None:
        self.group = group
        self.buckets = list(buckets)
        self.device = device
        self.transport_s = 0.0
        self._stream = self._receive()

    @property
    def names(self) -> list[str]:
        """Every name the stream will yield, in order (known before anything is received)."""
        return [spec.name for bucket in self.buckets for spec in bucket.specs]

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets:
            buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
            start = time.perf_counter()
            _broadcast(self.group, buffer)
            self.transport_s += time.perf_counter() - start
            yield from unpack(bucket, buffer)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._stream

    def __enter__(self) -> BucketReceiver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for _ in self._stream:
            pass


@dataclass(frozen=True)
class SharedBuffer:
    """A packed bucket one process hands to another on the same device: a CUDA IPC handle
    (`rebuild` and its arguments, and the device's UUID to check it is the same device), or on
    CPU the tensor itself."""

    tensor: torch.Tensor | None = None
    rebuild: Callable[..., torch.Tensor] | None = None
    args: tuple = ()
    device_uuid: str = ""


_IPC_DEVICE_ARG = 6
"""Position of the storage's device index in `rebuild_cuda_tensor`'s arguments."""


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share_buffer(buffer: torch.Tensor) -> SharedBuffer:
    """What another process on this device needs to read ``buffer``; the caller keeps ``buffer``
    alive until the reader has copied it out."""
    if buffer.device.type != "cuda":
        return SharedBuffer(tensor=buffer)
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(buffer)
    return SharedBuffer(rebuild=rebuild, args=tuple(args), device_uuid=_device_uuid(buffer.device))


def open_shared(shared: SharedBuffer, device: torch.device) -> torch.Tensor:
    """The sender's buffer, read in place: on CUDA mapped by IPC onto ``device``, which must be
    the sender's device (colocated actors see it under their own index)."""
    if shared.tensor is not None:
        return shared.tensor
    if device.type != "cuda" or _device_uuid(device) != shared.device_uuid:
        raise RuntimeError(
            f"a CUDA IPC bucket from device {shared.device_uuid} cannot be opened on {device}: "
            "a colocated engine must share its policy rank's GPU"
        )
    args = list(shared.args)
    args[_IPC_DEVICE_ARG] = device.index
    return shared.rebuild(*args)


class SharedBucketReceiver:
    """An engine's stream of its colocated rank's weights: ``fetch(bucket)`` asks the rank to
    pack and share the next bucket (`share_buffer`); each is copied into this process's own
    buffer at once, so the rank may reuse its memory for the next. Like `BucketReceiver`, leaving
    the context fetches whatever the loader did not ask for: under ZeRO-3 every rank's export
    joins collective gathers, so each rank must run its stream to the end."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        fetch: Callable[[Bucket], SharedBuffer],
        device: torch.device,
    ) -> None:
        self.buckets = list(buckets)
        self.fetch = fetch
        self.device = device
        self.transport_s = 0.0
        self._stream = self._receive()

    @property
    def names(self) -> list[str]:
        return [spec.name for bucket in self.buckets for spec in bucket.specs]

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets:
            start = time.perf_counter()
            shared = open_shared(self.fetch(bucket), self.device)
            if shared.numel() != bucket.numel or shared.dtype != bucket.dtype:
                raise ValueError(
                    f"shared bucket of {shared.numel()} {shared.dtype} does not match the plan's "
                    f"{bucket.numel} {bucket.dtype}"
                )
            buffer = shared.to(self.device, copy=True)
            del shared
            self.transport_s += time.perf_counter() - start
            yield from unpack(bucket, buffer)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._stream

    def __enter__(self) -> SharedBucketReceiver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for _ in self._stream:
            pass
