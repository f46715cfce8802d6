"""`oblr_trl.estimators` against independent references: exact enumeration, Monte Carlo, and plain loops.

The SNR functions tested here by their public names (`gradient_snr`, `snr_lr_scale`, `gradient_signal_noise`,
`step_scale_from_contributions`) are `oblr_trl.snr_formulas`'s, which compute through the trainer's own
`step_signal_noise` and `scale_from_signal_noise` (`tests/test_registries.py` checks that they do).

The references never reuse the module's code:

* toy softmax policies (``toy_policy``) give the policy gradient, the scores and the variance-optimal baseline in closed
  form, and exact expectations by enumerating actions (or every group of actions);
* Monte Carlo checks compare a sample mean with its known expectation, with the standard errors computed from the
  same samples: a 4-sigma band for a scalar, Hotelling's T^2 for a vector; each has a false-alarm probability of about
  1e-4 under the null, and the seeds are fixed anyway;
* the baselines are compared with a Python double loop over the formula, written from the specification.

Section 1 checks the math (unbiasedness, optimality, SNR estimators); section 2 the reference loops; section 3 edges.
"""

from __future__ import annotations

import math

import pytest
import torch

from oblr_trl.estimators import gradient_weighted_baseline, mean_baseline
from oblr_trl.snr_formulas import (
    gradient_signal_noise,
    gradient_snr,
    snr_lr_scale,
    snr_step_size,
    step_scale_from_contributions,
    step_signal_noise,
    step_signal_se,
)

import toy_policy as tp  # tests/ is on the tests' path (setup.cfg's pythonpath)

F64 = torch.float64
Z = 4.0  # width of every scalar Monte Carlo band, in standard errors (two-sided false alarm ~6e-5)


def _assert_within_se(samples: torch.Tensor, expected: torch.Tensor, what: str, z: float = Z) -> None:
    """Scalar check: the mean of ``samples`` (shape ``(draws, 1)``) is within ``z`` standard errors of ``expected``."""
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(samples.shape[0])
    zscore = (mean - expected) / se
    assert torch.all(zscore.abs() < z), f"{what}: mean {mean} vs expected {expected}, z-score {zscore}"


def _hotelling(samples: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Hotelling's T^2 of ``samples`` (``(draws, d)``) against the mean ``expected``, and its 1e-4 critical value.

    A joint test instead of d per-coordinate bands: with many coordinates, some of them driven by rare actions
    (heavy-tailed, far from the CLT at this sample size), the maximum of d z-scores is unreliable while their
    quadratic form is not. Directions without sample variance (the scores of a policy sum to zero) are dropped; the
    expected mean must have no component there. Under the null, (n-k)/(k(n-1)) T^2 ~ F(k, n-k), bounded here by the
    Wilson-Hilferty chi^2_k quantile at 1 - 1e-4 times (n-1)/(n-k) times a 3.7-sigma allowance for the F denominator.
    """
    n = samples.shape[0]
    diff = samples.mean(0) - expected
    evals, evecs = torch.linalg.eigh(torch.cov(samples.T).reshape(samples.shape[1], -1))
    keep = evals > 1e-10 * evals.max()
    proj = evecs[:, keep].T @ diff
    residual = diff - evecs[:, keep] @ proj
    assert residual.norm() <= 1e-9 * (expected.norm() + samples.mean(0).norm()), "mean outside the samples' span"
    k = int(keep.sum())
    t2 = float(n * (proj.pow(2) / evals[keep]).sum())
    z = 3.719  # one-sided 1e-4 normal quantile
    chi2_q = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    threshold = chi2_q * (n - 1) / (n - k) * (1 + z * math.sqrt(2 / (n - k)))
    return t2, threshold


def _assert_mean_matches(samples: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    t2, threshold = _hotelling(samples, expected)
    assert t2 < threshold, f"{what}: Hotelling T^2 = {t2:.1f} >= {threshold:.1f}; mean {samples.mean(0)} vs {expected}"


# ---------------------------------------------------------------------------------------------------------------------
# 0. The test utility itself: closed forms against autograd.
# ---------------------------------------------------------------------------------------------------------------------


def test_toy_policy_closed_forms_match_autograd():
    gen = torch.Generator().manual_seed(0)
    theta, rewards = tp.random_policy(6, gen)
    torch.testing.assert_close(tp.scores(theta), tp.autograd_scores(theta), rtol=0, atol=1e-14)
    t = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((torch.softmax(t, -1) * rewards).sum(), t)
    torch.testing.assert_close(tp.policy_gradient(theta, rewards), grad, rtol=0, atol=1e-14)
    # grad J = E[r s] = E[(r - b) s] for any constant b (the score has mean zero).
    pi = tp.probs(theta)
    with_baseline = (pi[:, None] * (rewards - 0.3)[:, None] * tp.scores(theta)).sum(0)
    torch.testing.assert_close(with_baseline, grad, atol=1e-14, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# 1. The math: the population baseline is Theorem 7's b*, leave-one-out is unbiased, the SNR estimators are unbiased.
# ---------------------------------------------------------------------------------------------------------------------


def test_population_weighted_baseline_is_the_variance_optimal_baseline():
    """Infinite group: weights pi_a * ||s_a||^2 over the K actions give b*, and b* minimizes tr Cov (Theorem 7)."""
    gen = torch.Generator().manual_seed(1)
    n_policies, num_actions = 50, 6
    theta, rewards = tp.random_policy(num_actions, gen, batch=(n_policies,))
    pop_weights = tp.probs(theta) * tp.score_sq_norms(theta)
    baseline, num_fallback = gradient_weighted_baseline(rewards.reshape(-1), pop_weights.reshape(-1), num_actions)
    assert num_fallback == 0
    b_module = baseline.view(n_policies, num_actions)
    # One baseline per policy (group), shared by its actions.
    torch.testing.assert_close(b_module, b_module[:, :1].expand_as(b_module), rtol=0, atol=0)
    b_star = b_module[:, 0]
    torch.testing.assert_close(b_star, tp.optimal_baseline(theta, rewards), rtol=1e-12, atol=0)

    # Independent of the formula: tr Cov[(r - b) s] (computed from its definition) is the quadratic
    # tr Cov(b* + d) = tr Cov(b*) + E||s||^2 d^2, i.e. b* is its unique minimizer.
    cov_at_star = tp.estimator_cov_trace(theta, rewards, b_star)
    curvature = (tp.probs(theta) * tp.score_sq_norms(theta)).sum(-1)
    for d in (-0.3, -1e-3, 1e-3, 0.3):
        cov_d = tp.estimator_cov_trace(theta, rewards, b_star + d)
        torch.testing.assert_close(cov_d - cov_at_star, curvature * d**2, rtol=1e-6, atol=1e-15)

    # Theorem 7 against the uniform (GRPO/RLOO population) baseline E[r]: never worse, strictly better here.
    mean_b = tp.expected_reward(theta, rewards)
    cov_at_mean = tp.estimator_cov_trace(theta, rewards, mean_b)
    assert torch.all(cov_at_star <= cov_at_mean)
    torch.testing.assert_close(cov_at_mean - cov_at_star, curvature * (mean_b - b_star) ** 2, rtol=1e-8, atol=1e-15)
    assert ((cov_at_mean - cov_at_star) / cov_at_mean).max() > 0.01  # not trivially equal on these policies


def test_repeated_actions_group_gives_b_star_and_exact_leave_one_out_shift():
    """A group where each action appears in proportion to its probability (pi = counts / N exactly)."""
    counts = torch.tensor([7, 1, 3, 12, 2, 5])
    theta = torch.log(counts.to(F64))  # softmax(log counts) = counts / N
    rewards = torch.tensor([0.9, 0.1, -0.4, 0.3, 2.0, 0.05], dtype=F64)
    actions = torch.repeat_interleave(torch.arange(6), counts)
    r, w = rewards[actions], tp.score_sq_norms(theta)[actions]
    n = int(counts.sum())

    b_plain, nf = gradient_weighted_baseline(r, w, n)
    assert nf == 0
    b_star = tp.optimal_baseline(theta, rewards)
    torch.testing.assert_close(b_plain, b_star.expand(n), rtol=1e-12, atol=0)

    # Leaving sample i out moves the weighted mean by exactly w_i (b - r_i) / (W - w_i).
    b_loo, nf = gradient_weighted_baseline(r, w, n, leave_one_out=True)
    assert nf == 0
    expected = b_star + w * (b_star - r) / (w.sum() - w)
    torch.testing.assert_close(b_loo, expected, rtol=1e-12, atol=1e-14)


def _exact_group_expectation(theta, rewards, group_size, baseline_fn, leave_one_out):
    """E over all K**G groups of the group estimate (1/G) sum_i (r_i - b_i) s_i, baseline from ``baseline_fn``."""
    actions = tp.all_action_tuples(theta.shape[-1], group_size)
    prob = tp.probs(theta)[actions].prod(1)
    r, w = rewards[actions], tp.score_sq_norms(theta)[actions]
    b, _ = baseline_fn(r.reshape(-1), w.reshape(-1), group_size, leave_one_out=leave_one_out)
    est = tp.group_estimates(actions, b.view(-1, group_size), theta, rewards)
    return (prob[:, None] * est).sum(0)


K_MC, G_MC, GROUPS_MC = 5, 8, 20_000


@pytest.fixture(scope="module")
def toy_bandit():
    gen = torch.Generator().manual_seed(0)
    theta, rewards = tp.random_policy(K_MC, gen)
    exact = {
        loo: _exact_group_expectation(theta, rewards, G_MC, gradient_weighted_baseline, loo) for loo in (True, False)
    }
    return theta, rewards, exact


def test_exact_enumeration_leave_one_out_is_unbiased_and_plain_is_not(toy_bandit):
    """Exact expectations over all 5**8 groups of 8 (no sampling error)."""
    theta, rewards, exact = toy_bandit
    grad = tp.policy_gradient(theta, rewards)
    tol = 1e-12 * grad.norm()
    assert (exact[True] - grad).norm() < tol, "weighted leave-one-out baseline must keep the gradient unbiased"
    # Including the sample in its own baseline correlates b_i with s_i: a bias of the order of ||grad J|| / G.
    assert (exact[False] - grad).norm() > 0.03 * grad.norm()

    # Same with the uniform baseline, where the bias of the plain group mean is known exactly: (1 - 1/G) grad J.
    rloo = _exact_group_expectation(theta, rewards, G_MC, mean_baseline, True)
    grpo = _exact_group_expectation(theta, rewards, G_MC, mean_baseline, False)
    assert (rloo - grad).norm() < tol
    assert (grpo - (1 - 1 / G_MC) * grad).norm() < tol


def test_monte_carlo_leave_one_out_unbiased_and_plain_bias_detectable(toy_bandit):
    """20,000 sampled groups of 8 with w_i = ||s_{a_i}||^2: the estimator's mean against closed forms."""
    theta, rewards, exact = toy_bandit
    grad = tp.policy_gradient(theta, rewards)
    gen = torch.Generator().manual_seed(1)
    actions = tp.sample_actions(theta.expand(GROUPS_MC, K_MC), G_MC, gen)  # (groups, G)
    r, w = rewards[actions].reshape(-1), tp.score_sq_norms(theta)[actions].reshape(-1)

    b_loo, nf = gradient_weighted_baseline(r, w, G_MC, leave_one_out=True)
    assert nf == 0
    est_loo = tp.group_estimates(actions, b_loo.view(-1, G_MC), theta, rewards)
    _assert_mean_matches(est_loo, grad, "leave-one-out weighted baseline vs grad J")

    b_plain, nf = gradient_weighted_baseline(r, w, G_MC, leave_one_out=False)
    assert nf == 0
    est_plain = tp.group_estimates(actions, b_plain.view(-1, G_MC), theta, rewards)
    # The plain estimator matches its own (exactly enumerated) biased expectation ...
    _assert_mean_matches(est_plain, exact[False], "plain weighted baseline vs its exact expectation")
    # ... and that bias is resolved at this sample size: the same test rejects grad J as its mean.
    t2, threshold = _hotelling(est_plain, grad)
    assert t2 > threshold
    # The test has power by a wide margin, not by luck of the seed: the exact bias alone is many standard errors.
    t2_exact_bias, _ = _hotelling(est_plain - est_plain.mean(0) + exact[False], grad)
    assert t2_exact_bias > 10 * threshold


def _gaussian_trials(mu, cov, n, trials, gen):
    """``trials`` batches of ``n`` i.i.d. N(mu, cov) vectors: returns m = mean ||g_i||^2 and ||gbar||^2 per batch."""
    chol = torch.linalg.cholesky(cov)
    x = mu + torch.randn(trials, n, mu.shape[0], generator=gen, dtype=F64) @ chol.T
    return x.pow(2).sum(-1).mean(1), x.mean(1).pow(2).sum(-1), x


def _random_cov(d, trace, gen):
    a = torch.randn(d, d, generator=gen, dtype=F64)
    cov = a @ a.T + 0.1 * torch.eye(d, dtype=F64)
    return cov * trace / cov.trace()


def test_gradient_snr_estimators_are_unbiased():
    """McCandlish et al.'s ||grad J||^2 and tr Sigma estimators, read back through the module, are unbiased.

    ``gradient_snr`` returns only their ratio S/T; ``snr_lr_scale`` turns it into nS/(nS + T) = S/||gbar||^2 (because
    nS + T = n ||gbar||^2), so S = scale * ||gbar||^2 and T = n ||gbar||^2 (1 - scale) when S is not clipped.
    """
    gen = torch.Generator().manual_seed(2)
    d, n, trials = 5, 8, 20_000
    cov = _random_cov(d, 2.0, gen)
    mu = torch.randn(d, generator=gen, dtype=F64)
    mu = 2.0 * mu / mu.norm()  # ||mu||^2 = 4 against tr Sigma / n = 0.25: the signal estimate is never clipped
    m, g2, _ = _gaussian_trials(mu, cov, n, trials, gen)

    scale = snr_lr_scale(gradient_snr(m, g2, n), n)
    signal = scale * g2
    noise = n * g2 * (1 - scale)
    assert torch.all(signal > 0), "regime chosen so that clipping never happens"
    _assert_within_se(signal[:, None], mu.pow(2).sum()[None], "||grad J||^2 estimate")
    _assert_within_se(noise[:, None], cov.trace()[None], "tr Sigma estimate")


def test_unclipped_signal_noise_estimates_are_unbiased_at_low_signal():
    """``gradient_signal_noise`` (the unclipped parts) is unbiased even where the signal estimate is negative half
    the time (clipping would bias it up). Imported, not looked up: a renamed function fails this module, never skips."""
    signal_noise = gradient_signal_noise
    gen = torch.Generator().manual_seed(10)
    d, n, trials = 6, 8, 20_000
    cov = _random_cov(d, 3.0, gen)
    mu = torch.full((d,), 0.1, dtype=F64)  # ||mu||^2 = 0.06 against tr Sigma / n = 0.375
    m, g2, _ = _gaussian_trials(mu, cov, n, trials, gen)
    signal, noise = signal_noise(m, g2, n)
    assert 0.2 < (signal < 0).double().mean() < 0.8
    _assert_within_se(signal.to(F64)[:, None], mu.pow(2).sum()[None], "unclipped ||grad J||^2 estimate")
    _assert_within_se(noise.to(F64)[:, None], cov.trace()[None], "unclipped tr Sigma estimate")


def test_the_trainers_step_estimates_are_unbiased_and_size_its_step():
    """The functions the trainer runs (`oblr_trl.snr_formulas`), in its own terms: a step's contributions
    ``H_q = g_q / N``, ``sum_q ||H_q||^2`` and ``||G||^2``. `step_signal_noise` is unbiased for ``||grad J||^2`` and
    ``tr Sigma`` of ``g_q`` where the signal estimate is negative half the time, and the ``"per_step"`` factor
    `snr_step_size` applies is ``snr_lr_scale(gradient_snr(m, ||gbar||^2, N))`` of the same samples."""
    gen = torch.Generator().manual_seed(11)
    d, n, trials = 6, 8, 20_000
    cov = _random_cov(d, 3.0, gen)
    mu = torch.full((d,), 0.1, dtype=F64)
    m, g2, x = _gaussian_trials(mu, cov, n, trials, gen)
    h = x / n
    sum_sq, total_sq = h.pow(2).sum((1, 2)), h.sum(1).pow(2).sum(-1)
    signal, noise = step_signal_noise(sum_sq, total_sq, n)
    assert 0.2 < (signal < 0).double().mean() < 0.8
    _assert_within_se(signal[:, None], mu.pow(2).sum()[None], "the trainer's ||grad J||^2 estimate")
    _assert_within_se(noise[:, None], cov.trace()[None], "the trainer's tr Sigma estimate")
    expected = snr_lr_scale(gradient_snr(m[:300], g2[:300], n), n)
    applied = [snr_step_size("per_step", float(a), float(b), n)[0].scale for a, b in zip(sum_sq[:300], total_sq[:300])]
    torch.testing.assert_close(torch.tensor(applied, dtype=F64), expected, rtol=1e-9, atol=1e-12)
    assert (expected == 0).any() and (expected > 0).any()


def _variance_band(samples: torch.Tensor) -> tuple[float, float]:
    """The sample variance of ``samples`` (1-d) and its standard error ``sqrt((mu_4 - var^2) / T)``."""
    centred = samples - samples.mean()
    var = float(centred.pow(2).mean())
    return var, math.sqrt(max(float(centred.pow(4).mean()) - var * var, 0.0) / samples.shape[0])


def _shapes(gen):
    """(name, mu, draw) of the toys: ``draw(trials, n)`` gives ``(trials, n, d)`` i.i.d. single-sample estimates."""
    d = 6
    mu = torch.full((d,), 0.3, dtype=F64)
    u = mu / mu.norm()
    cov = _random_cov(d, 3.0, gen)
    chol = torch.linalg.cholesky(cov)

    def gaussian(trials, n):
        return mu + torch.randn(trials, n, d, generator=gen, dtype=F64) @ chol.T

    def rank_one(trials, n):  # Sigma = 3 u u' along mu: the bound's two inequalities hold with equality
        return mu + math.sqrt(3.0) * torch.randn(trials, n, 1, generator=gen, dtype=F64) * u

    def skewed(trials, n):  # centred exponential noise, covariance 0.5 I: not Gaussian
        return mu + math.sqrt(0.5) * (torch.empty(trials, n, d, dtype=F64).exponential_(generator=gen) - 1.0)

    return [("gaussian", mu, gaussian, cov.trace()), ("rank one along mu", mu, rank_one, torch.tensor(3.0)),
            ("skewed", mu, skewed, torch.tensor(0.5 * d))]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_first_step_standard_error_bounds_the_signal_estimate_s_spread(n):
    """``step_signal_se`` (what ``"ema_soft"`` uses on its first step, with no history): at the true ``s = ||mu||^2``
    and ``v = tr Sigma`` its square ``2 v^2 / (n (n - 1)) + 4 s v / n`` bounds the Monte Carlo variance of the step's
    signal estimate, with equality where Sigma has rank one along mu (the derivation's inequalities are then
    equalities: checked within the band, so a wrong constant fails); with the step's own estimates plugged in, its
    mean square still covers the variance."""
    gen = torch.Generator().manual_seed(20 + n)
    trials = 40_000
    for name, mu, draw, trace in _shapes(gen):
        x = draw(trials, n)
        h = x / n  # the trainer's contributions: g_q = n H_q
        signal, noise = step_signal_noise(h.pow(2).sum((1, 2)), h.sum(1).pow(2).sum(-1), n)
        var, band = _variance_band(signal)
        s, v = float(mu.pow(2).sum()), float(trace)
        bound = step_signal_se(s, v, n) ** 2
        assert bound == pytest.approx(2 * v * v / (n * (n - 1)) + 4 * s * v / n, rel=1e-12)
        assert var <= bound + Z * band, f"{name}, n={n}: variance {var:.4g} above the bound {bound:.4g} (+-{band:.2g})"
        if name == "rank one along mu":
            assert abs(var - bound) <= Z * band, f"n={n}: rank one, variance {var:.4g} vs exact {bound:.4g}"
        plugged = torch.tensor([step_signal_se(float(a), float(b), n) ** 2 for a, b in zip(signal[:4000], noise[:4000])])
        assert float(plugged.mean()) >= var - Z * band, f"{name}, n={n}: plug-in {float(plugged.mean()):.4g} < {var:.4g}"


def test_gradient_snr_is_the_clipped_ratio_of_the_unbiased_estimates():
    """Per trial, in a low-signal regime where the signal estimate is negative about half the time."""
    gen = torch.Generator().manual_seed(3)
    d, n, trials = 4, 6, 4000
    cov = _random_cov(d, 1.0, gen)
    mu = torch.full((d,), 0.05, dtype=F64)
    m, g2, _ = _gaussian_trials(mu, cov, n, trials, gen)
    signal = (n * g2 - m) / (n - 1)
    noise = n * (m - g2) / (n - 1)
    assert 0.2 < (signal < 0).double().mean() < 0.8
    snr = gradient_snr(m, g2, n)
    assert snr.shape == m.shape
    torch.testing.assert_close(snr.to(F64), signal.clamp(min=0) / noise, rtol=1e-10, atol=1e-15)
    scale = snr_lr_scale(snr, n)
    torch.testing.assert_close(scale.to(F64), (n * snr / (1 + n * snr)).to(F64), rtol=1e-12, atol=0)
    assert torch.all((scale >= 0) & (scale < 1))


def test_step_scale_from_contributions_equals_snr_lr_scale_of_gradient_snr():
    """The algebraic identity of estimators.md with g_i = n h_i, m = mean ||g_i||^2, gbar = G = sum_i h_i."""
    gen = torch.Generator().manual_seed(4)
    d, n, trials = 7, 10, 3000
    # From pure noise (scale clipped to 0) to nearly aligned contributions (scale near 1).
    signal_strength = torch.logspace(-2, 2, trials, dtype=F64)[:, None, None]
    direction = torch.randn(1, 1, d, generator=gen, dtype=F64)
    h = signal_strength * direction + torch.randn(trials, n, d, generator=gen, dtype=F64)
    sum_sq = h.pow(2).sum((1, 2))
    total_sq = h.sum(1).pow(2).sum(-1)
    g = n * h
    m = g.pow(2).sum(-1).mean(1)
    g2 = g.mean(1).pow(2).sum(-1)
    via_snr = snr_lr_scale(gradient_snr(m, g2, n), n).to(F64)
    direct = step_scale_from_contributions(sum_sq, total_sq, n).to(F64)
    torch.testing.assert_close(direct, via_snr, rtol=1e-9, atol=1e-12)
    # Reference formula, written independently.
    reference = (n / (n - 1) * (1 - sum_sq / total_sq)).clamp(0, 1)
    torch.testing.assert_close(direct, reference, rtol=1e-12, atol=1e-15)
    assert (direct == 0).any() and (direct > 0.99).any()  # both ends of the range were exercised


def test_snr_edge_values():
    n = 8
    # All samples identical: no noise, positive signal.
    assert math.isinf(float(gradient_snr(2.0, 2.0, n)))
    assert float(snr_lr_scale(float("inf"), n)) == 1.0
    assert float(snr_lr_scale(gradient_snr(2.0, 2.0, n), n)) == 1.0
    # Nothing at all.
    assert float(gradient_snr(0.0, 0.0, n)) == 0.0
    assert float(snr_lr_scale(0.0, n)) == 0.0
    # Mean of the estimates is zero: signal clipped at 0.
    assert float(gradient_snr(3.0, 0.0, n)) == 0.0
    # Identical contributions -> scale 1; orthogonal equal-norm contributions -> scale 0.
    h = torch.randn(3, generator=torch.Generator().manual_seed(0), dtype=F64)
    aligned = step_scale_from_contributions(n * h.pow(2).sum(), (n * h).pow(2).sum(), n)
    assert float(aligned) == pytest.approx(1.0, abs=1e-12)
    assert float(step_scale_from_contributions(float(n), float(n), n)) == 0.0
    # snr_lr_scale is increasing and n*snr/(1+n*snr).
    assert float(snr_lr_scale(0.5, 4)) == pytest.approx(2 / 3, abs=1e-15)


def test_end_to_end_group_as_sample_noise_estimate_matches_monte_carlo_truth():
    """The toy trainer step of estimators.md: 16 prompts x 8 completions, weighted leave-one-out baseline.

    Each step draws 16 prompts i.i.d. from a pool of 32 independent softmax policies (the paper's setting: a prompt
    batch is a sample from the dataset), so the group sums H_q are i.i.d. and the group-as-sample estimator
    tr Sigma_hat / N (N = 16 prompts, g_q = N H_q) is unbiased for tr Cov(G), G = sum_i h_i, h_i = A_i s_i / (P G).
    The Monte Carlo truth is the spread of G over 4,000 steps; the comparison uses the per-step paired difference,
    whose standard error is computed from the steps. (With the same 16 prompts every step, the estimator would also
    count the spread between the prompts' gradients as noise: 3-4x the within-prompt truth on this toy.)
    """
    gen = torch.Generator().manual_seed(5)
    pool, num_actions, prompts_per_step, group_size, steps = 32, 6, 16, 8, 4000
    theta, rewards = tp.random_policy(num_actions, gen, batch=(pool,))
    prompts = torch.randint(pool, (steps, prompts_per_step), generator=gen)  # (T, P)
    actions = tp.sample_actions(theta[prompts], group_size, gen)  # (T, P, G)
    score_table = tp.scores(theta)[prompts]  # (T, P, K, K)
    s = torch.gather(score_table, 2, actions[..., None].expand(-1, -1, -1, num_actions))  # (T, P, G, K)
    r = torch.gather(rewards[prompts], 2, actions)
    w = s.pow(2).sum(-1)

    b, _ = gradient_weighted_baseline(r.reshape(-1), w.reshape(-1), group_size, leave_one_out=True)
    adv = r - b.view_as(r)
    c = 1.0 / (prompts_per_step * group_size)  # the mean-over-completions loss normalizer
    h = c * adv[..., None] * s  # per-completion contributions, in the K coordinates of their prompt's block
    group_sum = h.sum(2)  # H_q, (T, P, K)
    step_grad = torch.zeros(steps, pool, num_actions, dtype=F64)
    step_grad.scatter_add_(1, prompts[..., None].expand(-1, -1, num_actions), group_sum)
    step_grad = step_grad.reshape(steps, -1)  # G in the full (pool * K)-dimensional parameter space
    g2 = step_grad.pow(2).sum(1)

    # Unbiasedness of the whole step (leave-one-out baseline, several prompts): E[G] = (1/pool) concat_q grad J_q.
    expected_grad = tp.policy_gradient(theta, rewards).reshape(-1) / pool
    _assert_mean_matches(step_grad, expected_grad, "mean step gradient vs closed form")

    n_groups = prompts_per_step
    m_group = (n_groups**2 * group_sum.pow(2).sum(-1)).mean(1)
    noise_group = n_groups * (m_group - g2) / (n_groups - 1) / n_groups  # estimate of tr Cov(G)
    dev = (step_grad - step_grad.mean(0)).pow(2).sum(1) * steps / (steps - 1)  # its mean is the MC truth
    truth = dev.mean()
    assert dev.std() / math.sqrt(steps) < 0.02 * truth, "enough steps for a 2% resolution of the truth"
    _assert_within_se((noise_group - dev)[:, None], torch.zeros(1, dtype=F64), "group-as-sample tr Cov vs MC truth")

    # The same estimator with completions as samples ignores the within-group correlation and the prompt-level
    # variance shared by a group: it is biased (low) by far more than its standard error.
    n_comp = prompts_per_step * group_size
    m_comp = (n_comp**2 * h.pow(2).sum(-1)).reshape(steps, -1).mean(1)
    noise_comp = n_comp * (m_comp - g2) / (n_comp - 1) / n_comp
    diff = noise_comp - dev
    assert diff.mean() < -Z * diff.std() / math.sqrt(steps)

    # The module's step-size factor from the group sums is the same as through gradient_snr.
    scale = step_scale_from_contributions(group_sum.pow(2).sum((1, 2)), g2, n_groups)
    via_snr = snr_lr_scale(gradient_snr(m_group, g2, n_groups), n_groups)
    torch.testing.assert_close(scale.to(F64), via_snr.to(F64), rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# 2. Reference loops.
# ---------------------------------------------------------------------------------------------------------------------


def _reference_baseline(rewards, weights, group_size, leave_one_out):
    """The specification as a double loop over Python floats."""
    r, w = [float(x) for x in rewards], [float(x) for x in weights]
    out, fallback = [], 0
    for start in range(0, len(r), group_size):
        group = range(start, start + group_size)
        for i in group:
            others = [j for j in group if not math.isnan(r[j]) and not (leave_one_out and j == i)]
            if not others:
                out.append(0.0)
                fallback += 1
                continue
            w_sum = sum(w[j] for j in others)
            if w_sum == 0:
                out.append(sum(r[j] for j in others) / len(others))
                fallback += 1
            else:
                out.append(sum(w[j] * r[j] for j in others) / w_sum)
    return torch.tensor(out, dtype=F64), fallback


def _random_inputs(gen, n_groups, group_size, nan_frac=0.15, zero_frac=0.2, special_groups=True):
    n = n_groups * group_size
    rewards = torch.randn(n, generator=gen, dtype=F64)
    rewards[torch.rand(n, generator=gen) < nan_frac] = float("nan")
    weights = torch.rand(n, generator=gen, dtype=F64) * torch.exp(2 * torch.randn(n, generator=gen, dtype=F64))
    weights[torch.rand(n, generator=gen) < zero_frac] = 0.0
    # Force the rare cases into some groups: all weights zero, a single non-zero weight, every reward NaN.
    g = weights.view(n_groups, group_size)
    rr = rewards.view(n_groups, group_size)
    if special_groups and n_groups >= 3:
        g[0] = 0.0
        g[1, 1:] = 0.0
        rr[2] = float("nan")
    return rewards, weights


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_weighted_baseline_matches_reference_loop(leave_one_out):
    gen = torch.Generator().manual_seed(6)
    for trial in range(150):
        group_size = [1, 2, 3, 5, 8][trial % 5]
        n_groups = 1 + trial % 7
        rewards, weights = _random_inputs(gen, n_groups, group_size)
        expected, expected_fallback = _reference_baseline(rewards, weights, group_size, leave_one_out)
        baseline, num_fallback = gradient_weighted_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
        assert baseline.shape == rewards.shape
        torch.testing.assert_close(baseline, expected, rtol=1e-12, atol=1e-12, msg=lambda m: f"trial {trial}: {m}")
        assert num_fallback == expected_fallback, f"trial {trial}: fallback count {num_fallback} != {expected_fallback}"


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_weighted_baseline_float32_within_rounding_bound(leave_one_out):
    """float32 inputs (weights spread over ~3 decades) against the float64 loop, within a rounding-error bound.

    Forming a leave-one-out sum by subtracting from the group total costs up to ~G eps |total| absolute error in the
    numerator and the denominator, so |error| <~ G eps (sum_j w_j |r_j| + |b_i| W) / W_i, W_i = the set's weight.
    The bound below takes 4x that.
    """
    gen = torch.Generator().manual_seed(7)
    group_size, n_groups = 8, 64
    rewards, weights = _random_inputs(gen, n_groups, group_size, nan_frac=0.0, zero_frac=0.0, special_groups=False)
    expected, _ = _reference_baseline(rewards.float(), weights.float(), group_size, leave_one_out)
    baseline, num_fallback = gradient_weighted_baseline(
        rewards.float(), weights.float(), group_size, leave_one_out=leave_one_out
    )
    assert baseline.dtype == torch.float32 and num_fallback == 0
    r32, w32 = rewards.float().double().view(n_groups, group_size), weights.float().double().view(n_groups, group_size)
    set_weight = w32.sum(1, keepdim=True) - (w32 if leave_one_out else 0)
    abs_wr = (w32 * r32.abs()).sum(1, keepdim=True)
    eps = torch.finfo(torch.float32).eps
    bound = 4 * group_size * eps * (abs_wr + expected.view_as(w32).abs() * w32.sum(1, keepdim=True)) / set_weight
    err = (baseline.double().view_as(w32) - expected.view_as(w32)).abs()
    assert torch.all(err <= bound + eps * expected.view_as(w32).abs()), f"max error / bound {(err / bound).max()}"


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_mean_baseline_is_grpo_and_rloo_mean(leave_one_out):
    gen = torch.Generator().manual_seed(8)
    group_size, n_groups = 8, 12
    rewards = torch.randn(n_groups * group_size, generator=gen, dtype=F64)
    weights = torch.rand(n_groups * group_size, generator=gen, dtype=F64)  # must be ignored
    baseline, num_fallback = mean_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
    grouped = rewards.view(n_groups, group_size)
    if leave_one_out:  # RLOO
        expected = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    else:  # GRPO
        expected = grouped.mean(1, keepdim=True).expand_as(grouped)
    torch.testing.assert_close(baseline, expected.reshape(-1), rtol=1e-13, atol=1e-14)
    assert num_fallback == 0

    # With NaN rewards and empty sets it is the loop with unit weights, whatever the weights passed.
    for trial in range(60):
        group_size = [1, 2, 4, 8][trial % 4]
        rewards, weights = _random_inputs(gen, 1 + trial % 5, group_size)
        ones = torch.ones_like(rewards)
        expected, expected_fallback = _reference_baseline(rewards, ones, group_size, leave_one_out)
        baseline, num_fallback = mean_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
        torch.testing.assert_close(baseline, expected, rtol=1e-12, atol=1e-12)
        assert num_fallback == expected_fallback


# ---------------------------------------------------------------------------------------------------------------------
# 3. Edge behaviour.
# ---------------------------------------------------------------------------------------------------------------------


def test_return_types():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    weights = torch.tensor([1.0, 2.0, 1.0, 0.5, 0.5, 3.0])
    for fn in (gradient_weighted_baseline, mean_baseline):
        for loo in (False, True):
            baseline, num_fallback = fn(rewards, weights, 3, leave_one_out=loo)
            assert baseline.shape == rewards.shape, f"{fn.__name__}(leave_one_out={loo}) returned {baseline.shape}"
            assert baseline.dtype == rewards.dtype
            assert int(num_fallback) == 0


def test_group_size_one():
    rewards = torch.tensor([0.3, float("nan"), -1.2, 2.0], dtype=F64)
    weights = torch.tensor([1.0, 2.0, 0.0, 0.7], dtype=F64)
    # Leave-one-out: every set is empty -> baseline 0, all counted as fallback.
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, 1, leave_one_out=True)
    assert torch.equal(baseline, torch.zeros(4, dtype=F64)) and num_fallback == 4
    # Plain: the set is the sample itself (empty for the NaN reward; zero weight falls back to its own reward).
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, 1, leave_one_out=False)
    torch.testing.assert_close(baseline, torch.tensor([0.3, 0.0, -1.2, 2.0], dtype=F64), rtol=0, atol=0)
    assert num_fallback == 2


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_all_nan_group_and_nan_reward_own_baseline(leave_one_out):
    nan = float("nan")
    rewards = torch.tensor([nan, nan, nan, nan, nan, 3.0, 5.0, 2.0], dtype=F64)
    weights = torch.tensor([1.0, 2.0, 3.0, 1.0, 9.0, 1.0, 2.0, 4.0], dtype=F64)
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, 4, leave_one_out=leave_one_out)
    assert not torch.isnan(baseline).any()
    # All-NaN group: no valid reward in any set -> 0, counted.
    assert torch.equal(baseline[:4], torch.zeros(4, dtype=F64))
    assert num_fallback == 4
    # The NaN-reward sample's own baseline is the weighted mean of the others (NaN rewards weigh nothing).
    assert float(baseline[4]) == pytest.approx((1 * 3.0 + 2 * 5.0 + 4 * 2.0) / 7, abs=1e-14)
    if leave_one_out:
        assert float(baseline[5]) == pytest.approx((2 * 5.0 + 4 * 2.0) / 6, abs=1e-14)
    else:
        assert float(baseline[5]) == pytest.approx((1 * 3.0 + 2 * 5.0 + 4 * 2.0) / 7, abs=1e-14)


def test_zero_weights_fall_back_to_the_plain_mean():
    rewards = torch.tensor([1.0, 2.0, 4.0, 8.0, 1.0, 3.0, 5.0, 7.0], dtype=F64)
    weights = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.5, 0.0, 0.0, 0.0], dtype=F64)
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, 4)
    torch.testing.assert_close(baseline, torch.tensor([3.75] * 4 + [1.0] * 4, dtype=F64), rtol=0, atol=1e-15)
    assert num_fallback == 4
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, 4, leave_one_out=True)
    expected = [14 / 3, 13 / 3, 11 / 3, 7 / 3, 5.0, 1.0, 1.0, 1.0]  # sample 4's others all weigh 0 -> their mean
    torch.testing.assert_close(baseline, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-14)
    assert num_fallback == 5


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_small_but_nonzero_weights_are_still_weighted(leave_one_out):
    """Only a set whose weights sum to zero falls back: tiny weights (a near-deterministic completion has a score
    of norm ~0) still give the weighted mean, however small they are next to the left-out sample's weight."""
    rewards = torch.tensor([0.5, 1.0, 0.0, 4.0], dtype=F64)
    weights = torch.tensor([1.0, 1e-7, 3e-7, 0.0], dtype=F64)
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, 4, leave_one_out=leave_one_out)
    assert num_fallback == 0
    expected_0 = (1e-7 * 1.0 + 3e-7 * 0.0) / 4e-7 if leave_one_out else (0.5 + 1e-7) / (1 + 4e-7)
    assert float(baseline[0]) == pytest.approx(expected_0, rel=1e-9)
    # Scale-free: multiplying the weights by a tiny constant changes nothing.
    baseline_small, num_fallback = gradient_weighted_baseline(rewards, weights * 1e-30, 4, leave_one_out=leave_one_out)
    assert num_fallback == 0
    torch.testing.assert_close(baseline_small, baseline, rtol=1e-12, atol=0)


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_weight_scale_invariance_and_permutation_equivariance(leave_one_out):
    gen = torch.Generator().manual_seed(9)
    group_size, n_groups = 6, 10
    rewards, weights = _random_inputs(gen, n_groups, group_size, zero_frac=0.1)
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
    for factor in (3.7, 1e-3, 1e5):
        scaled, nf = gradient_weighted_baseline(rewards, weights * factor, group_size, leave_one_out=leave_one_out)
        torch.testing.assert_close(scaled, baseline, rtol=1e-12, atol=1e-14)
        assert nf == num_fallback
    # Permuting within each group permutes the baselines the same way.
    perm = torch.stack([torch.randperm(group_size, generator=gen) for _ in range(n_groups)])
    index = (perm + group_size * torch.arange(n_groups)[:, None]).reshape(-1)
    permuted, nf = gradient_weighted_baseline(rewards[index], weights[index], group_size, leave_one_out=leave_one_out)
    torch.testing.assert_close(permuted, baseline[index], rtol=1e-13, atol=1e-14)
    assert nf == num_fallback
    # NaN rewards never leak into a baseline.
    assert not torch.isnan(baseline).any()
