"""Rows of a step grouped by the prompt they answer, the unit of every group-relative statistic."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

GroupId = TypeVar("GroupId", bound=Hashable)


def group_rows(group_ids: Sequence[GroupId]) -> dict[GroupId, list[int]]:
    """Row indices of each group, groups in order of first appearance (rows ascending within)."""
    rows: dict[GroupId, list[int]] = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(g, []).append(i)
    return rows
