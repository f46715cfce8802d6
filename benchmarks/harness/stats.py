"""Paired comparisons over seeds: per-seed differences, Student-t intervals and the power of a paired t-test.

Pure functions of lists of numbers (standard library only; no scipy). The t distribution and the power of the paired
t-test are computed by integrating over the chi-square law of the sample variance:

    T = (Z + ncp) / sqrt(V / df),  Z ~ N(0, 1),  V ~ chi2(df),  ncp = delta * sqrt(n) / sd

so P(T <= t) = E_V[Phi(t * sqrt(V / df) - ncp)], and a two-sided test at level alpha rejects when |T| > t_{1-alpha/2}.
Checked against Monte Carlo draws of exactly that T in tests/test_paired_stats.py.
"""

from __future__ import annotations

import functools
import math
import statistics


def normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _scale_grid(df: int, points: int = 2001) -> tuple[list[float], list[float]]:
    """Simpson nodes s and weights (density included) of S = sqrt(V / df), V ~ chi2(df): smooth in s for df >= 2,
    where V's density in v has a square-root kink at 0."""
    hi = math.sqrt((df + 40 * math.sqrt(2 * df) + 60) / df)
    h = hi / (points - 1)
    log_norm = -(df / 2) * math.log(2) - math.lgamma(df / 2) + math.log(2 * df)
    nodes, weights = [], []
    for i in range(points):
        s = i * h
        v = df * s * s
        density = 0.0 if s == 0.0 else math.exp(log_norm + (df / 2 - 1) * math.log(v) - v / 2 + math.log(s))
        simpson = 1 if i in (0, points - 1) else (4 if i % 2 else 2)
        nodes.append(s)
        weights.append(density * simpson * h / 3)
    return nodes, weights


def _expect_over_chi2(df: int, fn) -> float:
    """E[fn(sqrt(V / df))] for V ~ chi2(df)."""
    if df < 2:
        raise ValueError("harness.stats: need df >= 2 (at least 3 seeds) for the t integrals")
    nodes, weights = _scale_grid(df)
    return sum(w * fn(s) for s, w in zip(nodes, weights))


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    return _expect_over_chi2(df, lambda s: normal_cdf(t * s))


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (bisection on `t_cdf`, to ~1e-9)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    lo, hi = -100.0, 100.0
    for _ in range(38):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def paired_power(delta: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level `alpha` to detect a true mean difference `delta` when the per-seed
    differences have standard deviation `sd`, with `n` seeds."""
    if sd <= 0:
        return 1.0 if delta != 0 else alpha
    df = n - 1
    crit = t_quantile(1 - alpha / 2, df)
    ncp = delta * math.sqrt(n) / sd
    return _expect_over_chi2(df, lambda s: 1 - normal_cdf(crit * s - ncp) + normal_cdf(-crit * s - ncp))


def seeds_for_power(delta: float, sd: float, power: float = 0.8, alpha: float = 0.05, max_n: int = 60) -> int | None:
    """The fewest seeds at which `paired_power(delta, sd, n, alpha)` reaches `power` (None beyond `max_n`)."""
    for n in range(3, max_n + 1):
        if paired_power(delta, sd, n, alpha) >= power:
            return n
    return None


def paired_difference(values: dict[int, float], reference: dict[int, float], level: float = 0.95) -> dict:
    """The per-seed differences values[s] - reference[s] over the seeds both have, their mean, standard deviation and
    Student-t interval at `level` (None with fewer than 3 common seeds)."""
    seeds = sorted(set(values) & set(reference))
    diffs = [values[s] - reference[s] for s in seeds]
    out = dict(seeds=seeds, diffs=diffs, n=len(diffs), mean=statistics.mean(diffs) if diffs else math.nan,
               sd=statistics.stdev(diffs) if len(diffs) > 1 else math.nan, ci=None)
    if len(diffs) >= 3:
        half = t_quantile(0.5 + level / 2, len(diffs) - 1) * out["sd"] / math.sqrt(len(diffs))
        out["ci"] = (out["mean"] - half, out["mean"] + half)
    return out


def problem_paired_se(correct: list[bool], reference: list[bool]) -> float:
    """The standard error (points) of accuracy(correct) - accuracy(reference) from the problems alone, when both were
    measured on the same problems in the same order: 100 sd(d) / sqrt(n), d_i = correct_i - reference_i. What the
    measurement adds to a per-seed difference, whatever the training did (problems both get right or both miss add
    nothing)."""
    if len(correct) != len(reference) or len(correct) < 2:
        raise ValueError("problem_paired_se: need two equally long lists of at least 2 problems")
    diffs = [int(a) - int(b) for a, b in zip(correct, reference)]
    return 100 * statistics.stdev(diffs) / math.sqrt(len(diffs))


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p-value of Fisher's exact test for the 2x2 table [[a, b], [c, d]] (rows: groups; columns: event, no
    event): the probability, under the hypergeometric law with the margins fixed, of every table no more likely than
    the observed one (a relative tolerance of 1e-7 counts ties as equal, as R and scipy do)."""
    if min(a, b, c, d) < 0:
        raise ValueError(f"harness.stats.fisher_exact: counts must be >= 0, got {[a, b, c, d]}")
    row1, col1, n = a + b, a + c, a + b + c + d

    def prob(x: int) -> float:
        return math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1)

    observed = prob(a)
    support = range(max(0, row1 + col1 - n), min(row1, col1) + 1)
    return min(1.0, sum(p for x in support if (p := prob(x)) <= observed * (1 + 1e-7)))

def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval at `level` of a binomial proportion with `k` events in `n` trials: the
    p at which P(X >= k) and P(X <= k) equal (1 - level) / 2, found by bisection on the binomial law (0 and 1 at the
    ends, where k = 0 or k = n)."""
    if not 0 <= k <= n or n == 0:
        raise ValueError(f"harness.stats.clopper_pearson: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    tail = (1 - level) / 2

    def cdf(x: int, p: float) -> float:  # P(X <= x)
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(x + 1))

    def solve(f) -> float:  # the root of a function increasing in p on [0, 1]
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: (1 - cdf(k - 1, p)) - tail)
    upper = 1.0 if k == n else solve(lambda p: tail - cdf(k, p))
    return lower, upper
