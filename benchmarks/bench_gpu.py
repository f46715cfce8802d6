"""One command for a lent GPU (issues 47, 56): OBLRPOTrainer against GRPOTrainer, timed in the same run, with the
counted prediction of ``oblr_trl/cost_model.py`` beside each timing.

Design:
* **The update** (generation excluded): one ``training_step`` plus the optimizer step of each trainer on a prepared
  batch of ``B`` completions of ``C`` tokens (TRL's ``_generate_and_score_completions`` returns it; OBLR-PO's own
  override runs on top, so its norms are timed). Modes: GRPO, OBLR-PO's default (``auto``: memory-aware on a GPU,
  issue 56), ``one_backward``, two passes, not every mode on every row. Models: random Qwen3s of Qwen3-0.6B's,
  Qwen3-1.7B's and Qwen3-4B's widths and depths with their real 151,936-token tied heads, bf16 autocast, full
  fine-tuning or LoRA r=16 on all linear layers, gradient checkpointing off and on (TRL's default). Medians of
  ``--repeats`` steps after a warm-up; beside each ratio, the FLOP model's (``cost_model.flops`` of
  ``one_backward.describe(model)``) for the path that ran, and the peaks.
* **A memory-tight row**: ``torch.cuda.set_per_process_memory_fraction`` set so that GRPO's measured peak fits but
  ``one_backward``'s predicted peak does not: the default must fall back (replayed or two passes), without an OOM.
* **A QLoRA row**: a bitsandbytes 4-bit (nf4) base with LoRA r=16: the norms against per-row autograd (fp32 compute,
  relative error), then the update's cost against GRPOTrainer's. Skipped, saying why, where bitsandbytes does not
  import (it travels as a wheel: ``make gpu-wheels``).
* **The whole RL step**: ``trainer.train()`` of each trainer for ``--rl_steps`` steps with the fastest generator TRL
  offers here (``use_transformers_continuous_batching=True`` where it runs, else HF ``generate``) at a fixed
  completion length, the step's time and generation's share of it (the time inside TRL's ``_generate_single_turn``),
  first step excluded.
* **Robust for one call**: each row is written as soon as it is measured; a row that fails (an OOM, a missing
  package) is recorded with its error and the run goes on; rows past ``--budget_s`` seconds are skipped (the first
  row's repeat at the end, which shows a warm-up artefact, included). The device and the date are printed first; with
  ``$OUT`` set (the device tool's folder that comes back) the results are copied there after every row.

    make bench-gpu                               # on a lent GPU: python3 benchmarks/bench_gpu.py (<= 8 min on an H100)
    python benchmarks/bench_gpu.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # this checkout's oblr_trl
import harness  # noqa: E402
from studies.prepared import prepared_batch  # noqa: E402
from studies import gpu_memory  # noqa: E402
from studies.gpu_report import failure, profile_table, ran_of, render as render_results  # noqa: E402

from oblr_trl.demo.tiny import build_tokenizer  # noqa: E402

GROUP, PROMPT = 8, 32
QWEN3 = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936)
WIDTHS = {
    "Qwen3-0.6B": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_hidden_layers=28),
    "Qwen3-1.7B": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_hidden_layers=28),
    "Qwen3-4B": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_hidden_layers=36),
    "small": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, num_hidden_layers=2),
}
QWEN3_06B = WIDTHS["Qwen3-0.6B"]
SMALL = WIDTHS["small"]
MODES = {"grpo": None, "auto": None, "one_backward": True, "two_passes": False}
ALL, CORE, PAIR = tuple(MODES), ("grpo", "auto", "one_backward"), ("grpo", "auto")


def row(width, batch, completion, lora, ckpt, modes=PAIR, kind="plain") -> dict:
    return dict(width=width, batch=batch, completion=completion, lora=lora, ckpt=ckpt, modes=list(modes), kind=kind)


def update_configs(quick: bool) -> list[dict]:
    """The update table's rows, most wanted first (a run out of time skips the last): (width, B, C, LoRA,
    checkpointing, modes, kind: ``plain``, ``tight`` (the memory-tight fallback) or ``qlora``)."""
    if quick:
        return [row("small", 8, 16, False, False, ALL), row("small", 8, 16, True, False, ALL),
                row("small", 8, 16, False, True, PAIR, "tight"), row("small", 8, 16, True, True, PAIR, "qlora")]
    w = "Qwen3-0.6B"  # the memory-tight row follows its unconstrained twin (8 x 2048, full, checkpointing)
    return [row(w, 8, 512, False, False, ALL), row(w, 8, 512, False, True, ALL), row(w, 8, 2048, False, True, ALL),
            row(w, 8, 512, True, False, CORE), row(w, 8, 2048, False, False, CORE), row(w, 8, 2048, True, False),
            row(w, 8, 512, True, True), row(w, 8, 2048, False, True, PAIR, "tight"),
            row(w, 8, 512, True, True, PAIR, "qlora"),
            # the whole RL step runs here (RL_AFTER), then the larger shapes and models
            row(w, 8, 4096, False, True), row(w, 8, 4096, True, True), row(w, 16, 1024, False, True),
            row("Qwen3-1.7B", 8, 1024, False, True), row("Qwen3-1.7B", 8, 1024, True, True),
            row("Qwen3-4B", 8, 1024, True, True), row(w, 8, 2048, True, True)]


RL_AFTER = {True: 1, False: 9}  # rows of update_configs(quick) before the whole RL step


def build_model(width: str, device: str, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**WIDTHS[width], tie_word_embeddings=True, max_position_embeddings=8192, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(config)


def build_qlora_base(width: str, device: str, compute_dtype=torch.bfloat16):
    """A random Qwen3 of ``width`` saved and loaded again with its linear layers in bitsandbytes 4-bit (nf4), as
    users load a QLoRA base (``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``)."""
    import bitsandbytes  # noqa: F401  (the row is skipped, with the reason, where it does not import)
    from transformers import BitsAndBytesConfig, Qwen3ForCausalLM

    model = build_model(width, "cpu")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        del model
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
        return Qwen3ForCausalLM.from_pretrained(folder, quantization_config=quant, device_map={"": device},
                                                torch_dtype=compute_dtype)


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


def tight_fraction(trainer, cfg: dict, need_gib: float) -> tuple[float | None, str]:
    return gpu_memory.tight_fraction(trainer, cfg, need_gib, PROMPT, GROUP)


def one_backward_shape(trainer, cfg: dict):
    return gpu_memory.one_backward_shape(trainer, cfg, PROMPT, GROUP)


def time_update(cfg: dict, mode: str, device: str, repeats: int, profile: bool = False, fraction=None,
                model=None) -> dict:
    """Median seconds of one training_step in ``mode``, the FLOP model's FLOPs for what ran, and the peak GiB allocated
    from the model's build (construction and its coverage probe, the warm-up step) and over the timed steps alone.
    ``profile``: the last step under ``torch.profiler``, its operators by device time (``profile`` in the row).
    ``fraction``: a per-process memory fraction to run under (a number, or a function of the trainer returning
    ``(fraction or None, note)``), reset afterwards; ``model``: a model built already (QLoRA's)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from oblr_trl import cost_model, one_backward

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
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
    note = ""
    if callable(fraction):
        fraction, note = fraction(trainer)
    times, peaks, table = [], [], None
    try:
        if fraction is not None and cuda:
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(fraction)
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
        ran = ran_of(plan, cfg["batch"])
        shape = one_backward.describe(trainer.model, cfg["batch"], PROMPT, cfg["completion"],
                                      2 if device != "cpu" else 4, cfg["ckpt"], GROUP)
        nan = float("nan")
        out = dict(seconds=statistics.median(times[1:]), ran=ran, flops=cost_model.flops(shape, ran.split("/")[0]),
                   peak_gib=peaks[0] if peaks else nan, step_peak_gib=max(peaks[1:]) if peaks else nan,
                   grpo_flops=cost_model.flops(shape, "grpo"))
        if fraction is not None:
            out["fraction"], out["note"] = fraction, note
        elif note:
            out["note"] = note
        if table is not None:
            out["profile"] = table
        return out
    finally:
        if fraction is not None and cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        del trainer, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def qlora_exactness(width: str, device: str, rows: int = 4, completion: int = 48) -> dict:
    """The engine's per-sequence squared norms on a 4-bit (nf4) base with LoRA r=16, fp32 compute, against one
    autograd backward per row: the largest relative error (the target: <= 1e-5)."""
    from peft import LoraConfig, get_peft_model

    from oblr_trl.grad_norms import per_sequence_grad_sq_norms

    model = build_qlora_base(width, device, compute_dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at 0: the norms of A's gradient alone; a random B tests both
            torch.nn.init.normal_(p, std=0.02)
    batch, _ = prepared_batch(rows, completion, model.config.vocab_size, PROMPT, rows, device)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    ours = per_sequence_grad_sq_norms(model, ids, mask, batch["completion_mask"]).double()
    params = [p for p in model.parameters() if p.requires_grad]
    reference = []
    for i in range(rows):
        logits = model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).logits[:, PROMPT - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[i : i + 1, PROMPT:, None]).squeeze(-1)
        grads = torch.autograd.grad((logp * batch["completion_mask"][i : i + 1]).sum(), params, allow_unused=True)
        reference.append(sum(g.double().pow(2).sum() for g in grads if g is not None))
    reference = torch.stack(reference).to(ours.device)
    err = ((ours - reference).abs() / reference.abs().clamp(min=1e-30)).max().item()
    del model
    gc.collect()
    return dict(rows=rows, completion=completion, max_rel_err=err, ours=ours.tolist(), reference=reference.tolist())


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
    p.add_argument("--repeats", type=int, default=4, help="timed update steps per mode, after one warm-up")
    p.add_argument("--rl_steps", type=int, default=3, help="timed RL steps per trainer, after one warm-up step")
    p.add_argument("--rl_completion", type=int, default=256)
    p.add_argument("--budget_s", type=float, default=400,
                   help="rows starting after this many seconds are skipped (the whole run stays within ~8 minutes)")
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

    for i, cfg in enumerate(configs):
        if args.tuning == "all" and i == RL_AFTER[args.quick]:  # after the core rows, before the larger models
            rl_step(args, res, width, log, over)
            save()
        res["update"].append(measure_row(cfg, args, res, log, over))
        save()
    if args.tuning == "all" and res["rl"] is None:
        rl_step(args, res, width, log, over)
    first = dict(configs[0], modes=list(PAIR), kind="plain")
    res["update"].append(dict(measure_row(first, args, res, log, over), repeat=True))  # a warm-up artefact shows
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
    out["modes"], cuda = {}, args.device.startswith("cuda")
    kind, fraction = cfg.get("kind", "plain"), None
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
    for mode in (["auto", "grpo"] if kind == "tight" else cfg["modes"]):
        try:
            model = build_qlora_base(cfg["width"], args.device) if kind == "qlora" else None
            if kind == "tight" and cuda:
                if mode == "auto":
                    grpo_peak = next((r["modes"]["grpo"].get("peak_gib") for r in res["update"] if r.get("width") ==
                                      cfg["width"] and (r["batch"], r["completion"], r["lora"], r["ckpt"]) ==
                                      (cfg["batch"], cfg["completion"], cfg["lora"], cfg["ckpt"]) and
                                      "seconds" in r.get("modes", {}).get("grpo", {})), None)
                    if grpo_peak is None:
                        grpo_peak = time_update(cfg, "grpo", args.device, 1)["peak_gib"]

                    def fraction(trainer, need=grpo_peak):
                        value, note = tight_fraction(trainer, cfg, need)
                        out["note"] = note
                        return value, note
                else:
                    fraction = out["modes"].get("auto", {}).get("fraction")  # GRPO under the same limit
            out["modes"][mode] = time_update(cfg, mode, args.device, args.repeats, fraction=fraction, model=model)
        except Exception as error:  # noqa: BLE001 - an OOM, a failing path: recorded, the run goes on
            out["modes"][mode] = failure(error)
    if kind == "tight":
        out["modes"] = {m: out["modes"][m] for m in ("grpo", "auto") if m in out["modes"]}
    log(f"update {cfg}: " + ", ".join(f"{k} {v['seconds'] * 1e3:.1f} ms ({v['ran']})" if "seconds" in v else
                                      f"{k} {v['error']}" for k, v in out["modes"].items()))
    return out


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
