"""Tandem co-generation with the junior on an engine of its own (arXiv:2606.28166, App. A.1.1:
senior and junior on separate devices).

A sample travels between the senior's engine and the junior's as a `Handoff` (prompt and response
token ids, its tandem seed, its token generator's state): each engine writes only the tokens whose
author it is, and the one taking over catches up on the new ids in its prefill. Authors come from
replaying the word-switch schedule on the ids and every token is drawn by the sample's own
generator (`tandem_support.draw_tokens`), so the samples are those of the shared engine, where the
junior runs inside the senior's: the same seeds give the same tokens and authorship.

`cowrite` runs the rounds: in each, every open sample goes to the engine of its next token's
author, and the two engines write their segments at the same time. `cowrite_continuous` hands
each sample over the moment its segment ends, to an engine that takes new segments while it
decodes others (vLLM's): no sample waits for the round's longest segment.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlvr.algorithms.tandem import JUNIOR, SENIOR, WordSwitchSchedule
from rlvr.generation.base import (
    GenerationRequest,
    GenerationResult,
    Sample,
    SamplingParams,
    cut_at_stop,
)
from rlvr.generation.engine_loop import grouped_samples, sample_trajectories
from rlvr.generation.tandem_support import (
    TANDEM_FLAGS,
    AuthorTracker,
    counters_to_dict,
    tandem_seed,
)
from rlvr.generation.trajectories import TrajectoryResult, Turn, turn_seed

HANDOFF = "handoff"
"""Finish reason of a segment that ended because the other author writes the next token."""


@dataclass
class Handoff:
    """One co-written sample between engines: everything either engine needs to continue it."""

    key: int
    """Its place among the call's samples."""
    prompt_ids: list[int]
    seed: int
    """The tandem seed: author coins and token draws both come from it."""
    max_tokens: int
    """Response tokens the sample may hold in all."""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Each token's log-prob under its author's processed distribution."""
    generator_state: torch.Tensor | None = None
    """The token generator's state after the last draw (None: nothing drawn yet)."""
    finish_reason: str | None = None
    """'stop' or 'length' once the sample has ended; None while it is open."""


class SegmentEngine(Protocol):
    """An engine as `cowrite_continuous` drives it: segments added at any time, stepped with
    those already running."""

    def __len__(self) -> int:
        """Segments added and not yet returned by `step`."""
        ...

    def add(self, handoffs: list[Handoff]) -> None:
        """Start each handoff's next segment (its next token is this engine's author's)."""
        ...

    def step(self, wait: bool = True) -> list[Handoff]:
        """Advance; the handoffs whose segments ended. `wait=False`: return at once (perhaps
        with nothing) where the engine writes in another process."""
        ...


SegmentWriter = Callable[[list[Handoff]], Callable[[], list[Handoff]]]
"""An engine as `cowrite` drives it: start writing the given samples' next segments (each until
the other author's turn or its end) and return a function that waits for the written handoffs."""


def start_handoffs(
    requests: Sequence[GenerationRequest], params: SamplingParams, context_limit: int
) -> list[Handoff]:
    """One handoff per sample, seeded as the shared engine seeds sample j of a request (its
    sample seed, else a fresh tandem seed), with as many tokens as the context leaves."""
    handoffs = []
    for key, trajectory in enumerate(sample_trajectories(requests, params)):
        prompt = trajectory.prompt_ids
        if not prompt or len(prompt) >= context_limit:
            raise ValueError(
                f"request {trajectory.trajectory_id!r}: a prompt of {len(prompt)} tokens needs "
                f"1 to {context_limit - 1} tokens (the context holds {context_limit})"
            )
        seed = tandem_seed(turn_seed(trajectory.seed, 0))
        max_tokens = min(params.max_tokens, context_limit - len(prompt))
        handoffs.append(Handoff(key, list(prompt), seed, max_tokens))
    return handoffs


def resume_segment(
    handoff: Handoff, params: SamplingParams, schedule: WordSwitchSchedule, author: int
) -> AuthorTracker:
    """The tracker an engine writing as `author` continues `handoff` with (its author state
    replayed from the ids, its generator where the other engine left it); raises unless the
    next token is `author`'s."""
    if author not in (SENIOR, JUNIOR):
        raise ValueError(f"author must be SENIOR ({SENIOR}) or JUNIOR ({JUNIOR}), got {author}")
    tracker = AuthorTracker.resume(
        schedule,
        handoff.seed,
        params.temperature,
        params.top_p,
        handoff.response_ids,
        handoff.generator_state,
    )
    if tracker.state.author != author:
        raise ValueError(f"sample {handoff.key}: its next token is not this engine's")
    return tracker


def by_next_author(
    handoffs: Sequence[Handoff], schedule: WordSwitchSchedule
) -> dict[int, list[Handoff]]:
    """The open handoffs grouped by the author of their next token."""
    turns: dict[int, list[Handoff]] = {SENIOR: [], JUNIOR: []}
    for handoff in handoffs:
        if handoff.finish_reason is None:
            turns[schedule.replay(handoff.seed, handoff.response_ids).author].append(handoff)
    return turns


def cowrite(
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    schedule: WordSwitchSchedule,
    senior: SegmentWriter,
    junior: SegmentWriter,
    decode: Callable[[list[int]], str],
    context_limit: int,
) -> list[GenerationResult]:
    """Co-write `n` samples per request on two engines; results as `generate` returns them.

    Each round sends every open sample to its next author's engine; the junior's batch starts
    first, so an engine in another process writes while an in-process senior does.
    """
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    handoffs = start_handoffs(requests, params, context_limit)
    pending = list(handoffs)
    while pending:
        turns = by_next_author(pending, schedule)
        waits = [writer(turns[author]) for author, writer in ((JUNIOR, junior), (SENIOR, senior))]
        written = sorted((h for wait in waits for h in wait()), key=lambda h: h.key)
        for handoff in written:
            handoffs[handoff.key] = handoff
        pending = [h for h in written if h.finish_reason is None]
    return _results(requests, handoffs, schedule, decode, params)


def cowrite_continuous(
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    schedule: WordSwitchSchedule,
    senior: SegmentEngine,
    junior: SegmentEngine,
    decode: Callable[[list[int]], str],
    context_limit: int,
) -> list[GenerationResult]:
    """`cowrite` without rounds: a segment that ends goes at once to the other author's engine,
    which adds it to the batch it is decoding. The engines run at the same time: the senior
    steps here while the junior writes elsewhere, and this waits on the junior only when the
    senior has nothing to write. Each token is drawn by its sample's generator from its author's
    logits on the same ids, so the samples are `cowrite`'s."""
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    handoffs = start_handoffs(requests, params, context_limit)
    engines = {SENIOR: senior, JUNIOR: junior}

    def hand_over(written: list[Handoff]) -> None:
        for handoff in written:
            handoffs[handoff.key] = handoff
        turns = by_next_author(written, schedule)
        for author, engine in engines.items():
            if turns[author]:
                engine.add(turns[author])

    hand_over(handoffs)
    while len(senior) or len(junior):
        written = senior.step() if len(senior) else []
        if len(junior):
            written += junior.step(wait=not len(senior))
        hand_over(written)
    return _results(requests, handoffs, schedule, decode, params)


def _results(
    requests: Sequence[GenerationRequest],
    handoffs: list[Handoff],
    schedule: WordSwitchSchedule,
    decode: Callable[[list[int]], str],
    params: SamplingParams,
) -> list[GenerationResult]:
    """The ended handoffs as `generate` returns samples: grouped by request, in order."""
    results = [
        TrajectoryResult(
            str(h.key),
            turns=[Turn(h.prompt_ids, h.seed, finished_sample(h, schedule, decode, params.stop))],
        )
        for h in handoffs
    ]
    return grouped_samples(requests, results)


def finished_sample(
    handoff: Handoff,
    schedule: WordSwitchSchedule,
    decode: Callable[[list[int]], str],
    stop: Collection[str],
) -> Sample:
    """The `Sample` of an ended handoff, with the authorship and counters the shared engine
    reports for the same ids."""
    state = schedule.start(handoff.seed)
    authorship = [state.observe(token) for token in handoff.response_ids]
    return Sample(
        token_ids=list(handoff.response_ids),
        text=cut_at_stop(decode(handoff.response_ids), tuple(stop)),
        logprobs=list(handoff.logprobs),
        finish_reason=handoff.finish_reason or "length",
        flags={TANDEM_FLAGS: counters_to_dict(state.counters)},
        authorship=authorship,
    )


def ready(handoffs: list[Handoff]) -> Callable[[], list[Handoff]]:
    """A `SegmentWriter`'s wait for segments already written (an engine in this process)."""
    return lambda: handoffs
