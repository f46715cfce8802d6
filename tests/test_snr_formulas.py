"""The SNR estimators of `oblr_trl.snr_formulas` against Monte Carlo on synthetic gradients with a known SNR.

A step's samples are ``H_q = mu + eps_q`` (``q = 1..N``, ``eps ~ N(0, I_d)``), so the single-sample estimator
``g_q = N H_q`` has ``SNR = ||mu||^2 / d`` and Theorem 4's true factor is ``N SNR / (1 + N SNR)``. Each test feeds an
estimator a long stationary stream of ``(sum_q ||H_q||^2, ||sum_q H_q||^2)`` and measures the bias, the spread and
the fraction of steps at scale 0 of its factor.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from oblr_trl import OBLRPOConfig
from oblr_trl.snr_formulas import (
    CALIBRATION_STEPS,
    MAX_LR_MULTIPLE,
    Calibration,
    SNRDecision,
    SNRState,
    calibrated_multiplier,
    expected_positive_part,
    scale_from_signal_noise,
    snr_step_size,
    step_scale_from_contributions,
    step_signal_noise,
    step_signal_se,
)

KW = {"per_step": {}, "ema": {"beta": 0.9}, "ema_soft": {"beta": 0.9}, "window": {"window": 10}}


def stream(n: int, snr: float, d: int, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mu = np.zeros(d)
    mu[0] = math.sqrt(snr * d)
    for _ in range(steps):
        h = mu + rng.standard_normal((n, d))
        yield float((h**2).sum()), float((h.sum(0) ** 2).sum())


def scales(estimator: str, n: int, snr: float, d: int, steps: int, burn_in: int = 40, seed: int = 0) -> np.ndarray:
    state, out = None, []
    for t, (sum_sq, g2) in enumerate(stream(n, snr, d, steps, seed)):
        decision, state = snr_step_size(estimator, sum_sq, g2, n, state, **KW[estimator])
        assert math.isfinite(decision.scale) and 0.0 <= decision.scale <= 1.0
        if t >= burn_in:
            out.append(decision.scale)
    return np.array(out)


def true_scale(n: int, snr: float) -> float:
    return n * snr / (1 + n * snr)


def test_per_step_is_the_papers_formula():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(2, 20))
        h = rng.standard_normal((n, 5)) + rng.standard_normal(5) * rng.uniform(0, 2)
        sum_sq, g2 = float((h**2).sum()), float((h.sum(0) ** 2).sum())
        decision, _ = snr_step_size("per_step", sum_sq, g2, n)
        assert decision.scale == pytest.approx(float(step_scale_from_contributions(sum_sq, g2, n)), abs=1e-12)


def test_step_signal_and_noise_are_unbiased():
    n, snr, d = 8, 0.05, 10
    est = np.array([step_signal_noise(s, g, n) for s, g in stream(n, snr, d, 40000)])
    # g_q = n H_q: ||grad J||^2 = n^2 ||mu||^2 = n^2 snr d, tr Sigma_g = n^2 d
    assert est[:, 0].mean() == pytest.approx(n**2 * snr * d, rel=0.05)
    assert est[:, 1].mean() == pytest.approx(n**2 * d, rel=0.02)
    assert (est[:, 0] < 0).mean() > 0.25  # the per-step signal is below 0 on many steps: what clipping turns into 0


def test_pooled_estimators_stop_skipping_steps_at_the_demos_operating_point():
    """N = 8 prompts, SNR 0.02 (the demo's logged mean SNR; true factor 0.138), a low-rank gradient (d = 10): the
    paper's per-step factor is 0 on ~40% of steps and biased up; the pooled estimators are nearly unbiased, with a
    fraction of the zeros and a smaller spread."""
    n, snr, d, steps = 8, 0.02, 10, 20000
    truth = true_scale(n, snr)
    per_step, ema, window = (scales(e, n, snr, d, steps) for e in ("per_step", "ema", "window"))
    assert (per_step == 0).mean() > 0.35
    assert per_step.mean() > 1.2 * truth  # clipping a ratio of noisy estimates biases it up
    for pooled, zero_at_most in ((ema, 0.12), (window, 0.2)):
        assert pooled.mean() == pytest.approx(truth, rel=0.08)
        assert (pooled == 0).mean() < zero_at_most
        assert pooled.std() < 0.6 * per_step.std()


def test_soft_ema_never_skips_and_stays_close():
    """``"ema_soft"`` at the same operating point: no step at scale 0, bias within 10%; with no signal at all (SNR 0)
    it keeps a small step, less than half what the paper's clipped per-step estimate averages there."""
    n, d = 8, 10
    soft = scales("ema_soft", n, 0.02, d, 20000)
    assert (soft == 0).mean() == 0.0
    assert soft.mean() == pytest.approx(true_scale(n, 0.02), rel=0.1)
    assert soft.std() < 0.6 * scales("per_step", n, 0.02, d, 20000).std()
    no_signal, paper = scales("ema_soft", n, 0.0, d, 20000), scales("per_step", n, 0.0, d, 20000)
    assert (no_signal == 0).mean() == 0.0 and no_signal.mean() < paper.mean() / 2


def test_expected_positive_part_against_monte_carlo():
    rng = np.random.default_rng(3)
    for mean, se in ((0.0, 1.0), (1.5, 0.5), (-2.0, 1.0), (0.3, 2.0)):
        draws = rng.normal(mean, se, 400000)
        assert expected_positive_part(mean, se) == pytest.approx(np.maximum(draws, 0).mean(), rel=0.01, abs=1e-3)
    assert expected_positive_part(-1.0, 0.0) == 0.0 and expected_positive_part(2.0, 0.0) == 2.0


def test_pooled_estimators_with_a_high_dimensional_gradient_almost_never_skip():
    n, snr, d = 8, 0.02, 100
    for estimator in ("ema", "ema_soft", "window"):
        s = scales(estimator, n, snr, d, 5000)
        assert (s == 0).mean() < 0.01
        assert s.mean() == pytest.approx(true_scale(n, snr), rel=0.05)


def test_two_samples_per_step_are_defined_and_less_biased_when_pooled():
    """N = 2 is the smallest N with an estimate; every estimator is biased up there (a ratio of estimates from one
    degree of freedom), the pooled ones far less than the paper's."""
    n, snr, d = 2, 0.02, 10
    truth = true_scale(n, snr)
    bias = {e: scales(e, n, snr, d, 20000).mean() - truth for e in KW}
    assert bias["per_step"] > 0.1
    for pooled in ("ema", "ema_soft", "window"):
        assert 0 <= bias[pooled] < bias["per_step"] / 2, bias


def test_a_strong_signal_gives_a_factor_near_one():
    n, snr, d = 8, 5.0, 10
    for estimator in KW:
        assert scales(estimator, n, snr, d, 300).mean() == pytest.approx(true_scale(n, snr), abs=0.02)


def test_ema_is_bias_corrected_from_the_first_step():
    """Constant inputs: the bias-corrected EMA equals the per-step estimate at every step (an uncorrected,
    zero-initialised EMA would start at 0.1x it and skip the first steps)."""
    state = None
    for _ in range(5):
        ema, state = snr_step_size("ema", 3.0, 10.0, 8, state, beta=0.9)
        per_step, _ = snr_step_size("per_step", 3.0, 10.0, 8)
        assert ema.scale == pytest.approx(per_step.scale, rel=1e-12) and ema.scale > 0
    soft = None  # constant inputs have no spread across steps: from the second step on the soft EMA is the EMA
    for step in range(5):
        decision, soft = snr_step_size("ema_soft", 3.0, 10.0, 8, soft, beta=0.9)
        if step == 0:  # no history: the first step's own standard error (step_signal_se) lifts the signal a little
            se = step_signal_se(decision.step_signal, decision.step_noise, 8)
            assert se > 0 and decision.step_signal < decision.signal <= decision.step_signal + 0.4 * se
            assert decision.signal == pytest.approx(expected_positive_part(decision.step_signal, se), rel=1e-12)
        else:
            assert decision.scale == pytest.approx(per_step.scale, rel=1e-9)


def test_window_pools_exactly_the_last_steps():
    inputs = [(3.0, 10.0), (5.0, 4.0), (2.0, 9.0), (4.0, 30.0)]
    state = None
    for sum_sq, g2 in inputs:
        decision, state = snr_step_size("window", sum_sq, g2, 8, state, window=2)
    (s1, v1), (s2, v2) = (step_signal_noise(s, g, 8) for s, g in inputs[-2:])
    assert decision.signal == pytest.approx((s1 + s2) / 2) and decision.noise == pytest.approx((v1 + v2) / 2)
    assert decision.scale == pytest.approx(scale_from_signal_noise((s1 + s2) / 2, (v1 + v2) / 2, 8)[0])


@pytest.mark.parametrize("estimator", list(KW))
def test_degenerate_input_gives_defined_factors_and_leaves_the_state(estimator):
    kw = KW[estimator]
    _, state = snr_step_size(estimator, 3.0, 10.0, 8, None, **kw)
    zero, after_zero = snr_step_size(estimator, 0.0, 0.0, 8, state, **kw)  # zero gradients: no signal, no evidence
    assert (zero.scale, zero.snr, zero.status, after_zero) == (0.0, 0.0, "zero_gradient", state)
    assert snr_step_size(estimator, 0.0, 0.0, 8, state, lr_scale_min=0.05, **kw)[0].scale == 0.05
    overflow, same = snr_step_size(estimator, 1e308, 1e308, 8, state, **kw)  # n * sum_sq overflows: not an estimate
    assert (overflow.status, same) == ("nonfinite_grad", state)
    for bad in (math.inf, math.nan):
        for args in ((3.0, bad), (bad, 10.0)):
            d, same = snr_step_size(estimator, *args, 8, state, lr_scale_min=0.05, **kw)
            assert (d.scale, d.status, same) == (0.05, "nonfinite_grad", state) and math.isnan(d.snr)
    for n in (0, 1):
        d, same = snr_step_size(estimator, 3.0, 10.0, n, state, **kw)
        assert (d.scale, d.status, same) == (1.0, "few_samples", state)
    noiseless, _ = snr_step_size(estimator, 1.0, 8.0**2, 8, None, **kw)  # 8 identical samples: noise estimate 0
    assert (noiseless.scale, noiseless.snr) == (1.0, math.inf)


def test_the_state_survives_json():
    state = None
    for sum_sq, g2 in stream(8, 0.05, 10, 12):
        _, state = snr_step_size("window", sum_sq, g2, 8, state, window=5)
        _, state = snr_step_size("ema_soft", sum_sq, g2, 8, state, beta=0.9)
    again = SNRState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state
    for estimator in ("ema", "ema_soft", "window"):
        a, _ = snr_step_size(estimator, 3.0, 10.0, 8, state, **KW[estimator])
        b, _ = snr_step_size(estimator, 3.0, 10.0, 8, again, **KW[estimator])
        assert a == b


@pytest.mark.parametrize(("options", "match"), [
    ({"snr_estimator": "median"}, r"OBLRPOConfig\.snr_estimator='median'.*allowed values"),
    ({"snr_estimator": "window", "snr_window": 0}, r"OBLRPOConfig\.snr_window=0"),
    ({"snr_ema": 1.0}, r"OBLRPOConfig\.snr_ema=1\.0"),
])
def test_bad_estimator_options_fail_at_construction(options, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        OBLRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **options)


def test_lr_stats_record_means_and_round_trip():
    """The running statistics behind oblr/lr_mean, oblr/lr_scale_mean and oblr/skipped_fraction, against the plain
    means of the steps, and through the checkpoint's JSON."""
    import json

    from oblr_trl.snr_formulas import LrStats

    assert LrStats().metrics() == {}
    scales = [0.5, 0.0, 0.25, 1.0]
    lrs = [1e-3 * s for s in scales]
    stats = LrStats()
    for scale, lr in zip(scales, lrs):
        stats = stats.record(scale, lr)
    metrics = stats.metrics()
    assert metrics["lr_mean"] == pytest.approx(sum(lrs) / 4)
    assert metrics["lr_scale_mean"] == pytest.approx(sum(scales) / 4)
    assert metrics["skipped_fraction"] == 0.25
    assert LrStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats


@pytest.mark.parametrize("estimator", list(KW))
def test_a_zero_gradient_step_after_an_informative_one_is_not_given_its_scale(estimator):
    """issue 46: under the EMAs a flat step averaged in as (signal 0, noise 0) kept the previous steps' ratio, so it
    went on at the earlier scale (~0.25 here) without a word; now its scale is 0 under every estimator, the state is
    kept as it was, and the next informative step continues from it."""
    kw = KW[estimator]
    first, state = snr_step_size(estimator, 3.0, 10.0, 8, None, **kw)
    assert first.scale > 0.2
    flat, kept = snr_step_size(estimator, 0.0, 0.0, 8, state, **kw)
    assert (flat.scale, flat.status, kept) == (0.0, "zero_gradient", state)
    again, _ = snr_step_size(estimator, 3.0, 10.0, 8, kept, **kw)
    assert again == snr_step_size(estimator, 3.0, 10.0, 8, state, **kw)[0]


def test_the_noise_scale_is_one_over_the_snr_in_samples_and_the_factor_is_n_over_n_plus_it():
    from oblr_trl.snr_formulas import gradient_noise_scale

    for estimator, kw in KW.items():
        state = None
        for sum_sq, g2 in stream(8, 0.1, 50, 30):
            d, state = snr_step_size(estimator, sum_sq, g2, 8, state, **kw)
            if d.status == "ok":
                assert d.noise_scale == pytest.approx(1 / d.snr)
                assert d.scale == pytest.approx(8 / (8 + d.noise_scale))  # Theorem 4's factor, N / (N + B)
            else:
                assert math.isnan(d.noise_scale)
    # McCandlish's B = tr Sigma / ||grad J||^2 on a known gradient: SNR 0.1 per sample gives B = 10 samples
    assert gradient_noise_scale(0.1, 1.0) == pytest.approx(10.0)


@pytest.mark.parametrize("estimator", list(KW))
def test_the_noise_scale_is_finite_or_undefined_never_inf(estimator):
    """Where the signal estimate is <= 0 the noise scale is unbounded: NaN (the trainer then logs nothing), never inf;
    a step of pure signal (noise estimate <= 0) has noise scale 0."""
    from oblr_trl.snr_formulas import gradient_noise_scale

    kw = KW[estimator]
    assert math.isnan(gradient_noise_scale(0.0, 1.0)) and math.isnan(gradient_noise_scale(-1.0, 1.0))
    assert math.isnan(gradient_noise_scale(5e-324, 1e300))  # overflows: undefined, not inf
    assert math.isnan(gradient_noise_scale(math.nan, 1.0)) and math.isnan(gradient_noise_scale(1.0, math.inf))
    assert gradient_noise_scale(2.0, -1.0) == 0.0
    _, state = snr_step_size(estimator, 3.0, 10.0, 8, None, **kw)
    degenerate = [snr_step_size(estimator, 0.0, 0.0, 8, state, **kw)[0],  # zero gradient
                  snr_step_size(estimator, 3.0, math.inf, 8, state, **kw)[0],  # non-finite
                  snr_step_size(estimator, 3.0, 10.0, 1, state, **kw)[0]]  # fewer than 2 samples
    assert all(math.isnan(d.noise_scale) for d in degenerate)
    noiseless, _ = snr_step_size(estimator, 1.0, 8.0**2, 8, None, **kw)
    assert noiseless.noise_scale == 0.0
    if estimator != "ema_soft":  # a signal estimate below 0: the step's scale is 0 and its noise scale unbounded
        negative, _ = snr_step_size(estimator, 4.0, 0.0, 4, None, **kw)
        assert negative.status == "zero_snr" and math.isnan(negative.noise_scale)


# ------------------------------------------------------------------ the calibrated mode (snr_lr_mode="calibrated")
def decision(factor: float, status: str = "ok", scale: float | None = None) -> SNRDecision:
    nan = math.nan
    return SNRDecision(factor if scale is None else scale, nan, 8, nan, nan, nan, nan, status, factor)


def multipliers(factors, calibration=None, **kw):
    calibration, out = calibration or Calibration(), []
    for f in factors:
        m, calibration = calibrated_multiplier(f if isinstance(f, SNRDecision) else decision(f), calibration, **kw)
        out.append(m)
    return out, calibration


def test_calibrated_multiplier_applies_the_scheduled_lr_while_calibrating_then_f_over_the_frozen_mean():
    """Brute force: the first K steps apply m = 1 (exactly the scheduled lr) while f_ref = mean(f_1..f_K) is measured;
    then m_t = min(f_t / f_ref, cap), f_ref frozen, so a fading factor still shrinks the step."""
    rng = np.random.default_rng(0)
    factors = list(rng.uniform(0.05, 0.6, CALIBRATION_STEPS)) + [0.9, 0.3, 0.1, 0.03, 0.01]
    got, calibration = multipliers(factors)
    f_ref = float(np.mean(factors[:CALIBRATION_STEPS]))
    assert got[:CALIBRATION_STEPS] == [1.0] * CALIBRATION_STEPS
    for t in range(CALIBRATION_STEPS, len(factors)):
        assert got[t] == pytest.approx(min(factors[t] / f_ref, MAX_LR_MULTIPLE), rel=1e-12)
    assert calibration.steps == CALIBRATION_STEPS and calibration.reference == pytest.approx(f_ref, rel=1e-12)
    assert got[-5] == MAX_LR_MULTIPLE and got[-4] > got[-3] > got[-2] > got[-1] > 0  # capped; fading: shorter


def test_calibrated_multiplier_keeps_the_ordering_and_is_capped():
    """After calibration, a noisier step (smaller f) is never longer (Theorem 4's ordering); no step applies more
    than MAX_LR_MULTIPLE x the scheduled lr, however clean."""
    _, calibration = multipliers([0.1] * CALIBRATION_STEPS)
    grid = np.linspace(0.0, 1.0, 101)
    steps = [calibrated_multiplier(decision(f), calibration)[0] for f in grid]
    assert all(a <= b for a, b in zip(steps, steps[1:])) and max(steps) == MAX_LR_MULTIPLE and steps[0] == 0.0
    assert calibrated_multiplier(decision(0.15), calibration)[0] == pytest.approx(1.5)
    assert calibrated_multiplier(decision(0.9), calibration, cap=3.0)[0] == 3.0


def test_calibration_starts_at_the_first_positive_factor_and_zero_gives_zero():
    """f_ref = 0 (no positive factor yet, e.g. the paper's per-step estimate clipped at 0): the step applies
    lr_scale_min (0 by default: f = 0 gives 0, warned as zero_snr by the trainer), and the calibration has not started.
    A zero factor during calibration counts (it is an estimate) and applies 0; after it, 0 gives 0."""
    got, calibration = multipliers([decision(0.0, "zero_snr"), decision(0.0, "zero_snr"), 0.3, 0.0, 0.3, 0.3], steps=3)
    assert got == [0.0, 0.0, 1.0, 0.0, 1.0, pytest.approx(0.3 / 0.2)] and calibration == Calibration(3, 0.6)
    assert calibrated_multiplier(decision(0.0, "zero_snr"), calibration)[0] == 0.0
    floored, _ = multipliers([decision(0.0, "zero_snr", scale=0.05)], lr_scale_min=0.05)
    assert floored == [0.05]


@pytest.mark.parametrize("status, scale", [("few_samples", 1.0), ("zero_gradient", 0.0), ("nonfinite_grad", 0.0)])
def test_degenerate_steps_do_not_count_and_take_the_decision_s_own_scale(status, scale):
    _, calibration = multipliers([0.2, 0.4])
    m, after = calibrated_multiplier(decision(math.nan, status, scale=scale), calibration)
    assert m == scale and after == calibration


def test_ema_soft_first_step_is_not_clipped_to_zero_for_want_of_history():
    """A first step whose own signal estimate is below 0 (noise dominates) kept scale 0 under "ema_soft" (no spread
    yet, se = 0); its own samples bound the standard error now, so the step moves, less than a clear step would."""
    sum_sq, n = 1.0, 4  # ||G||^2 = 0.9 < sum_sq: a negative signal estimate, a positive noise estimate
    step_s, step_v = step_signal_noise(sum_sq, 0.9, n)
    assert step_s < 0 < step_v
    soft, _ = snr_step_size("ema_soft", sum_sq, 0.9, n, beta=0.9)
    paper, _ = snr_step_size("per_step", sum_sq, 0.9, n)
    clear, _ = snr_step_size("ema_soft", 1.0, 3.9, n, beta=0.9)
    assert paper.scale == 0.0 and 0.0 < soft.scale < clear.scale and soft.status == "ok"
    se = step_signal_se(step_s, step_v, n)
    assert soft.signal == pytest.approx(expected_positive_part(step_s, se), rel=1e-12)
