"""Exact per-sequence norms on an FSDP2-sharded model (torch's fully_shard, gloo on CPU), each rank its own batch.

    torchrun --nproc_per_node 2 tests/distributed/fsdp2_norms.py OUT.json

Accelerate does not start FSDP on CPU, so the model is sharded here by hand, the way Accelerate's FSDP2 plugin does:
each decoder layer, then the root. Each rank writes whether its norms match per-sample autograd on an unsharded copy,
and whether a regular sharded training step still works after the norms pass.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
from reference import per_sample_sq_norms  # noqa: E402

from oblr_trl import per_sequence_grad_sq_norms  # noqa: E402
from oblr_trl.demo.tiny import build_model, build_tokenizer  # noqa: E402


def main(out_path: str):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)  # same seed on every rank
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    ids = torch.randint(5, len(tokenizer), (4, 14), generator=generator)
    attention = torch.ones_like(ids)
    completion_mask = torch.ones(4, 8, dtype=torch.long)
    completion_mask[1, 5:] = 0
    ids[0, :2], attention[0, :2] = tokenizer.pad_token_id, 0
    reference = per_sample_sq_norms(copy.deepcopy(model), ids, attention, completion_mask, temperature=0.9)

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.9)
    no_grad_left = all(p.grad is None for p in model.parameters())

    # a regular sharded step afterwards: forward, backward (reduce-scatter), optimizer step
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = model(input_ids=ids, attention_mask=attention, labels=ids).loss
    loss.backward()
    optimizer.step()
    step_ok = bool(torch.isfinite(loss)) and all(p.grad is not None for p in model.parameters())

    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"ours": ours.tolist(), "reference": reference.tolist(), "no_grad_left": no_grad_left,
                                     "step_ok": step_ok})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
