"""Checkpoint and resume of OBLR-PO's cross-step state (the SNR EMA, the calibrated eta_max), through the real trainer
on the tiny model.

Four steps straight and two steps + checkpoint + resume for two more must log the same `oblr/lr_scale`, `oblr/snr` and
`oblr/eta_max` and end at the same parameters: `snr_ema=0.5` makes steps 3-4 depend on the state carried over from step
2, and so does the calibration of `snr_lr_mode="calibrated"` (the default: f_ref is still the mean of steps 1-2). The RNG
(torch, numpy, python) is restored by transformers' own checkpoint, and `steps_per_generation ==
gradient_accumulation_steps` (the default) makes every step generate anew, so TRL's generation buffer holds nothing
across the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from helpers import DATASET, TOKENIZER, last_logged, length_reward, logged
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model
from oblr_trl.state_file import STATE_NAME as OBLR_STATE_NAME
from oblr_trl.state_file import StateFileError

digit_reward = length_reward  # the count of '1' and '2' digits


def make_trainer(output_dir, **overrides):
    args = dict(output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                max_steps=4, logging_steps=1, report_to="none", use_cpu=True, learning_rate=1e-2, seed=0, data_seed=0,
                disable_tqdm=True, snr_ema=0.5, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2)
    args.update(overrides)
    return OBLRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[digit_reward],
                         args=OBLRPOConfig(**args), train_dataset=DATASET)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("straight"))
    trainer.train()
    return trainer


def test_checkpoint_holds_the_ema_state(straight):
    checkpoint = os.path.join(straight.args.output_dir, "checkpoint-2")
    with open(os.path.join(checkpoint, OBLR_STATE_NAME)) as f:
        state = json.load(f)
    assert state["global_step"] == 2
    signal, noise = state["snr_state"]["signal"], state["snr_state"]["noise"]
    assert noise > 0 and signal >= 0  # a real smoothed state, not the first step's placeholder


def test_resume_reproduces_the_straight_run(straight, tmp_path):
    checkpoint = os.path.join(straight.args.output_dir, "checkpoint-2")
    resumed = make_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 4
    for key in ("oblr/lr_scale", "oblr/snr", "oblr/snr_factor", "oblr/eta_max", "oblr/reward_mean", "grad_norm"):
        ours, theirs = last_logged(resumed, key), logged(straight, key)
        assert len(ours) == len(theirs) == 4, key
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-12), key
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    states = []
    for run in (resumed, straight):  # the EMA state both runs end with, as their last checkpoints hold it
        with open(os.path.join(run.args.output_dir, "checkpoint-4", OBLR_STATE_NAME)) as f:
            saved = json.load(f)
            states.append([saved["snr_state"]["signal"], saved["snr_state"]["noise"], *saved["lr_stats"].values(),
                           *saved["calibration"].values()])
    assert states[0] == pytest.approx(states[1], rel=1e-6)
    assert states[0][-2:] == states[1][-2:] and states[0][-2] == 4  # the calibration: 4 steps counted, bit for bit
    assert last_logged(resumed, "oblr/eta_max") == logged(straight, "oblr/eta_max")  # bit for bit


def test_resume_from_a_checkpoint_without_oblr_state_warns(straight, tmp_path, caplog):
    """A checkpoint without oblr_state.json (e.g. written by GRPOTrainer) still resumes; the EMA restarts, warned."""
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(os.path.join(straight.args.output_dir, "checkpoint-2"), checkpoint)
    os.remove(checkpoint / OBLR_STATE_NAME)
    resumed = make_trainer(tmp_path / "out", max_steps=3)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert f"no {OBLR_STATE_NAME}" in caplog.text
    # step 3 then smooths nothing: its scale differs from the straight run's, which smoothed with step 2's state
    assert last_logged(resumed, "oblr/snr_factor")[2] != pytest.approx(logged(straight, "oblr/snr_factor")[2], rel=1e-6)
    assert resumed.step_sizer.calibration.steps == 1  # calibrated again from step 3 (the straight run: 3 steps)


# ------------------------------------------------------------------ issue 46: train() again, faults around a step
def test_train_twice_works_as_grpo_trainers_does(tmp_path):
    """`tr.train(); tr.train()` (a notebook's habit): GRPOTrainer's second call is a fresh run of max_steps on the same
    model and optimizer; ours too, with a fresh step sizer and the unsized-step guard registered once."""
    from trl import GRPOConfig, GRPOTrainer

    runs = {}
    for cls, config in ((OBLRPOTrainer, OBLRPOConfig), (GRPOTrainer, GRPOConfig)):
        trainer = cls(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[digit_reward],
                      args=config(**{**common(tmp_path / cls.__name__), "max_steps": 2, "save_strategy": "no"}),
                      train_dataset=DATASET)
        trainer.train()
        trainer.train()
        runs[cls] = (trainer.state.global_step, logged(trainer, "learning_rate"), len(logged(trainer, "loss")), trainer)
    ours, grpo = runs[OBLRPOTrainer], runs[GRPOTrainer]
    assert ours[:3] == grpo[:3] == (2, [0.01, 0.005], 2)  # the second run's own log: 2 steps, the schedule anew
    ours = ours[3]
    assert len(logged(ours, "oblr/lr_scale")) == 2 and ours.step_sizer.lr_stats.steps == 2  # this run's steps only
    base = ours.optimizer
    while hasattr(base, "optimizer"):
        base = base.optimizer
    assert len(base._optimizer_step_pre_hooks) == 1


def common(output_dir):
    return dict(output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                logging_steps=1, report_to="none", use_cpu=True, learning_rate=1e-2, seed=0, data_seed=0,
                disable_tqdm=True, gradient_accumulation_steps=2)


def test_train_then_resume_on_the_same_trainer_reproduces_the_straight_run(straight):
    """`train()` then `train(resume_from_checkpoint=...)` on one trainer: the resumed steps are the straight run's."""
    trainer = make_trainer(straight.args.output_dir + "-again")
    trainer.train()
    trainer.train(resume_from_checkpoint=os.path.join(trainer.args.output_dir, "checkpoint-2"))
    assert trainer.state.global_step == 4
    assert last_logged(trainer, "oblr/lr_scale") == pytest.approx(logged(straight, "oblr/lr_scale"), rel=1e-6)
    for (name, p), q in zip(trainer.model.named_parameters(), straight.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_an_exception_just_before_the_optimizer_step_leaves_the_scheduled_lr(tmp_path):
    """The step is sized at its last micro-batch; a callback raising before the optimizer steps must not leave the
    scaled lr behind (nor that step's samples): after it the optimizer holds the scheduler's lr, and train() runs
    again."""
    from transformers import TrainerCallback

    class Fails(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise KeyboardInterrupt("stopped by hand")

    trainer = make_trainer(tmp_path, max_steps=3, save_strategy="no", snr_lr_mode="eta_max")  # scale = f < 1
    trainer.add_callback(Fails())
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.step_sizer.lr_stats.steps == 2  # the second step was sized (scale < 1) and then not taken
    assert logged(trainer, "oblr/lr_scale")[0] < 1.0
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.lr_scheduler.get_last_lr()[0])
    assert not trainer.step_sizer.sized and trainer.step_sizer.samples.rows == []
    trainer.pop_callback(Fails)
    trainer.train()
    assert trainer.state.global_step == 3


@pytest.mark.parametrize("damage", ["", '{"version": 2, "global_step": 2, "snr_st', "nan"])
def test_a_damaged_state_file_is_refused_before_anything_loads(straight, tmp_path, damage):
    """Empty, truncated, or NaN (which used to be applied as the learning rate): refused naming the file and the fix;
    the model is untouched."""
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(os.path.join(straight.args.output_dir, "checkpoint-2"), checkpoint)
    path = checkpoint / OBLR_STATE_NAME
    if damage == "nan":
        saved = json.loads(path.read_text())
        saved["snr_state"]["noise"] = float("nan")
        damage = json.dumps(saved)
    path.write_text(damage)
    resumed = make_trainer(tmp_path / "out")
    before = [p.detach().clone() for p in resumed.model.parameters()]
    with pytest.raises(StateFileError, match=f"^{path}: .*delete the file"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.model.parameters()))
