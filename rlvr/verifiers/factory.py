"""Build the verifier a config names: `verifier.kind` "math" (MathVerifier), "code"
(CodeVerifier) or "python" (PythonVerifier, a reward plug-in), or `verifier.rewards`, several of
them with weights (WeightedVerifier). All have `verify_batch(responses, golds, timeout, prompts,
metadata)`, `wait_ready()` and `close()`, with a hard timeout per item (per call for python)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from rlvr.verifiers.code import CodeVerifier
from rlvr.verifiers.math import MathVerifier
from rlvr.verifiers.python import PythonVerifier
from rlvr.verifiers.weighted import Component, WeightedVerifier, reward_name

VerifierKind = Literal["math", "code", "python"]
KINDS: tuple[str, ...] = ("math", "code", "python")


def make_verifier(
    kind: str = "math",
    num_workers: int = 1,
    timeout: float = 5.0,
    function: str | Callable[..., Any] | None = None,
    rewards: Sequence[Mapping[str, Any]] = (),
    unsafe_hook_sandbox: bool = False,
) -> MathVerifier | CodeVerifier | PythonVerifier | WeightedVerifier:
    """A verifier of `kind` with `num_workers` parallel workers and a per-item `timeout`
    (`function`: the plug-in of kind python, its name or itself); with `rewards` (dicts with kind,
    weight and optionally function and name) their weighted sum, and `kind` is not used.
    `unsafe_hook_sandbox` lets code run under the audit-hook sandbox where namespaces do not
    work (rlvr.verifiers.sandbox)."""
    if rewards:
        return WeightedVerifier(
            [
                Component(
                    reward_name(r["kind"], r.get("function"), r.get("name")),
                    float(r["weight"]),
                    make_verifier(
                        r["kind"],
                        num_workers,
                        timeout,
                        r.get("function"),
                        unsafe_hook_sandbox=unsafe_hook_sandbox,
                    ),
                )
                for r in rewards
            ]
        )
    if kind == "math":
        return MathVerifier(num_workers=num_workers, timeout=timeout)
    if kind == "code":
        return CodeVerifier(
            num_workers=num_workers, timeout=timeout, unsafe_hook=unsafe_hook_sandbox
        )
    if kind == "python":
        if function is None or function == "":
            raise ValueError("verifier kind 'python' needs a function ('package.module:fn')")
        return PythonVerifier(function, num_workers=num_workers, timeout=timeout)
    raise ValueError(f"unknown verifier kind {kind!r}; expected one of {KINDS}")
