"""benchmarks/harness/stats.py: Student's t and the paired t-test's power against Monte Carlo draws of the same
statistic, and the paired difference against a hand computation."""

from __future__ import annotations

import importlib
import math
import statistics

import pytest
import torch



@pytest.fixture(scope="module")
def ps():
    return importlib.import_module("harness.stats")


@pytest.mark.parametrize("df,table", [(2, 4.302653), (4, 2.776445), (9, 2.262157), (29, 2.045230)])
def test_t_quantile_matches_the_tables(ps, df, table):
    assert ps.t_quantile(0.975, df) == pytest.approx(table, abs=2e-4)
    assert ps.t_quantile(0.025, df) == pytest.approx(-table, abs=2e-4)


def _simulated_t(n: int, ncp_delta: float, sd: float, draws: int = 200_000) -> torch.Tensor:
    """Paired t statistics of `draws` experiments with n seeds: differences ~ Normal(delta, sd^2)."""
    g = torch.Generator().manual_seed(0)
    d = ncp_delta + sd * torch.randn(draws, n, generator=g, dtype=torch.float64)
    return d.mean(1) / (d.std(1) / math.sqrt(n))


@pytest.mark.parametrize("n", [3, 5, 8])
def test_t_cdf_against_monte_carlo(ps, n):
    t = _simulated_t(n, 0.0, 1.0)
    for x in (-2.0, 0.5, 1.5):
        assert ps.t_cdf(x, n - 1) == pytest.approx(float((t <= x).double().mean()), abs=4e-3)


@pytest.mark.parametrize("n,delta,sd", [(5, 5.0, 5.0), (5, 5.0, 3.0), (8, 2.0, 4.0), (3, 10.0, 4.0)])
def test_paired_power_against_monte_carlo(ps, n, delta, sd):
    t = _simulated_t(n, delta, sd)
    crit = ps.t_quantile(0.975, n - 1)
    simulated = float((t.abs() > crit).double().mean())
    assert ps.paired_power(delta, sd, n) == pytest.approx(simulated, abs=5e-3)


def test_seeds_for_power_is_the_first_n_reaching_it(ps):
    n = ps.seeds_for_power(5.0, 5.0)
    assert ps.paired_power(5.0, 5.0, n) >= 0.8 > ps.paired_power(5.0, 5.0, n - 1)


def test_paired_difference_by_hand(ps):
    values, reference = {0: 10.0, 1: 14.0, 2: 9.0, 3: 30.0}, {0: 8.0, 1: 10.0, 2: 10.0}  # seed 3 has no partner
    out = ps.paired_difference(values, reference)
    diffs = [2.0, 4.0, -1.0]
    assert out["seeds"] == [0, 1, 2] and out["diffs"] == diffs and out["n"] == 3
    assert out["mean"] == pytest.approx(statistics.mean(diffs)) and out["sd"] == pytest.approx(statistics.stdev(diffs))
    half = 4.302653 * statistics.stdev(diffs) / math.sqrt(3)
    assert out["ci"] == pytest.approx((statistics.mean(diffs) - half, statistics.mean(diffs) + half), abs=1e-3)
    assert ps.paired_difference({0: 1.0, 1: 2.0}, {0: 0.0, 1: 0.0})["ci"] is None  # fewer than 3 seeds


def test_problem_paired_se_matches_the_spread_of_resampled_problem_sets(ps):
    """Draw problem sets from a population where the two models agree on most problems: the sd of the accuracy
    difference across draws matches the standard error computed from one draw."""
    import random

    rng = random.Random(0)
    n, draws = 400, 2000
    # per problem: (a right, b right) with P = 0.45 both, 0.30 neither, 0.15 a only, 0.10 b only
    kinds = [(1, 1)] * 45 + [(0, 0)] * 30 + [(1, 0)] * 15 + [(0, 1)] * 10
    diffs, ses = [], []
    for _ in range(draws):
        sample = [rng.choice(kinds) for _ in range(n)]
        a, b = [s[0] for s in sample], [s[1] for s in sample]
        diffs.append(100 * (sum(a) - sum(b)) / n)
        ses.append(ps.problem_paired_se(a, b))
    assert statistics.stdev(diffs) == pytest.approx(statistics.mean(ses), rel=0.05)
    assert statistics.mean(ses) == pytest.approx(100 * math.sqrt((0.25 - 0.05 ** 2) / n), rel=0.03)
    with pytest.raises(ValueError, match="equally long"):
        ps.problem_paired_se([1, 0], [1])
