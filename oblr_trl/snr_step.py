"""The SNR step size (Theorem 4) applied to a torch optimizer: one object that owns the mechanism across a step.

:class:`StepSizer` holds what lives between a step's micro-batches and across steps: the step's SNR samples (recorded
by the loss), the SNR estimator's state and the running lr statistics (both checkpointed), and the learning rates it
scaled (restored right after the optimizer step, so no scheduler compounds the scale). :meth:`StepSizer.size` returns
the metrics to log and the warnings found; the formulas are :func:`.step_size.snr_step_size`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from .estimators import unit_sq_norms
from .step_size import LrStats, SNRState, snr_step_size

STATE_NAME = "oblr_state.json"  # OBLR-PO's cross-step state, beside trainer_state.json in each checkpoint


@dataclass
class StepSamples:
    """The SNR samples of the optimizer step in progress, on this rank: per-row terms recorded by the two-pass path
    (unit, position, ``a_i = c_i A_i``, within-unit Gram row) and whole-unit ``||H_q||^2`` formed by ``one_backward``."""

    rows: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    formed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def reduce_all_ranks(self) -> tuple[float, int]:
        """``(sum_q ||H_q||^2, N)`` over every rank's samples of the step (a collective call); empties the record."""
        everyone = gather_object([(self.rows, self.formed)])
        self.rows, self.formed = [], []
        rows = [r for rank_rows, _ in everyone for r in rank_rows]
        formed = [f for _, rank_formed in everyone for f in rank_formed]
        total, n = 0.0, 0
        if rows:
            _, sq = unit_sq_norms(*(torch.cat(part) for part in zip(*rows)))
            total, n = total + float(sq.sum()), n + sq.numel()
        for units, sq in formed:
            total, n = total + float(sq.sum()), n + units.numel()
        return total, n


def grad_sq_norm(parameters, scaler=None) -> float:
    """``||G||^2`` of the step's (all-reduced, pre-clip) gradient, on every rank (FSDP2 shards gathered; fp16's loss
    scale divided out)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # FSDP2: a norm of DTensor shards
        norm = norm.full_tensor()
    if scaler is not None and scaler.is_enabled():  # fp16: gradients are still scaled here
        norm = norm / scaler.get_scale()
    return float(norm) ** 2


class StepSizer:
    """Sizes each optimizer step by ``N SNR / (1 + N SNR)`` from the samples recorded during it (see the module)."""

    def __init__(self, args):
        self.args = args
        self.samples = StepSamples()
        self.snr_state = SNRState()
        self.lr_stats = LrStats()
        self._saved: list[float] | None = None  # the scheduled lrs of the groups scaled this step
        self._groups: list[dict] = []

    @property
    def sized(self) -> bool:
        """Whether the step about to run has had its size set."""
        return self._saved is not None

    def record_rows(self, rows: torch.Tensor, unit: int, a: torch.Tensor, gram: torch.Tensor) -> None:
        """The two-pass path's terms of one micro-batch: row ids, ``a_i = c_i A_i`` and within-unit Gram rows."""
        self.samples.rows.append((rows.div(unit, rounding_mode="floor").cpu(), (rows % unit).cpu(), a.double().cpu(),
                                  gram.double().cpu()))

    def record_formed(self, units: torch.Tensor, unit_sq: torch.Tensor) -> None:
        """``one_backward``'s whole-unit ``||H_q||^2``, with the units' ids."""
        self.samples.formed.append((units.cpu(), unit_sq.double().cpu()))

    def drop_samples(self) -> None:
        """Forget the step's samples on every rank (DeepSpeed skipped the step)."""
        self.samples.reduce_all_ranks()

    def size(self, groups: list[dict], grad_sq_norm: float, unscored: bool = False) -> tuple[dict, list[str]]:
        """Scales the lr of ``groups`` by this step's SNR factor; returns the metrics to log (without the ``oblr/``
        prefix) and the warning keys. ``unscored``: the batch had no reward at all (an SNR of 0 is then that, not
        noise)."""
        sum_sq, n = self.samples.reduce_all_ranks()
        a = self.args
        step, self.snr_state = snr_step_size(
            a.snr_estimator, sum_sq, grad_sq_norm, n, self.snr_state, beta=a.snr_ema, window=a.snr_window,
            lr_scale_min=a.lr_scale_min,
        )
        warnings = [] if step.status == "ok" or (step.status == "zero_snr" and unscored) else [step.status]
        self._saved, self._groups = [group["lr"] for group in groups], groups
        for group in groups:
            group["lr"] = group["lr"] * step.scale
        applied = groups[0]["lr"]
        self.lr_stats = self.lr_stats.record(step.scale, applied)
        metrics = {"lr_scale": step.scale, "num_samples": float(n), "lr": applied, **self.lr_stats.metrics()}
        if step.snr == step.snr:  # undefined (fewer than 2 samples, non-finite gradient): not logged, warned
            metrics["snr"] = step.snr
        return metrics, warnings

    def restore(self) -> None:
        """Put back the scheduled lrs (after the optimizer step)."""
        if self._saved is not None:
            for group, lr in zip(self._groups, self._saved):
                group["lr"] = lr
            self._saved = None

    def save(self, folder: str, global_step: int) -> None:
        with open(os.path.join(folder, STATE_NAME), "w") as f:  # the SNR estimator's state, lr statistics
            json.dump({"version": 2, "global_step": global_step, "snr_state": self.snr_state.to_dict(),
                       "lr_stats": self.lr_stats.to_dict()}, f)

    def load(self, checkpoint: str) -> str | None:
        """Restore the state saved in ``checkpoint``; returns why it could not (a message to warn with), or None."""
        path = os.path.join(checkpoint, STATE_NAME)
        if not os.path.isfile(path):
            if self.args.snr_lr and self.args.snr_estimator != "per_step":
                return (f"{checkpoint} has no {STATE_NAME} (saved by another trainer or an older oblr-trl): the SNR "
                        "EMA restarts from this step's samples.")
            return None
        with open(path) as f:
            saved = json.load(f)
        if "snr_state" not in saved:
            return f"{path} predates the SNR estimator's state (an older oblr-trl): the estimate restarts."
        self.snr_state = SNRState.from_dict(saved["snr_state"])
        self.lr_stats = LrStats.from_dict(saved.get("lr_stats", {}))
        return None


class RestoreScheduledLR(TrainerCallback):
    """Puts back the scheduled learning rate right after the optimizer step, so no scheduler compounds the scale."""

    def __init__(self, sizer: StepSizer):
        self.sizer = sizer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.sizer.restore()
