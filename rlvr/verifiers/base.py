"""What every verifier shares: it holds worker processes or threads, released by `close`, also on
leaving a `with` block."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class ClosingVerifier:
    """A verifier usable as a context manager that closes on exit; subclasses define `close`."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
