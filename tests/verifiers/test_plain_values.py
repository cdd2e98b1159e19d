"""The plain-data codec between a solution's process and its tests' (rlvr.verifiers.harness):
builtin values survive the trip with their exact types; anything else is refused on either side."""

from __future__ import annotations

import json
import math

import pytest

from rlvr.verifiers.harness import MAX_DEPTH, decode, encode

VALUES = [
    None,
    True,
    0,
    -(10**40),
    2.5,
    -0.0,
    float("inf"),
    "é\n",
    b"\x00\xff",
    3 - 1j,
    [1, [2, (3,)]],
    (1, "a", None),
    {"a": 1, 2: [3], (4, 5): frozenset({6})},
    {1, "x", (2, 3)},
    frozenset(),
    [],
    {},
]


def _trip(value):
    return decode(json.loads(json.dumps(encode(value))))


def value_id(value) -> str:
    """The value's repr, a set's elements sorted: ids that do not depend on the hash seed (each
    test worker must collect the same ids)."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(map(repr, value))})"
    return repr(value)


@pytest.mark.parametrize("value", VALUES, ids=value_id)
def test_plain_values_come_back_equal_and_of_the_same_types(value):
    back = _trip(value)
    assert back == value and type(back) is type(value)
    if type(value) is dict:
        assert [type(k) for k in back] == [type(k) for k in value]
    if type(value) is float and value == 0:
        assert math.copysign(1, back) == math.copysign(1, value)


def test_nan_comes_back_as_nan():
    assert math.isnan(_trip(float("nan")))


class Always(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Named(str):
    pass


@pytest.mark.parametrize(
    "value",
    [Always(3), Named("x"), [1, Always(2)], {"k": Named("v")}, object(), len, range(3)],
    ids=["int subclass", "str subclass", "nested", "dict value", "object", "function", "range"],
)
def test_what_is_not_plain_data_by_exact_type_is_refused(value):
    with pytest.raises(TypeError):
        encode(value)


def test_nesting_is_bounded_both_ways():
    deep: list = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(TypeError):
        encode(deep)
    with pytest.raises(ValueError):
        decode(json.loads(json.dumps(deep)))


@pytest.mark.parametrize(
    "data",
    [
        {"object": []},
        {"tuple": 3},
        {"tuple": [1], "set": [2]},
        {"set": [[1]]},  # an unhashable member
        {"dict": [[[1], 2]]},  # an unhashable key
        {"dict": [[1]]},
        {"bytes": "zz"},
        {"complex": ["1", 0]},
    ],
)
def test_malformed_data_is_refused(data):
    with pytest.raises(ValueError):
        decode(data)
