"""oblr_trl.deepspeed_step without DeepSpeed or a model: the config checks, the norm, and the ZeroStepHook's seam on a
stand-in for a ZeRO optimizer that steps its torch optimizer as ZeRO stage 1/2 does (one param group per call)."""

import math

import pytest
import torch

from oblr_trl import deepspeed_step
from oblr_trl.path_choice import blockers
from oblr_trl import OBLRPOConfig


class DeepSpeedZeroOptimizer:
    """What the ZeroStepHook relies on in ZeRO stage 1/2: ``step`` sets ``_global_grad_norm`` (pre-clip), clips, then
    steps the wrapped torch optimizer once per param group with ``param_groups`` swapped to that one group."""

    def __init__(self, base, norm, overflow=False):
        self.optimizer, self.norm, self.overflow, self._global_grad_norm = base, norm, overflow, None

    def step(self):
        if self.overflow:  # DeepSpeed skips the whole step
            self._global_grad_norm = float("inf")
            return
        self._global_grad_norm = self.norm
        original = self.optimizer.param_groups
        for group in original:
            self.optimizer.param_groups = [group]
            self.optimizer.step()
        self.optimizer.param_groups = original


def make(norm=3.0, overflow=False):
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    base = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    return DeepSpeedZeroOptimizer(base, norm, overflow), base, (a, b)


def test_the_step_is_sized_once_before_the_parameters_move_and_restored_after():
    zero, base, (a, b) = make()
    calls, seen = [], []

    def size(sq):  # what the trainer does: scale every group's lr (the sizer's group dicts, not base.param_groups)
        calls.append((sq, a.detach().clone()))
        for group in sizer.groups:
            group["lr"] *= 0.5

    sizer = deepspeed_step.ZeroStepHook(zero, base, size=size, restore=lambda: [g.__setitem__("lr", lr) for g, lr in
                                                                             zip(sizer.groups, (0.1, 0.2))],
                                     skipped=lambda: seen.append("skipped"))
    base.register_step_pre_hook(lambda opt, args, kwargs: seen.append([g["lr"] for g in opt.param_groups]))
    zero.step()
    assert len(calls) == 1 and calls[0][0] == pytest.approx(9.0)  # ||G||^2 from DeepSpeed's norm, once per step
    torch.testing.assert_close(calls[0][1], torch.ones(2))  # sized before any parameter moved
    assert seen == [[0.05], [0.1]]  # each group stepped with its scaled lr
    torch.testing.assert_close(a.detach(), torch.full((2,), 0.95))
    torch.testing.assert_close(b.detach(), torch.full((3,), 0.9))
    assert [g["lr"] for g in base.param_groups] == [0.1, 0.2]  # restored before anything after the step (scheduler)
    zero.step()
    assert len(calls) == 2 and sizer.steps == 2  # the next step is sized again


def test_a_step_deepspeed_skips_is_reported_not_sized():
    zero, base, _ = make(overflow=True)
    events = []
    deepspeed_step.ZeroStepHook(zero, base, size=lambda sq: events.append("size"), restore=lambda: events.append("restore"),
                             skipped=lambda: events.append("skipped"))
    zero.step()
    assert events == ["skipped"]


def test_remove_undoes_the_seam():
    zero, base, _ = make()
    original = zero.step
    sizer = deepspeed_step.ZeroStepHook(zero, base, size=lambda sq: None, restore=lambda: None, skipped=lambda: None)
    assert zero.step != original
    sizer.remove()
    assert zero.step == original


def test_reported_grad_sq_norm():
    assert deepspeed_step.reported_grad_sq_norm(2.0) == 4.0
    assert deepspeed_step.reported_grad_sq_norm(torch.tensor(3.0)) == pytest.approx(9.0)
    assert math.isnan(deepspeed_step.reported_grad_sq_norm(float("inf")))
    with pytest.raises(RuntimeError, match="no global gradient norm"):
        deepspeed_step.reported_grad_sq_norm(None)


def test_config_refusal_names_the_option_and_the_alternative():
    for stage in (1, 2, 3):
        assert deepspeed_step.config_refusal({"zero_optimization": {"stage": stage}}) is None
    offload = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    assert deepspeed_step.config_refusal(offload) is None  # runs, and matches a plain run (test_deepspeed.py)
    for stage0 in ({}, {"zero_optimization": {"stage": 0}}):
        message = deepspeed_step.config_refusal(stage0)
        assert "zero_optimization.stage" in message and "zero_stage: 1, 2 or 3" in message and "DDP" in message


def test_zero_optimizer_refuses_what_is_not_zero():
    class Engine:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)

    with pytest.raises(NotImplementedError, match="zero_optimization.stage"):
        deepspeed_step.zero_optimizer(Engine())
    Engine.optimizer = DeepSpeedZeroOptimizer(Engine.optimizer, 1.0)
    assert deepspeed_step.zero_optimizer(Engine()) == (Engine.optimizer, Engine.optimizer.optimizer)


def test_one_backward_is_blocked_under_deepspeed_with_the_reason():
    args = OBLRPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True)
    assert blockers(args) == []
    (reason,) = blockers(args, deepspeed=True)
    assert reason.startswith("DeepSpeed") and "ZeRO" in reason
