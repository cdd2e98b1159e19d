"""Durable whole-file writes: readers see the old or the new content, never a torn file, and once
a write returns a crash cannot lose it (the rename itself is flushed with the directory)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries: a file created or renamed in it survives a crash only then."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically and durably: write `NAME.tmp` beside it, fsync it, rename
    it over `path`, then fsync the directory so the rename outlives a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
