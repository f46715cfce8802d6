"""``oblr_state.json``, OBLR-PO's state in each checkpoint: written atomically before the checkpoint counts as
complete, validated when read, and the checkpoint to resume from chosen among complete ones. Pure functions of paths
and values; the trainer calls them from ``_save_checkpoint``, ``_load_optimizer_and_scheduler`` and ``train``.

How a checkpoint becomes complete. transformers 5.24's ``Trainer._save_checkpoint`` (which TRL 1.16's only wraps, to
write the model card first) writes into ``checkpoint-N`` in place: the model, then the optimizer, scheduler, scaler
and RNG states, then ``trainer_state.json``, and only then deletes checkpoints beyond ``save_total_limit``. Resuming
reads ``trainer_state.json`` first, and it is written last: it is the mark of a complete checkpoint (nothing else
is). So the trainer writes this file *before* the parent's save (:func:`write_state`: a temporary file, fsync,
``os.replace``, fsync of the folder): every checkpoint with a ``trainer_state.json`` holds a whole
``oblr_state.json``. A crash at any point of a save leaves either a complete checkpoint (resumed bit-identically) or
one without ``trainer_state.json`` (or with a truncated one), which :func:`resume_point` passes over for the previous
complete checkpoint, warned, where ``train(resume_from_checkpoint=True)`` would otherwise pick the latest folder
however incomplete. A damaged ``oblr_state.json`` in a complete checkpoint was not left by a crash: it is refused
(:class:`StateFileError`, naming the file and the fix), never applied.
"""

from __future__ import annotations

import json
import math
import os
import re

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .snr_formulas import Calibration, LrStats, SNRState

STATE_NAME = "oblr_state.json"  # OBLR-PO's cross-step state, beside trainer_state.json in each checkpoint
TRAINER_STATE_NAME = "trainer_state.json"  # transformers' last write into a checkpoint: the mark of a complete one
VERSION = 3  # 3: the calibrated mode's state; 2: the SNR estimator's state and lr statistics; 1: neither
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class StateFileError(ValueError):
    """An ``oblr_state.json`` that cannot be used; the message names the file, what is wrong and what to do."""


def checkpoint_folder(run_dir: str, global_step: int) -> str:
    """The folder transformers saves step ``global_step``'s checkpoint in."""
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


def write_state(folder: str, global_step: int, snr_state: SNRState, lr_stats: LrStats,
                calibration: Calibration | None = None) -> str:
    """Write ``folder/oblr_state.json`` atomically (the folder is created if need be); returns its path. A crash
    leaves the previous file or none, never part of one. ``calibration``: the calibrated mode's state (a fresh one
    where ``None``)."""
    calibration = Calibration() if calibration is None else calibration
    os.makedirs(folder, exist_ok=True)
    path, tmp = os.path.join(folder, STATE_NAME), os.path.join(folder, f".{STATE_NAME}.{os.getpid()}.tmp")
    payload = {"version": VERSION, "global_step": global_step, "snr_state": snr_state.to_dict(),
               "lr_stats": lr_stats.to_dict(), "calibration": calibration.to_dict()}
    for stale in [n for n in os.listdir(folder) if n.startswith(f".{STATE_NAME}.") and n.endswith(".tmp")]:
        os.remove(os.path.join(folder, stale))  # a killed save's
    with open(tmp, "w") as f:
        json.dump(payload, f, allow_nan=False)  # a non-finite state is a bug: fail the save, write nothing
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the rename itself reaches the disk
    finally:
        os.close(descriptor)
    return path


def _refuse(path: str, problem: str) -> StateFileError:
    return StateFileError(
        f"{path}: {problem}. It holds OBLR-PO's SNR estimator state, lr statistics and calibrated eta_max for this "
        "checkpoint, and "
        "oblr-trl writes it atomically, so it was changed after the save. To resume anyway, delete the file (the SNR "
        "estimate then restarts from the next step's samples, warned), or resume from another checkpoint.")


def _no_constant(path: str, constant: str):
    raise _refuse(path, f"it holds {constant}, not a finite number")


def _number(value, path: str, key: str, *, integer: bool = False, minimum: float | None = None):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _refuse(path, f"{key} is {value!r}, not {'an integer' if integer else 'a number'}")
    if not math.isfinite(value):
        raise _refuse(path, f"{key} is {value!r}, not finite")
    if minimum is not None and value < minimum:
        raise _refuse(path, f"{key} is {value!r}, below {minimum}")
    return value


def _section(saved: dict, name: str, path: str, keys: tuple[str, ...]) -> dict:
    part = saved.get(name)
    if not isinstance(part, dict):
        raise _refuse(path, f"{name} is {part!r}, not an object")
    missing = [k for k in keys if k not in part]
    if missing:
        raise _refuse(path, f"{name} lacks the key(s) {missing}")
    return part


def parse_state(text: str, path: str,
                global_step: int | None = None) -> tuple[SNRState, LrStats, Calibration | None] | None:
    """The state in ``text`` (the content of ``path``), every field checked: ``(snr_state, lr_stats, calibration)``,
    with ``calibration`` ``None`` for a file of version 2 (an oblr-trl before the calibrated mode: the caller
    calibrates again); ``None`` for a file of version 1 (an oblr-trl before the SNR estimators, with no estimator
    state). Raises :class:`StateFileError` for an empty,
    truncated or garbled file, a missing key, a wrong type, a NaN or infinite value, or a ``global_step`` other than
    the checkpoint's (``global_step``, where given)."""
    if not text.strip():
        raise _refuse(path, "the file is empty")
    try:
        saved = json.loads(text, parse_constant=lambda constant: _no_constant(path, constant))
    except json.JSONDecodeError as e:
        raise _refuse(path, f"not valid JSON (truncated or garbled: {e})") from None
    if not isinstance(saved, dict):
        raise _refuse(path, f"it holds a {type(saved).__name__}, not an object")
    version = _number(saved.get("version"), path, "version", integer=True)  # every oblr-trl wrote one
    if version < 2:
        return None
    if version > VERSION:
        raise _refuse(path, f"version {version} was written by a newer oblr-trl (this one reads {VERSION})")
    step = _number(saved.get("global_step"), path, "global_step", integer=True, minimum=0)
    if global_step is not None and step != global_step:
        raise _refuse(path, f"it was saved at step {step}, but the checkpoint is at step {global_step}")
    s = _section(saved, "snr_state", path, ("steps", "signal", "noise", "signal_sq", "recent"))
    _number(s["steps"], path, "snr_state.steps", integer=True, minimum=0)
    for key in ("signal", "noise"):
        _number(s[key], path, f"snr_state.{key}")
    _number(s["signal_sq"], path, "snr_state.signal_sq", minimum=0)
    if not isinstance(s["recent"], list) or not all(isinstance(x, list) and len(x) == 2 for x in s["recent"]):
        raise _refuse(path, f"snr_state.recent is {s['recent']!r}, not a list of [signal, noise] pairs")
    for i, pair in enumerate(s["recent"]):
        for value in pair:
            _number(value, path, f"snr_state.recent[{i}]")
    stats = _section(saved, "lr_stats", path, ("steps", "skipped", "lr_sum", "scale_sum"))
    for key, integer in (("steps", True), ("skipped", True), ("lr_sum", False), ("scale_sum", False),
                         ("low_streak", True)):
        if key in stats:
            _number(stats[key], path, f"lr_stats.{key}", integer=integer, minimum=0)
    if stats["skipped"] > stats["steps"]:
        raise _refuse(path, f"lr_stats.skipped={stats['skipped']} exceeds lr_stats.steps={stats['steps']}")
    calibration = None
    if version >= 3:
        c = _section(saved, "calibration", path, ("steps", "factor_sum"))
        _number(c["steps"], path, "calibration.steps", integer=True, minimum=0)
        _number(c["factor_sum"], path, "calibration.factor_sum", minimum=0)
        calibration = Calibration.from_dict(c)
    return SNRState.from_dict(s), LrStats.from_dict(stats), calibration


def read_state(checkpoint: str, global_step: int | None = None
               ) -> tuple[tuple[SNRState, LrStats, Calibration | None] | None, str | None]:
    """``(state, note)`` of ``checkpoint``: the validated state (:func:`parse_state`), or ``None`` with a note to warn
    with where the checkpoint has no usable one (no file, or a version-1 file). Raises :class:`StateFileError` for
    a damaged file. ``global_step`` defaults to the checkpoint's own (its ``trainer_state.json``): transformers 4.x
    loads the optimizer before the trainer's state, when ``Trainer.state.global_step`` is still 0."""
    if global_step is None and not incomplete(checkpoint):
        global_step = checkpoint_step(checkpoint)
    path = os.path.join(checkpoint, STATE_NAME)
    if not os.path.isfile(path):
        return None, (f"{checkpoint} has no {STATE_NAME}: it was saved by another trainer (e.g. GRPOTrainer), by "
                      "oblr-trl 0.1.0 or earlier (which wrote the file after the rest of the checkpoint, so a crash "
                      "during the save could leave it out), or the file was removed. The SNR estimate restarts from "
                      "the next step's samples, oblr/lr_mean, lr_scale_mean and skipped_fraction count from this "
                      "step, and (snr_lr_mode='calibrated') eta_max is calibrated again from the next steps.")
    with open(path, encoding="utf-8", errors="replace") as f:
        state = parse_state(f.read(), path, global_step)
    if state is None:
        return None, f"{path} predates the SNR estimator's state (an older oblr-trl): the estimate restarts."
    return state, None


def incomplete(checkpoint: str) -> str | None:
    """Why ``checkpoint`` is not a complete transformers checkpoint (its ``trainer_state.json``, written last, is
    missing or unreadable), or ``None`` where it is complete."""
    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return f"it has no {TRAINER_STATE_NAME}, which transformers writes last: its save was interrupted"
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError):
        return f"its {TRAINER_STATE_NAME} is not valid JSON: its save was interrupted while writing it"
    return None


def checkpoint_step(checkpoint: str) -> int:
    """The global step of a complete checkpoint, from its ``trainer_state.json``."""
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
        return int(json.load(f)["global_step"])


def resume_point(resume_from_checkpoint, output_dir: str, warn=lambda note: None):
    """What ``train(resume_from_checkpoint=...)`` should resume from; ``warn`` is called with each note.

    ``True``: the latest *complete* checkpoint in ``output_dir`` (incomplete later ones named in the notes); ``True``
    unchanged where ``output_dir`` has no checkpoint at all (transformers then says so). A path: itself, if complete.
    Either way the chosen checkpoint's ``oblr_state.json`` is validated now, before anything is loaded. Raises a
    ``ValueError`` naming the checkpoint for an incomplete one given by path, or where no checkpoint is complete.
    """
    if not resume_from_checkpoint:
        return None
    notes = []
    if resume_from_checkpoint is True:
        found = sorted((int(m.group(1)), name) for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else ())
                       if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name)))
        if not found:
            return True
        for _, name in reversed(found):
            folder = os.path.join(output_dir, name)
            why = incomplete(folder)
            if why is None:
                break
            notes.append(f"{folder} is incomplete ({why}); resuming from an earlier checkpoint.")
        else:
            raise ValueError(f"No complete checkpoint in {output_dir}: {' '.join(notes)} Start without "
                             "resume_from_checkpoint, or restore a complete checkpoint there.")
        resume_from_checkpoint = folder
    elif not os.path.isdir(resume_from_checkpoint):
        return resume_from_checkpoint  # transformers names it ("Can't find a valid checkpoint at ...")
    else:
        why = incomplete(resume_from_checkpoint)
        if why is not None:
            raise ValueError(f"Checkpoint {resume_from_checkpoint} is incomplete: {why}. Resume from the checkpoint "
                             "before it, or pass resume_from_checkpoint=True to pick the latest complete one.")
    read_state(resume_from_checkpoint, checkpoint_step(resume_from_checkpoint))  # a damaged file: refused now
    for note in notes:
        warn(note)
    return resume_from_checkpoint
