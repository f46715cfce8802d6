"""The tables of ``benchmarks/bench_gpu.py`` (issues 47 and 56): the path a trainer took, a profiled step's summary,
a row's failure, the markdown of a run's results and of ``--profile``'s sections. Pure but for :func:`failure` (which
frees the device)."""

from __future__ import annotations

import gc

import torch

import harness


def ran_of(plan, batch: int) -> str:
    """The path a trainer took, as ``cost_counts`` names it: ``grpo``, ``one_backward/<rows per chunk>``,
    ``replay/<rows>`` or ``two_passes/<norms-pass rows>``."""
    if plan is None:
        return "grpo"
    if plan.on:
        return f"{'replay' if plan.replay else 'one_backward'}/{plan.chunk_rows or batch}"
    return f"two_passes/{plan.norms_chunk or batch}"


def profile_table(prof, cuda: bool, top: int = 25) -> dict:
    """A profiled step: operators and kernels by self device time (CPU time off CUDA), the kernels launched, the host
    syncs, and ``kernel_ms``: the kernels' time alone (an operator's self device time is its kernels', so a sum over
    operators and kernels together counts each kernel twice)."""
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"))
    syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaMemcpyAsync")
    timed = [e for e in events if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(launches=launches, syncs=syncs, kernel_ms=sum(getattr(e, key, 0) for e in timed) / 1e3,
                top=[dict(op=e.key[:60], calls=e.count, ms=getattr(e, key, 0) / 1e3) for e in rows])


def failure(error: BaseException) -> dict:
    """A row's failure as the table says it: the exception's type and first line."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}")


def _fmt_mode(v: dict, g: dict) -> list[str]:
    if "error" in v:
        return [v["error"]] + [""] * 7
    nan = float("nan")
    ok = "error" not in g
    ratio = lambda a, b: f"{a / b:.2f}x" if ok and b == b and b else "-"  # noqa: E731
    (lo, hi), median = v.get("ratio_range", (nan, nan)), v.get("ratio", nan)
    # a record from before the per-round ratios (no "ratio"): the ratio of the medians
    time = f"{median:.2f}x" if ok and median == median else ratio(v["seconds"], g.get("seconds", nan))
    return [v["ran"], f"{v['seconds'] * 1e3:.1f}", time, f"{lo:.2f}-{hi:.2f}x" if lo == lo and ok else "-",
            f"{v['flops'] / v.get('grpo_flops', g.get('flops', nan)):.2f}x", f"{v['peak_gib']:.2f}",
            f"{v.get('step_peak_gib', nan):.2f}", ratio(v.get("step_peak_gib", nan), g.get("step_peak_gib", nan))]


HEADER = ["width", "B x C", "tuning", "ckpt", "timed", "mode", "ran", "ms", "time / GRPO", "range",
          "model FLOPs / GRPO", "peak GiB from build", "peak GiB of the steps", "step peak / GRPO"]
LEGEND = ("`timed`: `paired`: the row's trainers alive together (one seeded model copy each), each warmed up once, "
          "then rounds of one step of every trainer, the order rotated each round (`benchmarks/studies/paired.py`); "
          "`alone`: one trainer after another (the memory-tight row, whose memory fraction binds the process, and "
          "rows two of whose trainers would crowd the device). `ms`: the median step; `time / GRPO`: the median of "
          "the per-round ratios (a round's step against that round's GRPO step; on `alone` rows the i-th against "
          "GRPO's i-th, measured apart), `range`: their smallest and largest. Memory, each trainer's own, above "
          "what was allocated before its build: `peak GiB from build`: the most allocated from the model's build "
          "through construction (OBLR-PO's coverage probe), the optimizer's creation and the warm-up step; `of the "
          "steps`: what it holds after the warm-up (resident, in the json) plus the largest rise of a timed step "
          "above its start.")


def render(res: dict, prompt: int, group: int) -> str:
    m = res["machine"]
    lines = ["# OBLR-PO against GRPO on a GPU: the update and the whole RL step", "",
             f"Measured {m['date']} on **{res['device_name']}** with `{res['command']}` (torch {m['torch']}, "
             f"transformers {m['transformers']}, trl {m['trl']}). Random-initialised Qwen3s (tied heads), "
             f"{prompt} prompt tokens, groups of {group}, bf16 autocast on a GPU. `auto`: OBLR-PO's default (on a GPU "
             "memory-aware: `one_backward` wherever its predicted peak fits the free memory); `ran`: the path it "
             "took and rows per chunk. `model FLOPs`: the FLOP model's ratio (`oblr_trl/cost_model.py`) for the path "
             "that ran.", "", "## The update", ""]
    rows = []
    for r in res["update"]:
        g = r["modes"].get("grpo", {"error": "not run"})
        kind = {"tight": "memory-tight", "qlora": "QLoRA r=16 (nf4)"}.get(r.get("kind"), "")
        tuning = kind if r.get("kind") == "qlora" else ("LoRA r=16" if r["lora"] else "full")
        label = r.get("width", res.get("width", "")) + (" (again, last)" if r.get("repeat") else "") + (
            f" ({kind})" if r.get("kind") == "tight" else "")
        head = [label, f"{r['batch']} x {r['completion']}", tuning, "on" if r["ckpt"] else "off",
                "paired" if r.get("paired") else "alone"]
        if r.get("skipped"):
            rows.append(head + ["-", f"skipped: {r['skipped']}"] + [""] * (len(HEADER) - len(head) - 2))
            continue
        for mode, v in r["modes"].items():
            rows.append(head + [mode, *_fmt_mode(v, g)])
    lines += harness.md_table(HEADER, rows) + ["", LEGEND]
    tight = [v for r in res["update"] if r.get("kind") == "tight" for v in r["modes"].values() if v.get("note")]
    if tight:
        lines += ["", f"Memory-tight row: `torch.cuda.set_per_process_memory_fraction`, {tight[0]['note']}."]
    q = res.get("qlora")
    if q is not None:
        lines += ["", "## QLoRA: the norms against per-row autograd", "",
                  f"skipped: {q['skipped']}" if "skipped" in q else
                  f"failed: {q['error']}" if "error" in q else
                  f"4-bit nf4 base, LoRA r=16 (B random), fp32 compute, {q['rows']} rows x {q['completion']} tokens: "
                  f"largest relative error of the per-sequence squared norms {q['max_rel_err']:.2e} (target <= 1e-5)."]
    if res.get("rl") is None:  # written after each update row, so a run stopped early still leaves its table
        return "\n".join(lines + ["", "The whole RL step: not in this run.", ""])
    rl = res["rl"]
    gen = {"cb": "transformers continuous batching", "hf": "HF generate"}.get(rl.get("generator"), "HF generate")
    lines += ["", f"## The whole RL step ({gen}, {rl['completion']} tokens per completion, full fine-tuning)", ""]
    if rl.get("cb_error"):
        lines += [f"Continuous batching did not run here ({rl['cb_error']}); HF generate instead.", ""]
    g = rl["modes"].get("grpo", {})
    lines += harness.md_table(["trainer", "s / step", "step / GRPO", "generation s", "generation's share"], [
        [mode, v["error"], "", "", ""] if "error" in v else
        [mode, f"{v['seconds']:.2f}", f"{v['seconds'] / g['seconds']:.2f}x" if "seconds" in g else "-",
         f"{v['generation']:.2f}", f"{v['share']:.0%}"]
        for mode, v in rl["modes"].items()])
    return "\n".join(lines + [""])


def profile_lines(cfg: dict, mode: str, row: dict) -> list[str]:
    """``--profile``'s section of one trainer: its step, the profiled step's kernel time, launches and syncs, its
    peaks, then its operators by device time."""
    prof = row["profile"]
    return [f"## {cfg['batch']} x {cfg['completion']}, full, checkpointing {'on' if cfg['ckpt'] else 'off'}: "
            f"{mode} ({row['ran']})", "",
            f"{row['seconds'] * 1e3:.1f} ms a step (median, the profiled step included), profiled step "
            f"{prof['kernel_ms']:.1f} ms of kernel time (CPU time on a CPU), {prof['launches']} kernel launches, "
            f"{prof['syncs']} host syncs and copies; peak {row['step_peak_gib']:.2f} GiB (steps), "
            f"{row['peak_gib']:.2f} GiB (from build).", ""] + harness.md_table(
        ["operator", "calls", "ms"], [[t["op"].replace("|", "/"), t["calls"], f"{t['ms']:.2f}"] for t in prof["top"]]
    ) + [""]
