"""The SNR step size (Theorem 4) with a choice of SNR estimator, as pure functions over a small state.

The paper sizes step ``t`` by ``N SNR_t / (1 + N SNR_t)`` with ``SNR_t`` estimated from step ``t``'s own ``N``
samples (``"per_step"``). Its signal estimate ``||grad J||^2 ~ (N ||gbar||^2 - m) / (N - 1)`` is unbiased but, at
the small ``N`` of a step (8 prompts on the demo), its noise is larger than its mean when the SNR is low: it falls
below 0 on about half the steps, the SNR is clipped to 0, and those steps do not move at all (136 of 300 on the
demo, the "learning-rate collapse" the paper warns about). The ratio ``N SNR / (1 + N SNR)`` of two noisy
estimates is also biased.

The remedy (McCandlish et al. 2018, App. A) is to average the signal and the noise estimates *separately* over
more samples than one step, and divide only then:

* ``"ema"``: exponential moving averages of both, zero-initialised and bias-corrected as Adam does
  (``m_t / (1 - beta^t)``), so the first step uses its own estimate and no step is biased toward 0 by the
  initialisation. Effective window ``(1 + beta) / (1 - beta)`` steps (19 at ``beta = 0.9``).
* ``"ema_soft"``: ``"ema"``, with the signal's clipping at 0 replaced by its expected positive part
  ``E[max(S, 0)]`` for ``S ~ Normal(s_hat, se^2)``, ``se`` the standard error of the averaged signal (from an EMA of
  its square): the estimate of ``max(signal, 0)`` that minimises the squared error under a flat prior. Equal to
  ``"ema"`` where the signal is clearly positive (``s_hat >> se``); where the averaged signal is indistinguishable
  from 0 it keeps a small step (``~0.4 se``) instead of none. Biased up by at most ``0.4 se`` in the signal. So it
  never reports a zero SNR while the step estimates vary (``se > 0``): a step can shrink toward 0 (``se`` falls as
  the estimates settle) without ever being 0. What says so is the trainer's stall warning: the scale below
  ``STALL_SCALE`` (1%) for ``STALL_STEPS`` (10) steps in a row (:class:`LrStats`), under every estimator.
* ``"window"``: the plain mean over the last ``window`` steps (a pooled estimate from ``window * N`` samples).
* ``"per_step"``: the paper's, this step only.

Every estimator returns the same :class:`SNRDecision`; the state (:class:`SNRState`) is plain floats, carried from
step to step by the trainer and saved with each checkpoint (``to_dict`` / ``from_dict``). The estimators are
registered by name in ``SNR_ESTIMATORS`` (:func:`register_snr_estimator`; ``OBLRPOConfig.snr_estimator`` selects
one, and :func:`snr_step_size` calls it from there).

The formulas exist once, here: :func:`step_signal_noise` (the unbiased per-step estimates) and
:func:`scale_from_signal_noise` (the SNR and Theorem 4's factor), which the trainer's :func:`snr_step_size` runs.
The public :func:`gradient_signal_noise`, :func:`gradient_snr`, :func:`snr_lr_scale` and
:func:`step_scale_from_contributions` (exported by :mod:`oblr_trl`) write them in
the paper's parameterization and call them, so their Monte Carlo tests test the trainer's code.

The per-step estimates are in the units of the single-sample estimator ``g_q = N H_q`` (``||grad J||^2`` and
``tr Sigma_g``). Under TRL's losses (a mean over the batch) ``H_q`` scales as ``1/N``, so these are the same
quantities at every ``N`` and may be averaged across steps of different size; the factor then uses this step's
``N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .registry import Registry

# name -> ``(signal, noise, state, *, beta, window, n) -> (signal, noise, new_state)``: this step's estimates averaged
# over steps as the estimator does (selected by ``OBLRPOConfig.snr_estimator``; :func:`register_snr_estimator`)
SNR_ESTIMATORS = Registry("snr_estimator", "SNR estimator")
register_snr_estimator = SNR_ESTIMATORS.register


@dataclass(frozen=True)
class SNRState:
    """What an SNR estimator carries across optimizer steps (all plain floats: JSON-serialisable).

    ``steps``: steps that updated the state; ``signal`` / ``noise``: the zero-initialised EMAs (``"ema"``);
    ``recent``: the last steps' ``(signal, noise)`` estimates, newest last (``"window"``).
    """

    steps: int = 0
    signal: float = 0.0
    noise: float = 0.0
    signal_sq: float = 0.0
    recent: tuple[tuple[float, float], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "signal": self.signal, "noise": self.noise, "signal_sq": self.signal_sq,
                "recent": [list(x) for x in self.recent]}

    @classmethod
    def from_dict(cls, d: dict) -> "SNRState":
        return cls(int(d["steps"]), float(d["signal"]), float(d["noise"]), float(d.get("signal_sq", 0.0)),
                   tuple((float(s), float(n)) for s, n in d.get("recent", ())))


# A step whose applied lr is below STALL_SCALE of the scheduled one (learning_rate at that point of the schedule) barely
# moves the model; STALL_STEPS such steps in a row are warned (the schedule's own warmup and decay do not count).
STALL_SCALE = 0.01
STALL_STEPS = 10


@dataclass(frozen=True)
class LrStats:
    """Running statistics of the applied step over a run (JSON-serialisable, saved with checkpoints): steps sized,
    steps at scale 0, the sums behind the mean applied lr and the mean scale, and ``low_streak``, the steps in a row
    (up to the last) whose scale was below ``STALL_SCALE``."""

    steps: int = 0
    skipped: int = 0
    lr_sum: float = 0.0
    scale_sum: float = 0.0
    low_streak: int = 0

    def record(self, scale: float, lr: float) -> "LrStats":
        """The statistics after one more step of ``scale`` (the SNR factor) applied as learning rate ``lr``."""
        return LrStats(self.steps + 1, self.skipped + int(scale == 0.0), self.lr_sum + lr, self.scale_sum + scale,
                       self.low_streak + 1 if scale < STALL_SCALE else 0)

    @property
    def stalled(self) -> bool:
        """Whether the last ``STALL_STEPS`` steps or more all had a scale below ``STALL_SCALE``."""
        return self.low_streak >= STALL_STEPS

    def metrics(self) -> dict[str, float]:
        """``lr_mean``, ``lr_scale_mean``, ``skipped_fraction`` over the steps so far (empty before the first)."""
        if not self.steps:
            return {}
        return {"lr_mean": self.lr_sum / self.steps, "lr_scale_mean": self.scale_sum / self.steps,
                "skipped_fraction": self.skipped / self.steps}

    def to_dict(self) -> dict:
        return {"steps": self.steps, "skipped": self.skipped, "lr_sum": self.lr_sum, "scale_sum": self.scale_sum,
                "low_streak": self.low_streak}

    @classmethod
    def from_dict(cls, d: dict) -> "LrStats":
        return cls(int(d.get("steps", 0)), int(d.get("skipped", 0)), float(d.get("lr_sum", 0.0)),
                   float(d.get("scale_sum", 0.0)), int(d.get("low_streak", 0)))


# ``OBLRPOConfig.snr_lr_mode="calibrated"``: learning_rate is the lr a user would give GRPO. The run's first
# CALIBRATION_STEPS sized steps apply it as scheduled while their mean factor f_ref is measured; after them each step
# applies f / f_ref of it (eta_max = learning_rate / f_ref), never more than MAX_LR_MULTIPLE x.
CALIBRATION_STEPS = 10
MAX_LR_MULTIPLE = 2.0
CALIBRATED_STATUSES = ("ok", "zero_snr")  # steps whose factor is an estimate of the SNR (and so count)


@dataclass(frozen=True)
class Calibration:
    """The calibrated mode's state (JSON-serialisable, saved with checkpoints): ``steps`` factors counted so far (at
    most ``CALIBRATION_STEPS``) and their sum. :attr:`reference` is their mean, ``f_ref``; 0 before the first."""

    steps: int = 0
    factor_sum: float = 0.0

    @property
    def reference(self) -> float:
        """``f_ref``, the mean factor of the counted steps (0 before any: uncalibrated)."""
        return self.factor_sum / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "factor_sum": self.factor_sum}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        return cls(int(d["steps"]), float(d["factor_sum"]))


def calibrated_multiplier(decision: "SNRDecision", calibration: Calibration, *, lr_scale_min: float = 0.0,
                          steps: int = CALIBRATION_STEPS, cap: float = MAX_LR_MULTIPLE) -> tuple[float, Calibration]:
    """``(m, new_calibration)``: the calibrated mode multiplies the scheduled lr by ``m``. ``f`` is this step's factor
    ``N SNR / (1 + N SNR)``, ``f_ref`` the mean factor over the run's first ``steps`` counted steps, and
    ``eta_max = scheduled lr / f_ref``.

    - Calibration (the first ``steps`` counted steps): each applies the scheduled lr (``m = 1``) while its factor is
      added to ``f_ref``, so those steps apply exactly the lr a user would give GRPO; a step whose factor is 0 applies
      0 (``lr_scale_min`` if set). A step counts when its factor is an estimate (status ``"ok"`` or ``"zero_snr"``,
      :data:`CALIBRATED_STATUSES`), from the first step whose factor is > 0.
    - After it, ``f_ref`` is frozen and ``m = max(min(f / f_ref, cap), lr_scale_min)``: a noisier step is shorter than
      a cleaner one (Theorem 4's ordering), a factor that fades later in the run shrinks the step with it, and no
      step applies more than ``cap`` x the scheduled lr.
    - Before the first positive factor (``f_ref = 0``: uncalibrated) every factor is 0, so the step applies
      ``lr_scale_min``.
    - Degenerate steps (``"few_samples"``, ``"zero_gradient"``, ``"nonfinite_grad"``) do not count and take the
      decision's own scale (1: the lr left as scheduled; or ``lr_scale_min``), as in the paper's reading.

    The factors are functions of all-reduced quantities, so every rank holds the same calibration and applies the
    same lr.
    """
    if decision.status not in CALIBRATED_STATUSES:
        return decision.scale, calibration
    factor = decision.factor
    if calibration.steps < steps and (calibration.steps > 0 or factor > 0.0):  # a calibration step
        calibration = Calibration(calibration.steps + 1, calibration.factor_sum + factor)
        return (1.0 if factor > 0.0 else lr_scale_min), calibration
    reference = calibration.reference
    if not reference > 0.0:
        return lr_scale_min, calibration
    return max(min(factor / reference, cap), lr_scale_min), calibration


@dataclass(frozen=True)
class SNRDecision:
    """One optimizer step's step-size decision: ``scale`` multiplies the scheduled lr.

    ``signal`` / ``noise``: the estimates of ``||grad J||^2`` and ``tr Sigma`` the scale was formed from (after
    averaging, before clipping at 0; NaN when undefined), ``step_signal`` / ``step_noise`` this step's own.
    ``snr`` is NaN where undefined. ``status``: ``"ok"``, ``"zero_snr"`` (the averaged signal is <= 0: scale 0 before
    the floor), ``"zero_gradient"`` (the step's gradient and every sample's share of it are exactly 0: scale 0 before
    the floor, state unchanged), ``"few_samples"`` (fewer than 2 samples: lr left unscaled, state unchanged),
    ``"nonfinite_grad"`` (a non-finite gradient norm or estimate: scale floored, state unchanged).
    :attr:`noise_scale` is ``1/SNR`` in samples (:func:`gradient_noise_scale`).
    """

    scale: float
    snr: float
    n: int
    signal: float
    noise: float
    step_signal: float
    step_noise: float
    status: str
    factor: float = math.nan  # N SNR / (1 + N SNR) before lr_scale_min's floor ("ok" and "zero_snr" steps)

    @property
    def noise_scale(self) -> float:
        """The gradient noise scale ``tr Sigma / ||grad J||^2`` in samples (:func:`gradient_noise_scale` of
        :attr:`noise` and :attr:`signal`); NaN where it is undefined."""
        return gradient_noise_scale(self.signal, self.noise)


def step_signal_noise(sum_sq, grad_sq_norm, n: int):
    """Unbiased estimates of ``||grad J||^2`` and ``tr Sigma`` from one step (McCandlish et al. 2018, App. A).

    ``sum_sq = sum_q ||H_q||^2`` over the step's ``n >= 2`` samples, ``grad_sq_norm = ||G||^2``, ``G = sum_q H_q``.
    With ``g_q = n H_q`` (mean ``G``, ``mean_q ||g_q||^2 = n sum_sq``): signal ``n (||G||^2 - sum_sq) / (n - 1)``,
    noise ``n (n sum_sq - ||G||^2) / (n - 1)``. Not clipped: the signal is negative on steps where noise dominates.
    Plain arithmetic: floats give floats (the trainer), tensors elementwise tensors (:func:`gradient_signal_noise`).
    """
    if n < 2:
        raise ValueError(f"step_signal_noise needs n >= 2 samples, got n={n}.")
    return n * (grad_sq_norm - sum_sq) / (n - 1), n * (n * sum_sq - grad_sq_norm) / (n - 1)


def scale_from_signal_noise(signal: float, noise: float, n: int) -> tuple[float, float]:
    """``(N SNR / (1 + N SNR), SNR)`` with ``SNR = max(signal, 0) / max(noise, 0)``; written as
    ``N s / (N s + v)`` so it is 1 when only the noise is 0 (or the signal is infinite) and 0 (with SNR 0) when the
    signal is <= 0. Floats (the trainer's step); :func:`elementwise_scale` maps it over tensors."""
    s, v = max(signal, 0.0), max(noise, 0.0)
    if s == 0.0:
        return 0.0, 0.0
    snr = s / v if v > 0 else math.inf
    if s == math.inf:
        return 1.0, snr
    return n * s / (n * s + v), snr


def gradient_noise_scale(signal: float, noise: float) -> float:
    """McCandlish et al.'s (2018) simple noise scale ``B = tr Sigma / ||grad J||^2 = 1 / SNR``, in samples (prompts
    under ``snr_sample_unit="group"``): the batch size at which a step's noise equals its signal, so Theorem 4's
    factor is ``N / (N + B)`` (one half at ``N = B``).

    ``max(noise, 0) / signal`` where the signal estimate is > 0 (0 when the noise estimate is <= 0: a step of pure
    signal). NaN where it is undefined or unbounded: a signal estimate <= 0 (the ``"zero_snr"`` step, scale 0), a
    non-finite estimate, or a ratio that overflows. The trainer logs no ``oblr/noise_scale`` for such a step: never
    ``inf`` or NaN in the logs.
    """
    if not (signal > 0 and math.isfinite(signal) and math.isfinite(noise)):
        return math.nan
    ratio = max(noise, 0.0) / signal
    return ratio if math.isfinite(ratio) else math.nan


def elementwise_scale(signal, noise, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scale_from_signal_noise` at every element of the broadcast ``signal`` and ``noise`` (numbers or
    tensors): ``(scale, snr)`` as float64 tensors of their shape, on their device: the same floats as the trainer's
    step, one element at a time (about a microsecond each; a step has one, a Monte Carlo test 20,000)."""
    s, v = torch.broadcast_tensors(torch.as_tensor(signal, dtype=torch.float64),
                                   torch.as_tensor(noise, dtype=torch.float64))
    pairs = [scale_from_signal_noise(a, b, n) for a, b in zip(s.reshape(-1).tolist(), v.reshape(-1).tolist())]
    out = torch.tensor(pairs, dtype=torch.float64).reshape(*s.shape, 2).to(s.device)
    return out[..., 0], out[..., 1]


# ----------------------------------------------------- the same formulas in the batch parameterization (public)
# ``m = mean_i ||g_i||^2`` over ``n`` single-sample estimates and ``||gbar||^2`` (the batch's squared norm), as the
# paper writes them. ``m = n sum_sq`` and ``gbar = G`` turn them into the step's quantities above, which these call:
# the formulas exist once, and the Monte Carlo tests (``tests/test_estimators_montecarlo.py``) test the code the
# trainer runs. Exported by :mod:`oblr_trl` under these names as the same function objects.
def gradient_signal_noise(mean_sample_sq_norm, batch_sq_norm, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased estimates of ``||grad J||^2`` and ``tr(Sigma)`` (McCandlish et al. 2018, App. A), not clipped.

    From ``m = mean_i ||g_i||^2`` over ``n`` i.i.d. single-sample estimates ``g_i`` and the squared norm of their
    mean ``||gbar||^2``: ``||grad J||^2 ~ (n ||gbar||^2 - m) / (n - 1)`` and ``tr Sigma ~ n (m - ||gbar||^2) / (n - 1)``
    (float64 tensors; :func:`step_signal_noise` at ``sum_sq = m / n``).
    """
    if n < 2:
        raise ValueError(f"gradient_snr needs n >= 2 samples, got n={n}.")
    m = torch.as_tensor(mean_sample_sq_norm, dtype=torch.float64)
    return step_signal_noise(m / n, torch.as_tensor(batch_sq_norm, dtype=torch.float64), n)


def snr_from_signal_noise(signal, noise) -> torch.Tensor:
    """``max(signal, 0) / max(noise, 0)``; ``inf`` when only the noise is 0, 0 when the signal is <= 0: the SNR of
    :func:`scale_from_signal_noise` (which does not depend on ``n``)."""
    return elementwise_scale(signal, noise, 2)[1]


def gradient_snr(mean_sample_sq_norm, batch_sq_norm, n: int) -> torch.Tensor:
    """SNR of the single-sample gradient estimator, ``SNR_t = ||grad J||^2 / tr(Sigma)`` (Theorem 4).

    Both parts from :func:`gradient_signal_noise` (``m = mean_i ||g_i||^2`` over ``n`` samples, ``||gbar||^2`` the
    squared norm of their mean), each clipped at 0. Returns ``inf`` when the noise estimate is 0 and the signal is
    positive, 0 when the signal is <= 0.
    """
    return elementwise_scale(*gradient_signal_noise(mean_sample_sq_norm, batch_sq_norm, n), n)[1]


def snr_lr_scale(snr, n: int) -> torch.Tensor:
    """Step-size factor of Theorem 4: ``eta_t / eta_max = N SNR_t / (1 + N SNR_t)`` (1 for an infinite SNR): the
    factor of :func:`scale_from_signal_noise` with signal ``SNR_t`` and noise 1 (float64 tensors)."""
    snr = torch.as_tensor(snr, dtype=torch.float64)
    if torch.any(snr < 0) or torch.any(torch.isnan(snr)):
        raise ValueError(f"snr must be >= 0 and not NaN, got {snr}.")
    return elementwise_scale(snr, 1.0, n)[0]


def step_scale_from_contributions(sum_sq_contributions, total_sq_norm, n: int) -> torch.Tensor:
    """Theorem 4's factor from the step's per-sample contributions ``h_i`` (``G = sum_i h_i``), with the SNR of
    this step only (``snr_estimator="per_step"``).

    With single-sample estimators ``g_i = n h_i`` and ``gbar = G``, ``snr_lr_scale(gradient_snr(m, ||G||^2, n), n)``
    simplifies to ``n / (n - 1) * (1 - sum_i ||h_i||^2 / ||G||^2)``, clipped to ``[0, 1]``: 1 when all ``h_i`` point
    the same way, 0 when they are orthogonal noise. ``G = 0`` gives 0 (no signal). Float64 tensors.
    """
    if n < 2:
        raise ValueError(f"step_scale_from_contributions needs n >= 2 samples, got n={n}.")
    s = torch.as_tensor(sum_sq_contributions, dtype=torch.float64)
    return elementwise_scale(*step_signal_noise(s, torch.as_tensor(total_sq_norm, dtype=torch.float64), n), n)[0]


# ---------------------------------------------------------------------------------------------- estimators
@register_snr_estimator("per_step")
def _per_step(signal: float, noise: float, state: SNRState, **_) -> tuple[float, float, SNRState]:
    return signal, noise, replace(state, steps=state.steps + 1)


@register_snr_estimator("ema")
def _ema(signal: float, noise: float, state: SNRState, *, beta: float, **_) -> tuple[float, float, SNRState]:
    t = state.steps + 1
    s = beta * state.signal + (1 - beta) * signal
    v = beta * state.noise + (1 - beta) * noise
    s2 = beta * state.signal_sq + (1 - beta) * signal**2
    correction = 1 - beta**t  # Adam's: the zero initialisation's weight beta^t removed
    return s / correction, v / correction, replace(state, steps=t, signal=s, noise=v, signal_sq=s2)


def expected_positive_part(mean: float, se: float) -> float:
    """``E[max(S, 0)]`` for ``S ~ Normal(mean, se^2)``: ``mean Phi(mean/se) + se phi(mean/se)`` (``max(mean, 0)`` at
    ``se = 0``)."""
    if not se > 0:
        return max(mean, 0.0)
    z = mean / se
    return mean * 0.5 * math.erfc(-z / math.sqrt(2)) + se * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def step_signal_se(signal: float, noise: float, n: int) -> float:
    """An upper bound on the standard error of one step's signal estimate, from that step's own estimates: what
    ``"ema_soft"`` uses on its first step, where no spread across steps exists yet.

    The signal estimate of :func:`step_signal_noise` is the U-statistic ``S = sum_{i != j} <g_i, g_j> / (n (n - 1))``
    of the ``n`` i.i.d. single-sample estimates ``g_i`` (mean ``mu``, covariance ``Sigma``; ``s = ||mu||^2``,
    ``v = tr Sigma``). Hoeffding's decomposition of an order-2 U-statistic with kernel ``h(x, y) = <x, y>`` gives
    ``Var S = 4 (n - 2) zeta_1 / (n (n - 1)) + 2 zeta_2 / (n (n - 1))`` with ``zeta_1 = Var <g_1, mu> = mu' Sigma mu``
    and ``zeta_2 = Var <g_1, g_2> = tr Sigma^2 + 2 mu' Sigma mu``. Bounding ``mu' Sigma mu <= s v`` (the largest
    eigenvalue of ``Sigma`` is at most its trace) and ``tr Sigma^2 <= v^2``:

        Var S <= 2 v^2 / (n (n - 1)) + 4 s v / n

    (equal when ``Sigma`` has rank one along ``mu``). Returned with the step's estimates plugged in, each clipped at 0
    (``max(signal, 0)``, ``max(noise, 0)``): ``sqrt(2 v^2 / (n (n - 1)) + 4 max(s, 0) v / n)``; 0 where ``n < 2``.
    Tested by Monte Carlo against the empirical spread of ``S`` (``tests/test_estimators_montecarlo.py``).
    """
    if n < 2:
        return 0.0
    s, v = max(signal, 0.0), max(noise, 0.0)
    return math.sqrt(2 * v * v / (n * (n - 1)) + 4 * s * v / n)


@register_snr_estimator("ema_soft")
def _ema_soft(signal: float, noise: float, state: SNRState, *, beta: float, n: int = 0,
              **_) -> tuple[float, float, SNRState]:
    s_hat, v_hat, state = _ema(signal, noise, state, beta=beta)
    t, correction = state.steps, 1 - beta**state.steps
    if t == 1:  # no history, so no spread across steps: the first step's own sampling error (step_signal_se)
        return expected_positive_part(s_hat, step_signal_se(signal, noise, n)), v_hat, state
    spread = max(state.signal_sq / correction - s_hat**2, 0.0)  # the EMA-weighted variance of the step estimates
    # variance of a bias-corrected EMA of t i.i.d. values: spread (1 - beta)(1 - beta^2t) / ((1 + beta)(1 - beta^t)^2)
    se = math.sqrt(spread * (1 - beta) * (1 - beta ** (2 * t)) / ((1 + beta) * correction**2))
    return expected_positive_part(s_hat, se), v_hat, state


@register_snr_estimator("window")
def _window(signal: float, noise: float, state: SNRState, *, window: int, **_) -> tuple[float, float, SNRState]:
    recent = (state.recent + ((signal, noise),))[-window:]
    return (sum(x[0] for x in recent) / len(recent), sum(x[1] for x in recent) / len(recent),
            replace(state, steps=state.steps + 1, recent=recent))


def check_estimator(estimator: str, beta: float = 0.9, window: int = 10) -> None:
    """Raise a ``ValueError`` naming the option for an unknown estimator or an out-of-range parameter."""
    SNR_ESTIMATORS.check(estimator)
    if estimator.startswith("ema") and not 0.0 <= beta < 1.0:
        raise ValueError(f"snr_ema={beta} must lie in [0, 1) for snr_estimator={estimator!r}.")
    if estimator == "window" and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"snr_window={window!r} must be an integer >= 1 for snr_estimator='window'.")


def snr_step_size(
    estimator: str, sum_sq: float, grad_sq_norm: float, n: int, state: SNRState | None = None, *,
    beta: float = 0.9, window: int = 10, lr_scale_min: float = 0.0,
) -> tuple[SNRDecision, SNRState]:
    """Theorem 4's step-size factor for one optimizer step, ``max(N SNR / (1 + N SNR), lr_scale_min)``, with
    ``SNR`` from ``estimator`` (``"per_step"``, ``"ema"`` with factor ``beta``, ``"window"`` of ``window`` steps).

    Args:
        sum_sq: ``sum_q ||H_q||^2`` over the step's ``n`` samples; grad_sq_norm: ``||G||^2``, ``G = sum_q H_q`` (the
            step's pre-clip gradient, all ranks).
        state: the previous step's :class:`SNRState` (``None``: the first step).

    Returns:
        ``(decision, new_state)``. Degenerate steps (``n < 2``; a non-finite ``||G||^2``, ``sum_sq`` or estimate; a
        gradient that is exactly 0) leave the state unchanged, so one bad step does not poison the average.

    A step whose gradient is exactly 0 with every sample's share 0 (``||G||^2 = sum_sq = 0``: every group's rewards
    identical, or no completion scorable or left in the loss) holds no evidence about the SNR and nothing to scale:
    under every estimator its scale is 0 (``lr_scale_min`` if set), status ``"zero_gradient"``, and the averages are
    not updated. (Averaging its zeros would keep the previous steps' ratio, so ``"ema"``/``"ema_soft"`` would go on
    applying an earlier step's scale, through Adam's momentum, to a step with no gradient of its own.)
    """
    check_estimator(estimator, beta, window)
    state = state if state is not None else SNRState()
    nan = math.nan
    if n < 2:
        return SNRDecision(1.0, nan, n, nan, nan, nan, nan, "few_samples"), state
    if grad_sq_norm == 0.0 and sum_sq == 0.0:
        return SNRDecision(lr_scale_min, 0.0, n, 0.0, 0.0, 0.0, 0.0, "zero_gradient"), state
    nonfinite = SNRDecision(lr_scale_min, nan, n, nan, nan, nan, nan, "nonfinite_grad"), state
    if not (math.isfinite(grad_sq_norm) and math.isfinite(sum_sq)):
        return nonfinite
    step_s, step_v = step_signal_noise(float(sum_sq), float(grad_sq_norm), n)
    signal, noise, new_state = SNR_ESTIMATORS[estimator](step_s, step_v, state, beta=beta, window=window, n=n)
    if not all(map(math.isfinite, (signal, noise, *_floats(new_state)))):  # overflow: not an estimate to carry on
        return nonfinite
    scale, snr = scale_from_signal_noise(signal, noise, n)
    status = "zero_snr" if scale == 0.0 else "ok"
    return SNRDecision(max(scale, lr_scale_min), snr, n, signal, noise, step_s, step_v, status, scale), new_state


def _floats(state: SNRState) -> list[float]:
    return [state.signal, state.noise, state.signal_sq, *(x for pair in state.recent for x in pair)]
