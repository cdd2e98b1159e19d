"""Generation interface: request/result types and the backend protocol every engine implements.

Backends (vLLM, transformers) take prompt token ids and return sampled token ids with their
log-probs; per-sample stop rules (DUET's marker-gated abort) plug in through `StopRule`.
Multi-turn rollouts (`rlvr.generation.trajectories.TrajectoryBackend`) build on these types.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from rlvr.algorithms.tandem import WordSwitchSchedule

EngineLoop = Literal["requests", "batch"]
"""How vLLM samples a `generate` call: "requests" runs every sample as its own request through
the engine loop (`rlvr.generation.engine_loop`, continuous batching, the path multi-turn rollouts
take); "batch" hands them all to one `vllm.LLM.generate` call. Both sample the same tokens."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by all samples of a request."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    """Default base seed of every request; sample j draws from seed + j (see `sample_seed`)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a sample ends (finish reason 'stop') with the token that completes one in
    its response text. As in vLLM, the token ids keep that token and `Sample.text` ends before
    the string (`cut_at_stop`)."""


def engine_stop_ids(eos_token_id: int, generation_eos: int | Sequence[int] | None) -> set[int]:
    """The ids a sample ends on, as vLLM stops: the tokenizer's EOS and every EOS of the model's
    generation config."""
    if generation_eos is None:
        generation_eos = []
    elif isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    return {eos_token_id, *generation_eos}


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to its earliest stop string (all of it when none occurs)."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(ends)] if ends else text


@runtime_checkable
class StopRule(Protocol):
    """Per-sample rule consulted while tokens are produced; it can force EOS mid-generation.

    A fresh rule object is made for every sample (`StopRuleFactory`), so rules may hold state.
    """

    def should_stop(self, generated_ids: Sequence[int]) -> bool:
        """Called after each new token with all response ids so far; True forces EOS next."""
        ...

    def flags(self) -> dict[str, Any]:
        """What the rule decided (e.g. marker / eps_kept / aborted), returned with the sample."""
        ...


class StopRuleFactory(Protocol):
    def __call__(self, request_index: int, sample_index: int) -> StopRule: ...


@dataclass
class GenerationRequest:
    """One prompt, `n` samples. `request_id` is the caller's stable key (e.g. prompt id)."""

    prompt_ids: list[int]
    n: int = 1
    request_id: str = ""
    seed: int | None = None
    """This request's base seed; set it per request so different prompts draw independent streams."""


def sample_seed(
    request: GenerationRequest, params: SamplingParams, sample_index: int
) -> int | None:
    """Seed of one sample: the request's base seed (else the params' one) plus the sample index."""
    base = request.seed if request.seed is not None else params.seed
    return None if base is None else (base + sample_index) % 2**63


@dataclass
class Sample:
    """One sampled response."""

    token_ids: list[int]
    text: str
    """The decoded response without special tokens, ending before a stop string."""
    logprobs: list[float]
    """Log-prob of each sampled token under the distribution it was drawn from: softmax(logits / T)
    renormalised over the top-p nucleus (log_softmax of the raw logits when greedy); a token a
    stop rule forced has log-prob 0 and its index in `flags` (`stop_rules.FORCED_EOS`). Both backends return this; the trainer's engine importance
    correction compares it with its own log-probs renormalised over the same nucleus
    (`rlvr.algorithms.nucleus`), so that equal weights give a ratio of 1."""
    finish_reason: str
    """'stop' (EOS, stop string or stop rule), 'length' (max_tokens), or 'abort'."""
    flags: dict[str, Any] = field(default_factory=dict)
    authorship: list[int] | None = None
    """Tandem rollouts only: the author of each token (1 = senior, 0 = junior), same length as
    `token_ids`; the schedule's counters are in `flags["tandem"]`."""
    model_tokens: list[bool] | None = None
    """Multi-turn rollouts only: whether the model sampled each token (False on what an
    environment answered between its turns), same length as `token_ids`."""


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    samples: list[Sample]


@runtime_checkable
class GenerationBackend(Protocol):
    """A generation engine that can take new weights in place."""

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_rule_factory: StopRuleFactory | None = None,
        schedule: WordSwitchSchedule | None = None,
    ) -> list[GenerationResult]:
        """Sample every request; `schedule` makes each sample a Tandem rollout co-written with
        the backend's junior (backends started with one)."""
        ...

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        names: Collection[str] | None = None,
    ) -> None:
        """Replace the engine's weights in place (HF parameter names) without restarting it;
        ``names``, when known ahead, announces the names ``named_tensors`` yields."""
        ...

    def close(self) -> None: ...


def scored_positions(positions: Iterable[int], length: int) -> list[int]:
    """`positions` as ints, checked to lie in 1..length-1 (position 0 has no prediction)."""
    out = [int(t) for t in positions]
    if out and (min(out) < 1 or max(out) >= length):
        raise ValueError(f"positions {min(out)}..{max(out)} outside 1..{length - 1}")
    return out
