"""A second tool module, with a name the first one has too."""

from __future__ import annotations


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
