"""Build the verifier a config names: `verifier.kind` "math" (MathVerifier) or "code"
(CodeVerifier). Both have `verify(response, gold)`, `verify_batch(responses, golds)` returning
`(reward, status)` pairs, `wait_ready()` and `close()`, with a hard per-item timeout."""

from __future__ import annotations

from typing import Literal

from rlvr.verifiers.code import CodeVerifier
from rlvr.verifiers.math import MathVerifier

VerifierKind = Literal["math", "code"]
KINDS: tuple[str, ...] = ("math", "code")


def make_verifier(
    kind: str = "math", num_workers: int = 1, timeout: float = 5.0
) -> MathVerifier | CodeVerifier:
    """A verifier of `kind` with `num_workers` parallel workers and a per-item `timeout`."""
    if kind == "math":
        return MathVerifier(num_workers=num_workers, timeout=timeout)
    if kind == "code":
        return CodeVerifier(num_workers=num_workers, timeout=timeout)
    raise ValueError(f"unknown verifier kind {kind!r}; expected one of {KINDS}")
