"""The unbiased pass@k estimator of Chen et al. (arXiv:2107.03374, Eq. 1)."""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct of n samples: 1 - C(n-c, k) / C(n, k).

    Exact integer combinatorics (Chen et al. 2021); 1 when fewer than k samples are wrong.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
