"""One implementation of the SNR, and one registry per selectable part (baselines, weight estimators, SNR estimators).

* The SNR formulas exist once, in `oblr_trl.snr_formulas`, where the trainer runs them; the public `gradient_snr`,
  `snr_lr_scale`, `gradient_signal_noise` and `step_scale_from_contributions` call them (so the Monte Carlo tests of
  the public names test the trainer's code). The numbers the trainer's step size comes from are unchanged: checked
  against a frozen copy of the float code it ran before (commit 9d1215d), bit for bit.
* `OBLRPOConfig` validates each option against its registry, and the trainer calls the registered entries.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import oblr_trl
from helpers import common_args, logged, train
from oblr_trl import OBLRPOConfig, OBLRPOTrainer, estimators, snr_formulas
from oblr_trl import step_sizer


# ------------------------------------------------------------------------------------- the numbers are unchanged
def _old_scale_from_signal_noise(signal: float, noise: float, n: int) -> tuple[float, float]:
    """``oblr_trl.snr_formulas.scale_from_signal_noise`` as it was (pure floats), frozen here as the reference."""
    s, v = max(signal, 0.0), max(noise, 0.0)
    if s == 0.0:
        return 0.0, 0.0
    snr = s / v if v > 0 else math.inf
    return n * s / (n * s + v), snr


def _old_public(m, g2, n):
    """The second implementation `oblr_trl.estimators` had: ``(gradient_snr, snr_lr_scale of it,
    step_scale_from_contributions at sum_sq = m / n)``, frozen here."""
    m, g2 = torch.as_tensor(m, dtype=torch.float64), torch.as_tensor(g2, dtype=torch.float64)
    signal, noise = ((n * g2 - m) / (n - 1)).clamp(min=0), (n * (m - g2) / (n - 1)).clamp(min=0)
    snr = torch.where(noise > 0, signal / torch.where(noise > 0, noise, torch.ones_like(noise)),
                      torch.where(signal > 0, torch.full_like(signal, math.inf), torch.zeros_like(signal)))
    x = n * snr
    finite_x = torch.where(torch.isinf(x), torch.zeros_like(x), x)
    scale = torch.where(torch.isinf(x), torch.ones_like(x), x / (1 + finite_x))
    ratio = (m / n) / torch.where(g2 > 0, g2, torch.ones_like(g2))
    direct = torch.where(g2 > 0, (n / (n - 1) * (1 - ratio)).clamp(0.0, 1.0), torch.zeros_like(g2))
    return snr, scale, direct


def _signal_noise_cases(seed: int = 0):
    rng = np.random.default_rng(seed)
    cases = [(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (-1.0, 2.0), (2.0, -1.0), (-0.0, 3.0), (1e-300, 1e300), (5e-324, 1.0),
             (1e300, 1e-300), (3.0, 3.0)]
    for _ in range(3000):
        scale = 10.0 ** rng.uniform(-30, 30)
        cases.append((float(rng.normal() * scale), float(rng.normal() * scale * 10.0 ** rng.uniform(-3, 3))))
    return cases


def test_scale_from_signal_noise_gives_the_old_floats_bit_for_bit():
    """The factor and SNR of every step the trainer sizes (finite inputs: `snr_step_size` refuses others): the same
    floats as the code it ran before. An infinite signal, where that code gave a NaN factor, now gives 1."""
    for signal, noise in _signal_noise_cases():
        for n in (2, 3, 8, 64, 1000):
            new = snr_formulas.scale_from_signal_noise(signal, noise, n)
            assert type(new[0]) is float and type(new[1]) is float
            assert new == _old_scale_from_signal_noise(signal, noise, n), (signal, noise, n)
    assert math.isnan(_old_scale_from_signal_noise(math.inf, 1.0, 8)[0])
    assert snr_formulas.scale_from_signal_noise(math.inf, 1.0, 8) == (1.0, math.inf)


@pytest.mark.parametrize("estimator", ["per_step", "ema", "ema_soft", "window"])
def test_every_snr_estimator_decides_as_before(estimator, monkeypatch):
    """Whole streams through `snr_step_size` (what the trainer calls), against the same stream with the old factor
    patched in: equal decisions and states at every step."""
    rng = np.random.default_rng(1)
    inputs = []
    for _ in range(300):
        h = rng.standard_normal((8, 10)) + 0.15 * rng.standard_normal(10)
        inputs.append((float((h**2).sum()), float((h.sum(0) ** 2).sum())))

    def run():
        state, out = None, []
        for sum_sq, g2 in inputs:
            decision, state = snr_formulas.snr_step_size(estimator, sum_sq, g2, 8, state, beta=0.9, window=10)
            out.append((decision, state))
        return out

    new = run()
    monkeypatch.setattr(snr_formulas, "scale_from_signal_noise", _old_scale_from_signal_noise)
    old = run()
    assert new == old
    assert any(d.scale == 0.0 for d, _ in new) or estimator == "ema_soft"  # the clipped branch was exercised
    assert any(0.0 < d.scale < 1.0 for d, _ in new)


def test_public_snr_functions_agree_with_the_removed_second_implementation():
    """The public names, now re-parameterisations of the trainer's functions, give what `oblr_trl.estimators`'
    own copy gave, to rounding (m / n is formed once more), edges included."""
    rng = np.random.default_rng(2)
    for n in (2, 5, 16, 1024):
        h = torch.as_tensor(rng.standard_normal((400, n, 6)) * 10.0 ** rng.uniform(-3, 3, (400, 1, 1)))
        h = h + torch.as_tensor(rng.uniform(0, 2, (400, 1, 1)) * rng.standard_normal((400, 1, 6)))
        sum_sq, g2 = h.pow(2).sum((1, 2)), h.sum(1).pow(2).sum(-1)
        m = n * sum_sq
        old_snr, old_scale, old_direct = _old_public(m, g2, n)
        snr = oblr_trl.gradient_snr(m, g2, n)
        torch.testing.assert_close(snr, old_snr, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(oblr_trl.snr_lr_scale(snr, n), old_scale, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(oblr_trl.step_scale_from_contributions(sum_sq, g2, n), old_direct, rtol=1e-9,
                                   atol=1e-12)
        assert (old_scale == 0).any() and (old_scale > 0.5).any()
    edges = torch.tensor([0.0, 1.0, 8.0, math.inf]), torch.tensor([0.0, 1.0, 1.0, 1.0])  # (m, ||gbar||^2)
    for new, old in zip((oblr_trl.gradient_snr(*edges, 8), oblr_trl.step_scale_from_contributions(edges[0] / 8,
                                                                                                   edges[1], 8)),
                        (_old_public(*edges, 8)[0], _old_public(*edges, 8)[2])):
        assert torch.equal(new, old)
    assert oblr_trl.snr_lr_scale(torch.tensor([0.0, 0.5, math.inf]), 4).tolist() == [0.0, 2 / 3, 1.0]


# ------------------------------------------------------------------------------------ one implementation, called
def test_the_public_snr_names_are_the_snr_formulas_and_have_one_home():
    for name in ("gradient_signal_noise", "gradient_snr", "snr_lr_scale", "step_scale_from_contributions"):
        assert getattr(oblr_trl, name) is getattr(snr_formulas, name), name
    for name in ("gradient_signal_noise", "gradient_snr", "snr_lr_scale", "step_scale_from_contributions",
                 "snr_from_signal_noise"):  # the baseline's module does not re-export them
        assert not hasattr(estimators, name), name
    assert step_sizer.snr_step_size is snr_formulas.snr_step_size


def _spy(calls: list, fn):
    def spy(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.append(out)
        return out
    return spy


def test_the_public_snr_names_run_the_trainers_formulas(monkeypatch):
    """`gradient_snr` & co. compute through `step_signal_noise` and `scale_from_signal_noise`, the functions of the
    trainer's step (the latter once per element): patch those, and the public results follow."""
    signal_noise, scales = [], []
    monkeypatch.setattr(snr_formulas, "step_signal_noise", _spy(signal_noise, snr_formulas.step_signal_noise))
    monkeypatch.setattr(snr_formulas, "scale_from_signal_noise", _spy(scales, snr_formulas.scale_from_signal_noise))
    snr = oblr_trl.gradient_snr(torch.tensor([6.0, 1.0, 4.0]), torch.tensor([1.0, 1.0, 0.5]), 4)
    assert len(signal_noise) == 1 and snr.tolist() == [s for _, s in scales] and len(scales) == 3
    scale = oblr_trl.step_scale_from_contributions(1.5, 1.0, 4)
    assert len(signal_noise) == 2 and len(scales) == 4 and float(scale) == scales[3][0]
    assert oblr_trl.snr_lr_scale(snr, 4).tolist() == [s for s, _ in scales[4:]]
    assert oblr_trl.gradient_signal_noise(6.0, 1.0, 4) is signal_noise[2]
    monkeypatch.setattr(snr_formulas, "scale_from_signal_noise", lambda signal, noise, n: (0.25, 7.0))
    assert oblr_trl.gradient_snr(6.0, 1.0, 4).item() == 7.0 and oblr_trl.snr_lr_scale(3.0, 4).item() == 0.25


def test_the_trainer_calls_the_registered_snr_estimator_and_formulas(monkeypatch):
    """One training step: the step size comes from the entry registered under `snr_estimator`, and from
    `step_signal_noise` / `scale_from_signal_noise`, which the Monte Carlo tests check through the public names."""
    estimated, signal_noise, scales = [], [], []
    registered = snr_formulas.SNR_ESTIMATORS["ema_soft"]
    monkeypatch.setitem(snr_formulas.SNR_ESTIMATORS, "ema_soft", _spy(estimated, registered))
    monkeypatch.setattr(snr_formulas, "step_signal_noise", _spy(signal_noise, snr_formulas.step_signal_noise))
    monkeypatch.setattr(snr_formulas, "scale_from_signal_noise", _spy(scales, snr_formulas.scale_from_signal_noise))
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1), snr_estimator="ema_soft"))
    assert len(estimated) == len(signal_noise) == len(scales) == 1
    assert estimated[0][2] == trainer.step_sizer.snr_state
    assert logged(trainer, "oblr/snr_factor") == [scales[0][0]]
    assert logged(trainer, "oblr/lr_scale") == [1.0]  # calibrated (the default): the first step applies learning_rate
    assert logged(trainer, "oblr/snr") == [scales[0][1]]


# --------------------------------------------------------------------------------------------------- registries
REGISTRIES = [(estimators.BASELINES, "baseline"), (estimators.GRAD_NORM_ESTIMATORS, "grad_norm_estimator"),
              (snr_formulas.SNR_ESTIMATORS, "snr_estimator")]


def test_the_registries_hold_the_built_in_entries():
    assert sorted(estimators.BASELINES) == ["gradient_weighted", "mean"]
    assert sorted(estimators.GRAD_NORM_ESTIMATORS) == ["exact", "length", "logit"]
    assert sorted(snr_formulas.SNR_ESTIMATORS) == ["ema", "ema_soft", "per_step", "window"]
    assert {k: v.needs for k, v in estimators.GRAD_NORM_ESTIMATORS.items()} == {
        "exact": "norms", "length": None, "logit": "logit_proxy"}
    exported = (oblr_trl.BASELINES, oblr_trl.GRAD_NORM_ESTIMATORS, oblr_trl.SNR_ESTIMATORS)
    assert all(a is b for a, (b, _) in zip(exported, REGISTRIES))


@pytest.mark.parametrize(("registry", "option"), REGISTRIES)
def test_a_taken_name_is_refused_and_an_unknown_one_names_the_option(registry, option):
    name = next(iter(registry))
    before = registry[name]
    with pytest.raises(ValueError, match=f"named '{name}' is already registered"):
        registry.add(name, lambda *a, **k: None)
    assert registry[name] is before
    with pytest.raises(ValueError, match=rf"{option}='nope' is not allowed; allowed values: \[.*'{name}'"):
        registry.select("nope")


@pytest.mark.parametrize(("registry", "option"), REGISTRIES)
def test_the_config_takes_its_allowed_values_from_the_registry(registry, option, monkeypatch):
    allowed = str(sorted(registry)).replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=rf"OBLRPOConfig\.{option}='nope' is not allowed; allowed values: {allowed}"):
        OBLRPOConfig(**common_args(), **{option: "nope"})
    monkeypatch.setitem(registry, "nope", registry[next(iter(registry))])  # a user's entry: accepted at once
    assert getattr(OBLRPOConfig(**common_args(), **{option: "nope"}), option) == "nope"


def test_a_registered_weight_estimator_is_used_by_baseline_weights(monkeypatch):
    calls = []
    lengths, sq = torch.tensor([1, 2, 3]), torch.tensor([4.0, 5.0, 6.0])
    monkeypatch.setitem(estimators.GRAD_NORM_ESTIMATORS, "squares",
                        estimators.WeightEstimator(lambda lt, ln, s: calls.append(lt) or s**2, needs="norms"))
    torch.testing.assert_close(estimators.baseline_weights("squares", "dapo", lengths, sq), sq**2)
    assert calls == ["dapo"]
    with pytest.raises(ValueError, match="needs the per-sequence squared norms"):
        estimators.baseline_weights("squares", "dapo", lengths)
    with pytest.raises(ValueError, match="needs="):
        estimators.register_weight_estimator("other", lambda *a: None, needs="gradients")


def test_register_weight_estimator_adds_an_entry_the_trainer_uses():
    """A weight estimator registered by name, with `needs=None` (no norms pass), selected by the config and called
    by the trainer for every generation batch."""
    calls = []
    entry = estimators.register_weight_estimator(
        "ones", lambda loss_type, lengths, sq_norms: calls.append(sq_norms) or torch.ones(lengths.shape[0]), needs=None)
    try:
        assert estimators.weight_estimator("ones") is entry
        with pytest.raises(ValueError, match="already registered"):
            estimators.register_weight_estimator("ones", lambda *a: None, needs=None)
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1), grad_norm_estimator="ones",
                                                       snr_lr=False))
        assert not trainer._needs_norms
    finally:
        del estimators.GRAD_NORM_ESTIMATORS["ones"]
    assert len(calls) >= 1 and all(c is None for c in calls)  # called, and no norms were formed for it


# ------------------------------------------------------------------------- registries that mean what they say
@pytest.mark.parametrize("uses_weights", [True, False])
def test_a_registered_baseline_gets_the_weights_it_declares(uses_weights):
    """Before: needs_norms checked baseline == 'gradient_weighted' by name, so a user's weighted baseline with
    snr_lr=False was handed zero weights, with no word said."""
    seen = []

    def mine(rewards, weights, group_size, leave_one_out=False):
        seen.append(weights.clone())
        return estimators.mean_baseline(rewards, weights, group_size, leave_one_out)

    assert estimators.register_baseline("mine", uses_weights=uses_weights)(mine) is mine
    try:
        assert estimators.baseline_uses_weights("mine") is uses_weights
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1), baseline="mine", snr_lr=False))
        assert trainer._needs_norms is uses_weights
    finally:
        del estimators.BASELINES["mine"]
    assert seen
    if uses_weights:  # the exact squared norms: positive for every completion with a token
        assert all(bool((w > 0).all()) for w in seen)
    else:  # not formed: zeros, and the baseline said it would not read them
        assert all(bool((w == 0).all()) for w in seen)


@pytest.mark.parametrize(("registry", "option"), REGISTRIES)
def test_the_command_line_takes_an_entry_registered_after_import(registry, option, monkeypatch):
    """The config's choices are the registry itself, read when the value is validated, not a list frozen at import."""
    from transformers import HfArgumentParser

    monkeypatch.setitem(registry, "later", registry[next(iter(registry))])
    (config,) = HfArgumentParser(OBLRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/oblr-test", f"--{option}", "later", "--use_cpu", "True", "--report_to", "none"])
    assert getattr(config, option) == "later"
    with pytest.raises(SystemExit):
        HfArgumentParser(OBLRPOConfig).parse_args_into_dataclasses(["--output_dir", "/tmp/x", f"--{option}", "nope"])
