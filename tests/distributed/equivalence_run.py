"""One OBLR-PO run with deterministic completions, for comparing 1 process with N (torchrun) on the same data.

    torchrun --nproc_per_node 2 tests/distributed/equivalence_run.py OUT.json PER_DEVICE_BATCH [ddp|fsdp]

Generation is replaced at TRL's narrowest seam (`rollout_func`) by a pure function of (prompt, position in its group),
so every process layout sees the same completions; the rest of the step (rewards gathered across ranks, the norms
pass, the baseline, the SNR step size) runs for real.
"""

import hashlib
import json
import os
import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.tiny import build_model, build_tokenizer

GROUP = 4
TOKENIZER = build_tokenizer()


def completion_text(prompt: str, position: int) -> str:
    digest = hashlib.sha256(f"{prompt}|{position}".encode()).hexdigest()
    return "".join(c for c in digest if c.isdigit())[: 1 + position + len(prompt) % 3]


DEGENERATE_FROM = None  # with mode "degenerate": completions from this global index on are empty (EOS alone)


def deterministic_rollout(prompts, trainer):
    offset = trainer.accelerator.process_index * len(prompts)
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        text = TOKENIZER.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids.append(TOKENIZER(text, add_special_tokens=False)["input_ids"])
        answer = completion_text(prompt[-1]["content"], (offset + i) % GROUP)
        if DEGENERATE_FROM is not None and offset + i >= DEGENERATE_FROM:
            answer = ""  # identical (zero) rewards and empty completions: all of rank 1's data under 2 processes
        completion_ids.append(TOKENIZER(answer, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": [[0.0] * len(c) for c in completion_ids]}


def ones_reward(completions, **kwargs):
    return [float(c[0]["content"].count("1")) for c in completions]


class Recorder(OBLRPOTrainer):
    records = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        prompts = gather_object([x["prompt"][-1]["content"] for x in inputs])
        completions = gather_object(TOKENIZER.batch_decode(out["completion_ids"], skip_special_tokens=True))
        advantages = self.accelerator.gather(out["advantages"]).tolist()
        self.records.append(sorted(zip(prompts, completions, advantages)))
        return out


def main(out_path: str, per_device: int, mode: str = "ddp"):
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i % 7}"}]} for i in range(64)])
    global DEGENERATE_FROM
    extra = {}
    if mode == "degenerate":
        DEGENERATE_FROM = 8  # the global batch is 16: the second half
    if mode == "fsdp":
        extra = dict(fsdp="full_shard", fsdp_config={"version": 2, "reshard_after_forward": True})
    args = OBLRPOConfig(
        output_dir="/tmp/oblr-equivalence", per_device_train_batch_size=per_device, num_generations=GROUP,
        max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", use_cpu=True, learning_rate=1e-2,
        save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, **extra,
    )
    torch.manual_seed(0)
    trainer = Recorder(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[ones_reward], args=args,
                       train_dataset=dataset, rollout_func=deterministic_rollout)
    trainer.train()
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "oblr/lr_scale" in h]
        with open(out_path, "w") as f:
            json.dump({
                "world_size": trainer.accelerator.num_processes,
                "records": trainer.records,
                "lr_scale": [h["oblr/lr_scale"] for h in logs],
                "snr": [h["oblr/snr"] for h in logs],
                "grad_norm": [h["grad_norm"] for h in logs],
                "num_samples": [h["oblr/num_samples"] for h in logs],
            }, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
    # Tear down deterministically: an orderly process-group shutdown, then exit without running C++ static
    # destructors, which intermittently aborted a rank at interpreter exit ("terminate called without an active
    # exception") after the run itself had finished.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
