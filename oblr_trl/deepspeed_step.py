"""The SNR step size under DeepSpeed ZeRO (stages 1, 2, 3): where it is applied, and what it needs.

Under DeepSpeed, Accelerate's ``backward`` calls ``engine.step()`` at the accumulation boundary, inside the Trainer's
``training_step``. The engine's step runs the ZeRO optimizer's ``step``, which (1) reduces/partitions the gradients,
(2) computes the global, all-reduced, unscaled and *pre-clip* gradient norm into ``_global_grad_norm``, (3) clips
and (4) calls the wrapped torch optimizer's ``step`` (once per parameter group or ZeRO-3 sub-group), then the engine
steps its lr scheduler. The seam:

* a step pre-hook on the wrapped torch optimizer: at its first call of an optimizer step the gradients are reduced and
  the norm is known, the parameters have not moved: the trainer sizes the step from ``_global_grad_norm ** 2`` and
  scales every parameter group's lr;
* a wrapper around the ZeRO optimizer's ``step``: afterwards (before the engine's scheduler steps) the scheduled lr
  is put back, and a step DeepSpeed skipped (overflow) is reported so its samples are dropped.

No trainer state here: :class:`ZeroStepHook` holds the callables the trainer gives it (the trainer's
:class:`.step_sizer.StepSizer` does the sizing).
"""

from __future__ import annotations

from typing import Callable

import torch

from .step_sizer import squared_norm

def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage of a (filled-in) DeepSpeed config; 0 where ZeRO is off."""
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0) or 0)


def config_refusal(ds_config: dict) -> str | None:
    """Why OBLR-PO cannot run with this DeepSpeed config (a message naming the option and the alternative), or
    ``None``. Without ZeRO (stage 0) there is no ZeRO optimizer step to hook. ZeRO-3 parameter offload is not refused: ZeRO-3's
    module hooks fetch offloaded parameters for the norms pass as for any forward, and the head is gathered with
    ``deepspeed.zero.GatheredParameters`` (tested against a plain run)."""
    stage = zero_stage(ds_config)
    if stage not in (1, 2, 3):
        return (f"OBLRPOTrainer supports DeepSpeed with ZeRO stages 1, 2 and 3 (zero_optimization.stage); got stage "
                f"{stage}. Set zero_stage: 1, 2 or 3, or use DDP (accelerate launch --multi_gpu).")
    return None


def reported_grad_sq_norm(norm) -> float:
    """``||G||^2`` from the global gradient norm DeepSpeed reported (a float or a 0-d tensor; ``None``: not computed).
    Without DeepSpeed the trainer forms it from ``.grad``: :func:`.step_sizer.parameters_grad_sq_norm`."""
    if norm is None:
        raise RuntimeError(
            "DeepSpeed computed no global gradient norm for this step (the ZeRO optimizer's compute_grad_norm is "
            "off); OBLR-PO's SNR step size needs it. Report your DeepSpeed version, or set snr_lr=False."
        )
    return squared_norm(norm)


def zero_optimizer(engine):
    """The engine's ZeRO optimizer (stage 1/2 ``DeepSpeedZeroOptimizer`` or stage 3 ``DeepSpeedZeroOptimizer_Stage3``)
    and the torch optimizer it steps; refuses anything else (e.g. ZeRO off, DeepSpeed's BF16_Optimizer)."""
    zero = engine.optimizer
    base = getattr(zero, "optimizer", None)
    name = type(zero).__name__
    if not name.startswith("DeepSpeedZeroOptimizer") or not isinstance(base, torch.optim.Optimizer):
        raise NotImplementedError(
            f"OBLRPOTrainer hooks DeepSpeed's ZeRO optimizer (stages 1-3); this engine's optimizer is {name}. Set "
            "zero_optimization.stage to 1, 2 or 3."
        )
    return zero, base


class ZeroStepHook:
    """Has each ZeRO optimizer step sized exactly once, between the gradient reduction and the parameter update.

    ``size(grad_sq_norm)``: the trainer's SNR step (scales every param group's lr); ``restore()``: puts the scheduled
    lr back; ``skipped()``: DeepSpeed skipped the step (overflow): drop its samples. ``groups``: the param-group dicts
    whose lr is set (ZeRO stage 1/2 swaps ``optimizer.param_groups`` for one group per inner call; the dicts stay).
    """

    def __init__(self, zero, base: torch.optim.Optimizer, size: Callable[[float], None], restore: Callable[[], None],
                 skipped: Callable[[], None]):
        self.zero, self.base, self.groups = zero, base, list(base.param_groups)
        self._size, self._restore, self._skipped = size, restore, skipped
        self.sized = False
        self.steps = 0  # optimizer steps sized so far
        self._handle = base.register_step_pre_hook(self._pre_step)
        self._original_step = zero.step
        zero.step = self._step

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self.sized:
            self.sized = True
            self._size(reported_grad_sq_norm(getattr(self.zero, "_global_grad_norm", None)))
            self.steps += 1

    def _step(self, *args, **kwargs):
        self.sized = False
        try:
            return self._original_step(*args, **kwargs)
        finally:
            if self.sized:
                self._restore()
            else:
                self._skipped()
            self.sized = False

    def remove(self) -> None:
        self._handle.remove()
        self.zero.step = self._original_step
