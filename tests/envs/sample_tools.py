"""Tools of a user's own module, outside the package: well-behaved ones and hostile ones. Each runs
in a sandbox that has the standard library only, so this module imports nothing else."""

from __future__ import annotations

import time
from typing import Literal


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def describe(
    word: str,
    times: int = 1,
    style: Literal["plain", "loud"] = "plain",
    tags: list[str] | None = None,
    weights: dict[str, float] | None = None,
) -> dict:
    """Describe a word.

    Args:
        word: The word.
        times: How often to repeat it.
        style: How to write it.
        tags: Labels to attach.
        weights: A weight per label.
    """
    text = " ".join([word.upper() if style == "loud" else word] * times)
    return {"text": text, "tags": tags or [], "weights": weights or {}}


def fails(reason: str) -> str:
    """Raise an error.

    Args:
        reason: The error's message.
    """
    raise ValueError(reason)


def sleeps(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def hoards(megabytes: int) -> int:
    """Hold memory.

    Args:
        megabytes: How much to hold, a megabyte at a time.
    """
    held = [bytearray(1 << 20) for _ in range(megabytes)]
    return len(held)


def floods(kilobytes: int) -> str:
    """Return a long text.

    Args:
        kilobytes: Its size.
    """
    return "x" * (kilobytes << 10)


def chatters(lines: int) -> str:
    """Print a lot, then answer.

    Args:
        lines: How many lines to print.
    """
    for i in range(lines):
        print(f"line {i} " + "y" * 100)
    return "done"


class Opaque:
    pass


def returns_object(label: str) -> object:
    """Return an object of the module's own class.

    Args:
        label: Ignored.
    """
    return Opaque()


def returns_subclass(label: str) -> str:
    """Return a subclass of str (not plain data: its methods are the tool's code).

    Args:
        label: The text.
    """

    class Sly(str):
        pass

    return Sly(label)


def exits(code: int) -> str:
    """Leave the process without answering.

    Args:
        code: The exit status.
    """
    import os

    os._exit(code)
