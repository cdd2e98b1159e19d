"""Importing a library without the optional packages it would import for features this project
never uses; those packages stay importable afterwards."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def without_modules(*names: str) -> Iterator[None]:
    """Inside the block, `import NAME` raises ImportError for each of `names` not yet imported (a
    None entry in sys.modules: Python's documented way to stop an import); after it, they import
    as usual. A package that is already imported is left as it is."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
