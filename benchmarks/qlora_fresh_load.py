"""QLoRA against a fresh load of the same checkpoint, one line per quantization setting: how far the model that
`validate()` (so `OBLRPOTrainer`'s construction) leaves is from a fresh load (logits), and how far its per-sequence
squared norms are from per-row autograd on that fresh load.

    python benchmarks/qlora_fresh_load.py [--hidden 64 256]

Settings: NF4 and FP4, with and without double quantization, float32 or bf16 compute, uint8 or bf16 storage, each
loaded as is and after a `generate()` before `validate()` (on a CPU with AVX512-BF16 that generation repacks the
4-bit weights for bitsandbytes' inference kernel). Tiny random Llama checkpoints (2 layers), tied embeddings.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings

import torch


def _batch(vocab):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (4, 11), generator=g)
    attention = torch.ones_like(ids)
    completion_mask = torch.ones(4, 6, dtype=torch.long)
    ids[0, :2], attention[0, :2] = 0, 0
    completion_mask[1, 3:] = 0
    return ids, attention, completion_mask


def measure(path, vocab, quant, double, compute, storage, generate) -> tuple[str, float, float]:
    """(what validate said, logits' relative difference from a fresh load, the norms' largest relative error
    against per-row autograd on that fresh load)."""
    from oblr_trl import per_sequence_grad_sq_norms, validate
    from oblr_trl.grad_norms.coverage import per_row_sq_norms
    from studies.peft_sweep import load_quantized

    ids, attention, completion_mask = _batch(vocab)
    model = load_quantized(path, quant, double, compute, storage)
    if generate:
        with torch.no_grad():
            model.generate(input_ids=ids[1:], attention_mask=attention[1:], max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    found = validate(model, strict=False)
    if found:
        return f"refused ({found[0].type})", float("nan"), float("nan")
    fresh = load_quantized(path, quant, double, compute, storage, repacking=False)
    with torch.no_grad():
        a = fresh(input_ids=ids, attention_mask=attention).logits.double()
        b = model(input_ids=ids, attention_mask=attention).logits.double()
    expected = per_row_sq_norms(fresh, ids, attention, completion_mask)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask).double()
    rows = expected > 0
    return ("passed", float((a - b).norm() / a.norm()),
            float(((ours - expected).abs()[rows] / expected[rows]).max()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args(argv)
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from bitsandbytes.functional import has_avx512bf16

    print(f"bitsandbytes CPU repacking (AVX512-BF16) on this machine: {bool(has_avx512bf16())}")
    print("| hidden | quant | double quant | compute | storage | generate first | validate | logits vs fresh load "
          "| norms vs autograd on it |\n|---|---|---|---|---|---|---|---|---|")
    vocab = 256
    with tempfile.TemporaryDirectory() as folder:
        for hidden in args.hidden:
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                         max_position_embeddings=64)).save_pretrained(folder)
            for quant, double, compute, storage in [(q, d, torch.float32, torch.uint8) for q in ("nf4", "fp4")
                                                    for d in (False, True)] + [
                    ("nf4", False, torch.bfloat16, torch.uint8), ("nf4", False, torch.float32, torch.bfloat16)]:
                for generate in (False, True):
                    said, logits, norms = measure(folder, vocab, quant, double, compute, storage, generate)
                    print(f"| {hidden} | {quant} | {'yes' if double else 'no'} | {str(compute)[6:]} | "
                          f"{str(storage)[6:]} | {'yes' if generate else 'no'} | {said} | {logits:.2g} | "
                          f"{norms:.2g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
