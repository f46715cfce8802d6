"""Exact per-sequence norms on DeepSpeed ZeRO-3 partitioned models (CPU processes, gloo), each rank its own batch.

    torchrun --nproc_per_node N tests/integration/distributed/zero3_norms.py OUT.json

For each case (full fine-tuning with trainable RMSNorms; LoRA on the LM head, tied and untied; trainable token rows,
whose rows the embedding (and a tied head) read outside their own module's forward, tied and untied), the model is checked
by `validate` (as the trainer does at construction), copied, partitioned by `deepspeed.initialize` (ZeRO-3: every
parameter holds 0 elements outside its module's forward) and its per-sequence squared norms are taken by the norms
pass. Each rank writes them beside per-sample autograd on the unpartitioned copy.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [TESTS, os.path.join(os.path.dirname(TESTS), "benchmarks")]
from reference import padded_batch, per_sample_sq_norms  # noqa: E402
from studies.zoo import VOCAB, build  # noqa: E402

from oblr_trl import per_sequence_grad_sq_norms, validate  # noqa: E402

CASES = {  # name: (tied embeddings, PEFT's LoraConfig arguments or None for full fine-tuning)
    "full fine-tuning, tied": (True, None),
    "LoRA on lm_head and q_proj, tied": (True, dict(target_modules=["q_proj", "lm_head"])),
    "LoRA on lm_head alone, untied": (False, dict(target_modules=["lm_head"])),
    "trainable_token_indices, tied": (True, dict(target_modules=["q_proj"], trainable_token_indices=[1, 2, 3])),
    "trainable_token_indices, untied": (False, dict(target_modules=["q_proj"], trainable_token_indices=[1, 2, 3])),
}
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
         "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}


def model_for(tie: bool, lora: dict | None):
    model = build("Llama", tie)
    if lora is None:
        return model
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, init_lora_weights="gaussian", **lora))


def main(out_path: str):
    import deepspeed

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4, seed=100 + rank)  # each rank its own batch
    results = {}
    for name, (tie, lora) in CASES.items():
        torch.manual_seed(0)  # the same model (and adapter initialisation) on every rank
        model = model_for(tie, lora)
        assert validate(model) == []
        reference = per_sample_sq_norms(copy.deepcopy(model), ids, attention, completion_mask, temperature=0.7)
        engine, *_ = deepspeed.initialize(model=model, config=ZERO3)
        partitioned = all(p.numel() == 0 for p in engine.module.parameters())
        ours = per_sequence_grad_sq_norms(engine.module, ids, attention, completion_mask, temperature=0.7)
        results[name] = {"ours": ours.tolist(), "reference": reference.tolist(), "partitioned": partitioned,
                         "no_grad_left": all(p.grad is None for p in engine.module.parameters())}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
