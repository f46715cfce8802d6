"""One command for a lent GPU (issue 47): OBLRPOTrainer against GRPOTrainer, timed in the same run, with the counted
prediction of ``oblr_trl/cost_model.py`` beside each timing.

Design:
* **The update** (generation excluded): one ``training_step`` of each trainer on a prepared batch of ``B``
  completions of ``C`` tokens (TRL's ``_generate_and_score_completions`` returns it; OBLR-PO's own override runs on
  top, so its norms are timed). Modes: GRPO, OBLR-PO's default (``auto``), ``one_backward``, two passes. Models:
  random Qwen3s of Qwen3-0.6B's width and depth with its real 151,936-token tied head, bf16 autocast, full
  fine-tuning (checkpointing off and on) and LoRA r=16 on all linear layers. Medians of ``--repeats`` steps after a
  warm-up; beside each ratio, the FLOP model's (``cost_model.flops`` of ``one_backward.describe(model)``).
* **The whole RL step**: ``trainer.train()`` of each trainer for ``--rl_steps`` steps with HF ``generate`` at a fixed
  completion length (``min_new_tokens`` = ``max_completion_length``), the step's time and generation's share of it
  (the time inside TRL's ``_generate_single_turn``), first step (compilation, allocation) excluded.
* The table names the device and the date. Nothing is asserted; ``--device cpu --quick`` runs a small model (tests).

    make bench-gpu                               # on a lent GPU: python3 benchmarks/bench_gpu.py (<= 8 min on an H100)
    python benchmarks/bench_gpu.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # this checkout's oblr_trl
import harness  # noqa: E402
from studies.prepared import prepared_batch  # noqa: E402

from oblr_trl.demo.tiny import build_tokenizer  # noqa: E402

GROUP, PROMPT = 8, 32
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936, num_hidden_layers=28)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512, num_hidden_layers=2)
MODES = {"grpo": None, "auto": None, "one_backward": True, "two_passes": False}


def update_configs(quick: bool) -> list[dict]:
    """(width, B, C, LoRA, checkpointing) of the update table."""
    if quick:
        return [dict(width="small", batch=8, completion=16, lora=lora, ckpt=False) for lora in (False, True)]
    return [dict(width="Qwen3-0.6B", batch=8, completion=c, lora=lora, ckpt=ckpt)
            for c in (512, 2048) for lora, ckpt in ((False, False), (False, True), (True, False))]


def build_model(width: str, device: str, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dims = QWEN3_06B if width == "Qwen3-0.6B" else SMALL
    config = Qwen3Config(**dims, tie_word_embeddings=True, max_position_embeddings=8192, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(config)


def config_args(mode: str, device: str, **kw):
    from trl import GRPOConfig

    from oblr_trl import OBLRPOConfig

    common = dict(output_dir="/tmp/bench_gpu", num_generations=GROUP, gradient_accumulation_steps=1,
                  steps_per_generation=1, report_to="none", use_cpu=device == "cpu", bf16=device != "cpu",
                  save_strategy="no", logging_steps=1, disable_tqdm=True, **kw)
    return GRPOConfig(**common) if mode == "grpo" else OBLRPOConfig(**common, one_backward=MODES[mode])


def make_trainer(mode: str, model, args, tokenizer, dataset, lora: bool, base=None):
    from trl import GRPOTrainer

    from oblr_trl import OBLRPOTrainer

    from transformers.trainer_callback import PrinterCallback

    base = base or GRPOTrainer
    cls = base if mode == "grpo" else type("Timed" + base.__name__, (OBLRPOTrainer, base), {})
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = cls(model=model, args=args, reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer,
                  peft_config=peft)
    trainer.remove_callback(PrinterCallback)  # the per-step metric dicts; the benchmark logs its own lines
    return trainer


def reward(completions, completion_ids=None, **kwargs):
    """Rewards with spread inside each group, from the completions' token ids."""
    return [float(sum(ids) % 7) / 7 for ids in completion_ids]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_update(cfg: dict, mode: str, device: str, repeats: int, profile: bool = False) -> dict:
    """Median seconds of one training_step in ``mode``, the FLOP model's FLOPs for what ran, and the peak GiB allocated
    from the model's build (construction and its coverage probe, the warm-up step) and over the timed steps alone.
    ``profile``: the last step under ``torch.profiler``, its operators by device time (``profile`` in the row)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from oblr_trl import cost_model, one_backward

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg["width"], device)
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
    times, peaks, table = [], [], None
    for i in range(repeats + 1):
        last = profile and i == repeats
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else [])) if last else contextlib.nullcontext()
        sync(device)
        start = time.perf_counter()
        rows = cfg["batch"]
        with prof:
            trainer.training_step(trainer.model, [{"prompt": "x"}] * rows, torch.tensor(rows * cfg["completion"]))
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            sync(device)
        times.append(time.perf_counter() - start)
        if cuda:  # the build's and warm-up's peak, then the timed steps' own
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        if last:
            table = profile_table(prof, cuda)
    plan = getattr(trainer, "one_backward_plan", None)
    ran = "grpo" if plan is None else "one_backward" if plan.on else "two_passes"
    shape = one_backward.describe(trainer.model, cfg["batch"], PROMPT, cfg["completion"], 2 if device != "cpu" else 4,
                                  cfg["ckpt"], GROUP)
    nan = float("nan")
    row = dict(seconds=statistics.median(times[1:]), ran=ran, flops=cost_model.flops(shape, ran),
               peak_gib=peaks[0] if peaks else nan, step_peak_gib=max(peaks[1:]) if peaks else nan)
    if table is not None:
        row["profile"] = table
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


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


def time_rl_step(mode: str, device: str, width: str, completion: int, steps: int) -> dict:
    """``trainer.train()`` for ``steps`` steps with HF generate at a fixed completion length: median seconds per
    step and generation's share (first step excluded)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    model = build_model(width, device)
    tokenizer = build_tokenizer(vocab_size=model.config.vocab_size)
    args = config_args(mode, device, per_device_train_batch_size=GROUP, max_completion_length=completion,
                       max_steps=steps + 1, generation_kwargs=dict(min_new_tokens=completion), temperature=1.0)
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
    trainer.train()
    step, gen = statistics.median(steps_s[1:] or steps_s), statistics.median(spent[1:] or spent)
    del trainer, model
    gc.collect()
    return dict(seconds=step, generation=gen, share=gen / step)


def render(res: dict) -> str:
    m = res["machine"]
    lines = ["# OBLR-PO against GRPO on a GPU: the update and the whole RL step", "",
             f"Measured {m['date']} on **{res['device_name']}** with `{res['command']}` (torch {m['torch']}, "
             f"transformers {m['transformers']}, trl {m['trl']}). Random-initialised Qwen3 (width "
             f"{res['width']}, tied head), {PROMPT} prompt tokens, groups of {GROUP}. `model`: the FLOP model's ratio "
             "(`oblr_trl/cost_model.py`, what the default chooses by) for the path that ran.", "", "## The update", ""]
    rows = []
    for r in res["update"]:
        g = r["modes"]["grpo"]
        for mode, v in r["modes"].items():
            rows.append([f"{r['batch']} x {r['completion']}", "LoRA r=16" if r["lora"] else "full",
                         "on" if r["ckpt"] else "off", mode, v["ran"], f"{v['seconds'] * 1e3:.1f}",
                         f"{v['seconds'] / g['seconds']:.2f}x", f"{v['flops'] / g['flops']:.2f}x",
                         f"{v['peak_gib']:.2f}", f"{v.get('step_peak_gib', float('nan')):.2f}",
                         f"{v.get('step_peak_gib', float('nan')) / g.get('step_peak_gib', float('nan')):.2f}x"])
    lines += harness.md_table(["B x C", "tuning", "ckpt", "mode", "ran", "ms", "time / GRPO", "model FLOPs / GRPO",
                               "peak GiB from build", "peak GiB of the steps", "step peak / GRPO"], rows)
    lines += ["", "`peak GiB from build`: allocated from the model's build through construction (OBLR-PO's coverage "
              "probe), the optimizer's creation and the warm-up step; `of the steps`: over the timed steps alone."]
    if res.get("rl") is None:  # written after each update row, so a run stopped early still leaves its table
        return "\n".join(lines + ["", "The whole RL step: not in this run.", ""])
    lines += ["", f"## The whole RL step (HF generate, {res['rl']['completion']} tokens per completion, "
              "full fine-tuning)", ""]
    g = res["rl"]["modes"]["grpo"]
    lines += harness.md_table(["trainer", "s / step", "step / GRPO", "generation s", "generation's share"], [
        [mode, f"{v['seconds']:.2f}", f"{v['seconds'] / g['seconds']:.2f}x", f"{v['generation']:.2f}",
         f"{v['share']:.0%}"]
        for mode, v in res["rl"]["modes"].items()])
    return "\n".join(lines + [""])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a small model and short completions (CPU-sized)")
    p.add_argument("--repeats", type=int, default=5, help="timed update steps per mode, after one warm-up")
    p.add_argument("--rl_steps", type=int, default=3, help="timed RL steps per trainer, after one warm-up step")
    p.add_argument("--rl_completion", type=int, default=256)
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
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    width = "small" if args.quick else "Qwen3-0.6B"
    res = dict(machine=harness.machine_info(device=args.device, precision="bf16 autocast" if args.device != "cpu"
                                            else "float32"), device_name=device_name, width=width, update=[], rl=None,
               command=" ".join(["python benchmarks/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)]))
    stem = args.stem or "bench_gpu_" + "".join(c if c.isalnum() else "_" for c in device_name.lower()).strip("_")
    configs = [c for c in update_configs(args.quick) if args.tuning == "all" or c["lora"] == (args.tuning == "lora")]
    time_update(configs[0], "grpo", args.device, 1)  # untimed: a fresh device's first kernels, allocator and autotuning
    if args.profile:
        return run_profile(args, res, stem, log)
    for cfg in configs:
        row = dict(cfg, modes={mode: time_update(cfg, mode, args.device, args.repeats) for mode in MODES})
        log(f"update {cfg}: " + ", ".join(f"{k} {v['seconds'] * 1e3:.1f} ms ({v['ran']})"
                                          for k, v in row["modes"].items()))
        res["update"].append(row)
        harness.write_results(args.out, stem, res, render(res))
    if args.tuning != "all":
        return 0
    completion = 16 if args.quick else args.rl_completion
    res["rl"] = dict(completion=completion, modes={
        mode: time_rl_step(mode, args.device, width, completion, args.rl_steps) for mode in ("grpo", "auto")})
    log(f"RL step: {res['rl']}")
    js, md = harness.write_results(args.out, stem, res, render(res))
    log(f"wrote {js} and {md}")
    return 0


def run_profile(args, res: dict, stem: str, log) -> int:
    lines = [f"# Where a step's device time goes: {res['device_name']}, {res['machine']['date']}", "",
             f"`{res['command']}` (torch {res['machine']['torch']}). One profiled step after the warm-up and "
             f"{args.repeats - 1} timed steps; operators by self device time (CPU time on a CPU).", ""]
    configs = [c for c in update_configs(args.quick) if not c["lora"]][:2]
    res["profile"] = []
    for cfg in configs:
        for mode in ("grpo", "auto", "one_backward"):
            row = time_update(cfg, mode, args.device, args.repeats, profile=True)
            prof = row["profile"]
            log(f"profile {cfg} {mode}: {row['seconds'] * 1e3:.1f} ms, {prof['launches']} launches, "
                f"{prof['syncs']} syncs/copies")
            res["profile"].append(dict(cfg, mode=mode, **row))
            lines += [f"## {cfg['batch']} x {cfg['completion']}, full, checkpointing {'on' if cfg['ckpt'] else 'off'}: "
                      f"{mode} ({row['ran']})", "",
                      f"{row['seconds'] * 1e3:.1f} ms a step (median, the profiled step included), profiled step "
                      f"{prof['kernel_ms']:.1f} ms of kernel time (CPU time on a CPU), {prof['launches']} kernel "
                      f"launches, {prof['syncs']} host syncs and copies; "
                      f"peak {row['step_peak_gib']:.2f} GiB (steps), {row['peak_gib']:.2f} GiB (from build).", ""]
            lines += harness.md_table(["operator", "calls", "ms"], [[t["op"].replace("|", "/"), t["calls"],
                                                                    f"{t['ms']:.2f}"] for t in prof["top"]]) + [""]
            harness.write_results(args.out, stem + "_profile", res, "\n".join(lines))
    log(f"wrote {args.out / (stem + '_profile.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
