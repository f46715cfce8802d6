"""benchmarks/applied_lr.py: the applied lr over the first 10 steps against `learning_rate`, from its own records and
from the lr window's records of OBLR-PO in the calibrated mode (SmolLM2's rows), on synthetic logs whose figures are
computed here by hand."""

from __future__ import annotations

import json

import pytest

import applied_lr  # noqa: E402


def window_record(tmp_path, lr, lrs, factors, lr_mean=True, seed=0):
    """An ablation record of the calibrated arm (its history cut to the ablation's keys), one entry per step."""
    history, total = [], 0.0
    for step, (applied, f) in enumerate(zip(lrs, factors), start=1):
        total += applied
        entry = {"step": step, "reward": 0.1, "learning_rate": lr, "oblr/lr": applied, "oblr/lr_scale": applied / lr,
                 "oblr/eta_max": lr / 0.2}
        if f is not None:
            entry["oblr/snr_factor"] = f
        if lr_mean:
            entry["oblr/lr_mean"] = total / step
        history.append(entry)
    record = dict(model="SmolLM2-135M-Instruct", learning_rate=lr, lr_scheduler_type="constant", steps=len(lrs),
                  seed=seed, seconds_per_step=80.0, arm=applied_lr.WINDOW_ARM, lr=lr, finished="2026-12-02 04:00 UTC",
                  history=history)
    path = tmp_path / f"{applied_lr.WINDOW_ARM}_lr{lr:.3g}_seed{seed}.json"
    path.write_text(json.dumps(record))
    return path


def test_window_records_give_smollm2_rows_read_like_the_scripts_own(tmp_path):
    lr = 1.5e-4
    # steps 1-10 apply lr except step 3, whose gradient was exactly 0 (no factor, scale 0); then 1.5 x lr
    lrs = [lr] * 2 + [0.0] + [lr] * 7 + [1.5 * lr] * 10
    factors = [0.2, 0.2, None] + [0.2] * 7 + [0.3] * 10
    window_record(tmp_path, lr, lrs, factors)
    window_record(tmp_path, 5e-4, [5e-4] * 20, [0.1] * 20, lr_mean=False)  # kept before oblr/lr_mean was: left out
    records = applied_lr.window_records(tmp_path)
    assert [r["learning_rate"] for r in records] == [lr]
    (row,) = applied_lr.rows(records)
    assert row["prompts_per_step"] == 8 and row["model"] == "SmolLM2-135M-Instruct"
    assert row["lr_mean_10"] == pytest.approx(9 * lr / 10) and row["ratio"] == pytest.approx(0.9) and row["within"]
    assert row["no_gradient"] == 1 and row["with_gradient"] == pytest.approx(1.0)
    assert row["later"] == pytest.approx(1.5) and row["f_first"] == pytest.approx(0.2)
    assert row["f_later"] == pytest.approx(0.3)
    text = applied_lr.render([row], "2-core CPU")
    assert "| SmolLM2-135M-Instruct | 8 | 0.00015 | 0.000135 | 0.90 | yes | 1 | 1.00 | 1.50 |" in text
    assert "SmolLM2-135M-Instruct: 1 of 1 runs" in text and "1 of the lr window's" in text


def test_a_ratio_beyond_25_percent_is_not_within(tmp_path):
    lr = 5e-5
    window_record(tmp_path, lr, [0.0] * 3 + [lr] * 17, [None] * 3 + [0.1] * 17)  # 3 of 10 steps without a gradient
    (row,) = applied_lr.rows(applied_lr.window_records(tmp_path))
    assert row["ratio"] == pytest.approx(0.7) and not row["within"]
