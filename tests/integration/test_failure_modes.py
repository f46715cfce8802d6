"""The failure signatures of OBLR-PO, each reproduced on the tiny model through the real trainer, and its guard at work.

(a) SNR ~ 0 for many steps (a pure-noise reward): the step collapses (scale 0, warned); `lr_scale_min` floors it;
    `snr_estimator="ema"` smooths it (the paper's `"per_step"` estimate is the one that collapses).
(b) wildly unequal gradient norms: the weighted baseline follows the dominant completion (it cannot leave the range of
    the rewards it averages); `oblr/weight_spread` shows it.
(c) non-finite per-sequence norms or gradient norm: set to 0 / lr scale floored, warned; everything stays finite.
(d) a reward function that raises: the exception propagates unchanged out of `train()`, the optimizer keeps its
    scheduled lr.
(e) every completion truncated: finite everything, with and without `mask_truncated_completions`.
"""

from __future__ import annotations

import logging
import math
import random
import statistics

import pytest
import torch

from helpers import DATASET, GROUP, TOKENIZER, assert_finite_everywhere, common_args, length_reward, logged
from helpers import train as train_trainer
from oblr_trl import OBLRPOConfig, OBLRPOTrainer, clip_weights, gradient_weighted_baseline
from oblr_trl import norm_passes
from oblr_trl.demo.tiny import build_model

digit_reward = length_reward  # the count of '1' and '2' digits


def coin_reward(seed=0, plus=None):
    """A fair coin per completion (pure noise: no direction to learn), seeded; optionally added to ``plus``."""
    rng = random.Random(seed)

    def coin(completions, **kwargs):
        base = plus(completions) if plus else [0.0] * len(completions)
        return [b + float(rng.random() < 0.5) for b in base]

    return coin


def train(reward=digit_reward, model=None, **overrides):
    """OBLR-PO (two passes) on the tiny setup with 2 micro-batches per step; the trainer records generations (with summed rewards)
    and the applied lrs (``trainer.applied_lrs``)."""
    overrides.setdefault("one_backward", False)  # the norms pass, which several tests break on purpose
    args = OBLRPOConfig(**common_args(output_dir="/tmp/oblr-failure-modes", gradient_accumulation_steps=2,
                                      **overrides))
    trainer, probe = train_trainer(OBLRPOTrainer, args, reward=reward, model=model)
    trainer.applied_lrs = probe.applied
    for gen in trainer.generations:
        gen["rewards"] = gen["rewards"].sum(1)
    return trainer


# ------------------------------------------------------------------------------------------ (a) SNR ~ 0: collapse
def test_pure_noise_reward_collapses_the_step_and_warns(caplog):
    with caplog.at_level(logging.WARNING):
        # the paper's estimate and reading (the calibrated default applies the scheduled lr in its first 10 steps)
        trainer = train(coin_reward(), max_steps=12, snr_estimator="per_step", snr_lr_mode="eta_max")
    scales = logged(trainer, "oblr/lr_scale")
    assert scales == logged(trainer, "oblr/snr_factor")  # in this reading the scale is the SNR factor itself
    assert len(scales) == 12
    assert sum(s == 0.0 for s in scales) >= 4, scales  # collapsed on a third of the steps at least
    assert statistics.mean(scales) < 0.1, scales  # and short where not
    assert "SNR estimate is 0" in caplog.text
    assert_finite_everywhere(trainer)


def test_lr_scale_min_floors_the_applied_step():
    trainer = train(coin_reward(), max_steps=12, lr_scale_min=0.1, snr_estimator="per_step")
    scales, scheduled = logged(trainer, "oblr/lr_scale"), logged(trainer, "learning_rate")
    assert min(scales) == 0.1  # the floor was needed (the same data collapses to 0 without it) and held
    for applied, scale, lr in zip(trainer.applied_lrs, scales, scheduled, strict=True):
        assert applied == pytest.approx(lr * scale, rel=1e-9)
        assert applied >= 0.1 * lr * (1 - 1e-12)


def test_running_step_size_statistics_are_logged():
    """oblr/skipped_fraction and oblr/lr_mean: the running fraction of steps at scale 0 and mean applied lr."""
    trainer = train(coin_reward(), max_steps=6, snr_estimator="per_step")
    scales, lrs = logged(trainer, "oblr/lr_scale"), logged(trainer, "oblr/lr")
    assert any(s == 0.0 for s in scales) and any(s > 0 for s in scales)  # both kinds of step occur
    assert logged(trainer, "oblr/skipped_fraction")[-1] == pytest.approx(statistics.mean(s == 0.0 for s in scales))
    assert logged(trainer, "oblr/lr_mean")[-1] == pytest.approx(statistics.mean(lrs), rel=1e-9)
    assert logged(trainer, "oblr/lr_scale_mean")[-1] == pytest.approx(statistics.mean(scales), rel=1e-9)


def test_snr_ema_smooths_the_scale_on_the_same_data():
    """learning_rate=0 keeps the model fixed, so both runs see the same generations and rewards (checked) and differ
    only in the smoothing. The reward is a weak signal plus a coin, so the raw scale moves between 0 and ~0.15."""
    reward = lambda seed: coin_reward(seed, plus=lambda cs: [2 * r for r in digit_reward(cs)])  # noqa: E731
    raw = train(reward(0), max_steps=16, learning_rate=0.0, snr_estimator="per_step")
    smooth = train(reward(0), max_steps=16, learning_rate=0.0, snr_estimator="ema", snr_ema=0.5)
    for a, b in zip(raw.generations, smooth.generations, strict=True):
        assert torch.equal(a["rewards"], b["rewards"]) and torch.equal(a["completion_ids"], b["completion_ids"])

    def jitter(trainer):  # mean squared step-to-step change of the scale
        s = logged(trainer, "oblr/lr_scale")
        return statistics.mean((y - x) ** 2 for x, y in zip(s, s[1:]))

    assert jitter(raw) > 1e-4  # not a vacuous comparison
    assert jitter(smooth) < 0.5 * jitter(raw), (logged(raw, "oblr/lr_scale"), logged(smooth, "oblr/lr_scale"))


# ----------------------------------------------------------------------------------- (b) extreme weight spread
def test_dominant_weight_sets_the_baseline_pure_function():
    rewards = torch.tensor([5.0, 1.0, -2.0, 0.5, 3.0, 3.0, 3.0, 3.0])
    weights = torch.tensor([1e8, 1.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    baseline, _ = gradient_weighted_baseline(rewards, weights, 4, leave_one_out=True)
    assert baseline[1:4].tolist() == pytest.approx([5.0] * 3, abs=1e-6)  # everyone else's baseline: the dominant reward
    assert float(baseline[0]) == pytest.approx((1.0 - 4.0 + 0.25) / 3.5)  # its own: the others' weighted mean
    assert baseline[4:].tolist() == pytest.approx([3.0] * 4)
    # and no baseline leaves the range of the rewards it averages
    r = rewards.view(2, 4)
    for i, b in enumerate(baseline.tolist()):
        others = torch.cat([r[i // 4, : i % 4], r[i // 4, i % 4 + 1 :]])
        assert others.min() - 1e-6 <= b <= others.max() + 1e-6
    spread = (weights.std() / weights.mean()).item()  # the trainer's oblr/weight_spread
    assert spread > 2.5


def _skew_norms(monkeypatch):
    """Completion 0 of every group gets a gradient 1e6x longer: its inner products are scaled accordingly."""
    original = norm_passes.per_sequence_grad_inner_products

    def skewed(*args, **kwargs):
        products = original(*args, **kwargs)
        s = torch.ones(products.shape[-1], dtype=products.dtype)
        s[0] = 1e6
        return products * s[:, None] * s[None, :]

    monkeypatch.setattr("oblr_trl.norm_passes.per_sequence_grad_inner_products", skewed)


def test_extreme_gradient_norm_spread_through_the_trainer(monkeypatch):
    """Completion 0 of every group gets a gradient 1e6x longer (its inner products scaled): the others' baselines
    become its reward, oblr/weight_spread jumps from ~0.2 to > 1, and everything stays finite."""
    plain = train(max_steps=1)
    _skew_norms(monkeypatch)
    skew = train(max_steps=1)
    assert max(logged(plain, "oblr/weight_spread")) < 0.6
    assert min(logged(skew, "oblr/weight_spread")) > 1.0
    gen = skew.generations[0]
    r, adv = gen["rewards"].view(-1, GROUP), gen["advantages"].view(-1, GROUP)
    torch.testing.assert_close(adv[:, 1:], r[:, 1:] - r[:, :1], rtol=0, atol=1e-5)
    assert_finite_everywhere(skew)


def test_weight_clip_guard_detects_and_bounds_a_dominant_completion(monkeypatch, caplog):
    """The same skew is detected (warned, naming weight_clip); with weight_clip=10 the dominant completion weighs at
    most 10x its group's median, so the others' baselines no longer collapse onto its reward."""
    _skew_norms(monkeypatch)
    with caplog.at_level(logging.WARNING):
        train(max_steps=1)
    assert "weight_clip" in caplog.text
    guarded = train(max_steps=1, weight_clip=10.0)
    gen = guarded.generations[0]
    assert logged(guarded, "oblr/clipped_weights")[0] == len(gen["rewards"]) // GROUP  # one per group
    weights = torch.diagonal(gen["oblr_gram"].view(-1, GROUP, GROUP), dim1=1, dim2=2).reshape(-1)
    clipped, n = clip_weights(weights, GROUP, 10.0)
    assert n == len(gen["rewards"]) // GROUP
    expected = gen["rewards"] - gradient_weighted_baseline(gen["rewards"], clipped, GROUP, leave_one_out=True)[0]
    torch.testing.assert_close(gen["advantages"], torch.nan_to_num(expected, nan=0.0))
    assert_finite_everywhere(guarded)


def test_clip_weights_pure_function():
    weights = torch.tensor([1e8, 1.0, 2.0, 3.0, 0.0, float("nan"), 4.0, 5.0])
    clipped, n = clip_weights(weights, 4, 10.0)
    assert n == 1 and clipped[0] == 20.0  # median of (1e8, 1, 2, 3) is 2 (lower median): cap 20
    assert clipped[1:4].tolist() == [1.0, 2.0, 3.0]
    assert clipped[4] == 0 and torch.isnan(clipped[5]) and clipped[6:].tolist() == [4.0, 5.0]  # others untouched
    assert torch.equal(clip_weights(weights, 4, float("inf"))[0].nan_to_num(-1), weights.nan_to_num(-1))
    with pytest.raises(ValueError, match="max_ratio"):
        clip_weights(weights, 4, 0.5)


# ------------------------------------------------------------------------------------------- (c) non-finite norms
def _break_norms(monkeypatch):
    original = norm_passes.per_sequence_grad_inner_products

    def broken(*args, **kwargs):
        products = original(*args, **kwargs)
        products[0, 1, :] = float("inf")  # completion 1's norm and its inner products: inf
        products[0, :, 1] = float("inf")
        products[-1, 2, 2] = float("nan")  # the chunk's last unit's third completion's norm: NaN
        return products

    monkeypatch.setattr("oblr_trl.norm_passes.per_sequence_grad_inner_products", broken)


def test_non_finite_per_sequence_norms_are_zeroed_and_warned(monkeypatch, caplog):
    _break_norms(monkeypatch)
    with caplog.at_level(logging.WARNING):
        trainer = train(max_steps=2)
    assert "Non-finite per-sequence gradient norms: those completions are treated as unscorable" in caplog.text
    assert_finite_everywhere(trainer)
    gen = trainer.generations[0]
    # the norms pass runs (and is broken) once per chunk: the cost model's (oblr_trl.path_choice.norms_chunk), else
    # the micro-batch, in whole groups
    chunk = trainer.route.norms_rows(GROUP, trainer.args.per_device_train_batch_size)
    gram = gen["oblr_gram"].view(-1, GROUP, GROUP)
    last = chunk // GROUP - 1  # the first chunk's last unit
    assert gram[0, 1].abs().max() == 0 and gram[0, :, 1].abs().max() == 0 and gram[last, 2, 2] == 0
    # the zeroed completions are unscorable: advantage 0, and no part in the others' baselines
    weights = torch.diagonal(gram, dim1=1, dim2=2).reshape(-1)
    rewards = gen["rewards"].clone()
    bad = [start + i for start in range(0, len(rewards), chunk) for i in (1, chunk - GROUP + 2)]
    rewards[bad] = float("nan")
    expected = rewards - gradient_weighted_baseline(rewards, weights, GROUP, leave_one_out=True)[0]
    torch.testing.assert_close(gen["advantages"], torch.nan_to_num(expected, nan=0.0))
    assert logged(trainer, "oblr/unscorable")[0] == int(torch.isnan(rewards).sum())  # None rewards + bad norms


def test_a_completion_with_a_zeroed_norm_takes_no_part_in_the_step(monkeypatch):
    _break_norms(monkeypatch)
    broken = train(max_steps=1)  # completion 1 (norm inf) has reward 1, advantage 1
    assert float(broken.generations[0]["advantages"][1]) == 0.0
    assert logged(broken, "oblr/lr_scale")[0] < 1.0 and logged(broken, "oblr/snr")[0] < math.inf


def test_non_finite_gradient_norm_floors_the_scale_and_keeps_parameters_finite(caplog):
    """Rewards of 1e30 make the step's gradient norm overflow float32 (inf): the scale drops to lr_scale_min for that
    step (warned), the clipped update is finite."""
    huge = lambda completions, **kwargs: [1e30 * (i % 2) for i in range(len(completions))]  # noqa: E731
    with caplog.at_level(logging.WARNING):
        trainer = train(huge, max_steps=2, lr_scale_min=0.05)
    assert logged(trainer, "grad_norm") == [math.inf, math.inf]
    assert logged(trainer, "oblr/lr_scale") == [0.05, 0.05]
    assert "Non-finite gradient norm" in caplog.text
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(torch.isfinite(g["advantages"]).all() for g in trainer.generations)


# -------------------------------------------------------------------------------------------- (d) reward raises
def test_a_raising_reward_function_propagates_and_leaves_the_scheduled_lr():
    """TRL calls reward functions without a guard: the exception leaves `train()` unchanged, after the steps already
    taken; no scaled lr is left in the optimizer. (Return None for an unscorable completion instead of raising.)"""
    calls = {"n": 0}

    def fails_on_second_batch(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ZeroDivisionError("verifier crashed")
        return digit_reward(completions)

    args = OBLRPOConfig(output_dir="/tmp/oblr-failure-modes", per_device_train_batch_size=8, num_generations=GROUP,
                        max_completion_length=6, max_steps=3, gradient_accumulation_steps=2, logging_steps=1,
                        report_to="none", use_cpu=True, learning_rate=1e-2, save_strategy="no", seed=0,
                        disable_tqdm=True)
    trainer = OBLRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER,
                            reward_funcs=[fails_on_second_batch], args=args, train_dataset=DATASET)
    with pytest.raises(ZeroDivisionError, match="verifier crashed"):
        trainer.train()
    assert trainer.state.global_step == 1 and len(logged(trainer, "oblr/lr_scale")) == 1
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.lr_scheduler.get_last_lr()[0])


# ------------------------------------------------------------------------------------- (e) everything truncated
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_all_completions_truncated(mask_truncated, caplog):
    never_eos = {"suppress_tokens": [TOKENIZER.eos_token_id, TOKENIZER.pad_token_id]}  # (TRL reads a pad as an end)
    with caplog.at_level(logging.WARNING):
        trainer = train(max_steps=2, max_completion_length=2, generation_kwargs=never_eos,
                        mask_truncated_completions=mask_truncated)
    assert logged(trainer, "completions/clipped_ratio") == [1.0, 1.0]
    assert_finite_everywhere(trainer)
    if mask_truncated:  # no token left in the loss: zero weights (plain-mean fallback), zero gradient, scale 0
        assert logged(trainer, "oblr/fallback_samples") == [16.0, 16.0]
        assert logged(trainer, "oblr/lr_scale") == [0.0, 0.0]
        assert "fell back" in caplog.text
    else:
        assert logged(trainer, "oblr/fallback_samples") == [0.0, 0.0]
        assert all(0.0 <= s <= 1.0 for s in logged(trainer, "oblr/lr_scale"))
