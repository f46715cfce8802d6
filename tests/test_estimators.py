"""The trainer's formulas as pure functions (`oblr_trl.estimators`), each against a brute-force reference.

(Property-based tests of the baselines and SNR: `test_estimators_properties.py`; Monte Carlo and toy-policy references:
`test_estimators_montecarlo.py`.)
"""

import math

import pytest
import torch

from oblr_trl import estimators
from oblr_trl.estimators import (
    aggregate_rewards,
    baseline_metrics,
    baseline_weights,
    mask_nonfinite_products,
    max_weight_ratio,
    register_baseline,
    unit_sq_norms,
)


def test_baseline_weights_are_squared_norms_of_the_scores_as_they_enter_the_loss():
    torch.manual_seed(0)
    u = torch.randn(6, 11, dtype=torch.float64)  # per-sequence scores
    lengths = torch.tensor([3, 1, 7, 4, 0, 2])
    sq = (u * u).sum(1)
    for loss_type in ("grpo", "sapo"):  # the loss averages each sequence: its score enters as u_i / |o_i|
        ref = torch.stack([(u[i] / max(int(lengths[i]), 1)).pow(2).sum() for i in range(6)])
        torch.testing.assert_close(baseline_weights("exact", loss_type, lengths, sq).double(), ref, rtol=1e-6, atol=0)
    for loss_type in ("dapo", "bnpo", "dr_grpo", "cispo", "luspo", "vespo"):
        torch.testing.assert_close(baseline_weights("exact", loss_type, lengths, sq).double(), sq, rtol=1e-6, atol=0)
    torch.testing.assert_close(baseline_weights("length", "grpo", lengths), lengths.float())
    with pytest.raises(ValueError, match="grad_norm_estimator='approx'.*allowed values"):
        baseline_weights("approx", "dapo", lengths, sq)
    with pytest.raises(ValueError, match="needs the per-sequence squared norms"):
        baseline_weights("exact", "dapo", lengths)


def test_unit_sq_norms_against_summed_vectors():
    """||H_q||^2 from Gram rows equals the squared norm of the explicitly summed contributions a_i u_i."""
    torch.manual_seed(1)
    k, units = 4, [7, 7, 3, 9, 7, 3, 9, 9, 3]
    positions = [0, 2, 1, 0, 3, 3, 1, 3, 0]  # unit 7 has members 0, 2, 3 here (member 1 is in another step)
    n = len(units)
    u = {(q, p): torch.randn(5, dtype=torch.float64) for q, p in zip(units, positions)}
    a = torch.randn(n, dtype=torch.float64)
    gram = torch.zeros(n, k, dtype=torch.float64)
    for i, (q, p) in enumerate(zip(units, positions)):
        for j in range(k):
            if (q, j) in u:
                gram[i, j] = u[(q, p)] @ u[(q, j)]
    ids, sq = unit_sq_norms(torch.tensor(units), torch.tensor(positions), a, gram)
    assert ids.tolist() == [3, 7, 9]
    for q, value in zip(ids.tolist(), sq.tolist()):
        h = sum(a[i] * u[(units[i], positions[i])] for i in range(n) if units[i] == q)
        assert value == pytest.approx(float(h @ h), rel=1e-12)


def test_aggregate_rewards_weights_and_marks_unscorable():
    nan, inf = float("nan"), float("inf")
    per_func = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan], [inf, 1.0], [0.5, nan]])
    rewards, infinite = aggregate_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert infinite == 1
    expected = [2.0, 1.5, nan, nan, 0.5]
    for r, e in zip(rewards.tolist(), expected):
        assert (math.isnan(r) and math.isnan(e)) or r == pytest.approx(e)


def test_mask_nonfinite_products():
    products = torch.arange(18, dtype=torch.float64).reshape(2, 3, 3)
    products[0, 1, 1] = float("inf")
    products[1, 0, 2] = float("nan")  # an off-diagonal product only: zeroed, the completion stays scorable
    masked, bad = mask_nonfinite_products(products)
    assert bad.tolist() == [False, True, False, False, False, False]
    assert masked[0, 1].abs().sum() == 0 and masked[0, :, 1].abs().sum() == 0
    assert masked[1, 0, 2] == 0 and masked[1, 0, 0] == 9 and torch.isfinite(masked).all()


def test_max_weight_ratio_and_metrics():
    w = torch.tensor([100.0, 1.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    ratio = max_weight_ratio(w, 4)
    assert ratio[0] == pytest.approx(100.0) and math.isnan(ratio[1])  # lower median 1; no usable weight
    rewards = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    metrics = baseline_metrics(rewards, torch.tensor([0.5, 0.5, 1.0, 1.0]), torch.tensor([1.0, 9.0, 1.0, 4.0]), 2, 1)
    assert metrics["unscorable"] == 1 and metrics["reward_mean"] == pytest.approx(1.0)
    assert metrics["baseline_mean"] == pytest.approx(2.5 / 3)
    assert metrics["weight_spread"] == pytest.approx(float(torch.tensor([1.0, 1.0, 4.0]).std() / 2.0))
    assert (metrics["fallback_samples"], metrics["clipped_weights"]) == (2.0, 1.0)
    empty = baseline_metrics(torch.tensor([float("nan")] * 2), torch.zeros(2), torch.zeros(2), 0, 0)
    assert all(math.isfinite(v) for v in empty.values())


def test_registering_a_baseline_name_twice_raises():
    with pytest.raises(ValueError, match="'mean' is already registered"):
        register_baseline("mean")(lambda *a: None)
    assert estimators.BASELINES["mean"].fn is estimators.mean_baseline
    assert not estimators.baseline_uses_weights("mean") and estimators.baseline_uses_weights("gradient_weighted")


def test_what_the_weights_need_is_the_estimator_s_declaration_under_a_baseline_that_uses_them(monkeypatch):
    """``weights_need``: the registered estimator's ``needs`` where the baseline reads the weights, else None; for
    every pair of registered baselines and estimators, a user's entries included."""
    monkeypatch.setitem(estimators.GRAD_NORM_ESTIMATORS, "proxy_squares",
                        estimators.WeightEstimator(lambda lt, ln, s: s**2, needs="logit_proxy"))
    monkeypatch.setitem(estimators.BASELINES, "ignores_weights",
                        estimators.Baseline(estimators.mean_baseline, uses_weights=False))
    expected = {("gradient_weighted", "exact"): "norms", ("gradient_weighted", "logit"): "logit_proxy",
                ("gradient_weighted", "length"): None, ("gradient_weighted", "proxy_squares"): "logit_proxy"}
    for baseline in estimators.BASELINES:
        for estimator in estimators.GRAD_NORM_ESTIMATORS:
            assert estimators.weights_need(baseline, estimator) == expected.get((baseline, estimator)), (
                baseline, estimator)
    with pytest.raises(ValueError, match="grad_norm_estimator='nope' is not allowed"):
        estimators.weights_need("gradient_weighted", "nope")
