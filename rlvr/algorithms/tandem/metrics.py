"""Tandem RL evaluation metrics (arXiv:2606.28166, Sec. 4): pass@k (Sec. 4.2), the
handoff-robustness loop (Sec. 4.3, App. B.3), marginal-token drift (Sec. 4.4), and junior
cross-entropy and distribution overlap (legibility, Sec. 4.5). Details the text leaves open follow
the authors' code ("the reference code", github.com/CSSLab/Tandem-RLVR) or are our choices, as
marked.

Pure functions over token ids, tensors and generic model callables; engines plug in as writers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import spearmanr

from rlvr.algorithms.counter_rng import uniform
from rlvr.algorithms.pass_at_k import pass_at_k
from rlvr.algorithms.tandem import JUNIOR, SENIOR, NextTokenLogits, sample_token


@dataclass
class MacroMean:
    """A metric aggregated sample -> problem -> benchmark -> macro (unweighted) mean."""

    macro: float
    per_benchmark: dict[str, float]
    per_problem: dict[str, dict[Hashable, float]]


def macro_mean(values: Mapping[str, Mapping[Hashable, Sequence[float]]]) -> MacroMean:
    """Mean per problem of its samples' values, mean per benchmark of its problems, then the
    unweighted mean of the benchmarks (`values[benchmark][problem] = per-sample values`).

    For pass@k give one value per problem. NaN values propagate (they mark undefined samples).
    """
    if not values:
        raise ValueError("no benchmarks")
    per_problem = {
        bench: {prob: float(np.mean(samples)) for prob, samples in problems.items()}
        for bench, problems in values.items()
    }
    if any(not problems for problems in per_problem.values()):
        raise ValueError("a benchmark has no problems")
    per_benchmark = {b: float(np.mean(list(p.values()))) for b, p in per_problem.items()}
    return MacroMean(float(np.mean(list(per_benchmark.values()))), per_benchmark, per_problem)


def bootstrap_macro_se(
    per_problem: Mapping[str, Sequence[float]], n_boot: int = 1000, seed: int = 0
) -> float:
    """Bootstrap standard error of the macro mean, resampling problems within each benchmark."""
    rng = np.random.default_rng(seed)
    boots = np.zeros(n_boot)
    for values in per_problem.values():
        v = np.asarray(values, dtype=np.float64)
        boots += v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(axis=1)
    return float((boots / len(per_problem)).std(ddof=1))


@dataclass(frozen=True)
class TurnRequest:
    """One turn to write: the full context (prompt + team text so far), its token allowance and seed."""

    context_ids: list[int]
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Turn:
    """What a writer produced: the turn's ids (ending at the step boundary, EOS or max_tokens)."""

    ids: list[int]
    eos: bool
    """The turn ended the response (EOS emitted, kept in `ids`)."""


TurnWriter = Callable[[list[TurnRequest]], list[Turn]]
"""A model in the HR loop: writes one turn for each request of a batch (e.g. one vLLM call with the
stop string "\\n\\n" kept in the output, or `token_turn_writer`)."""


@dataclass
class HandoffRollout:
    """One team chain of the HR evaluation."""

    response_ids: list[int]
    authorship: list[int]
    """1 where the senior wrote the token."""
    rounds: int
    finish_reason: str
    """'stop' (EOS), 'length' (shared budget spent) or 'rounds' (round cap)."""

    @property
    def senior_share(self) -> float:
        """Fraction of the chain's tokens the senior wrote (0 for an empty chain)."""
        return sum(self.authorship) / len(self.authorship) if self.authorship else 0.0


def handoff_budget(prompt_len: int, max_new_tokens: int = 3000, context_len: int = 4096) -> int:
    """The HR chain's shared token budget: min(max_new_tokens, context_len - prompt_len - 8), as
    in the reference code."""
    return max(0, min(max_new_tokens, context_len - prompt_len - 8))


def handoff_rollouts(
    prompts: Sequence[Sequence[int]],
    senior: TurnWriter,
    junior: TurnWriter,
    budgets: Sequence[int],
    seeds: Sequence[int],
    schedule: str = "strict",
    p: float = 0.5,
    max_rounds: int = 150,
) -> list[HandoffRollout]:
    """Team chains in which senior and junior take turns at step boundaries (Sec. 4.3).

    The senior writes the first turn. `schedule="strict"` alternates after every turn;
    `"stochastic"` lets the senior write the next turn iff `uniform(seed, r) < p` after turn r
    (App. B.3). Each chain shares one budget between both models; a turn of chain i is asked for
    at most the rest of it with seed `seeds[i] + tokens used so far`. A chain ends at EOS, when
    the budget is spent, or after `max_rounds` turns (the first writer, seeding and 150-round cap
    follow the reference code). Each round calls each writer once with the batch of chains it
    writes.
    """
    if schedule not in ("strict", "stochastic"):
        raise ValueError(f"schedule must be 'strict' or 'stochastic', got {schedule!r}")
    if not len(prompts) == len(budgets) == len(seeds):
        raise ValueError(f"{len(prompts)} prompts, {len(budgets)} budgets, {len(seeds)} seeds")
    chains = [HandoffRollout([], [], 0, "length") for _ in prompts]
    writer_of = [SENIOR] * len(prompts)
    active = [i for i, budget in enumerate(budgets) if budget > 0]
    while active:
        still: list[int] = []
        # Group before writing: a chain handed over in this round waits for the next one.
        groups = [[i for i in active if writer_of[i] == author] for author in (SENIOR, JUNIOR)]
        for author, write, mine in zip((SENIOR, JUNIOR), (senior, junior), groups, strict=True):
            if not mine:
                continue
            requests = [
                TurnRequest(
                    list(prompts[i]) + chains[i].response_ids,
                    budgets[i] - len(chains[i].response_ids),
                    seeds[i] + len(chains[i].response_ids),
                )
                for i in mine
            ]
            turns = write(requests)
            if len(turns) != len(requests):
                raise ValueError(f"writer returned {len(turns)} turns for {len(requests)} requests")
            for i, request, turn in zip(mine, requests, turns, strict=True):
                if not turn.ids or len(turn.ids) > request.max_tokens:
                    raise ValueError(
                        f"a turn must hold 1..{request.max_tokens} tokens, got {len(turn.ids)}"
                    )
                chain = chains[i]
                chain.response_ids += turn.ids
                chain.authorship += [author] * len(turn.ids)
                chain.rounds += 1
                if turn.eos:
                    chain.finish_reason = "stop"
                elif len(chain.response_ids) >= budgets[i]:
                    chain.finish_reason = "length"
                elif chain.rounds >= max_rounds:
                    chain.finish_reason = "rounds"
                else:
                    if schedule == "strict":
                        writer_of[i] = 1 - author
                    else:
                        writer_of[i] = SENIOR if uniform(seeds[i], chain.rounds) < p else JUNIOR
                    still.append(i)
        active = sorted(still)
    return chains


def token_turn_writer(
    model: NextTokenLogits,
    ends_step: Callable[[list[int]], bool],
    stop_ids: Iterable[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> TurnWriter:
    """A `TurnWriter` over a next-token-logits callable, one token at a time (tests, HF models).

    A turn ends after a token for which `ends_step(turn_ids)` holds (e.g. the decoded turn ends
    with "\\n\\n"), at a stop id, or at max_tokens; it samples with `sample_token` from a CPU
    generator seeded with the turn's seed.
    """
    stops = frozenset(stop_ids)

    def write(requests: list[TurnRequest]) -> list[Turn]:
        turns = []
        for request in requests:
            generator = torch.Generator("cpu").manual_seed(request.seed)
            context = list(request.context_ids)
            ids: list[int] = []
            eos = False
            while len(ids) < request.max_tokens:
                token = sample_token(model(context), generator, temperature, top_p, top_k)
                context.append(token)
                ids.append(token)
                if token in stops:
                    eos = True
                    break
                if ends_step(ids):
                    break
            turns.append(Turn(ids, eos))
        return turns

    return write


def junior_cross_entropy(
    junior_logits: torch.Tensor, response_ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-sample mean junior cross-entropy (nats) of the response tokens: `[b]`.

    `junior_logits[b, t]` (`[b, t, V]`) is the junior's prediction of `response_ids[b, t]`
    (teacher-forced on prompt + response, temperature 1); `mask` `[b, t]` selects the scored
    tokens (response only; leave EOS out). A row with no scored token gives NaN.
    """
    logp = torch.log_softmax(junior_logits.float(), dim=-1)
    picked = logp.gather(-1, response_ids.long().unsqueeze(-1)).squeeze(-1)
    mask = mask.bool()
    total = torch.where(mask, -picked, torch.zeros_like(picked)).sum(-1)
    return total / mask.sum(-1)


def distribution_overlap(
    senior_logits: torch.Tensor, junior_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-sample mean overlap sum_v min(p_S(v), p_J(v)) = 1 - TV over the masked positions: `[b]`.

    Logits `[b, t, V]` of both models at the same contexts, full-vocabulary softmax at temperature
    1; the overlap is the speculative-decoding acceptance rate. A row with no position gives NaN.
    """
    p_s = torch.softmax(senior_logits.float(), dim=-1)
    p_j = torch.softmax(junior_logits.float(), dim=-1)
    overlap = torch.minimum(p_s, p_j).sum(-1)
    mask = mask.bool()
    return torch.where(mask, overlap, torch.zeros_like(overlap)).sum(-1) / mask.sum(-1)


def token_counts(responses: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """How often each id occurs in a pool of responses: `[vocab_size]` int64."""
    ids = [np.asarray(r, dtype=np.int64) for r in responses]
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    return np.bincount(flat, minlength=vocab_size)


def smoothed_distribution(counts: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """Additively smoothed marginal: (count + alpha) / (total + alpha * V), over the full vocabulary."""
    counts = np.asarray(counts, dtype=np.float64)
    return (counts + alpha) / (counts.sum() + alpha * counts.size)


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) = sum_v p(v) log(p(v) / q(v)) in nats; q must be positive where p is."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    support = p > 0
    return float(np.sum(p[support] * (np.log(p[support]) - np.log(q[support]))))


def survival_curve(log_ratio: np.ndarray, frequent: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """S(tau) = |{v in frequent : |d(v)| > tau}| / |frequent| for each tau (non-increasing)."""
    d = np.abs(np.asarray(log_ratio)[np.asarray(frequent, dtype=bool)])
    if d.size == 0:
        raise ValueError("no frequent tokens")
    return (d[None, :] > np.asarray(taus, dtype=np.float64)[:, None]).mean(axis=1)


@dataclass
class Drift:
    """How far one model's marginal token distribution sits from the junior's."""

    kl_to_junior: float
    """KL(p_M || p_J)."""
    kl_from_junior: float
    """KL(p_J || p_M)."""
    log_ratio: np.ndarray
    """d_M(v) = log p_M(v) - log p_J(v) over the vocabulary (> 0: M over-uses v)."""
    taus: np.ndarray
    survival: np.ndarray
    """S_M(tau) over tokens the junior emits at least `min_junior_count` times."""


def marginal_drift(
    counts_model: np.ndarray,
    counts_junior: np.ndarray,
    taus: np.ndarray | None = None,
    alpha: float = 1.0,
    min_junior_count: int = 20,
) -> Drift:
    """Drift of model M from the junior from pooled token counts (Sec. 4.4, Fig. 4): both KL
    directions, the signed log-ratio and its survival curve (default taus 0, 0.1, ..., 4). Our
    choices, as the paper states neither: additive smoothing `alpha` and the frequency threshold
    `min_junior_count`."""
    if np.shape(counts_model) != np.shape(counts_junior):
        raise ValueError("count vectors must cover the same vocabulary")
    taus = np.linspace(0.0, 4.0, 41) if taus is None else np.asarray(taus, dtype=np.float64)
    p_m = smoothed_distribution(counts_model, alpha)
    p_j = smoothed_distribution(counts_junior, alpha)
    d = np.log(p_m) - np.log(p_j)
    frequent = np.asarray(counts_junior) >= min_junior_count
    return Drift(
        kl_divergence(p_m, p_j), kl_divergence(p_j, p_m), d, taus, survival_curve(d, frequent, taus)
    )


@dataclass
class Pushback:
    """How TRL moves on the tokens GRPO displaces most."""

    fraction: float
    """Share of the selected tokens where d_TRL - d_GRPO has the sign opposite to d_GRPO."""
    spearman: float
    """Spearman rho between d_GRPO and d_TRL - d_GRPO over the selected tokens."""
    token_ids: np.ndarray
    """The selected ids, largest |d_GRPO| first."""


def pushback(
    d_grpo: np.ndarray, d_trl: np.ndarray, top: int = 500, candidates: np.ndarray | None = None
) -> Pushback:
    """Top-`top` pushback (Sec. 4.4): among the tokens with the largest |d_GRPO| (within the
    boolean `candidates`, default all), the fraction where sign(d_TRL - d_GRPO) = -sign(d_GRPO)
    (our reading of "TRL shifting in the opposing direction").

    A token with d_GRPO = 0 or an unchanged d never counts as pushed back.
    """
    d_grpo = np.asarray(d_grpo, dtype=np.float64)
    d_trl = np.asarray(d_trl, dtype=np.float64)
    pool = np.arange(d_grpo.size) if candidates is None else np.flatnonzero(candidates)
    # Stable sort so ties keep id order and the selection is reproducible.
    order = pool[np.argsort(-np.abs(d_grpo[pool]), kind="stable")][:top]
    shift = d_trl[order] - d_grpo[order]
    fraction = float(np.mean(shift * d_grpo[order] < 0))
    rho = float(spearmanr(d_grpo[order], shift).statistic) if order.size > 1 else float("nan")
    return Pushback(fraction, rho, order)


def over_emitted(
    log_ratio: np.ndarray, counts_model: np.ndarray, counts_junior: np.ndarray, top: int = 20
) -> list[tuple[int, float, int, int]]:
    """The model's most over-used tokens: (id, d(v), count_M, count_J), largest d first (App. B.1)."""
    order = np.argsort(-np.asarray(log_ratio), kind="stable")[:top]
    return [
        (int(v), float(log_ratio[v]), int(counts_model[v]), int(counts_junior[v])) for v in order
    ]


def pass_at_k_table(
    correct: Mapping[str, Mapping[Hashable, Sequence[bool]]], ks: Sequence[int]
) -> dict[int, dict[str, dict[Hashable, list[float]]]]:
    """Per-problem pass@k for each k from per-sample verdicts (`correct[benchmark][problem]`), in
    `macro_mean`'s layout: `table[k][benchmark][problem] = [pass@k]`.

    n is each problem's own sample count, so k must not exceed it.
    """
    return {
        k: {
            bench: {prob: [pass_at_k(len(v), int(sum(v)), k)] for prob, v in problems.items()}
            for bench, problems in correct.items()
        }
        for k in ks
    }
