"""Checkpoint and resume of OBLR-PO's cross-step state (the SNR EMA), through the real trainer on the tiny model.

Four steps straight and two steps + checkpoint + resume for two more must log the same `oblr/lr_scale` and `oblr/snr`
and end at the same parameters: `snr_ema=0.5` makes steps 3-4 depend on the state carried over from step 2. The RNG
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

from helpers import DATASET, TOKENIZER, length_reward, logged
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.tiny import build_model
from oblr_trl.snr_step import STATE_NAME as OBLR_STATE_NAME

digit_reward = length_reward  # the count of '1' and '2' digits


def make_trainer(output_dir, **overrides):
    args = dict(output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                max_steps=4, logging_steps=1, report_to="none", use_cpu=True, learning_rate=1e-2, seed=0, data_seed=0,
                disable_tqdm=True, snr_ema=0.5, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2)
    args.update(overrides)
    return OBLRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[digit_reward],
                         args=OBLRPOConfig(**args), train_dataset=DATASET)


def last_logged(trainer, key):
    """One value per step: a resumed run's log_history holds the checkpoint's entries, then its own."""
    by_step = {h["step"]: h[key] for h in trainer.state.log_history if key in h}
    return [by_step[s] for s in sorted(by_step)]


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
    for key in ("oblr/lr_scale", "oblr/snr", "oblr/reward_mean", "grad_norm"):
        ours, theirs = last_logged(resumed, key), logged(straight, key)
        assert len(ours) == len(theirs) == 4, key
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-12), key
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    states = []
    for run in (resumed, straight):  # the EMA state both runs end with, as their last checkpoints hold it
        with open(os.path.join(run.args.output_dir, "checkpoint-4", OBLR_STATE_NAME)) as f:
            saved = json.load(f)
            states.append([saved["snr_state"]["signal"], saved["snr_state"]["noise"], *saved["lr_stats"].values()])
    assert states[0] == pytest.approx(states[1], rel=1e-6)


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
    assert last_logged(resumed, "oblr/lr_scale")[2] != pytest.approx(logged(straight, "oblr/lr_scale")[2], rel=1e-6)
