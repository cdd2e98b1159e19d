"""Handing freed heap memory back to the system.

glibc's malloc keeps what a process frees on its heap and in its arenas for later allocations; a
worker that holds a model and, between its calls, little else (a generation engine while the
trainer runs, the trainer while the engine samples) would keep its peak of activations, logits and
weight copies resident the whole run. `release_free_heap` asks malloc to return every free page
(`malloc_trim(0)`, which since glibc 2.8 also releases free pages inside the heap, not only its
top). Nothing allocated moves and no value changes; the next call faults its pages back in.
`pin_mmap_threshold` keeps large blocks from settling on the heap in the first place.
`preload_jemalloc` starts a process on jemalloc instead, whose freed extents coalesce and decay
back to the system on their own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h)."""
MAX_MMAP_THRESHOLD = 32 << 20
"""The largest threshold glibc accepts on 64-bit systems (HEAP_MAX_SIZE / 2)."""


@functools.cache
def _glibc(name: str, argtypes: tuple[type, ...]):
    """The C library's function `name` (returning an int), or None where the library cannot be
    loaded or lacks it (not glibc: musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


MALLCTL_ARENAS_ALL = 4096
"""jemalloc's arena index that names every arena in `arena.<i>.purge` (jemalloc >= 5.0)."""


@functools.cache
def _mallctl():
    """jemalloc's `mallctl` where jemalloc is this process's allocator (preloaded), else None."""
    fn = getattr(ctypes.CDLL(None), "mallctl", None)
    if fn is not None:
        c = ctypes
        fn.argtypes = [c.c_char_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_size_t]
        fn.restype = ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Return the process's free heap pages to the system (jemalloc's dirty pages too, where it is
    the allocator); False where that is not possible."""
    purged = False
    mallctl = _mallctl()
    if mallctl is not None:
        purged = mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0) == 0
    trim = _glibc("malloc_trim", (ctypes.c_size_t,))
    if trim is None:
        return purged
    trim(0)
    return True


def jemalloc_active() -> bool:
    """Whether this process allocates with jemalloc."""
    return _mallctl() is not None


def preload_jemalloc(library: Path, conf: str = "") -> dict[str, str]:
    """The environment variables that start a new process on the jemalloc shared library
    `library` (LD_PRELOAD), tuned by `conf` (MALLOC_CONF, e.g. "dirty_decay_ms:1000"; empty:
    jemalloc's defaults). A running process cannot change its allocator."""
    if not library.is_file():
        raise FileNotFoundError(f"no jemalloc library at {library}")
    return {"LD_PRELOAD": str(library), **({"MALLOC_CONF": conf} if conf else {})}


def pin_mmap_threshold(nbytes: int) -> bool:
    """Give every allocation of at least `nbytes` a mapping of its own, unmapped when freed, from
    now on; False where that is not possible (not glibc).

    glibc's threshold starts at 128 KiB but rises to the size of each mapped block freed (up to
    32 MiB), so the activations, logits and gradients a trainer allocates and frees every
    micro-batch soon come from the heap, where freed blocks stay resident and fragment it: one
    SmolLM2-135M full fine-tuning step peaked at 4.0 GiB that way, 3.2 GiB with 1 MiB pinned,
    but took 1.34x as long: every mapped block page-faults afresh.
    Pinning also turns off that adjustment (mallopt(3)).
    """
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"the mmap threshold must be in (0, {MAX_MMAP_THRESHOLD}], got {nbytes}")
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, nbytes) == 1
