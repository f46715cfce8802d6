"""`StepSizer`: scales exactly the step it was asked to, by `snr_step_size`'s factor computed from the recorded
samples; restores the scheduled lr; its state survives save/load; warnings are returned, not logged."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from oblr_trl.state_file import STATE_NAME
from oblr_trl.step_sizer import StepSizer, parameters_grad_sq_norm
from oblr_trl.snr_formulas import CALIBRATION_STEPS, STALL_SCALE, STALL_STEPS, snr_step_size


def config(**kw):
    return SimpleNamespace(**{**dict(snr_estimator="per_step", snr_ema=0.9, snr_window=10, lr_scale_min=0.0,
                                     snr_lr=True, snr_lr_mode="eta_max"), **kw})


def record_units(sizer, unit_sq):
    sizer.record_formed(torch.arange(len(unit_sq)), torch.tensor(unit_sq))


def test_size_applies_snr_step_size_to_the_groups_and_restore_puts_the_lr_back():
    sizer = StepSizer(config())
    groups = [{"lr": 1e-3}, {"lr": 2e-3}]
    record_units(sizer, [1.0, 2.0, 0.5, 1.5])
    metrics, warnings = sizer.size(groups, grad_sq_norm=9.0)
    decision, _ = snr_step_size("per_step", 5.0, 9.0, 4)
    assert sizer.sized and warnings == []
    assert [g["lr"] for g in groups] == pytest.approx([1e-3 * decision.scale, 2e-3 * decision.scale])
    assert metrics["lr_scale"] == decision.scale and metrics["num_samples"] == 4.0 and metrics["snr"] == decision.snr
    assert metrics["noise_scale"] == pytest.approx(1 / decision.snr)  # McCandlish's B, in prompts
    sizer.restore()
    assert [g["lr"] for g in groups] == [1e-3, 2e-3] and not sizer.sized
    assert sizer.samples.formed == []  # emptied by the step


def test_degenerate_steps_return_their_warning_keys():
    sizer = StepSizer(config())
    record_units(sizer, [1.0])
    metrics, warnings = sizer.size([{"lr": 1.0}], grad_sq_norm=1.0)
    assert warnings == ["few_samples"] and "snr" not in metrics and "noise_scale" not in metrics
    sizer.restore()
    record_units(sizer, [1.0, 1.0, 1.0, 1.0])  # mean sample norm 1, batch norm 0: no signal
    metrics, warnings = sizer.size([{"lr": 1.0}], grad_sq_norm=0.0)
    assert warnings == ["zero_snr"] and "noise_scale" not in metrics  # unbounded: not logged (never inf), warned
    assert all(math.isfinite(v) for v in metrics.values())
    sizer.restore()
    record_units(sizer, [1.0, 1.0, 1.0, 1.0])
    _, warnings = sizer.size([{"lr": 1.0}], grad_sq_norm=0.0, unscored=True)  # no reward at all: not noise's fault
    assert warnings == []


def test_state_round_trips_through_a_checkpoint_folder(tmp_path):
    sizer = StepSizer(config(snr_estimator="ema"))
    record_units(sizer, [1.0, 2.0, 0.5, 1.5])
    sizer.size([{"lr": 1.0}], grad_sq_norm=9.0)
    sizer.save(str(tmp_path), global_step=7)  # the run's folder: the file goes into its checkpoint-7
    checkpoint = tmp_path / "checkpoint-7"
    assert json.loads((checkpoint / STATE_NAME).read_text())["global_step"] == 7
    assert [p.name for p in checkpoint.iterdir()] == [STATE_NAME]  # no temporary file left behind
    other = StepSizer(config(snr_estimator="ema"))
    assert other.load(str(checkpoint), global_step=7) is None
    assert other.snr_state == sizer.snr_state and other.lr_stats == sizer.lr_stats
    assert other.calibration == sizer.calibration
    missing = StepSizer(config(snr_estimator="ema")).load(str(tmp_path / "nothing"))
    assert f"no {STATE_NAME}" in missing and "another trainer" in missing and "crash" in missing


def test_zero_gradient_step_scales_to_zero_and_warns_unless_unscored():
    sizer = StepSizer(config(snr_estimator="ema_soft"))
    record_units(sizer, [1.0, 2.0, 0.5, 1.5])
    sizer.size([{"lr": 1.0}], grad_sq_norm=9.0)  # an informative step: a positive scale, a state to keep
    sizer.restore()
    state = sizer.snr_state
    record_units(sizer, [0.0, 0.0, 0.0, 0.0])
    metrics, warnings = sizer.size([{"lr": 1.0}], grad_sq_norm=0.0)
    assert metrics["lr_scale"] == 0.0 and warnings == ["zero_gradient"] and sizer.snr_state == state
    sizer.restore()
    record_units(sizer, [0.0, 0.0, 0.0, 0.0])
    assert sizer.size([{"lr": 1.0}], grad_sq_norm=0.0, unscored=True)[1] == []  # no_rewards says it


def test_stall_is_warned_after_stall_steps_below_stall_scale():
    """ema_soft on steps whose signal estimate is +-0.07 around 0 against a noise of ~16: each scale is small but not 0
    (no zero-SNR warning): the stall warning is the one that says so, at the STALL_STEPS-th step in a row."""
    sizer = StepSizer(config(snr_estimator="ema_soft"))
    warned_at, scales = [], []
    for step in range(STALL_STEPS + 4):
        record_units(sizer, [1.0, 1.0, 1.0, 1.0])
        metrics, warnings = sizer.size([{"lr": 1.0}], grad_sq_norm=4.05 if step % 2 else 3.95)
        sizer.restore()
        scales.append(metrics["lr_scale"])
        warned_at += [step] if "stalled" in warnings else []
        assert "zero_snr" not in warnings or step == 0
    # the first step has no spread across steps: its own samples bound its standard error (step_signal_se), so it
    # is not clipped to 0 (a step of a real size); the later ones are, and the streak starts at step 1
    assert scales[0] > STALL_SCALE and all(0.0 < s < STALL_SCALE for s in scales[1:]), scales
    assert warned_at[0] == STALL_STEPS, warned_at
    record_units(sizer, [1.0, 2.0, 0.5, 1.5])
    sizer.size([{"lr": 1.0}], grad_sq_norm=9.0)  # a clear step ends the streak
    assert sizer.lr_stats.low_streak == 0


def test_reset_and_abandon_leave_a_fresh_sizer_and_the_scheduled_lr():
    sizer = StepSizer(config(snr_estimator="ema"))
    groups = [{"lr": 1e-3}]
    record_units(sizer, [1.0, 2.0, 0.5, 1.5])
    sizer.size(groups, grad_sq_norm=9.0)
    record_units(sizer, [1.0, 2.0])  # a next step's samples, recorded before an exception
    sizer.abandon()
    assert groups[0]["lr"] == 1e-3 and not sizer.sized and sizer.samples.formed == []
    assert sizer.lr_stats.steps == 1  # the finished step still counts
    sizer.reset()
    assert sizer.lr_stats.steps == 0 and sizer.snr_state.steps == 0


def test_parameters_grad_sq_norm_is_the_squared_total_norm_and_skips_parameters_without_grad():
    a, b, c = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    a.grad, b.grad = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([4.0, 0.0])
    assert parameters_grad_sq_norm([a, b, c]) == pytest.approx(25.0)
    assert parameters_grad_sq_norm([c]) == 0.0
    c.grad = torch.tensor([float("inf")])  # not finite: NaN, as DeepSpeed's reported norm (one squared_norm)
    assert math.isnan(parameters_grad_sq_norm([a, c]))


def test_the_two_pass_rows_are_read_in_one_transfer_and_their_sum_is_the_per_unit_quadratic_form(monkeypatch):
    """record_rows packs a micro-batch's row ids, a_i and Gram rows into one tensor for the host (one sync, not 4):
    the ids stay exact beyond float32's 2^24 (they count up over training), and the step's sum_q ||H_q||^2 is
    sum_q a_q^T G_q a_q whether a unit's rows came in one micro-batch or two."""
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: calls.append(1) or real(t, *a, **k))
    base, unit = 2**40, 2  # row ids far beyond float32's exact integers
    a = torch.tensor([1.0, -2.0, 0.5, 3.0])
    gram = torch.tensor([[2.0, 0.5], [0.5, 1.0], [4.0, -1.0], [-1.0, 3.0]])  # each row's Gram row within its unit
    rows = base + torch.arange(4)
    whole, split = StepSizer(config()), StepSizer(config())
    whole.record_rows(rows, unit, a, gram)
    assert len(calls) == 1
    ids = whole.samples.rows[0][0]
    assert ids.dtype == torch.int64 and ids.tolist() == [base // 2, base // 2, base // 2 + 1, base // 2 + 1]
    for part in ([0, 2], [1, 3]):  # each unit's two rows in different micro-batches
        split.record_rows(rows[part], unit, a[part], gram[part])
    expected = sum(float(a[q] @ gram[q] @ a[q]) for q in ([0, 1], [2, 3]))  # gram[q] is the unit's 2 x 2 Gram
    for sizer in (whole, split):
        total, n = sizer.samples.reduce_all_ranks()
        assert n == 2 and total == pytest.approx(expected)


def test_calibrated_mode_applies_the_scheduled_lr_while_calibrating_then_f_over_f_ref():
    """snr_lr_mode="calibrated": the first CALIBRATION_STEPS steps apply exactly the scheduled lr while f_ref (their
    mean factor) is measured; then each applies f / f_ref of it; logged with the factor and eta_max = lr / f_ref."""
    sizer = StepSizer(config(snr_lr_mode="calibrated"))
    steps = [([1.0, 2.0, 0.5, 1.5], 9.0), ([1.0, 1.0, 1.0, 1.0], 8.0), ([2.0, 0.5, 0.5, 1.0], 12.0)]
    factors = []
    for t in range(CALIBRATION_STEPS + 3):
        unit_sq, g2 = steps[t % 3]
        groups = [{"lr": 1e-3}, {"lr": 2e-3}]
        record_units(sizer, unit_sq)
        metrics, warnings = sizer.size(groups, grad_sq_norm=g2)
        decision, _ = snr_step_size("per_step", sum(unit_sq), g2, 4)
        factors.append(decision.scale)
        f_ref = sum(factors[:CALIBRATION_STEPS]) / min(len(factors), CALIBRATION_STEPS)
        m = 1.0 if t < CALIBRATION_STEPS else decision.scale / f_ref
        assert warnings == [] and metrics["snr_factor"] == decision.scale
        assert [g["lr"] for g in groups] == pytest.approx([1e-3 * m, 2e-3 * m], rel=1e-12)
        assert metrics["lr_scale"] == pytest.approx(m, rel=1e-12)
        assert metrics["eta_max"] == pytest.approx(1e-3 / f_ref, rel=1e-12)
        sizer.restore()
        assert [g["lr"] for g in groups] == [1e-3, 2e-3]
    assert len(set(factors)) == 3 and sizer.calibration.steps == CALIBRATION_STEPS
    assert sizer.calibration.factor_sum == pytest.approx(sum(factors[:CALIBRATION_STEPS]))


def test_calibrated_state_round_trips_and_a_version_2_checkpoint_calibrates_again(tmp_path):
    sizer = StepSizer(config(snr_lr_mode="calibrated", snr_estimator="ema"))
    record_units(sizer, [1.0, 2.0, 0.5, 1.5])
    sizer.size([{"lr": 1.0}], grad_sq_norm=9.0)
    sizer.save(str(tmp_path), global_step=1)
    other = StepSizer(config(snr_lr_mode="calibrated", snr_estimator="ema"))
    assert other.load(str(tmp_path / "checkpoint-1"), global_step=1) is None
    assert other.calibration == sizer.calibration and other.calibration.steps == 1
    path = tmp_path / "checkpoint-1" / STATE_NAME
    saved = json.loads(path.read_text())
    saved["version"] = 2
    del saved["calibration"]
    path.write_text(json.dumps(saved))
    note = other.load(str(tmp_path / "checkpoint-1"), global_step=1)
    assert "predates the calibrated learning rate" in note and other.calibration.steps == 0
    assert other.snr_state == sizer.snr_state  # the estimator's state is kept
    assert StepSizer(config(snr_estimator="ema")).load(str(tmp_path / "checkpoint-1"), global_step=1) is None
