"""Partial rollouts: a trajectory's model tokens sampled by more than one policy version.

With `Segments`, the engine loop (`rlvr.generation.engine_loop`) samples each trajectory's first
`tokens` model tokens (over all its turns) with the engine holding `versions[0]`; a turn that
reaches that boundary pauses there. Once no turn is sampling and no callback is pending, the loop
calls `hold(versions[1])` (the engine loads the newer weights between decode steps) and continues
every paused turn from its prompt + the tokens it sampled so far, with a seed of its own
(`segment_seed`); the rest of every trajectory is sampled by `versions[1]`. Which version samples
a token therefore depends on its position only, never on timing, so a run with partial rollouts
samples the same tokens on every repeat and resume. Every sample records the versions that
sampled its tokens (`flags["policy_versions"]`, runs of [version, tokens]); the engine log-prob of
each token is the one its own version gave, which the trainer's importance weight corrects.

Continuation recomputes the prefix under the new weights (vLLM's prefix cache is reset by a
weight load), so a continued token's KV and log-prob both come from the version that sampled it.
Stop rules and stop strings are not continued across a pause (a stop string could straddle it),
so the loop refuses them with segments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlvr.generation.base import Sample

POLICY_VERSIONS = "policy_versions"
"""Sample flag: [[version, tokens], ...], the policy versions that sampled the sample's model
tokens, in token order."""


@dataclass(frozen=True)
class Segments:
    """Where a trajectory's tokens change policy version, and how the engine changes it."""

    tokens: int
    """Model tokens each trajectory samples with `versions[0]` before it pauses."""
    versions: tuple[int, int]
    """The version of the first `tokens` model tokens, then of the rest."""
    hold: Callable[[int], None]
    """Make the engine hold a version (called while no turn is being sampled)."""

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"segments need tokens >= 1, got {self.tokens}")

    def version(self, segment: int) -> int:
        return self.versions[min(segment, 1)]


def segment_seed(seed: int | None, segment: int) -> int | None:
    """The seed a turn continues with after its `segment`-th pause (segment 0: the turn's own):
    a 63-bit blake2b hash of (seed, segment), so each continuation draws a stream of its own."""
    if seed is None or segment == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/segment/{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def version_runs(versions: Sequence[int]) -> list[list[int]]:
    """Per-token versions as runs of [version, tokens]."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def joined_runs(*parts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Runs of consecutive token spans, joined (a run continuing across spans is merged)."""
    joined: list[list[int]] = []
    for runs in parts:
        for version, count in runs:
            if joined and joined[-1][0] == version:
                joined[-1][1] += count
            elif count:
                joined.append([version, count])
    return joined


def stamped(sample: Sample, version: int) -> Sample:
    """`sample` with every token recorded as sampled by `version`."""
    sample.flags[POLICY_VERSIONS] = version_runs([version] * len(sample.token_ids))
    return sample


def continued(head: Sample, tail: Sample, decode: Callable[[list[int]], str]) -> Sample:
    """A turn paused after `head` and continued with `tail`, as one sample (its text decoded
    again from all its ids: a word may straddle the pause)."""
    ids = head.token_ids + tail.token_ids
    flags = {**head.flags, **tail.flags}
    flags[POLICY_VERSIONS] = joined_runs(head.flags[POLICY_VERSIONS], tail.flags[POLICY_VERSIONS])
    return Sample(
        token_ids=ids,
        text=decode(ids),
        logprobs=list(head.logprobs) + list(tail.logprobs),
        finish_reason=tail.finish_reason,
        flags=flags,
    )
