"""Tandem RL co-generation core (arXiv:2606.28166, Sec. 3.3-3.4 and App. A.1): the word-boundary
set, the per-request author state machine, the senior-only loss mask and a two-model segment-loop
generator that serves as the test oracle for the engine's fast path. "The reference code" is the
authors' code, github.com/CSSLab/Tandem-RLVR (the paper names it); it settles details the text
leaves open, such as when a redraw takes effect.

Seeding contract (every path that claims equality with `tandem_generate_reference` must follow it):

* Author coins are counter-based and independent of token sampling: draw r of a request (r = 0 is
  the first author, r = k the k-th redraw) is `counter_rng.uniform(seed, r)`, and the senior wins
  iff it is < p. A state is therefore rebuilt exactly from (seed, emitted ids) with no generator to
  restore.
* Tokens come from one CPU `torch.Generator` seeded with the request seed. For every emitted token,
  whichever model wrote it, `sample_token` draws exactly one `exponential_` over the full logits row
  (float32, after temperature, top-k, top-p) and takes argmax(probs / noise): vLLM's native
  `random_sample` for a seeded request. Greedy decoding (temperature < 1e-5) draws nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rlvr.algorithms.counter_rng import uniform
from rlvr.algorithms.nucleus import top_p_filter

SENIOR = 1
JUNIOR = 0
BYTE_LEVEL_SPACE = "\u0120"
"""The byte-level BPE leading-space marker `Ġ` that starts every word-initial token."""
GREEDY_EPS = 1e-5
"""Temperatures below this decode greedily (vLLM's threshold)."""

NextTokenLogits = Callable[[list[int]], torch.Tensor]
"""A model as the oracle sees it: full context ids (prompt + response so far) -> logits `[vocab]`.
An HF causal LM wraps as `lambda ids: model(torch.tensor([ids])).logits[0, -1]`."""


def word_boundary_ids(vocab: Mapping[str, int]) -> frozenset[int]:
    """Ids whose token string starts with `Ġ` (`tok.get_vocab()`): tokens that begin a new word.

    Built once at init; for Qwen3 it holds 53,021 ids. Special and newline tokens carry no `Ġ` and
    are excluded. An empty set means the tokenizer is not byte-level BPE (e.g. SentencePiece `▁`),
    where only the cap would ever redraw, so it raises instead of silently changing the method.
    """
    ids = frozenset(i for token, i in vocab.items() if token.startswith(BYTE_LEVEL_SPACE))
    if not ids:
        raise ValueError(
            f"no token starts with the byte-level space marker {BYTE_LEVEL_SPACE!r}; "
            "Tandem's word boundaries need a byte-level BPE tokenizer"
        )
    return ids


def require_same_vocab(senior_vocab: Mapping[str, int], junior_vocab: Mapping[str, int]) -> None:
    """Raise unless both vocabularies map the same strings to the same ids.

    Handoff passes token ids across unchanged, so any difference would feed the junior wrong tokens.
    """
    if senior_vocab == junior_vocab:
        return
    only_senior = set(senior_vocab) - set(junior_vocab)
    only_junior = set(junior_vocab) - set(senior_vocab)
    moved = [t for t in set(senior_vocab) & set(junior_vocab) if senior_vocab[t] != junior_vocab[t]]
    raise ValueError(
        "senior and junior tokenizers differ (Tandem hands off token ids, so they must be "
        f"identical): {len(only_senior)} tokens only in the senior's, {len(only_junior)} only in "
        f"the junior's, {len(moved)} with different ids; e.g. "
        f"{sorted(only_senior)[:3]} / {sorted(only_junior)[:3]} / {sorted(moved)[:3]}"
    )


@dataclass
class SwitchCounters:
    """Per-rollout schedule counters; a token that is a boundary and hits the cap counts as boundary."""

    boundary_redraws: int = 0
    cap_redraws: int = 0
    switches: int = 0
    """Consecutive emitted tokens with different authors."""

    @property
    def redraws(self) -> int:
        """All redraws after the first author draw (a redraw may keep the same author)."""
        return self.boundary_redraws + self.cap_redraws


@dataclass(frozen=True)
class WordSwitchSchedule:
    """TRL's switching rule: a Bernoulli(p) author redraw after each word-boundary token or after
    `cap` tokens since the last redraw (Sec. 3.3, App. A.1.2). As in the reference code, the token
    that triggers a redraw is written by the current author and the winner writes the next one.
    Holds no per-request state; see `AuthorState`."""

    boundary_ids: frozenset[int]
    p: float = 0.5
    """Probability that the senior wins a draw (the paper's fair coin: 0.5)."""
    cap: int = 32
    """K: redraw after this many tokens without a redraw, so no model keeps control through long
    runs without `Ġ` tokens (LaTeX, identifiers, code); App. A.1.2, 32 as in the reference code."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {self.p}")
        if self.cap < 1:
            raise ValueError(f"cap must be >= 1, got {self.cap}")

    def start(self, seed: int) -> AuthorState:
        """The state before the first response token: author = draw 0, counter at 0."""
        return AuthorState(self, seed, self.draw(seed, 0))

    def draw(self, seed: int, index: int) -> int:
        """Author won by draw `index` of the request (SENIOR iff the coin is below p)."""
        return SENIOR if uniform(seed, index) < self.p else JUNIOR

    def replay(self, seed: int, emitted_ids: Sequence[int]) -> AuthorState:
        """The state after `emitted_ids`, equal to the step-by-step one (e.g. after preemption)."""
        state = self.start(seed)
        for token in emitted_ids:
            state.observe(token)
        return state

    def authorship(self, seed: int, emitted_ids: Sequence[int]) -> list[int]:
        """Author of each emitted token (1 = senior) as the schedule assigns it for `seed`."""
        state = self.start(seed)
        return [state.observe(token) for token in emitted_ids]


@dataclass
class AuthorState:
    """One request's author state machine; advance it with `observe` after every emitted token.

    The prompt never advances it and EOS is observed like any other token.
    """

    schedule: WordSwitchSchedule = field(repr=False)
    seed: int
    author: int
    """Who writes the next token."""
    since: int = 0
    """Tokens emitted since the last draw."""
    n_tokens: int = 0
    counters: SwitchCounters = field(default_factory=SwitchCounters)
    last_author: int | None = None
    """Author of the last emitted token (None before the first)."""

    def observe(self, token_id: int) -> int:
        """Record one emitted token and return its author; then redraw if the token is a word
        boundary or the cap is reached, so the new author takes over from the next token."""
        wrote = self.author
        if self.last_author is not None and wrote != self.last_author:
            self.counters.switches += 1
        self.last_author = wrote
        self.n_tokens += 1
        self.since += 1
        boundary = token_id in self.schedule.boundary_ids
        if boundary or self.since >= self.schedule.cap:
            if boundary:
                self.counters.boundary_redraws += 1
            else:
                self.counters.cap_redraws += 1
            # Draw 0 chose the first author, so the k-th redraw is draw k.
            self.author = self.schedule.draw(self.seed, self.counters.redraws)
            self.since = 0
        return wrote


def sample_token(
    logits: torch.Tensor,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> int:
    """One token from `[vocab]` logits: temperature, then top-k (ties kept), then top-p (the
    smallest most-likely set with mass >= top_p, never dropping the top token), then one
    exponential race argmax(probs / Exp(1) noise) with `generator` (a CPU generator).

    The same filters and draw as vLLM's native sampler; `top_k <= 0` disables top-k.
    """
    logits = logits.detach().float().cpu()
    if temperature < GREEDY_EPS:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = top_p_filter(logits, top_p)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


@dataclass
class TandemRollout:
    """One co-written response: ids, the author of each (1 = senior), why it ended, counters."""

    response_ids: list[int]
    authorship: list[int]
    finish_reason: str
    """'stop' (a stop id, kept in the response) or 'length' (max_tokens)."""
    counters: SwitchCounters


def tandem_generate_reference(
    prompt_ids: Sequence[int],
    senior: NextTokenLogits,
    junior: NextTokenLogits,
    schedule: WordSwitchSchedule,
    seed: int,
    max_tokens: int,
    stop_ids: Collection[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> TandemRollout:
    """Co-write one response with a two-model segment loop (the test oracle for the paper's
    lockstep dual-decoder engine, App. A.1.1).

    The active model writes token by token on the shared id prefix until the schedule hands over,
    then the other model continues from the same prefix. Only the active model is queried, which
    gives the same distribution as lockstep decoding; sampling follows the module's seeding
    contract, so a fast path with the same seed must return identical ids and authorship.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    state = schedule.start(seed)
    generator = torch.Generator("cpu").manual_seed(seed)
    context = list(prompt_ids)
    response: list[int] = []
    authorship: list[int] = []
    while True:
        writer = senior if state.author == SENIOR else junior
        segment_author = state.author
        while state.author == segment_author:
            token = sample_token(writer(context), generator, temperature, top_p, top_k)
            context.append(token)
            response.append(token)
            authorship.append(state.observe(token))
            if token in stop_ids:
                return TandemRollout(response, authorship, "stop", state.counters)
            if len(response) >= max_tokens:
                return TandemRollout(response, authorship, "length", state.counters)


def authorship_matrix(
    authorships: Sequence[Sequence[int]],
    lengths: Sequence[int],
    offsets: Sequence[int],
    width: int,
) -> torch.Tensor:
    """Authorship laid out like the training batch: `[batch, width]` long, 0 outside responses.

    Row i holds `authorships[i][:lengths[i]]` starting at column `offsets[i]` (the prompt length
    for prompt+response rows, 0 for response-only rows), cut at `width`. An authorship shorter than
    its response raises: a missing mask must never become a silent all-junior or all-senior one.
    """
    if not len(authorships) == len(lengths) == len(offsets):
        raise ValueError(
            f"{len(authorships)} authorships, {len(lengths)} lengths, {len(offsets)} offsets"
        )
    out = torch.zeros((len(authorships), width), dtype=torch.long)
    for row, (auth, n, start) in enumerate(zip(authorships, lengths, offsets, strict=True)):
        if len(auth) < n:
            raise ValueError(f"authorship {row} has {len(auth)} flags for {n} response tokens")
        stop = min(start + n, width)
        if stop > start:
            out[row, start:stop] = torch.as_tensor(list(auth[: stop - start]), dtype=torch.long)
    return out


def senior_loss_mask(response_mask: torch.Tensor, authorship: torch.Tensor | None) -> torch.Tensor:
    """Positions that enter the senior's loss: response_mask AND authorship == senior (Sec. 3.4,
    Eq. 1; App. A.1.1).

    Shapes `[batch, seq]`, same layout. The gate only removes positions. Combined with `torch.where`
    so a boolean result is exact whatever the dtypes. `authorship=None` raises: the reference code
    silently trains plain GRPO when the mask is lost, a bug no metric shows.
    """
    if authorship is None:
        raise ValueError("tandem is enabled but no authorship mask arrived with the batch")
    if authorship.shape != response_mask.shape:
        raise ValueError(
            f"authorship {tuple(authorship.shape)} != response mask {tuple(response_mask.shape)}"
        )
    response_mask = response_mask.bool()
    return torch.where(authorship == SENIOR, response_mask, torch.zeros_like(response_mask))


def schedule_metrics(
    authorships: Sequence[Sequence[int]], counters: Sequence[SwitchCounters]
) -> dict[str, float]:
    """Per-step Tandem schedule metrics over one batch of rollouts (our diagnostics).

    `senior_token_frac` (all senior tokens / all response tokens, ungated; it must be near p),
    `switches_per_seq`, `mean_run_length` (tokens per same-author run) and `cap_redraw_share`
    (cap-triggered / all redraws; 0 when there are none).
    """
    if len(authorships) != len(counters):
        raise ValueError(f"{len(authorships)} authorships but {len(counters)} counters")
    tokens = sum(len(a) for a in authorships)
    if tokens == 0:
        return {}
    senior = sum(sum(1 for x in a if x == SENIOR) for a in authorships)
    switches = sum(c.switches for c in counters)
    runs = sum(c.switches + 1 for a, c in zip(authorships, counters, strict=True) if a)
    redraws = sum(c.redraws for c in counters)
    return {
        "tandem/senior_token_frac": senior / tokens,
        "tandem/switches_per_seq": switches / len(authorships),
        "tandem/mean_run_length": tokens / runs,
        "tandem/cap_redraw_share": sum(c.cap_redraws for c in counters) / redraws
        if redraws
        else 0.0,
    }
