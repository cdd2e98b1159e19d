"""VersionBoard: where engines in the middle of a partial rollout find the next policy version.

The rollout pipeline posts each policy version's snapshot (the object-store export, by reference)
as it is published; an engine whose trajectories pause at the segment boundary
(`rlvr.generation.segments`) waits here for the version it needs and loads it itself, inside its
generate call. As a Ray actor it runs threaded (each waiting engine holds one thread); in one
process it is a plain object.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

BOARD_THREADS = 64
"""Concurrent calls of the board actor: the engines waiting at once, plus the pipeline's posts."""


class BoardClosed(RuntimeError):
    """The board closed while an engine waited for a version (the run is stopping)."""


class VersionBoard:
    def __init__(self) -> None:
        self._snapshots: dict[int, list[Any]] = {}
        self._closed = False
        self._changed = threading.Condition()

    def post(self, version: int, snapshot: list[Any]) -> None:
        """`snapshot` is a list holding the version's export (a list, so that an object
        reference inside travels as a reference)."""
        with self._changed:
            self._snapshots[version] = snapshot
            self._changed.notify_all()

    def snapshot(self, version: int) -> list[Any]:
        """The posted snapshot of `version`, once it is posted."""
        with self._changed:
            while version not in self._snapshots:
                if self._closed:
                    raise BoardClosed(f"closed while an engine waited for policy version {version}")
                self._changed.wait(timeout=0.5)
            return self._snapshots[version]

    def release_before(self, version: int) -> None:
        with self._changed:
            for old in [v for v in self._snapshots if v < version]:
                del self._snapshots[old]

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def fetch_snapshot(board: Any, version: int) -> dict[str, Any]:
    """The named tensors of `version` from `board` (an actor handle or a `VersionBoard`)."""
    if isinstance(board, ray.actor.ActorHandle):
        (snapshot,) = ray.get(board.snapshot.remote(version))
    else:
        (snapshot,) = board.snapshot(version)
    return ray.get(snapshot) if isinstance(snapshot, ray.ObjectRef) else snapshot
