"""Small binomial statistics for verdicts: Wilson bounds and floors derived from a baseline.

A floor is derived, never set by hand: from a measured baseline of k successes in N items,
take the one-sided 99 % Wilson lower bound of the rate as the pessimistic true rate p, then the
floor at a sample of n items is the largest q/n such that a healthy engine scores below it with
probability at most `alpha` (P[Bin(n, p) < q] <= alpha). A floor of 0 cannot fail: callers
treat it as "no floor at this n" and say so.
"""

from __future__ import annotations

import math

Z_99 = 2.326         # one-sided 99 %


def wilson_upper(k: int, n: int, z: float = Z_99) -> float:
    """One-sided Wilson score upper bound of a binomial proportion k/n."""
    if n <= 0:
        return 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + half) / denom)


def wilson_lower(k: int, n: int, z: float = Z_99) -> float:
    """One-sided Wilson score lower bound of a binomial proportion k/n."""
    if n <= 0:
        return 0.0
    return max(0.0, 1.0 - wilson_upper(n - k, n, z))


def binom_cdf(q: int, n: int, p: float) -> float:
    """P[Bin(n, p) <= q]."""
    if q < 0:
        return 0.0
    return min(1.0, sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(q + 1)))


def derived_floor(k: int, N: int, n: int, alpha: float = 0.01) -> float:
    """The floor (a fraction of n) from a baseline of k/N; see the module docstring."""
    p = wilson_lower(k, N)
    q = 0
    while q < n and binom_cdf(q, n, p) <= alpha:      # P[X < q+1] = cdf(q) <= alpha
        q += 1
    return q / n


def fisher_greater(k: int, n: int, K: int, N: int) -> float:
    """One-sided Fisher exact test: the p-value of k of n against K of N under equal rates,
    for the alternative that the first rate is larger (hypergeometric P[X >= k] with k + K
    successes among n + N, n drawn)."""
    t, tot = k + K, n + N
    if n <= 0 or k <= 0:
        return 1.0
    return sum(math.comb(t, x) * math.comb(tot - t, n - x)
               for x in range(k, min(t, n) + 1)) / math.comb(tot, n)


def excess_budget(n: int, K: int, N: int, alpha: float) -> int:
    """The most events among n that the one-sided Fisher exact test at `alpha` still holds
    consistent with a reference of K events in N (the largest b with p(b) > alpha): a count
    above it says the rate is larger than the reference's, at a false-alarm rate <= alpha
    whatever the common rate. Both samples' spread counts, not only the reference's."""
    b = 0
    while b < n and fisher_greater(b + 1, n, K, N) > alpha:
        b += 1
    return b
