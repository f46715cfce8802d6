"""Every warning OBLR-PO gives during training, and the one mechanism that gives each at most once per run.

The pieces of the step (:mod:`.advantages`, :mod:`.snr_step`, :mod:`.precision`, :mod:`.one_backward`) return the
keys of what they found; the trainer passes them to :class:`Advice`, which logs each key's text once.
"""

from __future__ import annotations

import logging

from .step_size import STALL_SCALE, STALL_STEPS

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
    "stalled": f"The applied learning rate has stayed below {STALL_SCALE:.0%} of the scheduled one (eta_max) for "
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


class Advice:
    """Logs each warning key's text (`WARNINGS`) the first time it is given, and never again in this run."""

    def __init__(self):
        self.given: set[str] = set()

    def __call__(self, *keys: str, **fmt) -> None:
        for key in keys:
            if key not in self.given:
                self.given.add(key)
                logger.warning(WARNINGS[key].format(**fmt))
