"""Every warning OBLR-PO gives during training, and the one mechanism that gives each at most once per run.

The pieces of the step (:mod:`.advantages`, :mod:`.step_sizer`, :mod:`.precision`, :mod:`.one_backward`) return the
keys of what they found; the trainer passes them to :class:`Advice`, which logs each key's text once.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from .snr_formulas import STALL_SCALE, STALL_STEPS

logger = logging.getLogger("oblr_trl.trainer")

WEIGHT_RATIO_WARNING = 100.0  # a group's max/median baseline weight above this warns (baseline explosion)

WARNINGS = {
    "nonfinite_norms": "Non-finite per-sequence gradient norms: those completions are treated as unscorable "
    "(advantage 0, no part in any baseline or in the SNR).",
    "nonfinite_reward": "Rewards of +-inf were treated as unscorable (NaN): no baseline, advantage 0.",
    "fallback": "Some groups' baseline weights summed to 0 (zero gradients or all-unscorable rewards); their baseline "
    "fell back to the plain mean of rewards. Counted in oblr/fallback_samples.",
    "unscorable": "Completions with no reward (None/NaN) get advantage 0 and enter no baseline.",
    "no_rewards": "Every completion of a generation batch went unscored: each reward function returned None (or NaN) "
    "for all of them, so their steps cannot move (advantage 0, lr scale 0). This is the reward, not noise: check that "
    "the reward functions apply to this dataset (their names, the columns they read) and return floats.",
    "weight_spread": f"Gradient norms vary by more than {WEIGHT_RATIO_WARNING:.0f}x within a group: the "
    "gradient-weighted baseline follows one or two completions there. Set OBLRPOConfig(weight_clip=10) to bound any "
    "one completion's weight (see oblr/weight_spread).",
    "few_samples": "An optimizer step saw {n} sample(s); the SNR needs 2: lr left unscaled.",
    "nonfinite_grad": "Non-finite gradient norm: lr scaled to lr_scale_min for this step.",
    "deepspeed_skipped": "DeepSpeed skipped an optimizer step (gradient overflow): its SNR samples were dropped with "
    "it; the next step is sized from its own samples.",
    "zero_snr": "SNR estimate is 0 (noise dominates): the step size collapses to lr_scale_min. If this persists, raise "
    "the batch (more prompts per step), set lr_scale_min, or pool steps with snr_estimator='ema' or 'window'.",
    "zero_gradient": "An optimizer step's gradient was exactly 0 (every group's rewards identical, or no completion "
    "scorable or left in the loss): nothing to size, so its lr scale is 0 (lr_scale_min if set) and the SNR estimate "
    "is left as it was. If this persists the rewards do not vary within groups: check the reward functions, or raise "
    "num_generations or the sampling temperature.",
    "stalled": f"The applied learning rate has stayed below {STALL_SCALE:.0%} of the scheduled one (learning_rate) for "
    f"{STALL_STEPS} steps in a row: these steps barely move the model. The SNR estimate finds each step's gradient "
    "mostly noise, or zero. Check that the rewards vary within groups and are finite (oblr/reward_mean, reward_std, "
    "oblr/unscorable); give each step more prompts (per_device_train_batch_size, gradient_accumulation_steps); or set "
    "lr_scale_min (e.g. 0.05) to keep a floor, or snr_lr=False for GRPO's constant step.",
    "group_span": "A group of {group} completions spans ranks (local batch {local}); the SNR uses each completion as a "
    "sample. Make per_device_train_batch_size * steps_per_generation a multiple of num_generations for the group "
    "estimate.",
    "precision": "At the applied learning rate {lr:.3g}, an update rounds away for {frozen:.0%} of the trainable "
    "bf16/fp16 weights (below half their spacing): those weights cannot change. Load the model in float32 and train "
    "with bf16=True (autocast keeps fp32 master weights), or raise learning_rate.",
}


class Guide(NamedTuple):
    """What a warning of :data:`WARNINGS` means and what to do about it: the docs' Troubleshooting page is generated
    from :data:`GUIDE` (``docs/generate.py``), and a test fails for a warning without its entry."""

    meaning: str
    remedy: str


GUIDE = {
    "nonfinite_norms": Guide(
        "The norms pass gave a NaN or infinite squared gradient norm for some completions: an overflow in half "
        "precision, or NaN activations. The step goes on without them.",
        "Once is harmless. If it recurs, load the model in float32 and train with `bf16=True` (autocast), lower "
        "`learning_rate`, and check the model's weights for NaN; `grad_norm_estimator=\"length\", snr_lr=False` "
        "skips the norms altogether."),
    "nonfinite_reward": Guide(
        "A reward function returned `+inf` or `-inf` for some completions. OBLR-PO treats them as unscorable, as "
        "`None`: advantage 0, no part in any baseline; counted in `oblr/unscorable`.",
        "Return a finite float, or `None` for a completion the function cannot score."),
    "fallback": Guide(
        "In some groups the baseline weights `w_i` of the other completions summed to 0: their gradients were exactly "
        "0 (a saturated softmax: the policy was certain of every token) or their rewards were unscorable. There the "
        "baseline is the plain mean of the rewards (RLOO's); counted in `oblr/fallback_samples`.",
        "Nothing, if `oblr/fallback_samples` stays a small share of the completions. If it grows, the policy has "
        "saturated on those prompts (raise the sampling `temperature`) or their rewards are missing."),
    "unscorable": Guide(
        "A reward function returned `None` or NaN for some completions. They get advantage 0 and enter no baseline "
        "and no SNR sample; counted in `oblr/unscorable`.",
        "This is how a verifier says \"cannot score\". If `oblr/unscorable` is a large share of each batch, check "
        "that the reward function reads the columns your dataset has."),
    "no_rewards": Guide(
        "Every completion of a generation batch went unscored: the reward functions do not apply to this data. No "
        "step on that batch moves the model (advantage 0, lr scale 0), and this is said instead of the noise advice.",
        "Check the reward functions' names and the dataset columns they read as keyword arguments, and that they "
        "return floats."),
    "weight_spread": Guide(
        f"Within a group the largest baseline weight is more than {WEIGHT_RATIO_WARNING:.0f}x the median: the "
        "gradient-weighted baseline of the others is then about that one completion's reward, and their advantages "
        "are as noisy as that one reward. `oblr/weight_spread` (the weights' coefficient of variation) shows it.",
        "Set `OBLRPOConfig(weight_clip=10)`: each weight is capped at 10x its group's median (counted in "
        "`oblr/clipped_weights`). `baseline=\"mean\"` removes the weights altogether (RLOO's baseline)."),
    "few_samples": Guide(
        "An optimizer step saw fewer than 2 SNR samples (prompts, or completions with "
        "`snr_sample_unit=\"completion\"`), so its SNR is undefined: that step runs at the scheduled lr, unscaled, "
        "and logs no `oblr/snr`.",
        "Give each optimizer step at least 2 prompts: raise `per_device_train_batch_size` or "
        "`gradient_accumulation_steps`, or lower `num_generations`."),
    "nonfinite_grad": Guide(
        "The step's gradient norm was NaN or infinite (an overflow, or a NaN loss): its SNR cannot be formed, so the "
        "step runs at `lr_scale_min` (0 by default: it does not move).",
        "Once is harmless. If it recurs: fp16 overflows, so train with `bf16=True` and float32 weights, lower "
        "`learning_rate`, or check the rewards and the model for NaN."),
    "deepspeed_skipped": Guide(
        "DeepSpeed's loss scaler found an overflow and skipped the optimizer step; OBLR-PO dropped that step's SNR "
        "samples with it, and the next step is sized from its own.",
        "Nothing, if rare (fp16 loss scaling skips a few steps by design). If frequent, train in bf16."),
    "zero_snr": Guide(
        "The SNR estimate is 0: the step's gradients disagree so much that the signal estimate (`||G||^2` less its "
        "noise) is at or below 0, and the step runs at `lr_scale_min`. Given by `snr_estimator` `\"per_step\"`, "
        "`\"ema\"` and `\"window\"`; the default `\"ema_soft\"` takes a small step instead and never gives it.",
        "If it persists: give each step more prompts, set `lr_scale_min` (e.g. 0.05), or pool steps "
        "(`snr_estimator=\"ema_soft\"`, the default, or `\"ema\"`, `\"window\"`)."),
    "zero_gradient": Guide(
        "The step's gradient was exactly 0: every group's rewards were identical (all right or all wrong), or no "
        "completion was scorable or left in the loss. There is nothing to size: the lr scale is 0 (`lr_scale_min` if "
        "set) and the SNR estimate is left as it was.",
        "If it persists the rewards do not vary within groups: check the reward functions (`reward_std` in TRL's "
        "logs), raise `num_generations` or the sampling `temperature`, or pick prompts that are neither too easy nor "
        "too hard for the model."),
    "stalled": Guide(
        f"The applied lr has stayed below {STALL_SCALE:.0%} of the scheduled one (`learning_rate`) for {STALL_STEPS} steps "
        "in a row: the SNR estimate finds each step's gradient mostly noise, or zero, and the steps barely move the "
        "model. `oblr/lr_scale` and `oblr/lr` show it.",
        "Check that the rewards vary within groups and are finite (`oblr/reward_mean`, TRL's `reward_std`, "
        "`oblr/unscorable`); give each step more prompts; or set `lr_scale_min` (e.g. 0.05) to keep a floor, or "
        "`snr_lr=False` for GRPO's constant step."),
    "group_span": Guide(
        "With `snr_sample_unit=\"group\"`, a prompt's completions are split across processes, so a group cannot be "
        "one sample: the SNR counts completions instead (their noise is correlated, so it is misestimated).",
        "Make `per_device_train_batch_size x steps_per_generation` a multiple of `num_generations`."),
    "precision": Guide(
        "The model's trainable weights are bf16 or fp16, and at the applied lr (`learning_rate` shaped by the SNR "
        "factor; with `snr_lr_mode=\"eta_max\"` often far below it) most updates are below half a weight's "
        "spacing: they round away and those weights never change.",
        "Load the model in float32 and train with `bf16=True` (autocast keeps float32 master weights), or raise "
        "`learning_rate`."),
}


class Advice:
    """Logs each warning key's text (`WARNINGS`) the first time it is given, and never again in this run."""

    def __init__(self):
        self.given: set[str] = set()

    def __call__(self, *keys: str, **fmt) -> None:
        for key in keys:
            if key not in self.given:
                self.given.add(key)
                logger.warning(WARNINGS[key].format(**fmt))
