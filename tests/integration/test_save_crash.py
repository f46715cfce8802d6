"""A crash at any point of a checkpoint's save resumes bit-identically: from that checkpoint where the save got as far
as transformers' last write (`trainer_state.json`), else from the checkpoint before it, said in a warning.

Each case is a real process (`save_crash_child.py`) that trains the tiny setup with a checkpoint every step and
SIGKILLs itself at one point of the save of checkpoint-3, leaving on disk what was written by then. The run is then
resumed here with `resume_from_checkpoint=True` to step 4 and compared with an uninterrupted run: the same lr scales
at every step and the same final weights. (Plain transformers would pick the incomplete checkpoint-3 and fail on it.)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from helpers import DATASET, TOKENIZER, last_logged, length_reward
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model
from oblr_trl.state_file import STATE_NAME, TRAINER_STATE_NAME

CHILD = os.path.join(os.path.dirname(__file__), "save_crash_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
pytestmark = pytest.mark.slow  # a training process per case


def make_trainer(output_dir):
    args = OBLRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4,
                        max_completion_length=6, max_steps=4, logging_steps=1, report_to="none", use_cpu=True,
                        learning_rate=1e-2, seed=0, data_seed=0, disable_tqdm=True, snr_ema=0.5,
                        save_strategy="steps", save_steps=1, gradient_accumulation_steps=2)
    return OBLRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[length_reward],
                         args=args, train_dataset=DATASET)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("straight"))
    trainer.train()
    return trainer


# point of the save of checkpoint-3 -> the checkpoint the run resumes from
POINTS = {"state_file": 2, "model": 2, "optimizer": 2, "rng": 2, "trainer_state": 2, "rotate": 3}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_kill_during_a_save_resumes_as_the_uninterrupted_run(point, straight, tmp_path, caplog):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, CHILD, str(tmp_path), point, "3"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == -9, child.stdout[-2000:] + child.stderr[-3000:]  # killed, not finished
    checkpoint3 = tmp_path / "checkpoint-3"
    complete = (checkpoint3 / TRAINER_STATE_NAME).is_file() and point == "rotate"
    if point == "trainer_state":  # the half-written file is there
        assert 0 < (checkpoint3 / TRAINER_STATE_NAME).stat().st_size
    if point != "state_file":  # written first, whole
        assert (checkpoint3 / STATE_NAME).is_file()
    assert complete == (POINTS[point] == 3)

    resumed = make_trainer(tmp_path)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert (f"{checkpoint3} is incomplete" in caplog.text) == (POINTS[point] == 2)
    assert resumed.state.global_step == 4
    assert last_logged(resumed, "oblr/lr_scale") == pytest.approx(last_logged(straight, "oblr/lr_scale"), rel=1e-6,
                                                             abs=1e-12)
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
