"""What OBLR-PO's exact per-sequence gradient norms cost, next to GRPO's own work, in both update modes.

One run, same batch and model for every measurement of a configuration (model x completion length C):

1. ``norms_vs_fwdbwd``: ``per_sequence_grad_sq_norms`` vs one plain forward+backward of the batch (the sum of the
   completion log-probs through TRL's fused LM head, ``.backward()``: GRPO's policy-loss pass). Also the group form
   ``per_sequence_grad_inner_products(group_size=8)`` (``snr_sample_unit="group"``, the trainer's default).
   ``norms_vs_loop``: speed-up of the exact norms over the naive loop (one forward+backward per sequence).
2. The update of each mode vs GRPO's forward+backward, timed as one call: **two passes** (the group norms pass, then
   GRPO's loss pass) and **one_backward** (``OBLRPOConfig(one_backward=True)``: one forward/backward, the norms, the
   weight gradients and the group norms formed from what was kept).
3. Peak memory of each (CPU: peak RSS of a fresh subprocess per measurement; CUDA: ``torch.cuda.max_memory_allocated``
   of the timed calls), with and without gradient checkpointing.
4. A whole RL step (generation, scoring, norms, loss, optimizer), one subprocess per trainer so that its peak memory is
   its own: ``trl.GRPOTrainer`` + ``GRPOConfig`` (with and without gradient checkpointing) vs ``OBLRPOTrainer`` in
   each mode, same arguments otherwise.

The headline (the JSON object printed last) gives the DEFAULT mode's ratios under the historical keys
(``update_vs_grpo``, ``peak_mem_vs_grpo``, ``step_vs_grpo``, ...; ``--default-mode``, ``one_backward`` unless told)
and every mode's under keys that name it (``update_two_pass_vs_grpo``, ``step_one_backward_vs_grpo``, ...).
Models: ``tiny``/``small`` (``oblr_trl.demo.tiny``), ``medium`` (a 32k-vocab Qwen3), random-initialised models of real
shapes (``smollm2-135m``, ``qwen3-0.6b``, ``qwen3-1.7b``), or any Hugging Face folder or name with ``--model``.

Timings are medians of repeats that interleave the measured functions (so slow drifts of a shared machine hit all of
them alike), after a warm-up round. Nothing is asserted. ``python benchmarks/step_cost.py --quick`` takes about 10
minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

from harness import Log, fmt, machine_info, write_results  # noqa: E402
from studies.step_cost.calls import (accuracy, device_and_dtype, label, load_model, make_batch,  # noqa: E402
                                     param_counts, time_config)
from studies.step_cost.design import (FNS_CPU, FNS_CUDA, GRAM_FNS, GROUP, SIZES, STEP_KINDS, STEP_MODE,  # noqa: E402,F401
                                      grpo_of)
from studies.step_cost.probes import flop_estimates, profile_norms  # noqa: E402
from studies.step_cost.report import config_ratios, headline, render_markdown  # noqa: E402
from studies.step_cost.workers import mem_worker, memory_config, run_steps, step_worker  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes tiny+small, lengths 64 and 256 (~10 minutes)")
    parser.add_argument("--sizes", nargs="*", choices=SIZES, default=None,
                        help="built-in models (default: tiny small [medium]; none when --model is given)")
    parser.add_argument("--model", nargs="+", default=[], metavar="PATH_OR_NAME",
                        help="Hugging Face folder(s) or name(s) to measure as well (their weights)")
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (a multiple of 8, the group)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up round")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per configuration, soft cap")
    parser.add_argument("--fns", nargs="+", default=None, help="measured functions (default: by device)")
    parser.add_argument("--max-gram-gflop", type=float, default=None,
                        help="skip the group form (and its update) when its estimated Gram GFLOP exceed this")
    parser.add_argument("--step-configs", nargs="*", default=None,
                        help="size:length pairs for the RL step (a --model's PATH:length too)")
    parser.add_argument("--step-steps", type=int, default=3, help="timed RL steps per trainer (after 1 warm-up)")
    parser.add_argument("--step-kinds", nargs="+", choices=STEP_KINDS, default=None)
    parser.add_argument("--step-batch", type=int, default=16,
                        help="per_device_train_batch_size of the RL step (16 = 2 prompts x 8, so the SNR has 2 samples)")
    parser.add_argument("--default-mode", choices=("one_backward", "two_pass"), default="one_backward",
                        help="the mode whose ratios the historical headline keys report")
    parser.add_argument("--mem", choices=("all", "largest", "none"), default="all")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; default: the CPUs this process may use, less those the 1-minute load "
                        "average says other processes keep busy (at least 1): oversubscribed OpenMP threads that "
                        "spin-wait for a descheduled sibling make small ops 10-50x slower on a shared machine")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--tag", default=None, help="output file stem (default step_cost, or step_cost_full)")
    parser.add_argument("--mem-worker", nargs=5, metavar=("SIZE", "LEN", "BATCH", "PROMPT", "MODE"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--step-worker", nargs=5, metavar=("KIND", "SIZE", "LEN", "STEPS", "BATCH"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch % GROUP:
        parser.error(f"--batch must be a multiple of {GROUP}")
    quick = args.quick
    if args.sizes is None:
        args.sizes = [] if args.model else (["tiny", "small"] if quick else ["tiny", "small", "medium"])
    args.specs = list(args.sizes) + list(args.model)
    args.cap_medium = args.lengths is None  # the 32k-vocab model's Grams grow too slow past 1024 tokens
    args.lengths = args.lengths or ([64, 256] if quick else [64, 256, 1024, 2048])
    args.budget = args.budget or (25.0 if quick else 60.0)
    args.max_gram_gflop = args.max_gram_gflop or (2000.0 if quick else 1500.0)
    if args.step_configs is None:
        args.step_configs = ["tiny:256", "small:256"] if quick else ["tiny:64", "tiny:256", "tiny:1024", "small:64",
                                                                     "small:256"]
    args.step_kinds = args.step_kinds or (["grpo", "two_pass", "one_backward", "default"] if quick else list(STEP_KINDS))
    args.tag = args.tag or ("step_cost" if quick or args.out_dir != HERE / "results" else "step_cost_full")
    if args.threads is None:
        cpus = len(os.sched_getaffinity(0))
        args.threads = max(1, min(cpus, round(cpus - max(0.0, os.getloadavg()[0] - 0.5))))
    return args


def measure_config(spec, completion, args, device, dtype, largest, log, jsonl) -> dict:
    """One configuration: times (stage 1), accuracy, memory (stage 2), a profile of the largest."""
    model, _ = load_model(spec, device)
    total_params, _ = param_counts(model)
    batch = make_batch(model.config.vocab_size, args.batch, args.prompt_len, completion, device)
    length = args.prompt_len + completion
    est1 = flop_estimates(model, args.batch, length, completion, 1)
    est8 = flop_estimates(model, args.batch, length, completion, GROUP)
    names = list(args.fns or (FNS_CUDA if device.type == "cuda" else FNS_CPU))
    skipped = []
    if est8["gram_total"] > args.max_gram_gflop:
        names = [n for n in names if n not in GRAM_FNS]
        skipped.append(f"group form skipped (est. {est8['gram_total']:.0f} GFLOP of Gram products)")
    fns, times, outputs, guard = time_config(model, batch, device, dtype, names, args, log)
    guard.fns = guard.model = None
    skipped += [f"{k}: {v}" for k, v in guard.failed.items()]
    err, gerr = accuracy(outputs)
    finite = {k: bool(torch.isfinite(v).all()) for k, v in outputs.items() if isinstance(v, torch.Tensor)}
    if not all(finite.values()):
        skipped.append("non-finite outputs: " + ", ".join(k for k, ok in finite.items() if not ok))
    row = dict(size=label(spec), params=total_params, vocab=model.config.vocab_size, hidden=model.config.hidden_size,
               layers=model.config.num_hidden_layers, completion=completion, length=length, batch=args.batch,
               times=times, max_rel_err_norms=err, max_rel_err_group=gerr, est_gflop_sq=est1, est_gflop_group=est8,
               skipped=skipped)
    if not args.no_profile and (spec, completion) == largest:
        forms = [f for f in ("norms", "group") if f in times and times[f] == times[f]]
        row["profile"] = profile_norms(model, batch, device, dtype, fns, forms=forms)
    del model, fns, batch, outputs  # CPU: the memory subprocesses below must not share the machine with them
    if args.mem == "all" or (args.mem == "largest" and (spec, completion) == largest):
        row["memory"] = memory_config(spec, completion, args, guard, device, names)
    row["ratios"] = config_ratios(times, row.get("memory"))
    log_row(row, log)
    jsonl.write(json.dumps(row, default=float) + "\n")
    jsonl.flush()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def log_row(row, log):
    t, r = row["times"], row["ratios"]
    mb = lambda k: fmt((row.get("memory", {}).get(k) or {}).get("peak_bytes", float("nan")) / 2**20, ".0f")  # noqa
    log(f"{row['size']:12s} C={row['completion']:5d}: " + " ".join(f"{k} {fmt(v, '.3f')}s" for k, v in t.items())
        + f" | norms/fwdbwd {fmt(r['norms_vs_fwdbwd'])} loop/norms {fmt(r['norms_vs_loop'])} loop_sq/norms "
        f"{fmt(r['norms_vs_loop_sq'])} | update/GRPO: two-pass "
        f"{fmt(r['update_group_vs_grpo'])} one_backward {fmt(r['update_one_backward_vs_grpo'])}"
        + (f" | peak MB fwdbwd {mb('fwdbwd')} (ckpt {mb('fwdbwd_ckpt')}); mem/GRPO two-pass "
           f"{fmt(r.get('peak_mem_two_pass_vs_grpo'))} (ckpt {fmt(r.get('peak_mem_two_pass_ckpt_vs_grpo_ckpt'))}) "
           f"one_backward {fmt(r.get('peak_mem_one_backward_vs_grpo'))} "
           f"(ckpt {fmt(r.get('peak_mem_one_backward_ckpt_vs_grpo_ckpt'))})" if "memory" in row else "")
        + f" | rel err {fmt(row['max_rel_err_norms'], '.1e')}" + ("; " + "; ".join(row["skipped"]) if row["skipped"]
                                                                   else ""))


def main(argv=None):
    args = parse_args(argv)
    if args.mem_worker:
        spec, c, b, p, mode = args.mem_worker
        return mem_worker(spec, int(c), int(b), int(p), mode, args.threads)
    if args.step_worker:
        kind, spec, c, steps, b = args.step_worker
        return step_worker(kind, spec, int(c), int(steps), int(b), args.threads)

    # stage 0: machine and plan
    torch.set_num_threads(args.threads)
    device, dtype = device_and_dtype()
    log = Log()
    machine = machine_info(args.threads, torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "bf16 autocast" if dtype is not None else "float32")
    log(f"machine: {machine}")
    configs = [(s, c) for s in args.specs for c in args.lengths
               if not (s == "medium" and c > 1024 and args.cap_medium)]
    largest = configs[-1]
    log(f"batch {args.batch} sequences (group {GROUP}), prompt {args.prompt_len} tokens; configurations {configs}; "
        f"{args.repeats} timed rounds after 1 warm-up; default mode {args.default_mode}")

    # stage 1-2: the update's parts, memory, profile, per configuration (streamed to <tag>.jsonl as they finish)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / f"{args.tag}.jsonl", "w") as jsonl:
        rows = [measure_config(s, c, args, device, dtype, largest, log, jsonl) for s, c in configs]

    # stage 3: whole RL steps
    steps = []
    for spec_len in args.step_configs:
        spec, c = spec_len.rsplit(":", 1)
        steps.append(run_steps(spec, int(c), args, log))

    # stage 4: headline and files
    lines = headline(rows[-1], steps[-1] if steps else None, args.default_mode)
    head = {k: (round(v, 3) if isinstance(v, float) else v) for k, v, _ in lines}
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = dict(machine=machine, command="python benchmarks/step_cost.py " + " ".join((argv or sys.argv[1:])),
                  args=dict(quick=args.quick, specs=args.specs, lengths=args.lengths, batch=args.batch,
                            step_batch=args.step_batch, step_steps=args.step_steps, prompt_len=args.prompt_len,
                            repeats=args.repeats, group=GROUP, default_mode=args.default_mode),
                  rows=rows, steps=steps, headline=head, headline_where={k: w for k, _, w in lines},
                  elapsed_s=log.elapsed())
    js, md = write_results(args.out_dir, args.tag, result, render_markdown(result))
    log(f"wrote {md} and {js.name} in {log.elapsed():.0f}s")
    print(json.dumps(head))


if __name__ == "__main__":
    main()
