"""Grouping rows by prompt id: first-appearance order, rows ascending, any hashable id."""

from rlvr.algorithms.groups import group_rows


def test_group_rows_keeps_first_appearance_order():
    assert group_rows(["b", "a", "b", "c", "a"]) == {"b": [0, 2], "a": [1, 4], "c": [3]}
    assert list(group_rows([3, 1, 3, 2])) == [3, 1, 2]
    assert group_rows([]) == {}
