"""Exactness of the per-sequence norms on a real checkpoint vs one torch.autograd.grad per row (float32, CPU).

    python benchmarks/real_model_norms.py /work/cache/smollm2-135m-instruct --batch 4
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms.coverage import per_row_sq_norms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=12)
    parser.add_argument("--completion", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32).eval()
    validate(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (args.batch, args.prompt + args.completion), generator=g)
    attention = torch.ones_like(ids)
    mask = torch.ones(args.batch, args.completion, dtype=torch.long)
    ids[0, :3], attention[0, :3] = 0, 0  # left padding
    mask[1, 5:], attention[1, args.prompt + 5 :] = 0, 0  # right padding
    t = time.time()
    ours = per_sequence_grad_sq_norms(model, ids, attention, mask).double()
    t_ours = time.time() - t
    t = time.time()
    reference = per_row_sq_norms(model, ids, attention, mask)  # one autograd.grad per row: the package's oracle
    t_ref = time.time() - t
    print(f"model {args.path}: {type(model).__name__}, {model.config.num_hidden_layers} layers, vocab {vocab}, "
          f"tied={model.config.tie_word_embeddings}, batch {args.batch} x ({args.prompt}+{args.completion}) tokens")
    print("ours     ", ours.tolist())
    print("reference", reference.tolist())
    print(f"max relative error {float(((ours - reference).abs() / reference).max()):.2e}; "
          f"time ours {t_ours:.1f}s, per-row autograd {t_ref:.1f}s (CPU, shared machine)")


if __name__ == "__main__":
    main()
