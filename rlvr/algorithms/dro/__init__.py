"""DRO: the R3 reference-certainty reward, the variance query filter, rubric gates and the loss.

Pure numpy/torch kernels of Direct Reasoning Optimization (Xu et al., arXiv:2506.13351): the
self-certainty of the reference answer after each CoT, scored from token ids (Sec. 3.1.1, App. M),
R3 (Eq. 2) and its Avg Prob / Avg Logprob baselines (Table 1), the offline variance filter
(Sec. 4.2), rubric parsing (App. E) and the coverage / consistency gates (Sec. 4.1), and the group
advantage (Eq. 1) with the Dr.GRPO-style loss and the 80/20 entropy mask (Eq. 3, App. F.2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlvr.algorithms.advantages import group_advantages
from rlvr.algorithms.grpo import kl_k3, policy_loss

# Defaults of the paper's Table 3 and App. F.2: gates mu=1, rho_g=25%, nu=60%, filter fractions 10%,
# beta 0.001. Our choices where it gives a range or an approximate value: omega 1.5 (the paper: 1-2
# per dataset), the clip bounds exactly 0.05 / 0.85 (the paper: "<~0.05" / ">~0.85"), rho_ent 0.4
# (the paper: 0.3-0.5), advantage eps 1e-4 (TRL's, the trainer the paper used).
DEFAULT_OMEGA = 1.5
DEFAULT_CLIP_LOW = 0.05
DEFAULT_CLIP_HIGH = 0.85
DEFAULT_TOKEN_FRAC = 0.10
DEFAULT_QUERY_FRAC = 0.10
DEFAULT_MU = 1
DEFAULT_RHO_G = 0.25
DEFAULT_NU = 0.6
DEFAULT_ADV_EPS = 1e-4
DEFAULT_BETA = 0.001
DEFAULT_RHO_ENT = 0.4
MAX_RUBRIC_ITEMS = 10

REFERENCE_REWARDS = ("r3", "avg_prob", "avg_logprob")

ArrayLike = np.ndarray | torch.Tensor | Sequence[float]


def _ceil_count(frac: float, n: int) -> int:
    """ceil(frac * n), at least 1: the count of a top fraction (J_top, gate band, kept queries).

    The tolerance stops float noise from adding one (0.1 * 30 is 3.0000000000000004).
    """
    return max(1, math.ceil(frac * n - 1e-9))


def _ids(seq: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    values = seq.tolist() if isinstance(seq, np.ndarray | torch.Tensor) else seq
    return [int(t) for t in values]


def _float_array(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


# --- scoring input (Sec. 3.1.1): [q | c_i | d | y] as token ids -----------------------------------


def split_completion(
    completion_ids: Sequence[int] | np.ndarray | torch.Tensor,
    delimiter_ids: Sequence[int] | np.ndarray | torch.Tensor,
) -> tuple[list[int], list[int] | None]:
    """Split a completion at the first CoT/answer delimiter: (CoT ids, answer ids or None).

    The delimiter (e.g. Qwen3's `</think>` id) is found as a token-id subsequence and belongs to
    neither part. Without it (or with an empty delimiter) the whole completion is the CoT and the
    answer is None: the rubric gates check final answers (Sec. 4.1), and our choice is that such a
    rollout meets no rubric item.
    """
    completion, delimiter = _ids(completion_ids), _ids(delimiter_ids)
    m = len(delimiter)
    if m:
        for start in range(len(completion) - m + 1):
            if completion[start : start + m] == delimiter:
                return completion[:start], completion[start + m :]
    return completion, None


def match_delimiter(
    completion_ids: Sequence[int] | np.ndarray | torch.Tensor,
    variants: Sequence[Sequence[int]],
) -> list[int] | None:
    """The delimiter tokenization that occurs first in the completion (the longer on a tie).

    A text delimiter tokenizes by what precedes it in byte-level BPE (" The" after a period is
    one token; "$\\" or " \\" opens `\\boxed{`), so it is searched as each of its
    tokenizations, still by token id. None when no variant occurs (or there are none).
    """
    completion = _ids(completion_ids)
    found = []
    for variant in map(_ids, variants):
        cot, answer = split_completion(completion, variant)
        if answer is not None:
            found.append((len(cot), -len(variant), variant))
    return min(found)[2] if found else None


def build_scoring_ids(
    prompt_ids: Sequence[int] | np.ndarray | torch.Tensor,
    completion_ids: Sequence[int] | np.ndarray | torch.Tensor,
    delimiter_ids: Sequence[int] | np.ndarray | torch.Tensor,
    reference_ids: Sequence[int] | np.ndarray | torch.Tensor,
    separator_ids: Sequence[int] | np.ndarray | torch.Tensor = (),
) -> tuple[list[int], range]:
    """The R3 teacher-forcing input `q + c + d + y` as token ids, and the positions of `y` in it.

    The sampled answer after the delimiter is dropped ("slicing"); `d` is `delimiter_ids` then the
    fixed `separator_ids` (e.g. the ids of "\\n\\n"), so the reference always follows the same
    separator whatever the policy emitted after `</think>`. Without a delimiter in the completion
    the whole completion is the prefix and nothing is appended (App. M: Table 8 finds it about as
    good). Strip EOS or other stop tokens from `completion_ids` first: the reference must not
    follow an end of text.
    Nothing is re-tokenized, so token j of the reference is the same id in every rollout. Read
    `token_logprobs[pos]` (log p(ids[pos] | ids[:pos]), vLLM prompt log-prob alignment) at the
    returned positions.
    """
    reference = _ids(reference_ids)
    if not reference:
        raise ValueError("the reference answer has no tokens; refuse it at data load")
    cot, answer = split_completion(completion_ids, delimiter_ids)
    suffix = _ids(delimiter_ids) + _ids(separator_ids) if answer is not None else []
    prefix = _ids(prompt_ids) + cot + suffix
    if not prefix:
        raise ValueError("empty prompt and CoT: the first reference token has no context")
    return prefix + reference, range(len(prefix), len(prefix) + len(reference))


def reference_logprobs(
    token_logprobs: Sequence[ArrayLike] | torch.Tensor | np.ndarray,
    ref_positions: Sequence[Sequence[int]],
) -> np.ndarray:
    """Log-probs of the reference tokens after each rollout's prefix: `[G, L]` float64, detached.

    `token_logprobs[i][t]` is log p(ids_i[t] | ids_i[:t]) of scoring sequence i at temperature 1
    over the full vocabulary (vLLM prompt log-probs, or `rlvr.training.batch.token_logprobs`);
    rows may be ragged or padded. `ref_positions[i]` are its reference positions from
    `build_scoring_ids`; every row must have the same number L of them.
    """
    if len(token_logprobs) != len(ref_positions):
        raise ValueError(
            f"{len(token_logprobs)} log-prob rows but {len(ref_positions)} position lists"
        )
    lengths = {len(pos) for pos in ref_positions}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"every row needs the same non-zero number of positions, got {lengths}")
    rows = []
    for row, pos in zip(token_logprobs, ref_positions, strict=True):
        idx = np.asarray(list(pos), dtype=np.int64)
        values = _float_array(row)
        if idx.min() < 1 or idx.max() >= len(values):
            # Position 0 has no prediction; anything past the row was never scored.
            raise ValueError(f"positions {idx.min()}..{idx.max()} outside 1..{len(values) - 1}")
        rows.append(values[idx])
    out = np.stack(rows)
    if np.isnan(out).any() or (out > 1e-3).any():
        raise ValueError("reference log-probs must be <= 0 and not NaN")
    # logits - logsumexp in low precision can land a rounding error above 0.
    return np.minimum(out, 0.0)


def self_certainty(
    token_logprobs: Sequence[ArrayLike] | torch.Tensor | np.ndarray,
    ref_positions: Sequence[Sequence[int]],
) -> np.ndarray:
    """The self-certainty matrix P `[G, L]`: p_ij = pi_s(y_j | q, c_i, d, y_<j) (Sec. 3.1.1).

    Probabilities, not log-probs: exp of `reference_logprobs` at the same arguments.
    """
    return np.exp(reference_logprobs(token_logprobs, ref_positions))


# --- R3 (Eq. 2) and the baselines of Table 1 -----------------------------------------------------


def _certainty_matrix(probs: ArrayLike) -> np.ndarray:
    p = _float_array(probs)
    if p.ndim != 2 or p.shape[1] == 0:
        raise ValueError(f"expected a [G, L] matrix with L >= 1, got shape {p.shape}")
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError("self-certainties must be probabilities in [0, 1]")
    return p


def token_std(probs: ArrayLike, ddof: int = 1) -> np.ndarray:
    """sigma_j `[L]`: the std of each reference token's certainty across the G rollouts.

    Sample std (ddof=1, torch's default; our choice, the paper does not say); a group of one
    rollout has none and is refused.
    """
    p = _certainty_matrix(probs)
    if p.shape[0] <= ddof:
        raise ValueError(f"need more than {ddof} rollouts for a std with ddof={ddof}, got {len(p)}")
    return p.std(axis=0, ddof=ddof)


def emphasis_weights(sigma: ArrayLike, omega: float = DEFAULT_OMEGA) -> np.ndarray:
    """w_j = softmax_j(omega * sigma_j) `[L]` over ALL reference tokens; omega=0 gives 1/L each.

    A mild, smooth emphasis of the tokens whose certainty depends on the CoT, never a top-k.
    """
    z = float(omega) * _float_array(sigma)
    if z.ndim != 1 or z.size == 0 or not np.isfinite(z).all():
        raise ValueError(f"sigma must be a finite non-empty [L] vector, got {z.shape}")
    e = np.exp(z - z.max())
    return e / e.sum()


def r3_rewards(
    probs: ArrayLike,
    omega: float = DEFAULT_OMEGA,
    clip_low: float = DEFAULT_CLIP_LOW,
    clip_high: float = DEFAULT_CLIP_HIGH,
    ddof: int = 1,
    sigma_on_clipped: bool = False,
) -> np.ndarray:
    """R3 per rollout `[G]`: sum_j w_j * clip(p_ij, clip_low, clip_high) (Eq. 2).

    `probs` is one group's P `[G, L]`; the weights come from the same group's sigma, so R3 is one
    convex combination shared by all rollouts and lies in [clip_low, clip_high]. sigma is taken
    on the unclipped probabilities unless `sigma_on_clipped`: Sec. 3.2 defines sigma_j as the std
    of the self-certainty itself.
    """
    if not 0 <= clip_low <= clip_high <= 1:
        raise ValueError(f"need 0 <= clip_low <= clip_high <= 1, got {clip_low}, {clip_high}")
    p = _certainty_matrix(probs)
    clipped = np.clip(p, clip_low, clip_high)
    w = emphasis_weights(token_std(clipped if sigma_on_clipped else p, ddof), omega)
    return clipped @ w


def avg_prob_rewards(probs: ArrayLike) -> np.ndarray:
    """The RLPR "Avg Prob" baseline `[G]`: (1/L) sum_j p_ij (R3 with omega=0 and no clipping)."""
    return _certainty_matrix(probs).mean(axis=1)


def avg_logprob_rewards(ref_logprobs: ArrayLike) -> np.ndarray:
    """The VeriFree "Avg Logprob" baseline `[G]`: (1/L) sum_j log p_ij, from the log-probs."""
    logp = _float_array(ref_logprobs)
    if logp.ndim != 2 or logp.shape[1] == 0 or np.isnan(logp).any():
        raise ValueError(f"expected a [G, L] log-prob matrix with L >= 1, got shape {logp.shape}")
    return logp.mean(axis=1)


def reference_rewards(
    ref_logprobs: ArrayLike,
    method: str = "r3",
    omega: float = DEFAULT_OMEGA,
    clip_low: float = DEFAULT_CLIP_LOW,
    clip_high: float = DEFAULT_CLIP_HIGH,
    ddof: int = 1,
) -> np.ndarray:
    """One group's rewards `[G]` from its reference log-probs `[G, L]` by `method` name.

    "r3" (DRO), "avg_prob" (RLPR) or "avg_logprob" (VeriFree): the reward variants of the paper's
    Table 1, picked by a config string. Avg Logprob reads the log-probs directly, so a tiny
    probability keeps its precision.
    """
    if method not in REFERENCE_REWARDS:
        raise ValueError(f"unknown reference reward {method!r}; choose one of {REFERENCE_REWARDS}")
    logp = _float_array(ref_logprobs)
    if method == "avg_logprob":
        return avg_logprob_rewards(logp)
    if method == "avg_prob":
        return avg_prob_rewards(np.exp(logp))
    return r3_rewards(np.exp(logp), omega, clip_low, clip_high, ddof)


# --- variance-based query filter (Sec. 4.2) ------------------------------------------------------


def filter_score(probs: ArrayLike, token_frac: float = DEFAULT_TOKEN_FRAC, ddof: int = 1) -> float:
    """sbar: the mean of the ceil(token_frac * L) largest sigma_j of a query's P `[G, L]`.

    The DRO filter statistic (Sec. 4.2): only the top tokens count, because averaging sigma over
    all tokens dilutes the few reasoning-reflective ones (App. T, Table 13).
    """
    if not 0 < token_frac <= 1:
        raise ValueError(f"token_frac must be in (0, 1], got {token_frac}")
    sigma = token_std(probs, ddof)
    k = _ceil_count(token_frac, sigma.size)
    return float(np.sort(sigma)[-k:].mean())


def mean_token_std(probs: ArrayLike, ddof: int = 1) -> float:
    """The RLPR-style all-token mean of sigma_j: the filter statistic DRO improves on (ablation)."""
    return float(token_std(probs, ddof).mean())


@dataclass(frozen=True)
class QuerySelection:
    """Queries kept by the offline filter, as indices into the scored corpus.

    `by_score`: the top `query_frac` by sbar, best first (never a zero-variance query);
    `hard`: the hard-case fill, lowest mean certainty first.
    """

    by_score: np.ndarray
    hard: np.ndarray

    @property
    def kept(self) -> np.ndarray:
        """All kept indices, ascending (corpus order)."""
        return np.sort(np.concatenate([self.by_score, self.hard]))


def select_queries(
    scores: ArrayLike,
    mean_probs: ArrayLike,
    query_frac: float = DEFAULT_QUERY_FRAC,
    retention: float | None = None,
) -> QuerySelection:
    """Keep ceil(query_frac * N) queries by sbar, then fill to ceil(retention * N) with hard ones.

    `scores[n]` is query n's `filter_score`, `mean_probs[n]` its mean unclipped certainty over all
    G x L entries. The paper keeps the top 10% plus an undefined "small additional fraction to
    preserve hard cases" (Sec. 4.2); our choice: the fill takes the not-yet-kept queries of lowest
    mean certainty, the ones the policy finds hardest. `retention` is the per-dataset total of
    Table 3 (ParaRev 0.18, RaR-Medicine 0.16, FinQA 0.125, ContractNLI 200/330); None keeps only
    the sbar part. Ties go to the lower index.
    """
    s, m = _float_array(scores), _float_array(mean_probs)
    if s.ndim != 1 or s.shape != m.shape or s.size == 0:
        raise ValueError(
            f"scores and mean_probs must be equal non-empty [N], got {s.shape}, {m.shape}"
        )
    if not (np.isfinite(s).all() and np.isfinite(m).all()):
        raise ValueError("scores and mean_probs must be finite")
    retention = query_frac if retention is None else retention
    if not 0 < query_frac <= retention <= 1:
        raise ValueError(f"need 0 < query_frac <= retention <= 1, got {query_frac}, {retention}")
    n = s.size
    n_top = _ceil_count(query_frac, n)
    n_hard = _ceil_count(retention, n) - n_top
    ranked = np.argsort(-s, kind="stable")[:n_top]
    # A zero-variance query gives every rollout the same R3, hence no advantage signal.
    by_score = ranked[s[ranked] > 0]
    rest = np.setdiff1d(np.arange(n), by_score)
    hard = rest[np.argsort(m[rest], kind="stable")][:n_hard]
    return QuerySelection(by_score=by_score, hard=hard)


# --- rubric JSON (the App. E prompts) ------------------------------------------------------------


def _last_json_array(text: str) -> list | None:
    """The last top-level JSON array in free text (after any reasoning or code fences), or None."""
    decoder = json.JSONDecoder()
    found = None
    i = text.find("[")
    while i != -1:
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("[", i + 1)
            continue
        if isinstance(value, list):
            found = value
        # Arrays nested inside the decoded one are part of it, not later arrays.
        i = text.find("[", end)
    return found


def _rubric_id(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _is_yes(value: object) -> bool:
    # The judge must say "No" when in doubt, so only an explicit yes counts.
    if isinstance(value, bool):
        return value
    return isinstance(value, str) and value.strip().lower() in ("yes", "true")


def parse_rubric_items(text: str, max_items: int = MAX_RUBRIC_ITEMS) -> list[str] | None:
    """The rubric items written by the reference model, from the last JSON array in `text`.

    Items are `{"id", "rubric_item"}` objects; entries without a non-empty string item are skipped
    and at most `max_items` are kept in order (App. E allows 10). None when no usable array is
    found, so the caller can regenerate.
    """
    array = _last_json_array(text)
    if array is None:
        return None
    items = [
        e["rubric_item"].strip()
        for e in array
        if isinstance(e, dict)
        and isinstance(e.get("rubric_item"), str)
        and e["rubric_item"].strip()
    ]
    return items[:max_items] or None


def parse_rubric_judgment(text: str, rubric_ids: Sequence[int]) -> np.ndarray | None:
    """S_i `[K]` bool: which rubric items one answer satisfies, from the judge's last JSON array.

    Entries are `{"id", "satisfied", ...}`, in `rubric_ids` order. A missing id is unsatisfied, as
    is anything but an explicit true/"yes", and a duplicated id is satisfied only if every entry
    says so. None when no array with a recognisable id is found: retry once, then use all False
    (our choice: the paper does not cover unparseable judgments, and its judge prompt says "No"
    when in doubt, App. E).
    """
    array = _last_json_array(text)
    if array is None:
        return None
    verdicts: dict[int, bool] = {}
    for entry in array:
        if not isinstance(entry, dict):
            continue
        rid = _rubric_id(entry.get("id"))
        if rid is not None:
            verdicts[rid] = verdicts.get(rid, True) and _is_yes(entry.get("satisfied"))
    if not verdicts:
        return None
    return np.array([verdicts.get(int(k), False) for k in rubric_ids], dtype=bool)


# --- gates (Sec. 4.1) ----------------------------------------------------------------------------


def _judgments(satisfied: ArrayLike) -> np.ndarray:
    s = np.asarray(satisfied.cpu() if isinstance(satisfied, torch.Tensor) else satisfied)
    if s.ndim != 2:
        raise ValueError(f"rubric judgments must be [G, K], got shape {s.shape}")
    return s.astype(bool)


def coverage_gate(satisfied: ArrayLike, mu: int = DEFAULT_MU) -> bool:
    """COV: every rubric item is met by at least `mu` of the G rollouts (`satisfied` `[G, K]`).

    An empty rubric set (an ungated query) passes.
    """
    return bool((_judgments(satisfied).sum(axis=0) >= mu).all())


def consistency_gate(
    satisfied: ArrayLike, rewards: ArrayLike, rho_g: float = DEFAULT_RHO_G, nu: float = DEFAULT_NU
) -> bool:
    """CONS: each of the ceil(rho_g * G) best rollouts by reward meets at least a `nu` share of items.

    Ties in reward go to the lower index and the share test is inclusive (3 of 5 passes nu=0.6):
    our choices, the paper fixes neither. An empty rubric set passes.
    """
    s = _judgments(satisfied)
    r = _float_array(rewards)
    if r.shape != (s.shape[0],) or np.isnan(r).any():
        raise ValueError(f"rewards must be [G] = [{s.shape[0]}] without NaN, got {r.shape}")
    if not 0 < rho_g <= 1 or not 0 <= nu <= 1:
        raise ValueError(f"need 0 < rho_g <= 1 and 0 <= nu <= 1, got {rho_g}, {nu}")
    k = s.shape[1]
    if k == 0:
        return True
    top = np.argsort(-r, kind="stable")[: _ceil_count(rho_g, len(r))]
    # Compare counts, not float shares: nu * K may land a hair above an integer.
    return bool((s[top].sum(axis=1) >= nu * k - 1e-9).all())


@dataclass(frozen=True)
class GroupScore:
    """One rollout group's DRO outcome: rewards, advantages, gate verdicts and logged statistics."""

    rewards: np.ndarray
    advantages: np.ndarray
    coverage: bool
    consistency: bool
    mean_prob: float
    sbar: float

    @property
    def accepted(self) -> bool:
        """Whether the group trains this step (COV and CONS)."""
        return self.coverage and self.consistency


def group_advantage(rewards: ArrayLike, eps: float = DEFAULT_ADV_EPS) -> np.ndarray:
    """A_i = (r_i - mean r) / (std r + eps) `[G]` for one group, sample std (ddof=1, TRL).

    Truncated rollouts are included: they shape the baseline even though the loss skips them.
    Equal rewards give exactly 0.
    """
    r = _float_array(rewards)
    if r.ndim != 1 or r.size < 2:
        raise ValueError(f"a group needs at least 2 rewards, got shape {r.shape}")
    if (r == r[0]).all():
        # The float mean of equal values can miss them by an ulp, which 1 / eps blows up to 1e-12.
        return np.zeros_like(r)
    return group_advantages(r, np.zeros(r.size, dtype=np.int64), scale="group", eps=eps)


def score_group(
    ref_logprobs: ArrayLike,
    satisfied: ArrayLike | None = None,
    method: str = "r3",
    omega: float = DEFAULT_OMEGA,
    clip_low: float = DEFAULT_CLIP_LOW,
    clip_high: float = DEFAULT_CLIP_HIGH,
    mu: int = DEFAULT_MU,
    rho_g: float = DEFAULT_RHO_G,
    nu: float = DEFAULT_NU,
    eps: float = DEFAULT_ADV_EPS,
) -> GroupScore:
    """The per-group reducer of a DRO step: rewards, gates and advantages from G rollouts.

    `ref_logprobs` `[G, L]` from `reference_logprobs`; `satisfied` `[G, K]` rubric judgments, where
    a rollout with no final answer must have an all-False row; None (no rubrics, e.g. FinQA) or
    K = 0 (an ungated query) passes both gates. `sbar` is the online filter statistic.
    """
    logp = _float_array(ref_logprobs)
    rewards = reference_rewards(logp, method, omega, clip_low, clip_high)
    judged = np.zeros((logp.shape[0], 0), dtype=bool) if satisfied is None else satisfied
    probs = np.exp(logp)
    return GroupScore(
        rewards=rewards,
        advantages=group_advantage(rewards, eps),
        coverage=coverage_gate(judged, mu),
        consistency=consistency_gate(judged, rewards, rho_g, nu),
        mean_prob=float(probs.mean()),
        sbar=filter_score(probs),
    )


# --- loss (Eq. 3 with the settings of App. F.2) --------------------------------------------------


def entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, rho_ent: float = DEFAULT_RHO_ENT
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 80/20 mask `[B, T]`: tokens of `mask` whose entropy is among the top `rho_ent` fraction.

    The threshold is the ceil(rho_ent * n)-th largest entropy of the n tokens in `mask`, so that
    many tokens are kept, plus any tied with it. Returns (keep mask, threshold); with no token in
    `mask` the keep mask is empty and the threshold is +inf.
    """
    mask = mask.bool()
    entropy = entropy.detach()
    threshold = entropy_threshold(entropy[mask], rho_ent)
    return mask & (entropy.float() >= threshold), threshold


def entropy_threshold(values: torch.Tensor, rho_ent: float = DEFAULT_RHO_ENT) -> torch.Tensor:
    """The 80/20 cut of a flat set of token entropies: the ceil(rho_ent * n)-th largest value
    (+inf when there is none). The trainer takes it over every loss token of the step."""
    if not 0 < rho_ent <= 1:
        raise ValueError(f"rho_ent must be in (0, 1], got {rho_ent}")
    if values.numel() == 0:
        return torch.tensor(math.inf)
    k = _ceil_count(rho_ent, values.numel())
    return torch.topk(values.detach().float().flatten(), k).values[-1]


def dro_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    accepted: torch.Tensor | None = None,
    beta: float = DEFAULT_BETA,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    rho_ent: float = DEFAULT_RHO_ENT,
    max_len: int | None = None,
    num_sequences: int | None = None,
    entropy_threshold: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO's Dr.GRPO-style loss: sum M * (E * pg + beta * k3) / (N_acc * max_len) (App. F.2).

    Shapes: `logp`, `old_logp`, `ref_logp`, `entropy`, `mask` `[B, T]` (mask = real completion
    tokens); `advantages`, `truncated`, `accepted` `[B]` (accepted = the sequence's group passed
    the rubric gates). M drops truncated sequences (they still counted in their group's baseline)
    and rejected groups; E keeps the top `rho_ent` of M's tokens by entropy (`entropy_mask`) and
    gates only the PPO-clip term, while the k3 KL to `ref_logp` covers every token of M. The
    normaliser counts the accepted sequences, truncated ones included (TRL); rejected groups
    contribute no gradient and do not count. `entropy=None` applies PG to all of M. With
    micro-batches pass the step's `num_sequences` (accepted sequences) and one `max_len`
    (default: T) so every micro-batch shares the normaliser, and the whole batch's
    `entropy_threshold` (`entropy_mask` over every rank's tokens) so the 80/20 cut is the batch's,
    not each micro-batch's. `token_weights` (the engine importance correction) weight the PG term.

    Returns the loss and detached stats: pg_loss, kl_loss, kl_mean (per token of M),
    entropy_threshold, pg_token_frac (share of M's tokens with PG), num_sequences, and the
    PPO-clip statistics of `grpo.policy_loss` over the PG tokens.
    """
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp for the KL term")
    mask = mask.bool()
    batch = logp.shape[0]
    rows = torch.ones(batch, dtype=torch.bool, device=logp.device)
    if accepted is not None:
        rows = accepted.bool().to(logp.device)
    keep = rows.clone()
    if truncated is not None:
        keep = keep & ~truncated.bool().to(logp.device)
    m = mask & keep[:, None]
    n_rows = int(rows.sum())
    n_seq = n_rows if num_sequences is None else int(num_sequences)
    if n_seq < n_rows:
        raise ValueError(f"num_sequences={n_seq} is below this batch's {n_rows} accepted sequences")
    norm_len = logp.shape[1] if max_len is None else int(max_len)

    if entropy is None:
        pg_mask, threshold = m, torch.tensor(-math.inf)
    elif entropy_threshold is not None:
        threshold = torch.tensor(float(entropy_threshold))
        pg_mask = m & (entropy.detach().float() >= threshold)
    else:
        pg_mask, threshold = entropy_mask(entropy, m, rho_ent)

    pg, stats = policy_loss(
        logp,
        old_logp,
        advantages.to(logp.device),
        pg_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        agg="seq-mean-token-sum-norm",
        max_len=norm_len,
        token_weights=token_weights,
    )
    # policy_loss divides by all B rows; the normaliser is the step's accepted sequences instead
    # (rejected rows hold no PG token, so they add nothing above). All rejected: the loss is 0.
    pg = pg * (batch / n_seq if n_seq else 0.0)
    if ref_logp is None:
        kl_tok = torch.zeros_like(logp)
    else:
        kl_tok = torch.where(m, kl_k3(logp, ref_logp, m), torch.zeros_like(logp))
    kl = kl_tok.sum() / (max(n_seq, 1) * norm_len)
    loss = pg + beta * kl
    with torch.no_grad():
        n_m = m.sum().clamp(min=1)
        stats.update(
            pg_loss=pg.detach(),
            kl_loss=kl.detach(),
            kl_mean=kl_tok.detach().sum() / n_m,
            entropy_threshold=threshold,
            pg_token_frac=pg_mask.sum() / n_m,
            num_sequences=torch.tensor(n_seq),
        )
    return loss, stats
