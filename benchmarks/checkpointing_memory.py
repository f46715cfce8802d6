"""The norms pass's peak memory under each gradient checkpointing: none, non-reentrant, and reentrant (where the pass
runs each layer under its own checkpoint, ``oblr_trl/grad_norms/hooks.py``).

A random tied Qwen3 (8 layers, hidden 256, vocabulary 4096, float32) and 8 rows x 1024 tokens (960 completion tokens),
the within-group products with groups of 4, on the CPU with one thread; each setting in its own process, its peak RSS
above the RSS before the pass (after a first, small pass that runs the checks), and the pass's seconds.

    python benchmarks/checkpointing_memory.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SETTINGS = ("none", "non-reentrant", "reentrant")


def one(setting: str) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from harness.memory import peak_rss
    from oblr_trl import per_sequence_grad_inner_products

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).train()
    if setting != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": setting == "reentrant"})
    ids = torch.randint(1, 4096, (8, 1024))
    attention, completion = torch.ones_like(ids), torch.ones(8, 960, dtype=torch.long)
    per_sequence_grad_inner_products(model, ids[:2, :64], attention[:2, :64], completion[:2, :32], group_size=2)
    with peak_rss() as peak:
        start = time.perf_counter()
        per_sequence_grad_inner_products(model, ids, attention, completion, group_size=4)
        seconds = time.perf_counter() - start
    return {"setting": setting, "peak_mib": round(peak["peak_bytes"] / 2**20), "seconds": round(seconds, 1),
            "method": peak["method"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a child process's setting
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    rows = [json.loads(subprocess.run([sys.executable, __file__, "--one", s], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for s in SETTINGS]
    print("| gradient checkpointing | norms pass peak above RSS (MiB) | seconds |\n|---|---|---|")
    for row in rows:
        print(f"| {row['setting']} | {row['peak_mib']} | {row['seconds']} |")
    print(f"\n({rows[0]['method']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
