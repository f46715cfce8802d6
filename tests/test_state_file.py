"""`oblr_trl.state_file`: `oblr_state.json` written atomically, every damaged form of it refused naming the file and
the fix, and the checkpoint to resume from chosen among complete ones. Files on disk, no trainer (the trainer-level
faults, real kills and corrupt checkpoints, are in tests/integration/test_save_crash.py)."""

from __future__ import annotations

import json
import os

import pytest

from oblr_trl.state_file import (STATE_NAME, TRAINER_STATE_NAME, StateFileError, parse_state, read_state,
                                 resume_point, write_state)
from oblr_trl.snr_formulas import Calibration, LrStats, SNRState

SNR = SNRState(steps=3, signal=0.5, noise=2.0, signal_sq=0.4, recent=((0.1, 1.0), (0.2, 2.0)))
STATS = LrStats(steps=3, skipped=1, lr_sum=0.02, scale_sum=0.6, low_streak=1)
CAL = Calibration(steps=3, factor_sum=0.7000000000000001)  # a float that only repr round-trips exactly


def good() -> dict:
    return {"version": 3, "global_step": 6, "snr_state": SNR.to_dict(), "lr_stats": STATS.to_dict(),
            "calibration": CAL.to_dict()}


def test_write_then_read_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = write_state(str(tmp_path / "checkpoint-6"), 6, SNR, STATS, CAL)
    assert os.listdir(tmp_path / "checkpoint-6") == [STATE_NAME] and path.endswith(STATE_NAME)
    assert read_state(str(tmp_path / "checkpoint-6"), 6) == ((SNR, STATS, CAL), None)


def test_a_version_2_file_reads_without_a_calibration():
    """oblr-trl before the calibrated mode wrote version 2 (no calibration): its state is kept, the calibration is
    None (the step sizer then calibrates again, with a note: tests/test_step_sizer.py)."""
    saved = good()
    saved["version"] = 2
    del saved["calibration"]
    assert parse_state(json.dumps(saved), "f.json") == (SNR, STATS, None)


def test_a_non_finite_state_is_not_written(tmp_path):
    with pytest.raises(ValueError):
        write_state(str(tmp_path), 1, SNRState(steps=1, signal=float("nan")), STATS)
    assert not os.path.exists(tmp_path / STATE_NAME)


def test_an_older_file_without_low_streak_reads_with_a_fresh_streak():
    saved = good()
    del saved["lr_stats"]["low_streak"]
    assert parse_state(json.dumps(saved), "f.json")[1] == LrStats(3, 1, 0.02, 0.6, 0)
    assert parse_state(json.dumps(saved), "f.json")[2] == CAL


def _damaged():
    text = json.dumps(good())
    cases = {
        "empty": ("", "the file is empty"),
        "blank": ("  \n", "the file is empty"),
        "garbage": ("\x00\x13not json", "not valid JSON"),
        "truncated": (text[: len(text) // 2], "not valid JSON"),
        "a list": ("[1, 2]", "not an object"),
        "an empty object": ("{}", "version is None"),
        "nan": (text.replace('"signal": 0.5', '"signal": NaN'), "NaN"),
        "inf": (text.replace('"lr_sum": 0.02', '"lr_sum": Infinity'), "Infinity"),
        "newer": (text.replace('"version": 3', '"version": 9'), "newer oblr-trl"),
    }
    for name, edit, problem in (
        ("no snr_state", lambda d: d.pop("snr_state"), "snr_state is None"),
        ("no steps", lambda d: d["snr_state"].pop("steps"), "lacks the key(s) ['steps']"),
        ("no lr_stats key", lambda d: d["lr_stats"].pop("lr_sum"), "lacks the key(s) ['lr_sum']"),
        ("string steps", lambda d: d["snr_state"].update(steps="3"), "snr_state.steps is '3', not an integer"),
        ("bool steps", lambda d: d["lr_stats"].update(steps=True), "lr_stats.steps is True, not an integer"),
        ("float steps", lambda d: d["snr_state"].update(steps=2.5), "not an integer"),
        ("string signal", lambda d: d["snr_state"].update(signal="0.5"), "snr_state.signal is '0.5', not a number"),
        ("negative", lambda d: d["lr_stats"].update(skipped=-1), "lr_stats.skipped is -1, below 0"),
        ("skipped > steps", lambda d: d["lr_stats"].update(skipped=9), "exceeds lr_stats.steps"),
        ("recent", lambda d: d["snr_state"].update(recent=[[1.0]]), "snr_state.recent"),
        ("no step", lambda d: d.pop("global_step"), "global_step is None"),
        ("no version", lambda d: d.pop("version"), "version is None"),
        ("no calibration", lambda d: d.pop("calibration"), "calibration is None"),
        ("calibration key", lambda d: d["calibration"].pop("factor_sum"), "lacks the key(s) ['factor_sum']"),
        ("negative calibration", lambda d: d["calibration"].update(factor_sum=-0.1), "calibration.factor_sum is -0.1"),
        ("float calibration steps", lambda d: d["calibration"].update(steps=1.5), "calibration.steps is 1.5"),
        ("other step", lambda d: d.update(global_step=4), "saved at step 4, but the checkpoint is at step 6"),
    ):
        saved = good()
        edit(saved)
        cases[name] = (json.dumps(saved), problem)
    return cases


DAMAGED = _damaged()


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_file_is_refused_naming_the_file_the_problem_and_the_fix(name, tmp_path):
    text, problem = DAMAGED[name]
    (tmp_path / STATE_NAME).write_text(text)
    with pytest.raises(StateFileError) as caught:
        read_state(str(tmp_path), 6)
    message = str(caught.value)
    assert message.startswith(str(tmp_path / STATE_NAME)) and problem in message, message
    assert "delete the file" in message and "another checkpoint" in message


def test_a_missing_file_and_a_version_1_file_are_notes_not_errors(tmp_path):
    state, note = read_state(str(tmp_path), 6)
    assert state is None and "another trainer (e.g. GRPOTrainer)" in note and "crash" in note
    (tmp_path / STATE_NAME).write_text(json.dumps({"version": 1, "global_step": 6, "ema": 0.3}))
    state, note = read_state(str(tmp_path), 6)
    assert state is None and "predates" in note


def checkpoint(run, step, trainer_state="complete", oblr=True):
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if oblr:
        write_state(str(folder), step, SNR, STATS)
    if trainer_state == "complete":
        (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": step}))
    elif trainer_state == "truncated":
        (folder / TRAINER_STATE_NAME).write_text('{"global_step": ')
    return str(folder)


def test_resume_true_takes_the_latest_complete_checkpoint_and_says_which_it_passed_over(tmp_path):
    checkpoint(tmp_path, 2)
    complete = checkpoint(tmp_path, 4)
    missing = checkpoint(tmp_path, 6, trainer_state=None)
    truncated = checkpoint(tmp_path, 8, trainer_state="truncated", oblr=False)
    notes = []
    assert resume_point(True, str(tmp_path), notes.append) == complete
    assert [n.split(" is incomplete")[0] for n in notes] == [truncated, missing]
    assert "not valid JSON" in notes[0] and f"no {TRAINER_STATE_NAME}" in notes[1]


def test_an_incomplete_or_damaged_checkpoint_is_refused_before_anything_loads(tmp_path):
    complete = checkpoint(tmp_path, 2)
    missing = checkpoint(tmp_path, 4, trainer_state=None)
    with pytest.raises(ValueError, match=f"{missing} is incomplete.*resume_from_checkpoint=True"):
        resume_point(missing, str(tmp_path))
    assert resume_point(complete, str(tmp_path)) == complete
    with open(os.path.join(complete, STATE_NAME), "w") as f:
        f.write("{")
    for arg in (complete, True):  # a damaged file in a complete checkpoint is not a crash's: refused, not skipped
        with pytest.raises(StateFileError, match="not valid JSON"):
            resume_point(arg, str(tmp_path))


def test_no_complete_checkpoint_and_no_checkpoint(tmp_path):
    assert resume_point(None, str(tmp_path)) is None and resume_point(False, str(tmp_path)) is None
    assert resume_point(True, str(tmp_path)) is True  # none at all: transformers' own error follows
    assert resume_point(str(tmp_path / "nowhere"), str(tmp_path)) == str(tmp_path / "nowhere")  # transformers' too
    checkpoint(tmp_path, 2, trainer_state=None)
    with pytest.raises(ValueError, match="No complete checkpoint"):
        resume_point(True, str(tmp_path))


def test_without_a_step_the_file_is_checked_against_the_checkpoints_own_step(tmp_path):
    """transformers 4.x loads the optimizer (and the trainer this file) before its own state: ``Trainer.state`` is
    still at step 0 then, so the step to check against is the checkpoint's ``trainer_state.json``."""
    folder = tmp_path / "checkpoint-6"
    write_state(str(folder), 6, SNR, STATS, CAL)
    (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": 6}))
    assert read_state(str(folder)) == ((SNR, STATS, CAL), None)
    (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": 7}))
    with pytest.raises(StateFileError, match="saved at step 6, but the checkpoint is at step 7"):
        read_state(str(folder))
