"""Functions that cannot be tools, each for its own reason (rlvr.envs.tools refuses them at load)."""

from __future__ import annotations

from tests.envs.sample_tools import add as borrowed  # noqa: F401  (defined elsewhere)


class Point:
    pass


def takes_object(point: Point) -> int:
    """Take an object.

    Args:
        point: A point.
    """
    return 0


def takes_tuple(pair: tuple[int, int]) -> int:
    """Take a pair (it would arrive as a list).

    Args:
        pair: Two numbers.
    """
    return sum(pair)


def int_keys(table: dict[int, str]) -> int:
    """Take a table.

    Args:
        table: Rows by number.
    """
    return len(table)


def star_args(*numbers: int) -> int:
    """Add numbers.

    Args:
        numbers: The numbers.
    """
    return sum(numbers)


def star_kwargs(**options: str) -> int:
    """Count options.

    Args:
        options: The options.
    """
    return len(options)


def positional_only(a: int, /) -> int:
    """Echo.

    Args:
        a: A number.
    """
    return a


def no_hint(a) -> int:
    """Echo.

    Args:
        a: A number.
    """
    return a


def undocumented_argument(a: int, b: int) -> int:
    """Add.

    Args:
        a: A number.
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


async def asynchronous(a: int) -> int:
    """Echo later.

    Args:
        a: A number.
    """
    return a


unnamed = lambda a: a  # noqa: E731
