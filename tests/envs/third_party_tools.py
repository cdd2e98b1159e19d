"""A tool whose module imports a package from outside the standard library, which the sandbox
that runs tools does not have."""

from __future__ import annotations

import numpy


def mean(values: list[float]) -> float:
    """The mean.

    Args:
        values: Numbers.
    """
    return float(numpy.mean(values))
