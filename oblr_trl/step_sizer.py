"""The SNR step size (Theorem 4) applied to a torch optimizer: one object that owns the mechanism across a step.

:class:`StepSizer` holds what lives between a step's micro-batches and across steps: the step's SNR samples (recorded
by the loss), the SNR estimator's state, the running lr statistics and the calibration of ``snr_lr_mode="calibrated"``
(all checkpointed), and the learning rates it
scaled (restored right after the optimizer step, so no scheduler compounds the scale). :meth:`StepSizer.size` returns
the metrics to log and the warnings found; the formulas are :func:`.snr_formulas.snr_step_size`'s and
:func:`.snr_formulas.calibrated_multiplier`'s. The step's
``||G||^2``: :func:`parameters_grad_sq_norm` (under DeepSpeed, :func:`.deepspeed_step.reported_grad_sq_norm`, called
from :class:`.deepspeed_step.ZeroStepHook`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from .estimators import unit_sq_norms
from . import state_file
from .snr_formulas import CALIBRATION_STEPS, Calibration, LrStats, SNRState, calibrated_multiplier, snr_step_size


@dataclass
class StepSamples:
    """The SNR samples of the optimizer step in progress, on this rank: per-row terms recorded by the two-pass path
    (unit, position, ``a_i = c_i A_i``, within-unit Gram row) and whole-unit ``||H_q||^2`` formed by ``one_backward``."""

    rows: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    formed: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (units, sum of their ||H_q||^2)

    def reduce_all_ranks(self) -> tuple[float, int]:
        """``(sum_q ||H_q||^2, N)`` over every rank's samples of the step (a collective call); empties the record."""
        # one_backward's ||H_q||^2 summed on the device, read by the host in one transfer (one sync, not 3)
        sums = [sq for _, sq in self.formed]
        local = [(sum(count for count, _ in self.formed), float(torch.stack(sums).sum()))] if sums else []
        everyone = gather_object([(self.rows, local)])
        self.rows, self.formed = [], []
        rows = [r for rank_rows, _ in everyone for r in rank_rows]
        formed = [f for _, rank_formed in everyone for f in rank_formed]
        total, n = 0.0, 0
        if rows:
            _, sq = unit_sq_norms(*(torch.cat(part) for part in zip(*rows)))
            total, n = total + float(sq.sum()), n + sq.numel()
        for count, sq in formed:  # each rank's whole-unit sums, read once (record_formed keeps them on the device)
            total, n = total + sq, n + count
        return total, n


UNSIZED_STEP = (
    "OBLRPOTrainer: an optimizer step is about to run without its SNR step size (snr_lr=True). The step size is set in "
    "training_step at the step's last micro-batch; this training loop stepped the optimizer elsewhere. Report your "
    "transformers/accelerate versions, or set snr_lr=False.")


def guard_optimizer(optimizer, hook) -> None:
    """Register ``hook`` (which refuses an unsized step) as a step pre-hook once, on the torch optimizer itself:
    a second ``train()`` hands back Accelerate's wrapper, which has no hooks of its own."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not getattr(optimizer, "_oblr_guarded", False):
        optimizer.register_step_pre_hook(hook)
        optimizer._oblr_guarded = True


def squared_norm(norm) -> float:
    """A gradient norm (a float or a 0-d tensor) squared, as a float; NaN where it is not finite (the SNR step treats
    inf and NaN alike: :func:`.snr_formulas.snr_step_size`'s ``"nonfinite_grad"``)."""
    value = float(norm.item() if torch.is_tensor(norm) else norm)
    return value * value if math.isfinite(value) else float("nan")


def parameters_grad_sq_norm(parameters, scaler=None) -> float:
    """``||G||^2`` of the step's (all-reduced, pre-clip) gradient from the parameters' ``.grad``, on every rank (FSDP2
    shards gathered; fp16's loss scale divided out). Under DeepSpeed, ZeRO reports the norm itself:
    :func:`.deepspeed_step.reported_grad_sq_norm`."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if not any(hasattr(g, "device_mesh") for g in grads) and len({(g.device, g.dtype) for g in grads}) == 1:
        # one operator for every gradient (as get_total_norm's foreach path on a GPU), on any device
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # FSDP2: a norm of DTensor shards
        norm = norm.full_tensor()
    if scaler is not None and scaler.is_enabled():  # fp16: gradients are still scaled here
        norm = norm / scaler.get_scale()
    return squared_norm(norm)


class StepSizer:
    """Sizes each optimizer step by its SNR factor ``N SNR / (1 + N SNR)`` from the samples recorded during it, as
    ``snr_lr_mode`` says (see the module)."""

    def __init__(self, args):
        self.args = args
        self._saved: list[float] | None = None  # the scheduled lrs of the groups scaled this step
        self.reset()

    def reset(self) -> None:
        """A fresh run's state (``train()`` without a checkpoint: no samples, a fresh estimate and statistics)."""
        self.abandon()
        self.snr_state, self.lr_stats, self.calibration = SNRState(), LrStats(), Calibration()

    def abandon(self) -> None:
        """Leave a step unfinished (``train()`` ended by an exception): scheduled lrs back, this rank's samples gone."""
        self.restore()
        self.samples, self._groups = StepSamples(), []

    @property
    def sized(self) -> bool:
        """Whether the step about to run has had its size set."""
        return self._saved is not None

    def record_rows(self, rows: torch.Tensor, unit: int, a: torch.Tensor, gram: torch.Tensor) -> None:
        """The two-pass path's terms of one micro-batch: row ids, ``a_i = c_i A_i`` and within-unit Gram rows, read by
        the host in one transfer (one sync, not 4; float64 holds the row ids exactly below 2^53)."""
        columns = (rows.div(unit, rounding_mode="floor"), rows % unit, a.detach())
        packed = torch.cat([torch.stack([c.double() for c in columns], 1), gram.detach().double()], dim=1).cpu()
        self.samples.rows.append((packed[:, 0].long(), packed[:, 1].long(), packed[:, 2], packed[:, 3:]))

    def record_formed(self, units: torch.Tensor, unit_sq: torch.Tensor) -> None:
        """``one_backward``'s whole-unit ``||H_q||^2``, with the units' ids."""
        self.samples.formed.append((units.numel(), unit_sq.double().sum()))  # on the device until the step is sized

    def drop_samples(self) -> list[str]:
        """Forget the step's samples on every rank (DeepSpeed skipped the step: an overflow); returns the warning."""
        self.samples.reduce_all_ranks()
        return ["deepspeed_skipped"]

    def size(self, groups: list[dict], grad_sq_norm: float, unscored: bool = False) -> tuple[dict, list[str]]:
        """Scales the lr of ``groups`` by this step's multiplier: the SNR factor ``f`` (``snr_lr_mode="eta_max"``),
        or ``f / f_ref`` capped (``"calibrated"``, :func:`.snr_formulas.calibrated_multiplier`); returns the metrics
        to log (without the ``oblr/`` prefix) and the warning keys. ``lr_scale`` is the multiplier (applied lr /
        scheduled lr), ``snr_factor`` is ``f``, ``eta_max`` the scheduled lr / ``f_ref`` (the scheduled lr itself in
        ``"eta_max"`` mode). ``unscored``: the batch had no reward at all (an SNR of 0 is then that, not noise)."""
        sum_sq, n = self.samples.reduce_all_ranks()
        a = self.args
        step, self.snr_state = snr_step_size(
            a.snr_estimator, sum_sq, grad_sq_norm, n, self.snr_state, beta=a.snr_ema, window=a.snr_window,
            lr_scale_min=a.lr_scale_min,
        )
        quiet = step.status == "ok" or (unscored and step.status in ("zero_snr", "zero_gradient"))  # no_rewards says
        warnings = [] if quiet else [step.status]
        self._saved, self._groups = [group["lr"] for group in groups], groups
        scheduled = groups[0]["lr"] if groups else 0.0
        if a.snr_lr_mode == "calibrated":
            scale, self.calibration = calibrated_multiplier(step, self.calibration, lr_scale_min=a.lr_scale_min)
            reference = self.calibration.reference
            eta_max = scheduled / reference if reference > 0 else None  # not logged before the first positive factor
        else:  # "eta_max": the scheduled lr is eta_max
            scale, eta_max = step.scale, scheduled
        for group in groups:
            group["lr"] = group["lr"] * scale
        applied = groups[0]["lr"] if groups else 0.0
        self.lr_stats = self.lr_stats.record(scale, applied)
        if self.lr_stats.stalled:
            warnings.append("stalled")
        metrics = {"lr_scale": scale, "num_samples": float(n), "lr": applied, **self.lr_stats.metrics()}
        if step.factor == step.factor:  # an estimate ("ok", "zero_snr" steps)
            metrics["snr_factor"] = step.factor
        if eta_max is not None:
            metrics["eta_max"] = eta_max
        if step.snr == step.snr:  # undefined (fewer than 2 samples, non-finite gradient): not logged, warned
            metrics["snr"] = step.snr
        if step.noise_scale == step.noise_scale:  # undefined or unbounded (signal <= 0): not logged
            metrics["noise_scale"] = step.noise_scale
        return metrics, warnings

    def restore(self) -> None:
        """Put back the scheduled lrs (after the optimizer step)."""
        if self._saved is not None:
            for group, lr in zip(self._groups, self._saved):
                group["lr"] = lr
            self._saved = None

    def save(self, run_dir: str, global_step: int) -> None:
        """Write the state into ``run_dir/checkpoint-<global_step>`` (atomically; :func:`.state_file.write_state`)."""
        state_file.write_state(state_file.checkpoint_folder(run_dir, global_step), global_step, self.snr_state,
                               self.lr_stats, self.calibration)

    def load(self, checkpoint: str, global_step: int | None = None) -> str | None:
        """Restore the state saved in ``checkpoint`` (validated: a damaged file raises
        :class:`.state_file.StateFileError`); returns why there was none to restore (a message to warn with), or
        None. No note where the run would not use the estimator's state (``snr_lr=False``, ``"per_step"``)."""
        state, note = state_file.read_state(checkpoint, global_step)
        if state is None:
            self.snr_state, self.lr_stats, self.calibration = SNRState(), LrStats(), Calibration()
            carried = self.args.snr_estimator != "per_step" or self.args.snr_lr_mode == "calibrated"
            return note if self.args.snr_lr and carried else None
        self.snr_state, self.lr_stats, calibration = state
        self.calibration = Calibration() if calibration is None else calibration
        if calibration is None and self.args.snr_lr and self.args.snr_lr_mode == "calibrated":
            return (f"{checkpoint}/{state_file.STATE_NAME} predates the calibrated learning rate (an older oblr-trl, "
                    f"where learning_rate was eta_max): eta_max is calibrated again from the next "
                    f"{CALIBRATION_STEPS} steps.")
        return None


class RestoreScheduledLR(TrainerCallback):
    """Puts back the scheduled learning rate right after the optimizer step, so no scheduler compounds the scale."""

    def __init__(self, sizer: StepSizer):
        self.sizer = sizer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.sizer.restore()
