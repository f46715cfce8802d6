"""One command for a lent GPU (issues 47, 56): OBLRPOTrainer against GRPOTrainer, timed in the same run, with the
counted prediction of ``oblr_trl/cost_model.py`` beside each timing.

Design:
* **The update** (generation excluded): one ``training_step`` plus the optimizer step of each trainer on a prepared
  batch of ``B`` completions of ``C`` tokens (TRL's ``_generate_and_score_completions`` returns it; OBLR-PO's own
  override runs on top, so its norms are timed). Modes: GRPO, OBLR-PO's default (``auto``: memory-aware on a GPU,
  issue 56), ``one_backward``, two passes, not every mode on every row. Models: random Qwen3s of Qwen3-0.6B's,
  Qwen3-1.7B's and Qwen3-4B's widths and depths with their real 151,936-token tied heads, bf16 autocast, full
  fine-tuning or LoRA r=16 on all linear layers, gradient checkpointing off and on (TRL's default); beside each
  ratio, the FLOP model's (``cost_model.flops`` of ``path_choice.describe(model)``) for the path that ran.
* **Paired timing** (``studies/paired.py``): timed one mode after another, identical paths differed by up to 1.5x on
  the H100 (2026-11-27), so a row's trainers now live together (one seeded model copy each), each warmed up once
  (``auto`` built first, so its memory-aware choice sees the device as alone), then ``--repeats`` rounds of one step
  of each, the order rotated every round. ``time / GRPO`` is the median of the per-round ratios, with their range.
  Memory is each trainer's own, above what was allocated before its build (``gpu_memory.Meter``): the peak from its
  build, and its resident bytes plus the largest rise of a step. Timed alone (one trainer at a time, as before): the
  memory-tight row (its fraction binds the process) and Qwen3-1.7B's full fine-tuning (two hold ~51 GiB).
* **A memory-tight row**: ``torch.cuda.set_per_process_memory_fraction`` set so that GRPO's measured peak fits but
  ``one_backward``'s predicted peak does not: the default must fall back (replayed or two passes), without an OOM.
* **A QLoRA row**: a bitsandbytes 4-bit (nf4) base with LoRA r=16: the norms against per-row autograd (fp32 compute,
  relative error), then the update's cost against GRPOTrainer's. Skipped, saying why, where bitsandbytes does not
  import (it travels as a wheel: ``make gpu-wheels``).
* **The whole RL step**, last: ``trainer.train()`` of each trainer for one warm-up step and ``--rl_steps`` (1) timed
  ones with the fastest generator TRL offers here (``use_transformers_continuous_batching=True`` where it runs, else
  HF ``generate``) at a fixed completion length, the step's time and generation's share of it (the time inside
  TRL's ``_generate_single_turn``). ~30 s a step on the H100, 99% generation: the least wanted per second.
* **Robust for one call**: each row is written as soon as it is measured; a row that fails (an OOM, a missing
  package) is recorded with its error and the run goes on; rows, the first row's repeat (which shows a warm-up
  artefact) and the RL step starting past ``--budget_s`` (330) seconds are skipped. The device and the date are
  printed first; with ``$OUT`` set (the device tool's folder that comes back) the results are copied there after
  every row.

Expected on an H100: ~275 s for the update rows and the repeat, then ~125 s for the RL step: ~400 s, ~430 s with
the imports and ``make``'s wheels (the 10-minute call holds it; ~8 minutes at worst: the RL step starts by 330 s or not at all).
Estimated from the run of 2026-11-27 (``results/gpu/bench_gpu_nvidia_h100_2026-11-27.log``): its rows' wall times
where measured (8.7-22.7 s; the QLoRA row with its check 48 s; the steps are as many as before, one warm-up and
``--repeats`` per trainer, only interleaved); elsewhere 5 steps per trainer at ms fitted to the measured rows against
the FLOP model's FLOPs (full, checkpointing: ~190 ms + 2.8 ms/TFLOP; LoRA: ~350 ms + 3.6; ``auto`` ~1.45x GRPO's)
plus ~2 s a build (3-5 s at 1.7B and 4B): 8 x 2048 LoRA 13 s, Qwen3-1.7B 12 and 15 s, Qwen3-4B 26 s, 8 x 4096 LoRA
20 s, 16 x 1024 9 s; the RL step: 4 steps at the ~30 s its 8 took then (238 s).

    make bench-gpu                               # on a lent GPU: python3 benchmarks/bench_gpu.py (<= 8 min on an H100)
    python benchmarks/bench_gpu.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
import harness  # noqa: E402
from studies.prepared import prepared_batch  # noqa: E402
from studies import gpu_memory, gpu_models, paired  # noqa: E402
from studies.gpu_models import GROUP, MODES, PROMPT, build_model, build_qlora_base, config_args, make_trainer  # noqa: E402
from studies.gpu_report import failure, profile_lines, profile_table, ran_of, render as render_results  # noqa: E402

from oblr_trl.demo.tiny import build_tokenizer  # noqa: E402

ALL, CORE, PAIR = tuple(MODES), ("grpo", "auto", "one_backward"), ("grpo", "auto")


def row(width, batch, completion, lora, ckpt, modes=PAIR, kind="plain", paired=True) -> dict:
    """One row of the update table; ``paired``: its trainers timed together in interleaved rounds (never the
    memory-tight row's: its memory fraction binds the whole process)."""
    return dict(width=width, batch=batch, completion=completion, lora=lora, ckpt=ckpt, modes=list(modes), kind=kind,
                paired=paired and kind != "tight")


def update_configs(quick: bool) -> list[dict]:
    """The update table's rows, most wanted first (a run out of time skips the last): (width, B, C, LoRA,
    checkpointing, modes, kind: ``plain``, ``tight`` (the memory-tight fallback) or ``qlora``, paired). First the
    modes side by side at Qwen3-0.6B with full fine-tuning, then LoRA at TRL's default (checkpointing on) and
    without, the fallbacks (memory-tight, QLoRA), the larger models (never measured yet), and last Qwen3-0.6B's
    other shapes (no checkpointing at 8 x 2048, measured on 2026-11-27; 8 x 4096; 16 x 1024)."""
    if quick:
        return [row("small", 8, 16, False, False, ALL), row("small", 8, 16, True, False, ALL),
                row("small", 8, 16, False, True, PAIR, "tight"), row("small", 8, 16, True, True, PAIR, "qlora")]
    w = "Qwen3-0.6B"  # the memory-tight row follows its unconstrained twin (8 x 2048, full, checkpointing)
    return [row(w, 8, 512, False, False, ALL), row(w, 8, 512, False, True, ALL), row(w, 8, 2048, False, True, ALL),
            row(w, 8, 512, True, True), row(w, 8, 2048, True, True), row(w, 8, 512, True, False, CORE),
            row(w, 8, 2048, False, True, PAIR, "tight"), row(w, 8, 512, True, True, PAIR, "qlora"),
            # two full 1.7B trainers hold ~51 GiB before a step: timed alone
            row("Qwen3-1.7B", 8, 1024, False, True, paired=False), row("Qwen3-1.7B", 8, 1024, True, True),
            row("Qwen3-4B", 8, 1024, True, True), row(w, 8, 2048, False, False), row(w, 8, 2048, True, False),
            row(w, 8, 4096, False, True), row(w, 8, 4096, True, True), row(w, 16, 1024, False, True)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def tight_fraction(trainer, cfg: dict, need_gib: float) -> tuple[float | None, str]:
    return gpu_memory.tight_fraction(trainer, cfg, need_gib, PROMPT, GROUP)


def one_backward_shape(trainer, cfg: dict):
    return gpu_memory.one_backward_shape(trainer, cfg, PROMPT, GROUP)


def prepared_trainer(cfg: dict, mode: str, device: str, model=None):
    """A trainer of ``mode`` whose batch is a fixed prepared one (generation excluded; OBLR-PO's own override runs on
    top, so its norms are timed), its optimizer created, checkpointing as the row says. ``model``: one built
    already (QLoRA's), else a seeded :func:`build_model` (so the trainers of a row start from identical copies)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    model = model if model is not None else build_model(cfg["width"], device)
    prepared, rewards = prepared_batch(cfg["batch"], cfg["completion"], model.config.vocab_size, PROMPT, GROUP, device)

    class Prepared(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            self._rewards_per_func = rewards  # what _calculate_rewards would have kept (OBLR-PO reads it)
            return dict(prepared)

    args = config_args(mode, device, per_device_train_batch_size=cfg["batch"], gradient_checkpointing=cfg["ckpt"],
                       max_completion_length=cfg["completion"])
    dataset = Dataset.from_list([{"prompt": "x"}] * cfg["batch"])
    tokenizer = build_tokenizer(vocab_size=model.config.vocab_size)
    trainer = make_trainer(mode, model, args, tokenizer, dataset, cfg["lora"], Prepared)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    if cfg["ckpt"]:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.train()
    return trainer


def one_step(trainer, cfg: dict, device: str, prof=None) -> float:
    """Seconds of one update: ``training_step``, the optimizer's step, the gradients dropped, the device synced
    before and after (``prof``: a profiler around it)."""
    rows = cfg["batch"]
    sync(device)
    start = time.perf_counter()
    with prof or contextlib.nullcontext():
        trainer.training_step(trainer.model, [{"prompt": "x"}] * rows, torch.tensor(rows * cfg["completion"]))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        sync(device)
    return time.perf_counter() - start


def mode_result(trainer, cfg: dict, device: str, times: list[float], meter) -> dict:
    """A mode's record: its timed steps and their median, the path it took, the FLOP model's FLOPs for that path and
    GRPO's, and its own memory (``gpu_memory.Meter``)."""
    from oblr_trl import cost_model, path_choice

    ran = ran_of(getattr(trainer, "route", None), cfg["batch"])
    shape = path_choice.describe(trainer.model, cfg["batch"], PROMPT, cfg["completion"], 2 if device != "cpu" else 4,
                                 cfg["ckpt"], GROUP)
    return dict(seconds=statistics.median(times), times=times, ran=ran, flops=cost_model.flops(shape, ran.split("/")[0]),
                grpo_flops=cost_model.flops(shape, "grpo"), **meter.gib())


def time_update(cfg: dict, mode: str, device: str, repeats: int, profile: bool = False, fraction=None,
                model=None) -> dict:
    """One trainer alone: built, one warm-up step, ``repeats`` timed steps (:func:`mode_result`).
    ``profile``: the last step under ``torch.profiler``, its operators by device time (``profile`` in the row).
    ``fraction``: a per-process memory fraction to run under (a number, or a function of the trainer returning
    ``(fraction or None, note)``), reset afterwards; ``model``: a model built already (QLoRA's)."""
    cuda = device.startswith("cuda")
    meter = gpu_memory.Meter(cuda)
    trainer = prepared_trainer(cfg, mode, device, model)
    note, table = "", None
    if callable(fraction):
        fraction, note = fraction(trainer)
    try:
        if fraction is not None and cuda:
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(fraction)
        one_step(trainer, cfg, device)  # the warm-up
        meter.built()
        times = []
        for i in range(repeats):
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else [])) if profile and i == repeats - 1 else None
            times.append(meter.step(functools.partial(one_step, trainer, cfg, device, prof)))
            table = profile_table(prof, cuda) if prof is not None else table
        out = mode_result(trainer, cfg, device, times, meter)
        if fraction is not None:
            out["fraction"] = fraction
        out.update({"note": note} if note else {}, **({"profile": table} if table is not None else {}))
        return out
    finally:
        if fraction is not None and cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        del trainer, model
        gpu_memory.release(device)


def time_paired(cfg: dict, modes: list[str], device: str, repeats: int, model_of=None) -> dict:
    """Every mode of a row alive at once and timed in ``repeats`` interleaved rounds (``studies.paired``): each
    built and warmed up in turn, ``auto`` first, so that its memory-aware choice sees the device as a lone trainer's
    would (the others' weights not there yet); then one step of each per round, the order rotated. A mode that fails
    to build or to step is recorded with its error; the rest run. ``model_of(mode)``: a model built already."""
    try:
        return _paired(cfg, modes, device, repeats, model_of)
    finally:  # the trainers went with _paired's frame
        gpu_memory.release(device)


def _paired(cfg: dict, modes: list[str], device: str, repeats: int, model_of) -> dict:
    live, failed = {}, {}
    for mode in sorted(modes, key=lambda m: m != "auto"):
        try:
            live[mode] = warmed_up(cfg, mode, device, model_of(mode) if model_of else None)
        except Exception as error:  # noqa: BLE001 - an OOM at build: recorded, the row goes on
            failed[mode] = failure(error)
    steps = {m: functools.partial(me.step, functools.partial(one_step, t, cfg, device)) for m, (t, me) in live.items()}
    times, errors = paired.interleave(steps, repeats)
    failed.update({m: failure(e) for m, e in errors.items()})
    return {m: mode_result(live[m][0], cfg, device, times[m], live[m][1]) if m in times else failed[m] for m in modes}


def warmed_up(cfg: dict, mode: str, device: str, model=None) -> tuple:
    """A trainer built and stepped once (the warm-up), with its memory :class:`gpu_memory.Meter`."""
    meter = gpu_memory.Meter(device.startswith("cuda"))
    trainer = prepared_trainer(cfg, mode, device, model)
    one_step(trainer, cfg, device)
    meter.built()
    return trainer, meter


def qlora_exactness(width: str, device: str) -> dict:
    return gpu_models.qlora_exactness(build_qlora_base(width, device, compute_dtype=torch.float32), device)


def time_rl_step(mode: str, device: str, width: str, completion: int, steps: int, generator: str = "hf") -> dict:
    """``trainer.train()`` for ``steps`` steps at a fixed completion length with ``generator`` (``"cb"``:
    transformers' continuous batching, ``use_transformers_continuous_batching=True``; ``"hf"``: HF generate): median
    seconds per step and generation's share (first step excluded)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    model = build_model(width, device)
    tokenizer = build_tokenizer(vocab_size=model.config.vocab_size)
    kw = dict(use_transformers_continuous_batching=True) if generator == "cb" else {}
    args = config_args(mode, device, per_device_train_batch_size=GROUP, max_completion_length=completion,
                       max_steps=steps + 1, generation_kwargs=dict(min_new_tokens=completion), temperature=1.0, **kw)
    dataset = Dataset.from_list([{"prompt": "What is 17 + 25? Show your work."}] * GROUP * (steps + 1))
    trainer = make_trainer(mode, model, args, tokenizer, dataset, lora=False)
    generate, spent = trainer._generate_single_turn, []

    def timed_generate(*a, **kw):
        sync(device)
        start = time.perf_counter()
        out = generate(*a, **kw)
        sync(device)
        spent.append(time.perf_counter() - start)
        return out

    trainer._generate_single_turn = timed_generate
    steps_s = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, *a, **kw):
            sync(device)
            steps_s.append(time.perf_counter() - self.start)

    trainer.add_callback(StepTimer())
    try:
        trainer.train()
    finally:
        del trainer, model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    step, gen = statistics.median(steps_s[1:] or steps_s), statistics.median(spent[1:] or spent)
    return dict(seconds=step, generation=gen, share=gen / step, generator=generator)


def render(res: dict) -> str:
    return render_results(res, PROMPT, GROUP)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a small model and short completions (CPU-sized)")
    p.add_argument("--repeats", type=int, default=4,
                   help="timed update steps per mode (rounds, on a paired row), after one warm-up step each")
    p.add_argument("--rl_steps", type=int, default=1, help="timed RL steps per trainer, after one warm-up step")
    p.add_argument("--rl_completion", type=int, default=256)
    p.add_argument("--budget_s", type=float, default=330, help="rows and the RL step starting after this many "
                   "seconds are skipped (the update rows take ~275 s on an H100, the RL step ~125 s after them)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--stem", default=None, help="default: bench_gpu_<device name>")
    p.add_argument("--tuning", choices=["all", "full", "lora"], default="all",
                   help="the update table's rows: every one, or full fine-tuning's or LoRA's alone (no RL step then)")
    p.add_argument("--profile", action="store_true", help="instead of the tables: the first update configurations "
                   "(full fine-tuning, checkpointing off and on) under torch.profiler, operators by device time, in "
                   "<stem>_profile.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    with harness.quiet():  # the libraries' warnings off while it runs, and only then
        return run(parse_args(argv), argv)


def run(args, argv=None) -> int:
    log = harness.Log()
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    width = "small" if args.quick else "Qwen3-0.6B"
    res = dict(machine=harness.machine_info(device=args.device, precision="bf16 autocast" if args.device != "cpu"
                                            else "float32"), device_name=device_name, width=width, update=[], rl=None,
               command=" ".join(["python benchmarks/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)]))
    print(f"bench_gpu: {device_name}, {res['machine']['date']}, torch {torch.__version__}", flush=True)
    stem = args.stem or "bench_gpu_" + "".join(c if c.isalnum() else "_" for c in device_name.lower()).strip("_")
    configs = [c for c in update_configs(args.quick) if args.tuning == "all" or c["lora"] == (args.tuning == "lora")]
    try:  # untimed: a fresh device's first kernels, allocator and autotuning
        time_update(configs[0], "grpo", args.device, 1)
    except Exception as error:  # noqa: BLE001 - the rows say it again, each
        log(f"warm-up failed: {failure(error)['error']}")
    if args.profile:
        return run_profile(args, res, stem, log)
    over = lambda: time.perf_counter() - started > args.budget_s  # noqa: E731

    def save():
        written = harness.write_results(args.out, stem, res, render(res))
        if os.environ.get("OUT"):  # the device tool's folder that comes back: a copy after every row
            harness.write_results(Path(os.environ["OUT"]), stem, res, render(res))
        return written

    for cfg in configs:
        res["update"].append(measure_row(cfg, args, res, log, over))
        save()
    first = dict(configs[0], modes=list(PAIR), kind="plain")
    res["update"].append(dict(measure_row(first, args, res, log, over), repeat=True))  # a warm-up artefact shows
    save()
    if args.tuning == "all":  # last: ~30 s a step on an H100 (generation), the least wanted per second
        rl_step(args, res, width, log, over)
    js, md = save()
    log(f"wrote {js} and {md} in {time.perf_counter() - started:.0f} s")
    print(render(res), flush=True)  # the table in the run's output too
    return 0


def measure_row(cfg: dict, args, res: dict, log, over) -> dict:
    """One row of the update table, every mode of it; a failing mode is recorded and the rest run."""
    out = {k: v for k, v in cfg.items() if k != "modes"}
    if over():
        log(f"update {cfg}: skipped (past --budget_s {args.budget_s:.0f} s)")
        return dict(out, skipped=f"past the run's time budget ({args.budget_s:.0f} s)", modes={})
    out["modes"], cuda, kind = {}, args.device.startswith("cuda"), cfg.get("kind", "plain")
    if kind == "qlora":
        try:
            res["qlora"] = qlora_exactness(cfg["width"], args.device if cuda else "cpu")
            log(f"QLoRA exactness: largest relative error {res['qlora']['max_rel_err']:.2e}")
        except ImportError as error:
            res["qlora"] = dict(skipped=f"bitsandbytes does not import ({error}); `make gpu-wheels` carries it")
            print(f"bench_gpu: the QLoRA row is skipped: {res['qlora']['skipped']}", flush=True)
            return dict(out, skipped=res["qlora"]["skipped"], modes={})
        except Exception as error:  # noqa: BLE001 - said in the table; the run goes on
            res["qlora"] = failure(error)
            log(f"QLoRA exactness failed: {res['qlora']['error']}")
    model_of = (lambda mode: build_qlora_base(cfg["width"], args.device)) if kind == "qlora" else None
    if kind == "tight":
        out["modes"] = tight_row(cfg, args, res, out)
    elif cfg.get("paired"):
        try:
            out["modes"] = time_paired(cfg, cfg["modes"], args.device, args.repeats, model_of)
        except Exception as error:  # noqa: BLE001 - a failure outside one mode's: every mode says it
            out["modes"] = dict.fromkeys(cfg["modes"], failure(error))
    else:
        for mode in cfg["modes"]:
            try:
                out["modes"][mode] = time_update(cfg, mode, args.device, args.repeats,
                                                 model=model_of(mode) if model_of else None)
            except Exception as error:  # noqa: BLE001 - an OOM, a failing path: recorded, the run goes on
                out["modes"][mode] = failure(error)
    out["modes"] = paired.with_ratios(out["modes"], "grpo")
    log(f"update {cfg}: " + ", ".join(f"{k} {v['seconds'] * 1e3:.1f} ms ({v['ran']}, {v['ratio']:.2f}x)"
                                      if "seconds" in v else f"{k} {v['error']}" for k, v in out["modes"].items()))
    return out


def tight_row(cfg: dict, args, res: dict, out: dict) -> dict:
    """The memory-tight row, one trainer at a time (the fraction binds the process): the default under a fraction
    that refuses ``one_backward`` but holds GRPO's peak from the build (its unconstrained twin's, else measured
    now), then GRPO under the same fraction."""
    modes, cuda = {}, args.device.startswith("cuda")
    for mode in ("auto", "grpo"):
        try:
            fraction = modes.get("auto", {}).get("fraction")  # GRPO under the default's limit
            if cuda and mode == "auto":
                need = gpu_memory.twin_peak(res["update"], cfg)
                need = need if need is not None else time_update(cfg, "grpo", args.device, 1)["peak_gib"]
                fraction = functools.partial(noted_fraction, cfg, need, out)
            modes[mode] = time_update(cfg, mode, args.device, args.repeats, fraction=fraction)
        except Exception as error:  # noqa: BLE001 - an OOM, a failing path: recorded, the run goes on
            modes[mode] = failure(error)
    return {m: modes[m] for m in ("grpo", "auto")}


def noted_fraction(cfg: dict, need_gib: float, out: dict, trainer) -> tuple[float | None, str]:
    """:func:`tight_fraction` for ``trainer``, its note kept in the row (``out``) for the table."""
    value, out["note"] = tight_fraction(trainer, cfg, need_gib)
    return value, out["note"]


def rl_step(args, res: dict, width: str, log, over) -> None:
    """The whole RL step of GRPO and the default: continuous batching where it runs, else HF generate."""
    completion = 16 if args.quick else args.rl_completion
    rl = dict(completion=completion, modes={}, generator="hf")
    if over():
        rl["modes"] = {"grpo": dict(error="skipped: past the run's time budget")}
        res["rl"] = rl
        return
    # continuous batching where it runs for both trainers, else HF generate for both (one generator per table)
    for generator in (["cb", "hf"] if args.device.startswith("cuda") else ["hf"]):
        rl["modes"], rl["generator"] = {}, generator
        for mode in ("grpo", "auto"):
            try:
                rl["modes"][mode] = time_rl_step(mode, args.device, width, completion, args.rl_steps, generator)
            except Exception as error:  # noqa: BLE001 - said in the table
                rl["modes"][mode] = failure(error)
                if generator == "cb":
                    rl["cb_error"] = f"{mode}: {rl['modes'][mode]['error']}"
                    break
        if "cb_error" not in rl or generator == "hf" or over():
            break
    res["rl"] = rl
    log(f"RL step: {rl}")


def run_profile(args, res: dict, stem: str, log) -> int:
    lines = [f"# Where a step's device time goes: {res['device_name']}, {res['machine']['date']}", "",
             f"`{res['command']}` (torch {res['machine']['torch']}). One profiled step after the warm-up and "
             f"{args.repeats - 1} timed steps; operators by self device time (CPU time on a CPU).", ""]
    configs = [c for c in update_configs(args.quick) if not c["lora"] and c["kind"] == "plain"][:2]
    res["profile"] = []
    for cfg in configs:
        for mode in ("grpo", "auto", "one_backward"):
            row = time_update(cfg, mode, args.device, args.repeats, profile=True)
            prof = row["profile"]
            log(f"profile {cfg} {mode}: {row['seconds'] * 1e3:.1f} ms, {prof['launches']} launches, "
                f"{prof['syncs']} syncs/copies")
            res["profile"].append(dict(cfg, mode=mode, **row))
            lines += profile_lines(cfg, mode, row)
            harness.write_results(args.out, stem + "_profile", res, "\n".join(lines))
    log(f"wrote {args.out / (stem + '_profile.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
