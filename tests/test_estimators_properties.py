"""Property-based tests (hypothesis) of the pure estimators in `oblr_trl.estimators`.

Inputs span what a run can produce and more: NaN rewards (unscorable completions), zero, negative, infinite and NaN
weights, and magnitudes from 1e-30 to 1e30 for both weights and rewards, in float32 (the trainer's dtype) and float64.
The baseline is checked against a float64 Python reference of its specification, and for the invariances that
specification implies: scale-free in the weights, equivariant under permutations within and across groups, and a
weighted mean (so within the range of the rewards it averages). The SNR functions are checked for range, monotonicity,
scale invariance and the identity that links `step_scale_from_contributions` to `gradient_snr` and `snr_lr_scale`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from oblr_trl.estimators import gradient_weighted_baseline, mean_baseline
from oblr_trl.snr_formulas import gradient_signal_noise, gradient_snr, snr_lr_scale, step_scale_from_contributions

SETTINGS = settings(deadline=None, max_examples=60, derandomize=True, database=None)
NAN, INF = float("nan"), float("inf")
RTOL = {torch.float32: 2e-5, torch.float64: 1e-12}


# --------------------------------------------------------------------------------------------------- strategies
def magnitude(lo: int = -30, hi: int = 30) -> st.SearchStrategy[float]:
    """Positive floats log-uniform over [1e``lo``, 1e``hi``] (both float32-representable as normal numbers)."""
    return st.builds(lambda m, e: m * 10.0**e, st.floats(1.0, 9.99), st.integers(lo, hi))


signed_magnitude = st.builds(lambda x, s: s * x, magnitude(), st.sampled_from([-1.0, 1.0]))
reward_value = st.one_of(signed_magnitude, st.integers(-3, 3).map(float), st.just(NAN))
weight_value = st.one_of(magnitude(), magnitude(), st.sampled_from([0.0, -1.0, -1e30, INF, -INF, NAN]))


@st.composite
def batches(draw, reward=reward_value, weight=weight_value, max_group=6, max_groups=4):
    group_size = draw(st.integers(1, max_group))
    n = group_size * draw(st.integers(1, max_groups))
    rewards = draw(st.lists(reward, min_size=n, max_size=n))
    weights = draw(st.lists(weight, min_size=n, max_size=n))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    leave_one_out = draw(st.booleans())
    return torch.tensor(rewards, dtype=dtype), torch.tensor(weights, dtype=dtype), group_size, leave_one_out


# ----------------------------------------------------------------------------------------------------- reference
def reference_baseline(rewards, weights, group_size, leave_one_out):
    """The specification in float64 Python: for each sample, its set = its group (minus itself with leave-one-out)
    restricted to non-NaN rewards; weights that are not finite and positive count as 0. Weighted mean of the set if its
    weights sum to > 0, else its plain mean (counted as a fallback), 0 for an empty set. Also returns each set's
    largest |reward| (the scale of the rounding error)."""
    r, w = rewards.double().tolist(), weights.double().tolist()
    out, scale, fallback = [], [], 0
    for i in range(len(r)):
        start = i - i % group_size
        group = range(start, start + group_size)
        members = [j for j in group if not (leave_one_out and j == i) and not math.isnan(r[j])]
        ws = [w[j] if math.isfinite(w[j]) and w[j] > 0 else 0.0 for j in members]
        scale.append(max((abs(r[j]) for j in members), default=0.0))
        if sum(ws) > 0:
            out.append(math.fsum(wj * r[j] for wj, j in zip(ws, members)) / math.fsum(ws))  # float64: no overflow
        else:
            fallback += 1
            out.append(math.fsum(r[j] for j in members) / len(members) if members else 0.0)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(scale, dtype=torch.float64), fallback


def assert_close_to(baseline, expected, scale, dtype, what=""):
    err = (baseline.double() - expected).abs()
    bound = RTOL[dtype] * scale + 1e-300
    worst = int(torch.argmax(err - bound))
    got, want = float(baseline[worst]), float(expected[worst])
    assert torch.all(err <= bound), f"{what} sample {worst}: got {got!r}, want {want!r}"


# ------------------------------------------------------------------------------------------------------ baselines
@SETTINGS
@given(batches())
def test_baseline_matches_reference_shape_dtype_finite(batch):
    rewards, weights, group_size, leave_one_out = batch
    baseline, num_fallback = gradient_weighted_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
    assert baseline.shape == rewards.shape and baseline.dtype == rewards.dtype
    assert torch.is_tensor(num_fallback) and num_fallback.dim() == 0  # on the device: read with the metrics
    assert torch.isfinite(baseline).all(), f"non-finite baseline {baseline}"
    expected, scale, expected_fallback = reference_baseline(rewards, weights, group_size, leave_one_out)
    assert_close_to(baseline, expected, scale, rewards.dtype)
    assert num_fallback == expected_fallback


@SETTINGS
@given(batches())
def test_baseline_lies_within_the_range_of_its_set(batch):
    rewards, weights, group_size, leave_one_out = batch
    baseline, _ = gradient_weighted_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
    r = rewards.view(-1, group_size).double()
    for i, b in enumerate(baseline.double().tolist()):
        g, k = divmod(i, group_size)
        others = [x for j, x in enumerate(r[g].tolist()) if not (leave_one_out and j == k) and not math.isnan(x)]
        if not others:
            assert b == 0.0
            continue
        lo, hi = min(others), max(others)
        slack = RTOL[rewards.dtype] * max(abs(lo), abs(hi))
        assert lo - slack <= b <= hi + slack, f"sample {i}: baseline {b!r} outside [{lo!r}, {hi!r}]"


@SETTINGS
@given(batches(weight=st.one_of(magnitude(-15, 15), st.just(0.0), st.just(NAN))), st.integers(-12, 12),
       st.floats(1.0, 9.99))
def test_baseline_is_invariant_to_scaling_the_weights(batch, exponent, mantissa):
    rewards, weights, group_size, leave_one_out = batch
    c = mantissa * 10.0**exponent
    scaled = weights * c
    positive = torch.isfinite(weights) & (weights > 0)
    assume(bool(torch.all(scaled[positive] >= torch.finfo(weights.dtype).tiny)))  # stays a normal number
    baseline, nf = gradient_weighted_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
    baseline_c, nf_c = gradient_weighted_baseline(rewards, scaled, group_size, leave_one_out=leave_one_out)
    _, scale, _ = reference_baseline(rewards, weights, group_size, leave_one_out)
    assert nf == nf_c
    assert_close_to(baseline_c, baseline.double(), scale, rewards.dtype, f"c={c}:")


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_baseline_is_permutation_equivariant(batch, rnd):
    rewards, weights, group_size, leave_one_out = batch
    n_groups = rewards.numel() // group_size
    within = [rnd.sample(range(group_size), group_size) for _ in range(n_groups)]
    across = rnd.sample(range(n_groups), n_groups)
    index = torch.tensor([g * group_size + k for g in across for k in within[g]])
    baseline, nf = gradient_weighted_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
    permuted, nf_p = gradient_weighted_baseline(rewards[index], weights[index], group_size, leave_one_out=leave_one_out)
    _, scale, _ = reference_baseline(rewards, weights, group_size, leave_one_out)
    assert nf == nf_p
    assert_close_to(permuted, baseline[index].double(), scale[index], rewards.dtype)


@SETTINGS
@given(batches())
def test_mean_baseline_ignores_weights_and_is_unit_weighted(batch):
    rewards, weights, group_size, leave_one_out = batch
    baseline, nf = mean_baseline(rewards, weights, group_size, leave_one_out=leave_one_out)
    unit, nf_unit = gradient_weighted_baseline(rewards, torch.ones_like(rewards), group_size, leave_one_out)
    assert baseline.shape == rewards.shape and baseline.dtype == rewards.dtype
    assert torch.equal(baseline, unit) and nf == nf_unit
    expected, scale, expected_fallback = reference_baseline(rewards, torch.ones_like(rewards), group_size,
                                                            leave_one_out)
    assert_close_to(baseline, expected, scale, rewards.dtype)
    assert nf == expected_fallback  # with unit weights, only sets without a valid reward fall back


@SETTINGS
@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]), st.integers(2, 5),
       st.lists(st.integers(-100, 100), min_size=10, max_size=10), st.booleans())
def test_baseline_keeps_low_precision_reward_dtypes(dtype, group_size_half, ints, leave_one_out):
    rewards = torch.tensor([x / 8 for x in ints[: 2 * group_size_half]], dtype=dtype)
    weights = torch.linspace(0.5, 2.0, rewards.numel())  # float32 weights with half-precision rewards
    baseline, _ = gradient_weighted_baseline(rewards, weights, group_size_half, leave_one_out=leave_one_out)
    assert baseline.dtype == dtype and baseline.shape == rewards.shape and torch.isfinite(baseline).all()
    expected, scale, _ = reference_baseline(rewards, weights, group_size_half, leave_one_out)
    assert torch.all((baseline.double() - expected).abs() <= 1e-2 * scale + 1e-3)


def test_dominant_weight_sets_the_baseline_at_any_magnitude():
    """A crafted extreme-spread group (the 'wildly varying gradient norms' failure signature): the baseline of every
    other sample is the dominant completion's reward, finite even where w * r overflows float32 (1e30 * 1e10)."""
    for big, reward_scale in [(1e30, 1e10), (1e30, 1.0), (1e20, 1e15), (1.0, 1e-30)]:
        rewards = torch.tensor([1.0, 2.0, 3.0, 4.0]) * reward_scale
        weights = torch.tensor([big, big * 1e-12, big * 1e-12, big * 1e-12])
        baseline, nf = gradient_weighted_baseline(rewards, weights, 4, leave_one_out=True)
        assert nf == 0 and torch.isfinite(baseline).all(), (big, reward_scale, baseline)
        assert baseline[1:].tolist() == pytest.approx([reward_scale] * 3, rel=1e-6)
        assert float(baseline[0]) == pytest.approx(3.0 * reward_scale, rel=1e-6)  # the others: equal weights


def test_float64_weights_beyond_float32_range_still_weigh():
    """float64 weights with float32 rewards are not cast down first (1e300 -> inf would drop the dominant weight)."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    weights = torch.tensor([1e300, 1.0, 1.0, 1.0], dtype=torch.float64)
    baseline, nf = gradient_weighted_baseline(rewards, weights, 4, leave_one_out=True)
    assert baseline.dtype == torch.float32 and nf == 0
    assert baseline.tolist() == [3.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------------------------ SNR
nonneg = st.one_of(magnitude(), st.just(0.0))
sizes = st.integers(2, 1024)


@SETTINGS
@given(st.lists(nonneg, min_size=1, max_size=5), st.lists(nonneg, min_size=1, max_size=5), sizes,
       st.sampled_from([torch.float32, torch.float64]))
def test_snr_shape_dtype_and_range(ms, g2s, n, dtype):
    k = min(len(ms), len(g2s))
    m, g2 = torch.tensor(ms[:k], dtype=dtype), torch.tensor(g2s[:k], dtype=dtype)
    signal, noise = gradient_signal_noise(m, g2, n)
    snr = gradient_snr(m, g2, n)
    assert snr.shape == m.shape and snr.dtype == torch.float64 and signal.shape == noise.shape == m.shape
    assert not torch.isnan(snr).any() and (snr >= 0).all()
    # E ||gbar||^2 = ||grad J||^2 + tr(Sigma) / n, for the estimates too (up to cancellation in m - g2)
    err = (signal + noise / n - g2.double()).abs()
    assert torch.all(err <= 1e-12 * torch.maximum(m, g2).double()), err
    # inf exactly where the noise estimate is <= 0 and the signal > 0
    assert torch.equal(torch.isinf(snr), (noise <= 0) & (signal > 0))
    scale = snr_lr_scale(snr, n)
    assert scale.shape == m.shape and scale.dtype == torch.float64
    assert torch.all((scale >= 0) & (scale <= 1))


@SETTINGS
@given(nonneg, nonneg, sizes, magnitude(-20, 20))
def test_snr_is_scale_invariant(m, g2, n, c):
    torch.testing.assert_close(gradient_snr(c * m, c * g2, n), gradient_snr(m, g2, n), rtol=1e-9, atol=1e-300)


@SETTINGS
@given(st.lists(st.one_of(nonneg, st.just(INF)), min_size=2, max_size=20), sizes, sizes)
def test_lr_scale_is_monotonic_in_snr_and_n(snrs, n1, n2):
    snr = torch.tensor(sorted(snrs), dtype=torch.float64)
    scale = snr_lr_scale(snr, n1)
    assert torch.all((scale >= 0) & (scale <= 1))
    assert torch.all(scale[1:] >= scale[:-1]), (snr, scale)
    assert torch.all(scale[torch.isinf(snr)] == 1) and torch.all(scale[snr == 0] == 0)
    lo, hi = sorted((n1, n2))
    assert torch.all(snr_lr_scale(snr, hi) >= snr_lr_scale(snr, lo))


@pytest.mark.parametrize("bad", [-1e-30, -1.0, NAN])
def test_lr_scale_refuses_negative_or_nan_snr(bad):
    with pytest.raises(ValueError, match="snr"):
        snr_lr_scale(torch.tensor([0.5, bad]), 4)


@SETTINGS
@given(nonneg, nonneg, sizes)
def test_step_scale_equals_lr_scale_of_gradient_snr(sum_sq, g2, n):
    direct = step_scale_from_contributions(sum_sq, g2, n)
    via_snr = snr_lr_scale(gradient_snr(n * sum_sq, g2, n), n)
    assert 0.0 <= float(direct) <= 1.0
    assert float(direct) == pytest.approx(float(via_snr), abs=1e-9)


@SETTINGS
@given(st.lists(nonneg, min_size=1, max_size=6), st.lists(nonneg, min_size=1, max_size=6), sizes)
def test_step_scale_keeps_shapes(sums, g2s, n):
    k = min(len(sums), len(g2s))
    s, g2 = torch.tensor(sums[:k], dtype=torch.float32), torch.tensor(g2s[:k], dtype=torch.float32)
    out = step_scale_from_contributions(s, g2, n)
    assert out.shape == s.shape and out.dtype == torch.float64 and torch.isfinite(out).all()
    torch.testing.assert_close(out, snr_lr_scale(gradient_snr(n * s.double(), g2, n), n), rtol=0, atol=1e-9)


def test_snr_functions_with_infinite_inputs():
    """An infinite sample norm is all noise (SNR 0); an infinite contribution sum gives scale 0."""
    assert float(gradient_snr(INF, 1.0, 4)) == 0.0
    assert float(step_scale_from_contributions(INF, 1.0, 4)) == 0.0
    assert float(snr_lr_scale(INF, 4)) == 1.0
    for fn in (gradient_snr, gradient_signal_noise, step_scale_from_contributions):
        with pytest.raises(ValueError, match="n >= 2"):
            fn(1.0, 1.0, 1)
