"""The exact norms pass on a Qwen3-MoE model at a realistic expert count vs a plain forward+backward (same run,
interleaved): ``python benchmarks/moe_norms.py --experts 32 --top-k 4``.

The expert banks take the routed-token rule (:mod:`oblr_trl.grad_norms.rules.experts`: cost proportional to the tokens
each expert sees); the routers, their logits' rule (:mod:`oblr_trl.grad_norms.rules.routers`). With ``--per-row`` the
banks and routers are also timed on the per-row path (one re-run of the bank per sequence, what they took before
the rule; the benchmark lifts ``per_row.MAX_NUMEL`` so that a large bank is not refused), and the two passes'
norms are checked equal.

Measured 2026-11-23 04:47-04:49 UTC (commit 8af407d: banks by routed tokens, routers by logits) on a shared 2-core
CPU (load average 3.3-4.5 from other jobs: absolute times are inflated, ratios are from interleaved runs), 1 thread,
batch 8, ``--reps 5``; plain forward+backward vs the norms pass:

    --experts 8  --top-k 2 --hidden 512 --moe-intermediate 256 --length 128: 0.718s vs 0.766s, 1.07x
    --experts 32 --top-k 4 --hidden 512 --moe-intermediate 256 --length 128: 1.344s vs 1.580s, 1.18x
    --experts 64 --top-k 8 --hidden 512 --moe-intermediate 256 --length 128: 1.620s vs 1.832s, 1.13x
    --experts 32 --top-k 4 --length 64 --per-row: 0.190s vs 0.240s, 1.27x; per-row path 0.516s, 2.72x (max rel.
    difference between the two paths' norms 1.5e-07)

With ``--lora R`` the banks carry PEFT's LoRA of rank R (``target_parameters`` on both weights, everything else
frozen), whose factors take :mod:`oblr_trl.grad_norms.rules.lora_experts`'s rule. Measured 2026-11-28 14:21 UTC (commit
533834a) on the same kind of shared 2-core CPU (load average 6.7), 1 thread, batch 8, ``--reps 5``:

    --lora 16 --experts 32 --top-k 4 --length 64 --per-row: 0.390s vs 0.722s, 1.85x; per-row path 1.571s, 4.03x
    (max rel. difference between the two paths' norms 9.4e-08)
"""

import argparse
import statistics
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from oblr_trl import per_sequence_grad_sq_norms
from oblr_trl.grad_norms.rules import per_row, registry


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--per-row", action="store_true", help="also time the banks on the per-row path")
    p.add_argument("--lora", type=int, default=0, help="rank of a LoRA on the expert banks (target_parameters), the "
                   "rest frozen; 0: full fine-tuning")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    per_row.MAX_NUMEL = 1 << 40
    model = _model(args)
    ids = torch.randint(1, args.vocab, (args.batch, args.length), device=args.device)
    attention = torch.ones_like(ids)
    completion = torch.ones(args.batch, args.length // 2, dtype=torch.long, device=args.device)

    def plain():
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None]).sum().backward()
        model.zero_grad(set_to_none=True)

    def norms():
        return per_sequence_grad_sq_norms(model, ids, attention, completion)

    def per_row():  # banks and routers on the per-row path: their rules switched off for this call
        with registry.switched_off("expert_bank", "router", "lora_expert_bank"):
            return per_sequence_grad_sq_norms(model, ids, attention, completion)

    def timed(fn):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    plain()  # warm-up
    routed = norms()
    if args.per_row:
        reference = per_row()
        error = float(((routed - reference).abs() / reference.abs().clamp_min(1e-30)).max())
    t_plain, t_norms, t_rows = [], [], []
    for _ in range(args.reps):  # interleaved
        t_plain.append(timed(plain))
        t_norms.append(timed(norms))
        if args.per_row:
            t_rows.append(timed(per_row))
    mp, mn = statistics.median(t_plain), statistics.median(t_norms)
    lora = f", LoRA r={args.lora} on the expert banks" if args.lora else ""
    print(f"Qwen3-MoE{lora} {args.layers} layers, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
          f"moe-intermediate {args.moe_intermediate}, vocab {args.vocab}, batch {args.batch} x {args.length} tokens, "
          f"{args.device}, {args.threads} thread(s)")
    print(f"plain forward+backward {mp:.3f}s, norms pass (banks and routers by rule) {mn:.3f}s "
          f"(medians of {args.reps}); "
          f"ratio {mn / mp:.2f}x")
    if args.per_row:
        mr = statistics.median(t_rows)
        print(f"norms pass with banks and routers on the per-row path {mr:.3f}s; ratio {mr / mp:.2f}x "
              f"(routed vs per-row norms: max rel. difference {error:.1e})")


def _model(args):
    """The Qwen3-MoE model, random; with ``--lora R``, PEFT's LoRA of rank R on its expert banks' two weights (both
    factors drawn: ``init_lora_weights=False``)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                            num_experts=args.experts, num_experts_per_tok=args.top_k, pad_token_id=0)
    model = Qwen3MoeForCausalLM(config)
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, init_lora_weights=False, target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    return model.to(args.device).eval()


if __name__ == "__main__":
    main()
