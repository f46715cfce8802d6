"""``torch.compile`` of the per-layer algebra: does it cut the update's operator calls, exactly, and at what
cost? ``python benchmarks/compile_algebra.py --quick`` (about 2 minutes on 2 CPU cores; the full run longer).

For Qwen3-0.6B's linear shapes (q 1024->2048, k/v 1024->1024, o 2048->1024, gate/up 1024->3072, down 3072->1024, a
LoRA r=16 pair on q, and one whole decoder layer's seven maps with their shared inputs) at B rows (one group, k = B)
and completion lengths T, this builds the factors a layer hands to the engine (random output gradients and inputs,
float32 or bf16) and runs :func:`layer_work`, the per-layer work ``one_backward`` does for them, through the
package's own functions: ``_Pass.keep`` (``autocast_operands``, materialized where ``materializing_saves_memory``),
the norms ``PerSequenceGradients.inner_products(1)`` takes (``summed_self_products``) and the update
``accumulate_grad(-a, group_size=k)`` forms (``block_weighted_rows``, its scaled-input cache, the group's squared
norm). Eager, and under ``torch.compile`` (the default, ``dynamic=True``; ``fullgraph=True`` tried first).

Per shape: (a) ATen operator calls eager (``studies.counting.OpCounter``; views apart) against what the compiled graph
launches (the calls of its wrapper's ``call``: generated kernels, extern kernels such as mm/bmm, ATen fallbacks;
``torch._inductor.metrics.generated_kernel_count`` beside); (b) median seconds eager vs compiled after a warm-up,
interleaved; (c) the largest difference of the outputs, ``max|compiled - eager| / max|eager|``, and each path's
against the float64 maths; (d) compile time (inductor's caches off: a cold compile), graph breaks
(``torch._dynamo.explain``), the graphs compiled as T changes. On a CPU the package takes its CPU path (float32
products, no tensor-core casts), on CUDA its GPU path. Writes ``results/compile_algebra{_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
import harness  # noqa: E402
from studies.counting import OpCounter  # noqa: E402
from oblr_trl.grad_norms.factors import (Dense, Factored, Materialized, autocast_operands,  # noqa: E402
                                         block_weighted_rows, keep_scaled, materializing_saves_memory,
                                         per_sample_dtype, summed_self_products)

# name -> the maps (input width, output width, input id): maps with one input id read one tensor (q/k/v, gate/up)
LAYER = [(1024, 2048, 0), (1024, 1024, 0), (1024, 1024, 0), (2048, 1024, 1), (1024, 3072, 2), (1024, 3072, 2),
         (3072, 1024, 3)]  # a Qwen3-0.6B decoder layer's maps: q, k, v (one input), o, gate, up (one input), down
SHAPES = {"q_proj": LAYER[:1], "k_proj": LAYER[1:2], "o_proj": LAYER[3:4], "gate_proj": LAYER[4:5],
          "down_proj": LAYER[6:], "lora_A(q) r16": [(1024, 16, 0)], "lora_B(q) r16": [(16, 2048, 0)], "layer": LAYER}
QUICK_SHAPES = ["k_proj", "lora_B(q) r16"]
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
LAUNCH = re.compile(r"\b(?:cpp_fused\w*|triton_\w+)(?:\.run)?\(")
EXTERN = re.compile(r"\bextern_kernels\.\w+\(")
FALLBACK = re.compile(r"\b(?:torch\.ops\.)?aten\.\w+(?:\.\w+)?\(")


def layer_work(lefts: list[torch.Tensor], rights: list[torch.Tensor], scale: torch.Tensor):
    """One layer's per-layer algebra in ``one_backward``, by the package's functions: each map's usage as ``_Pass.keep``
    forms it (``Factored(Dense(output grad), Dense(input))``, cast by ``autocast_operands``, materialized where that
    saves memory), the norms' ``(B, 1, 1)`` self products (``summed_self_products`` over the layer's usages, as
    ``inner_products(1)`` takes them), and the update's weight gradients ``sum_i scale_i u_i`` with the group's
    ``||H||^2`` (``accumulate_grad(scale, group_size=B)``: one block, rows in one slice). Returns the norms, the
    gradients and the squared norm."""
    k = scale.shape[0]
    cast: dict = {}
    usages = []
    for left, right in zip(lefts, rights):
        u = autocast_operands(Factored(Dense(left), Dense(right)), cast)
        if materializing_saves_memory(u):
            u = Materialized(u.materialize().to(per_sample_dtype(u)))
        usages.append(u)
    norms = summed_self_products([u.blocked(1) for u in usages], 1)
    cache: dict = {}
    grads, sq = [], []
    for u, left in zip(usages, lefts):
        keep_scaled(cache, [u])
        part = block_weighted_rows(u, scale, k, 0, left.shape[-1], cache)  # one block: (rows, cols)
        sq.append(part.pow(2).sum(dtype=torch.float64))
        grads.append(part)
    return norms, grads, torch.stack(sq).sum(0).reshape(1)


def make_inputs(maps, batch: int, length: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Random factors of ``maps`` (inputs shared by id, as q/k/v read one tensor) and the advantages' scale."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    inputs = {i: rand(batch, length, n_in) for n_in, _, i in maps}
    lefts = [rand(batch, length, n_out) / length ** 0.5 for _, n_out, _ in maps]
    return lefts, [inputs[i] for _, _, i in maps], torch.randn(batch, generator=g).to(device)


def reference(lefts, rights, scale):
    """What :func:`layer_work` computes, in float64 from the maths (``g_i = sum_t L_t (x) R_t``): the yardstick."""
    grads = [torch.einsum("btl,btr->blr", a.double(), b.double()) for a, b in zip(lefts, rights)]
    upd = [torch.einsum("b,blr->lr", scale.double(), g) for g in grads]
    return sum(g.pow(2).sum((1, 2)) for g in grads).view(-1, 1, 1), upd, sum(u.pow(2).sum() for u in upd).view(1)


def max_rel_diff(a, b) -> float:
    """``max |a - b| / max |b|`` over two outputs of :func:`layer_work` (each tensor its own scale)."""
    return max(float((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30))
               for x, y in zip([a[0], *a[1], a[2]], [b[0], *b[1], b[2]]))


def wrapper_calls(codes: list[str]) -> dict:
    """Calls in the compiled wrappers' ``call``: generated kernels, extern kernels (mm/bmm), ATen fallbacks."""
    found = Counter()
    for code in codes:
        body = code[code.find("def call("):]
        body = body[: body.find("\nrunner = ")] if "\nrunner = " in body else body
        found["kernels"] += len(LAUNCH.findall(body))
        found["extern"] += len(EXTERN.findall(body))
        found["fallback"] += len(FALLBACK.findall(body))
    return dict(found, launches=found["kernels"] + found["extern"] + found["fallback"], graphs=len(codes))


def sync(device: str):
    return (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)


def compile_run(mode: str, inputs, device: str) -> tuple[dict, object]:
    """Compile ``layer_work`` cold in ``mode`` (``default`` or ``dynamic``; fullgraph where it works) and run it on
    ``inputs``: its compile time, the wrapper's calls and the kernels inductor generated."""
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code

    rec = dict(mode=mode)
    for fullgraph in (True, False):
        torch._dynamo.reset()
        metrics.reset()
        fn = torch.compile(layer_work, dynamic=True if mode == "dynamic" else None, fullgraph=fullgraph)
        t0 = time.perf_counter()
        try:
            _, codes = run_and_get_code(fn, *inputs)
        except Exception as error:  # noqa: BLE001 - a graph break under fullgraph: recorded, then without it
            rec["fullgraph_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        sync(device)()
        rec.update(compile_s=time.perf_counter() - t0, fullgraph=fullgraph, generated_kernels=int(
            metrics.generated_kernel_count), **wrapper_calls(codes))
        return rec, fn
    return rec, None


def measure(name: str, length: int, dtype_name: str, args) -> dict:
    """One row: eager counts and graph breaks, then each compile mode timed against eager (interleaved)."""
    from torch._dynamo.utils import counters

    maps = SHAPES[name]
    make = lambda t: make_inputs(maps, args.batch, t, DTYPES[dtype_name], args.device)  # noqa: E731
    inputs = make(length)
    row = dict(shape=name, maps=len(maps), T=length, dtype=dtype_name, batch=args.batch, seconds={})
    with torch.no_grad():
        eager_out, exact = layer_work(*inputs), reference(*inputs)  # a warm-up (lazy initialisations), the maths
        with OpCounter() as count:
            layer_work(*inputs)
        row.update(eager_ops=count.total, eager_views=count.views, eager_top=count.calls.most_common(6),
                   eager_err_vs_float64=max_rel_diff(eager_out, exact))
        explained = torch._dynamo.explain(layer_work)(*inputs)
        row.update(graphs=explained.graph_count, graph_breaks=explained.graph_break_count,
                   break_reasons=[str(b.reason)[:200] for b in explained.break_reasons])
        for mode in args.modes:
            rec, fn = compile_run(mode, inputs, args.device)
            row[mode] = rec
            if fn is None:
                continue
            medians, outputs = harness.time_interleaved({"eager": lambda: layer_work(*inputs),
                                                         mode: lambda: fn(*inputs)}, ["eager", mode], args.repeats,
                                                        args.budget, sync(args.device), log=lambda s: None)
            row["seconds"][mode] = dict(eager=medians["eager"], compiled=medians[mode])
            rec["max_rel_diff"] = max_rel_diff(outputs[mode], eager_out)
            rec["err_vs_float64"] = max_rel_diff(outputs[mode], exact)
            rec["recompiles"] = []
            for other in (length + 8, length + 16):  # the graphs compiled, and the call's seconds, at new lengths
                before, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
                fn(*make(other))
                sync(args.device)()
                rec["recompiles"].append(dict(length=other, new_graphs=counters["stats"]["unique_graphs"] - before,
                                              seconds=time.perf_counter() - t0))
    return row


def table(rows: list[dict], modes: list[str]) -> list[str]:
    """The markdown table: a line per row and compile mode."""
    head = ["shape", "T", "dtype", "eager ops (non-view)", "breaks", "mode", "fullgraph", "launches (kern+extern)",
            "eager s", "compiled s", "speed-up", "diff", "err eager/compiled", "compile s", "graphs for T'"]
    lines = []
    for r in rows:
        for mode in modes:
            c, ops = r.get(mode, {}), f"{r['eager_ops']} ({r['eager_ops'] - r['eager_views']})"
            if "compile_s" not in c:  # inductor failed: its error is in the JSON
                lines.append([r["shape"], r["T"], r["dtype"], ops, r["graph_breaks"], mode, "failed"] + ["n/a"] * 8)
                continue
            e, s = r["seconds"][mode]["eager"], r["seconds"][mode]["compiled"]
            lines.append([r["shape"], r["T"], r["dtype"], ops, r["graph_breaks"], mode, c["fullgraph"],
                          f"{c['launches']} ({c['kernels']}+{c['extern']})", harness.fmt(e, ".4f"),
                          harness.fmt(s, ".4f"), harness.fmt(e / s if e and s else None), f"{c['max_rel_diff']:.1e}",
                          f"{r['eager_err_vs_float64']:.1e} / {c['err_vs_float64']:.1e}",
                          f"{c['compile_s']:.1f}", "+".join(str(x["new_graphs"]) for x in c["recompiles"])])
    return harness.md_table(head, lines)


def render(res: dict) -> str:
    m = res["machine"]
    lines = [f"# torch.compile of the per-layer algebra: {m['device']}, {m['date']}", "",
             f"`{res['command']}`. {harness.machine_line(m)}", "",
             f"B = {res['batch']} rows, one group (k = B); `layer`: a Qwen3-0.6B decoder layer's {len(LAYER)} maps. "
             "Eager ops: ATen calls (not views, in brackets); launches: the compiled wrapper's calls, kernels + extern "
             "(mm/bmm) + fallbacks; diff: max|compiled - eager| / max|eager|; err: each against the float64 maths; "
             f"graphs for T': compiled at T + 8, T + 16. emulate_precision_casts: {res['emulate_precision_casts']}.",
             "", *table(res["rows"], res["modes"]), "", "Per 28 layers (`layer`, default mode): eager calls (not views)"
             " minus launches:", ""]
    lines += [f"- T={r['T']} {r['dtype']}: {28 * (r['eager_ops'] - r['eager_views'] - r['default']['launches'])} "
              "calls fewer" for r in res["rows"] if r["shape"] == "layer" and "launches" in r.get("default", {})]
    lines += ["", "Eager operator calls, the most frequent, and graph breaks:", ""]
    lines += [f"- {r['shape']} T={r['T']} {r['dtype']}: " + ", ".join(f"{n} {c}" for n, c in r["eager_top"])
              + "".join(f"; break: {b}" for b in r["break_reasons"]) for r in res["rows"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, T 32 and 64, 2 repeats")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: all (quick: QUICK_SHAPES)")
    p.add_argument("--lengths", type=int, nargs="+", help="completion lengths T (default 512 2048; quick 32 64)")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--modes", nargs="+", choices=["default", "dynamic"], default=["default", "dynamic"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, help="timed rounds (default 5; quick 2)")
    p.add_argument("--budget", type=float, default=60.0, help="seconds of timing per row at most")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--emulate-casts", action="store_true",
                   help="inductor's emulate_precision_casts: round to bf16 where eager does (off: its default)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--stem", help="result file stem (default compile_algebra, quick compile_algebra_quick)")
    args = p.parse_args(argv)
    args.shapes = args.shapes or (QUICK_SHAPES if args.quick else list(SHAPES))
    args.lengths = args.lengths or ([32, 64] if args.quick else [512, 2048])
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.stem = args.stem or ("compile_algebra_quick" if args.quick else "compile_algebra")
    return args


def configure(threads: int, emulate_casts: bool = False, device: str = "cpu") -> str:
    """Torch threads; inductor compiling in this process, its caches off, its kernel cache in a fresh folder (returned:
    cold compiles), warmed up once on a trivial function (its one-time costs out of the rows)."""
    import tempfile

    import torch._inductor.config as inductor

    torch.set_num_threads(threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="compile_algebra_")
    inductor.compile_threads = 1
    inductor.fx_graph_cache = False
    inductor.autotune_local_cache = False
    inductor.emulate_precision_casts = emulate_casts
    torch._functorch.config.enable_autograd_cache = False
    torch.compile(lambda x: (x * 2).sum(0))(torch.ones(4, 4, device=device))
    torch._dynamo.reset()
    return cache


def main(argv=None) -> dict:
    args = parse_args(argv)
    cache = configure(args.threads, args.emulate_casts, args.device)
    machine = harness.machine_info(args.threads, args.device,
                                   "float32 and bf16 factors" if len(args.dtypes) > 1 else args.dtypes[0])
    command = "python benchmarks/compile_algebra.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = []
    for name in args.shapes:
        for length in args.lengths:
            for dtype_name in args.dtypes:
                rows.append(measure(name, length, dtype_name, args))
                print("\n".join(table(rows[-1:], args.modes)[2:]), flush=True)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res = dict(machine=machine, command=command.strip(), batch=args.batch, modes=args.modes, rows=rows,
               emulate_precision_casts=args.emulate_casts)
    shutil.rmtree(cache, ignore_errors=True)
    js, md = harness.write_results(args.out, args.stem, res, render(res))
    print(f"wrote {js} and {md}")
    return res


if __name__ == "__main__":
    main()
