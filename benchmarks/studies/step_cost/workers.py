"""step_cost.py's subprocess workers, each in a fresh process so that its peak memory is its own: the peak RSS of one
measured call (CPU), and whole RL steps of one trainer kind (``python benchmarks/step_cost.py --mem-worker ...`` /
``--step-worker ...``)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from harness.memory import peak_rss

from .calls import device_and_dtype, label, load_model, make_batch, make_fns
from .design import GROUP, MEM_CPU, STEP_MODE, grpo_of

SCRIPT = Path(__file__).resolve().parents[2] / "step_cost.py"  # run with --mem-worker / --step-worker


def mem_worker(spec: str, completion: int, batch: int, prompt: int, mode: str, threads: int) -> None:
    """Run in a fresh CPU process: peak RSS of one call of ``mode`` above the RSS after building everything."""
    torch.set_num_threads(threads)
    device, dtype = device_and_dtype()
    model, _ = load_model(spec, device)
    data = make_batch(model.config.vocab_size, batch, prompt, completion, device)
    fns = make_fns(model, data, device, dtype)
    # load kernels/libraries on a short batch first, so one-time initialisation does not count
    make_fns(model, make_batch(model.config.vocab_size, GROUP, 8, 8, device), device, dtype)[mode]()
    with peak_rss() as mem:
        fns[mode]()
    print(json.dumps(mem))

def _subprocess_json(cmd: list[str], env: dict | None = None, cwd=None) -> dict:
    """The last JSON line a worker printed (``failed``: its stderr's end, where it printed none)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                                       **(env or {})}, cwd=cwd)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return dict(failed=proc.stderr.strip()[-400:])
    return json.loads(lines[-1])

def measure_memory_cpu(spec, completion, batch, prompt, mode, threads) -> dict:
    res = _subprocess_json([sys.executable, str(SCRIPT), "--mem-worker", spec, str(completion),
                            str(batch), str(prompt), mode, "--threads", str(threads)])
    if "failed" in res:
        return dict(peak_bytes=float("nan"), method="failed: " + res["failed"][-300:])
    return res

def memory_config(spec, completion, args, guard, device, names) -> dict:
    """Stage 2 of a configuration: peak memory per function (CUDA: from the timed calls; CPU: subprocesses)."""
    if device.type == "cuda":
        return {n: dict(peak_bytes=guard.peak.get(n, float("nan")), method="torch.cuda.max_memory_allocated above "
                        "allocated, the largest over the timed calls") for n in names}
    modes = [m for m in MEM_CPU if m.removesuffix("_ckpt") in names]
    return {m: measure_memory_cpu(spec, completion, args.batch, args.prompt_len, m, args.threads) for m in modes}

def reward_ones(completions, **kwargs):
    return [float(c[0]["content"].count("1")) for c in completions]

def step_worker(kind: str, spec: str, completion: int, steps: int, batch: int, threads: int) -> None:
    """Run in a fresh process: ``steps`` timed RL steps (after one warm-up) of one trainer, its peak memory."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    torch.set_num_threads(threads)
    device, _ = device_and_dtype()
    model, tokenizer = load_model(spec, device, fused=False)
    if tokenizer is None:
        raise SystemExit(f"step_cost: the RL step needs a tokenizer: {spec!r} has none (use tiny, small or --model).")
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Count the ones in {i:012d} + {3 * i:012d}"}]} for i in range(256)]
    )
    common = dict(output_dir=f"/tmp/oblr-step-cost-{kind}", per_device_train_batch_size=batch,
                  num_generations=GROUP, max_completion_length=completion, max_steps=steps + 1, logging_steps=1,
                  learning_rate=1e-5, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                  use_cpu=device.type != "cuda", bf16=device.type == "cuda",
                  gradient_checkpointing=not kind.endswith("no_ckpt"),
                  generation_kwargs={"min_new_tokens": completion})  # every completion is exactly max length
    sections = defaultdict(float)
    base = GRPOTrainer if kind.startswith("grpo") else OBLRPOTrainer

    class Trainer(base):
        def _generate_and_score_completions(self, *a, **k):  # TRL's method: generation, rewards (and OBLR's norms)
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **k)
            sections["generate+score"] += time.perf_counter() - t0
            return out

    args = GRPOConfig(**common) if base is GRPOTrainer else OBLRPOConfig(**common, one_backward=STEP_MODE[kind])
    step_times, step_sections = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sections.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.t0)
            step_sections.append(dict(sections))

    trainer = Trainer(model=model, processing_class=tokenizer, reward_funcs=[reward_ones], args=args,
                      train_dataset=dataset, callbacks=[Timer()])
    trainer.remove_callback(PrinterCallback)  # keep the benchmark's output to one line per configuration
    with peak_rss() as mem:
        trainer.train()
    timed = step_times[1:]  # step 0 is the warm-up
    med = {k: statistics.median(s.get(k, 0.0) for s in step_sections[1:]) for k in step_sections[-1]}
    print(json.dumps(dict(step_s=statistics.median(timed), steps=len(timed), sections=med, peak_bytes=mem["peak_bytes"],
                          mem_method=mem["method"] + " over the whole train() call",
                          gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
                          mode=_mode_taken(trainer, base is GRPOTrainer))))


def _mode_taken(trainer, grpo: bool) -> str:
    """The path a trainer took: ``grpo``, ``two_pass``, or ``one_backward``/``replay`` with its chunk's rows (an older
    ``oblr_trl``, run under ``PYTHONPATH`` to compare checkouts, has no route: its rows are the batch's)."""
    if grpo:
        return "grpo"
    if not trainer.uses_one_backward:
        return "two_pass"
    route = getattr(trainer, "route", None)
    rows = getattr(route, "chunk_rows", None) or trainer.args.per_device_train_batch_size
    return f"{'replay' if getattr(route, 'replay', False) else 'one_backward'}/{rows}"

def run_steps(spec: str, completion: int, args, log) -> dict:
    """Stage 3: every trainer kind in its own subprocess, same arguments otherwise; ratios to GRPO (checkpointed)."""
    res = {}
    for kind in args.step_kinds:
        r = _subprocess_json([sys.executable, str(SCRIPT), "--step-worker", kind, spec,
                              str(completion), str(args.step_steps), str(args.step_batch), "--threads",
                              str(args.threads)])
        res[kind] = r
        log(f"  RL step {label(spec)} C={completion} {kind}: " + (
            f"{r['step_s']:.2f}s/step, peak RSS +{r['peak_bytes'] / 2**20:.0f} MB, checkpointing "
            f"{r['gradient_checkpointing']}, mode {r.get('mode')}" if "failed" not in r
            else "FAILED " + r["failed"][-300:]))
    out = dict(size=label(spec), completion=completion, **res)
    for kind in args.step_kinds:
        g = res.get("grpo" if kind == "grpo_no_ckpt" else grpo_of(kind), {})
        if kind != "grpo" and "step_s" in res[kind] and "step_s" in g:
            out[f"step_{kind}_vs_grpo"] = res[kind]["step_s"] / g["step_s"]
            out[f"step_peak_mem_{kind}_vs_grpo"] = res[kind]["peak_bytes"] / g["peak_bytes"]
    return out
