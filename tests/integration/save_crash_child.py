"""Child process of test_save_crash.py: trains the tiny setup of test_resume.py, saving every step, and SIGKILLs
itself at one point of the save of checkpoint-<step>. The kill is real: the process dies there, leaving on disk exactly
what was written by then (a partial file where the point is mid-write).

    python save_crash_child.py <output_dir> <point> <step>
"""

from __future__ import annotations

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
torch.set_num_threads(1)

import transformers.trainer as hf_trainer  # noqa: E402
from transformers.trainer_callback import TrainerState  # noqa: E402

from helpers import DATASET, TOKENIZER, length_reward  # noqa: E402
from oblr_trl import OBLRPOConfig, OBLRPOTrainer  # noqa: E402
from oblr_trl.demo.tiny import build_model  # noqa: E402

output_dir, point, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = f"checkpoint-{step}"


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_when_saving(cls, name):
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        if self.state.global_step == step:
            die()
        return original(self, *args, **kwargs)

    setattr(cls, name, wrapper)


if point == "state_file":  # oblr_state.json written to its temporary file, not yet renamed into place
    real_replace = os.replace

    def replace(src, dst, *a, **k):
        if dst.endswith(os.path.join(target, "oblr_state.json")):
            die()
        return real_replace(src, dst, *a, **k)

    os.replace = replace
elif point in ("model", "optimizer", "rng"):  # before the model / the optimizer and scheduler / the RNG states
    kill_when_saving(hf_trainer.Trainer, {"model": "save_model", "optimizer": "_save_optimizer_and_scheduler",
                                          "rng": "_save_rng_state"}[point])
elif point == "trainer_state":  # transformers' last write, half done
    real_save = TrainerState.save_to_json

    def save_to_json(self, path):
        if target in path:
            real_save(self, path)
            with open(path, "r+") as f:
                f.truncate(os.path.getsize(path) // 2)
            die()
        return real_save(self, path)

    TrainerState.save_to_json = save_to_json
elif point == "rotate":  # the checkpoint is complete; older ones not yet deleted
    real_rotate = hf_trainer.rotate_checkpoints

    def rotate(*args, **kwargs):
        if os.path.isdir(os.path.join(output_dir, target)):
            die()
        return real_rotate(*args, **kwargs)

    hf_trainer.rotate_checkpoints = rotate
else:
    raise SystemExit(f"unknown point {point}")

args = OBLRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                    max_steps=4, logging_steps=1, report_to="none", use_cpu=True, learning_rate=1e-2, seed=0,
                    data_seed=0, disable_tqdm=True, snr_ema=0.5, save_strategy="steps", save_steps=1,
                    gradient_accumulation_steps=2)
OBLRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[length_reward], args=args,
              train_dataset=DATASET).train()
print("finished without the kill")
