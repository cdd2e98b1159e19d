"""Handing freed heap memory back to the system.

glibc's malloc keeps what a process frees on its heap and in its arenas for later allocations; a
worker that holds a model and, between its calls, little else (a generation engine while the
trainer runs, the trainer while the engine samples) would keep its peak of activations, logits and
weight copies resident the whole run. `release_free_heap` asks malloc to return every free page
(`malloc_trim(0)`, which since glibc 2.8 also releases free pages inside the heap, not only its
top). Nothing allocated moves and no value changes; the next call faults its pages back in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library is not glibc (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the process's free heap pages to the system; False where that is not possible."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
