"""Quieter TRL logs for what OBLR-PO handles by design.

TRL's `GRPOTrainer._calculate_rewards` (trl/trainer/grpo_trainer.py, TRL 1.16) warns with a dump of the whole data row
("All reward functions returned None for the following kwargs: ... Please ensure that at least one reward function
returns a valid reward.") on EVERY step in which some completion got None from every reward function. OBLR-PO's
docs recommend exactly that (docs/troubleshooting.md, "Degenerate data") for unscorable completions: they get advantage 0, enter no baseline, and are counted
in `oblr/unscorable`. `AllNoneRewardsOnce` lets the first such warning through (the row helps to debug a reward
function), with a note on what OBLR-PO does with those completions, and drops the repeats.

Install it with `install_all_none_reward_filter()` (idempotent; each call shows the warning once more, so a new trainer
warns again once). It is a `logging.Filter` on TRL's module logger: nothing of TRL's is patched.
"""

from __future__ import annotations

import logging

TRL_GRPO_LOGGER = "trl.trainer.grpo_trainer"
ALL_NONE_MESSAGE = "All reward functions returned None"
NOTE = (
    "\n(oblr-trl: OBLR-PO treats such completions as unscorable: advantage 0, part of no baseline, counted in "
    "`oblr/unscorable`. This warning is shown once; later ones are dropped.)"
)


class AllNoneRewardsOnce(logging.Filter):
    """Pass TRL's all-None-rewards warning once (with `NOTE` appended), drop the repeats, pass everything else."""

    def __init__(self) -> None:
        super().__init__()
        self.shown = False
        self.dropped = 0

    def reset(self) -> None:
        self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        if ALL_NONE_MESSAGE not in str(record.msg):
            return True
        if self.shown:
            self.dropped += 1
            return False
        self.shown = True
        record.msg = f"{record.msg}{NOTE}"
        return True


def install_all_none_reward_filter(logger_name: str = TRL_GRPO_LOGGER) -> AllNoneRewardsOnce:
    """Add `AllNoneRewardsOnce` to TRL's GRPO logger (once per process) and re-arm it; return the filter."""
    logger = logging.getLogger(logger_name)
    for existing in logger.filters:
        if isinstance(existing, AllNoneRewardsOnce):
            existing.reset()
            return existing
    installed = AllNoneRewardsOnce()
    logger.addFilter(installed)
    return installed
