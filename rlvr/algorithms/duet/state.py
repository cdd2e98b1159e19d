"""DUET's online state (arXiv:2605.08441, Eq. 3 and Alg. 1 lines 45-55): the per-prompt surrogate
and length estimates behind the allocation, and the window of kept lengths that sets K1/K2.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlvr.algorithms.groups import group_rows

PromptId = int | str


def _prompt_id(value: Hashable) -> PromptId:
    # Ids go into JSON checkpoints, so only plain ints and strings (numpy ints become ints).
    if isinstance(value, bool) or not isinstance(value, int | str | np.integer):
        raise TypeError(f"prompt ids must be int or str, got {type(value).__name__}")
    return value if isinstance(value, str) else int(value)


@dataclass
class _PromptEntry:
    sigma: float = 0.0
    """Running mean of the within-step surrogate sigma_obs_{q,t} (Eq. 3)."""
    k: int = 0
    """Number of within-step surrogate observations (groups with >= 2 kept rollouts)."""
    length: float = 0.0
    """Running mean kept-rollout length (Lhat_q)."""
    n_lengths: int = 0
    """Number of kept rollouts behind `length`."""
    visits: int = 0
    """Number of steps the prompt was observed in (with or without kept rollouts)."""


class PromptState:
    """Per-prompt surrogate s_hat and length L_hat, keyed by a stable prompt id (dataset index).

    After each step, `update` folds in the step's rollouts: prompts with >= 2 kept-not-aborted
    rollouts get one more surrogate observation std_i(A_i * sum_l logp_il) (Eq. 3 with plain GRPO
    advantages and old log-probs; population std as the reference code) into a running mean;
    every kept rollout updates the prompt's running mean length (Alg. 1 lines 50-51; the
    reference code updates it only for groups with >= 2 kept). The allocation reads
    s_hat = max(s_floor, sigma_obs) once a prompt has k_warmup observations, else s_floor. s_floor
    starts at `s_floor_init` and, at the end of epoch 1, becomes max(floor_min, the
    `floor_percentile`-th percentile of sigma_obs over observed prompts), then stays frozen
    (App. A.3). At most `capacity` prompts are kept (the reference code's LRU cap); the least
    recently updated one is dropped first (it becomes cold again).
    """

    def __init__(
        self,
        *,
        k_warmup: int = 1,
        s_floor_init: float = 0.01,
        floor_percentile: float = 5.0,
        floor_min: float = 0.0,
        capacity: int = 50_000,
    ) -> None:
        """floor_min > 0 keeps the frozen floor positive (our option: p5 is often 0 when many
        groups have equal rewards, and a prompt held at n_min = 1 then never gets a new
        observation); the default 0 is the paper's behaviour."""
        if k_warmup < 1 or capacity < 1:
            raise ValueError("k_warmup and capacity must be >= 1")
        self.k_warmup = k_warmup
        self.floor_percentile = floor_percentile
        self.floor_min = floor_min
        self.capacity = capacity
        self.s_floor = float(s_floor_init)
        self.floor_frozen = False
        self.epoch = 1
        self._entries: OrderedDict[PromptId, _PromptEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._entries

    def s_hat(self, prompt_id: Hashable) -> float:
        """The allocation's surrogate for one prompt (Eq. 4's s_hat)."""
        entry = self._entries.get(_prompt_id(prompt_id))
        if entry is None or entry.k < self.k_warmup:
            return self.s_floor
        return max(self.s_floor, entry.sigma)

    def l_hat(self, prompt_id: Hashable, cold_length: float) -> float:
        """The prompt's mean kept length, or `cold_length` before its first kept rollout."""
        entry = self._entries.get(_prompt_id(prompt_id))
        if entry is None or entry.n_lengths == 0:
            return float(cold_length)
        return entry.length

    def observed(self, prompt_id: Hashable) -> dict[str, float | int] | None:
        """The stored record of a prompt (sigma, k, length, n_lengths, visits), or None."""
        entry = self._entries.get(_prompt_id(prompt_id))
        return None if entry is None else dict(vars(entry))

    def update(
        self,
        prompt_ids: Sequence[Hashable],
        advantages: Sequence[float] | np.ndarray,
        logprob_sums: Sequence[float] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        kept: Sequence[bool] | np.ndarray,
    ) -> dict[PromptId, float]:
        """Fold one step's rollouts into the state; all arguments are per rollout `[rollouts]`.

        `advantages` are the group advantages before DUET weighting (pass weighted ones to mimic
        the reference code), `logprob_sums` the old-policy log-prob summed over response tokens,
        `kept` False for aborted rollouts. A prompt's rollouts are one group of consecutive rows;
        rows of one id split apart (the prompt twice in the step) raise ValueError. Returns the
        within-step surrogate sigma_obs_{q,t} of each prompt that got one (for the calibration
        diagnostic).
        """
        ids = [_prompt_id(q) for q in prompt_ids]
        adv = np.asarray(advantages, dtype=np.float64)
        logp = np.asarray(logprob_sums, dtype=np.float64)
        length = np.asarray(lengths, dtype=np.float64)
        keep = np.asarray(kept, dtype=bool)
        if not adv.shape == logp.shape == length.shape == keep.shape == (len(ids),):
            raise ValueError(
                "prompt_ids, advantages, logprob_sums, lengths, kept must be [rollouts]"
            )
        if not (np.isfinite(adv).all() and np.isfinite(logp).all() and np.isfinite(length).all()):
            raise ValueError("advantages, logprob_sums and lengths must be finite")

        members = group_rows(ids)
        for i in range(1, len(ids)):
            q = ids[i]
            if q != ids[i - 1] and members[q][0] < i:
                # Two groups of one prompt in a step would merge into one surrogate observation.
                raise ValueError(
                    f"prompt {q!r} has two separate runs of rollouts in one step: a step holds "
                    "each prompt once, its rollouts next to each other"
                )
        observed: dict[PromptId, float] = {}
        for q, rows in members.items():
            entry = self._entries.pop(q, None) or _PromptEntry()
            self._entries[q] = entry  # re-inserted last: most recently used
            entry.visits += 1
            rows_kept = [i for i in rows if keep[i]]
            if len(rows_kept) >= 2:
                sigma_t = float(np.std(adv[rows_kept] * logp[rows_kept]))
                entry.sigma = (entry.k * entry.sigma + sigma_t) / (entry.k + 1)
                entry.k += 1
                observed[q] = sigma_t
            if rows_kept:
                total = entry.n_lengths * entry.length + float(length[rows_kept].sum())
                entry.n_lengths += len(rows_kept)
                entry.length = total / entry.n_lengths
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return observed

    def end_epoch(self) -> None:
        """Mark an epoch boundary; after epoch 1 the floor is reset to the percentile and frozen.

        With no observed prompt at that point the floor keeps its value (and is frozen).
        """
        if not self.floor_frozen:
            sigmas = [e.sigma for e in self._entries.values() if e.k >= 1]
            if sigmas:
                floor = float(np.percentile(sigmas, self.floor_percentile))
                self.s_floor = max(self.floor_min, floor)
            self.floor_frozen = True
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """JSON-plain snapshot (ints, floats, strings, lists); `load_state_dict` restores it."""
        return {
            "s_floor": self.s_floor,
            "floor_frozen": self.floor_frozen,
            "epoch": self.epoch,
            "prompts": [
                [q, e.sigma, e.k, e.length, e.n_lengths, e.visits] for q, e in self._entries.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` snapshot (configuration stays as constructed)."""
        self.s_floor = float(state["s_floor"])
        self.floor_frozen = bool(state["floor_frozen"])
        self.epoch = int(state["epoch"])
        self._entries = OrderedDict(
            (
                _prompt_id(q),
                _PromptEntry(float(sigma), int(k), float(length), int(n_len), int(visits)),
            )
            for q, sigma, k, length, n_len, visits in state["prompts"]
        )


class LengthWindow:
    """The last `size` kept-not-aborted rollout lengths and the stop thresholds K1/K2 fit to them.

    K1 (poll start) and K2 (abort gate) start at 0.3 and 0.7 of `max_len`. `observe` refits them
    to K1 = max(k1_min, p30), K2 = max(K1 + k2_gap, p80) of the window (numpy's linear
    percentile, truncated to int) once at least `refit_every` steps passed since the last refit
    (the first counts from step 0) and the window holds at least `min_samples` lengths. The
    quantiles, window and cadence are the paper's (Sec. 3.2, App. A.3); the clamps and
    `min_samples` follow the reference code.
    """

    def __init__(
        self,
        max_len: int = 3072,
        *,
        size: int = 1024,
        refit_every: int = 10,
        min_samples: int = 32,
        k1_quantile: float = 30.0,
        k2_quantile: float = 80.0,
        k1_min: int = 32,
        k2_gap: int = 50,
    ) -> None:
        self.max_len = max_len
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.k1_quantile = k1_quantile
        self.k2_quantile = k2_quantile
        self.k1_min = k1_min
        self.k2_gap = k2_gap
        self.lengths: deque[int] = deque(maxlen=size)
        self.k1 = int(0.3 * max_len)
        self.k2 = int(0.7 * max_len)
        self.last_refit_step = 0

    def cold_length(self) -> float:
        """L_hat for a prompt with no kept rollout yet: the window mean, or max_len if empty."""
        return float(np.mean(self.lengths)) if self.lengths else float(self.max_len)

    def observe(self, lengths: Iterable[int], step: int) -> bool:
        """Append one step's kept lengths, then refit K1/K2 if due; True if it refitted."""
        self.lengths.extend(int(n) for n in lengths)
        if step - self.last_refit_step < self.refit_every or len(self.lengths) < self.min_samples:
            return False
        window = np.asarray(self.lengths)
        self.k1 = max(self.k1_min, int(np.percentile(window, self.k1_quantile)))
        self.k2 = max(self.k1 + self.k2_gap, int(np.percentile(window, self.k2_quantile)))
        self.last_refit_step = step
        return True

    def state_dict(self) -> dict[str, Any]:
        """JSON-plain snapshot; `load_state_dict` restores it exactly."""
        return {
            "lengths": list(self.lengths),
            "k1": self.k1,
            "k2": self.k2,
            "last_refit_step": self.last_refit_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` snapshot (the window size stays as constructed)."""
        self.lengths.clear()
        self.lengths.extend(int(n) for n in state["lengths"])
        self.k1 = int(state["k1"])
        self.k2 = int(state["k2"])
        self.last_refit_step = int(state["last_refit_step"])
