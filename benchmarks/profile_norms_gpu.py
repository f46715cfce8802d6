"""Where the exact per-sequence norms pass spends its time on a GPU, and whether its numbers still agree.

For each configuration (random-initialised real shape x completion length, bf16 autocast as in step_cost.py):

* ``fwdbwd`` (GRPO's loss pass), ``norms`` (``per_sequence_grad_sq_norms``), ``group``
  (``per_sequence_grad_inner_products(group_size=8)``) and optionally ``loop_sq``: interleaved medians (seconds);
* a breakdown of one ``norms`` call by component, each timed between device synchronisations (so the parts add up to
  a little more than the plain call): the LM head's softmax terms, the per-layer rules, the half-precision casts, the
  inner products by strategy (token Grams, materialized per-sample gradients, the tied embedding/head's sparse rows,
  the head's chunked per-sample gradients), the rest being the forward, the backward and the hooks;
* torch.profiler's top operators by device time, the device-busy total against the wall time, and the count of
  device-to-host synchronisations;
* accuracy: the norms against ``loop_sq`` (autograd, one sequence at a time) under the same bf16 autocast, and in
  float32 (no autocast) where ``--accuracy`` names the configuration.

Prints one line per configuration and writes JSON (``--out``). Nothing is asserted. Used for issue 17 on an H100.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from studies.step_cost.calls import device_and_dtype, load_model, make_batch, make_fns

from oblr_trl.grad_norms import engine, factors, per_sequence_grad_sq_norms


def sync():
    torch.cuda.synchronize()


class Breakdown:
    """Patches the engine's and factors' module-level functions with device-synchronised timers."""

    TARGETS = [(engine, "lm_head_terms", "head_terms"), (factors, "_sparse_rows_block_products", "tied_sparse_rows"),
               (factors, "_head_materialized_block_products", "head_per_sample"),
               (factors, "_head_gram_block_products", "head_gram"),
               (factors, "_materialized_block_products", "materialized"), (factors, "gram", "gram"),
               (engine, "self_products", "products_total")]

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self.saved = []

    def _wrap(self, fn, name):
        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out
        return timed

    def __enter__(self):
        for mod, attr, name in self.TARGETS:
            if hasattr(mod, attr):
                self.saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, self._wrap(getattr(mod, attr), name))
        init = engine._Pass.__init__  # the rules each pass runs, from the model's plan: timed there

        def timed_rules(run, *a, **k):
            init(run, *a, **k)
            run.rules = {m: self._wrap(r, "rules") if callable(r) else r for m, r in run.rules.items()}

        self.saved.append((engine._Pass, "__init__", init))
        engine._Pass.__init__ = timed_rules
        if hasattr(engine, "autocast_operands"):
            ao = engine.autocast_operands
            self.saved.append((engine, "autocast_operands", ao))
            engine.autocast_operands = self._wrap(ao, "half_casts")
        return self

    def __exit__(self, *exc):
        for mod, attr, fn in reversed(self.saved):
            setattr(mod, attr, fn)


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    ok = torch.isfinite(a) & torch.isfinite(b)
    return ((a - b).abs()[ok] / b.abs()[ok]).max().item() if ok.any() else float("nan"), int((~ok).sum())


def measure(spec, completion, args, device, dtype):
    model, _ = load_model(spec, device)
    vocab = model.config.vocab_size
    batch = make_batch(vocab, args.batch, args.prompt_len, completion, device)
    fns = make_fns(model, batch, device, dtype)
    names = ["fwdbwd", "norms", "group"] + (["loop_sq"] if args.loop else [])
    row = dict(size=spec, completion=completion, batch=args.batch, prompt=args.prompt_len)
    outputs = {}
    for name in names:  # warm-up
        outputs[name] = fns[name]()
    sync()
    times = defaultdict(list)
    for _ in range(args.repeats):
        for name in names:
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    row["times"] = {k: statistics.median(v) for k, v in times.items()}
    t = row["times"]
    row["norms_vs_fwdbwd"] = t["norms"] / t["fwdbwd"]
    row["group_vs_fwdbwd"] = t["group"] / t["fwdbwd"]
    if "loop_sq" in t:
        row["loop_vs_norms"] = t["loop_sq"] / t["norms"]
        row["err_norms_vs_loop_bf16"], row["nonfinite_rows_bf16"] = rel_err(outputs["norms"], outputs["loop_sq"])
    with Breakdown() as bd:
        fns["norms"]()
        sync()
        t0 = time.perf_counter()
        bd.seconds.clear(), bd.calls.clear()
        fns["norms"]()
        sync()
        wall = time.perf_counter() - t0
    row["breakdown"] = dict(wall_synced=wall, **{k: round(v, 5) for k, v in bd.seconds.items()})
    row["breakdown_calls"] = dict(bd.calls)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fns["norms"]()
        sync()
    events = prof.key_averages()
    dev = sorted(events, key=lambda e: -e.self_device_time_total)
    row["top_device_ops"] = {e.key[:90]: round(e.self_device_time_total / 1e6, 5) for e in dev[: args.top]}
    row["device_busy"] = sum(e.self_device_time_total for e in events) / 1e6
    row["syncs"] = {e.key: e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense")}
    row["kernel_launches"] = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                                     "cuLaunchKernel", "cuLaunchKernelEx"))
    if f"{spec}:{completion}" in args.accuracy:
        ids, att, cm = batch
        with torch.autocast("cuda", enabled=False):
            n32 = per_sequence_grad_sq_norms(model, ids, att, cm)
            fns32 = make_fns(model, batch, device, None)
            l32 = fns32["loop_sq"]()
        row["err_norms_vs_loop_fp32"], _ = rel_err(n32, l32)
        row["err_norms_bf16_vs_loop_fp32"], _ = rel_err(outputs["norms"], l32)
        if "loop_sq" in outputs:
            row["err_loop_bf16_vs_loop_fp32"], _ = rel_err(outputs["loop_sq"], l32)
        row["norms_bf16"] = outputs["norms"].tolist()
        row["norms_fp32"] = n32.tolist()
    del model, fns
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["smollm2-135m:512", "smollm2-135m:2048", "qwen3-0.6b:512",
                                                     "qwen3-0.6b:2048"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop", action="store_true", help="also time loop_sq (and check the norms against it)")
    p.add_argument("--accuracy", nargs="*", default=[], help="SIZE:C configurations also checked in float32")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device, dtype = device_and_dtype()
    assert device.type == "cuda", "a GPU is needed"
    info = dict(label=args.label, device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), batch=args.batch)
    print(json.dumps(info), flush=True)
    rows = []
    for cfg in args.configs:
        spec, c = cfg.split(":")
        row = measure(spec, int(c), args, device, dtype)
        row["out_dtype_kernel"] = getattr(factors, "_OUT_DTYPE", {}).get("ok")
        rows.append(row)
        t = row["times"]
        print(f"[{args.label}] {spec} C={c} B={args.batch}: " + " ".join(f"{k} {v:.4f}s" for k, v in t.items())
              + f" | norms/fwdbwd {row['norms_vs_fwdbwd']:.2f} group/fwdbwd {row['group_vs_fwdbwd']:.2f}"
              + (f" loop/norms {row['loop_vs_norms']:.2f}" if "loop_vs_norms" in row else "")
              + f" | device busy {row['device_busy']:.4f}s launches {row['kernel_launches']} syncs {row['syncs']}",
              flush=True)
        print("   breakdown:", json.dumps(row["breakdown"]), flush=True)
        print("   top:", json.dumps(row["top_device_ops"])[:1200], flush=True)
        acc = {k: v for k, v in row.items() if k.startswith("err_")}
        if acc:
            print("   accuracy:", json.dumps(acc), flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(info=info, rows=rows), indent=1))


if __name__ == "__main__":
    main()
