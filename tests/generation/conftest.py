"""Fixtures for the generation backends: scripted stop rules (the tiny model is session-wide)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest


class StopAfter:
    """Forces EOS once `k` tokens were generated; records every length it was shown."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.shown: list[int] = []

    def should_stop(self, generated_ids: Sequence[int]) -> bool:
        self.shown.append(len(generated_ids))
        return len(generated_ids) >= self.k

    def flags(self) -> dict[str, Any]:
        return {"shown": list(self.shown)}


class StopOnToken:
    """Forces EOS right after `token` appears; reports where it saw it."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.at: int | None = None

    def should_stop(self, generated_ids: Sequence[int]) -> bool:
        if generated_ids[-1] == self.token:
            self.at = len(generated_ids)
            return True
        return False

    def flags(self) -> dict[str, Any]:
        return {"aborted": self.at is not None, "at": self.at}


@pytest.fixture
def stop_after() -> type[StopAfter]:
    return StopAfter


@pytest.fixture
def stop_on_token() -> type[StopOnToken]:
    return StopOnToken
