"""Prompts per step (stage 1): OBLR-PO's SNR step factor ``N SNR / (1 + N SNR)`` against N, at fixed parameters.

Every comparison so far ran at N = 8 prompts per optimizer step; the paper trained at N = 128 (G = 8). This measures,
without training at any N, what the step factor would be at N = 8 ... 128 at two points of the demo's run:

1. **Checkpoints.** The demo's start (SmolLM2-135M-Instruct through the demo's fresh LoRA adapter, r=16, seed 0), and
   the same after 15 demo steps (``examples/demo.py --max_steps 15``: OBLR-PO's defaults, the demo's preset, 8 prompts
   x 8 completions per step; its adapter is kept under ``outputs/prompts_per_step/``).
2. **One pool per checkpoint.** ``--prompts`` (128) prompts drawn from the demo's training problems (the same
   prompts at both checkpoints), ``--group_size`` (8) completions each, sampled and scored by the demo's
   ``OBLRPOTrainer`` itself (``_generate_and_score_completions``: the demo's temperature 1, completion budget and
   verifier reward). Each group's advantages come from :func:`oblr_trl.advantages.compute_advantages` (the default
   baseline, the demo's ``weight_clip``) over the exact per-sequence gradients of :func:`oblr_trl.grad_norms.
   per_sequence_grads` (in micro-batches of ``--micro_batch`` rows); each group's gradient
   ``H_q = sum_{i in q} a_i u_i`` (``a_i = shape_i A_i``, :func:`oblr_trl.loss_terms.sequence_shape`: the batch's
   common loss normalizer cancels in the SNR) is formed by :meth:`PerSequenceGradients.accumulate_grad`, the
   trainer's own ``one_backward`` update, one group at a time, and kept; the record is their Gram matrix
   ``K_qp = <H_q, H_p>`` (float64). Its diagonal is checked against the ``||H_q||^2`` that ``accumulate_grad`` forms
   for the trainer (``group_size=G``).
3. **Re-sampling (pure, from the records).** A step of N prompts drawn from the pool (``--draws`` draws without
   replacement) has ``sum_q ||H_q||^2 = sum_{q in S} K_qq`` and ``||G||^2 = 1_S^T K 1_S``: exactly what the trainer's
   :class:`oblr_trl.step_sizer.StepSizer` hands :func:`oblr_trl.snr_formulas.snr_step_size`, which forms the decision
   here too. Two estimators: ``per_step`` (the paper's, and the first step of ``ema`` and ``window``), and the default
   ``ema_soft`` after ``--chain`` (15) steps whose batches are independent draws at these same parameters (an
   idealisation: in training the parameters move between the steps the average spans).

Reported per checkpoint and N: the SNR estimate's mean, std and 5-95% range, the factor's mean, std and 5-95% range
and the share of steps below 0.5, and the factor at the pool's own SNR (N = 128's estimate, no re-sampling noise).
Without replacement, a draw of 64 of 128 varies less than a fresh batch of 64 (finite population); the decision
table also gives draws with replacement (a bootstrap: fresh batches from the pool).

Stage 2 (paired training at N = 64) runs only if the factor at N = 64 still varies materially: its spread over the
re-samples (5-95% range) or its change between the checkpoints (of the mean) is >= ``--threshold`` (0.2).

    python benchmarks/prompts_per_step.py                 # both checkpoints (each skipped once recorded), the table
    python benchmarks/prompts_per_step.py --render        # the table from the records only
    python benchmarks/prompts_per_step.py --quick --records DIR --out DIR/pps   # the tiny model, small (the tests)

Resumable: the 15-step demo run is skipped when its adapter exists; each checkpoint's record is written once, whole.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
from harness import md_table, utc_now  # noqa: E402
from harness.procs import is_running, real_demo_outputs  # noqa: E402

from oblr_trl.snr_formulas import SNRState, snr_step_size  # noqa: E402

RESULTS = HERE / "results"
RECORDS = RESULTS / "prompts_per_step_runs"
OUT = RESULTS / "prompts_per_step"
WORK = ROOT / "outputs" / "prompts_per_step"
NS = [8, 16, 32, 64, 128]
QUICK = dict(model="tiny", steps=2, prompts=16, ns=[2, 4, 8, 16], draws=50, chain=5, warmup_steps=5, decision_n=8)
# Stage 2, by the ablation's resumable runner (GRPO 1.5e-4, OBLR-PO 22.2x: the window's best; 1 min a step at N = 64)
STAGE2_COMMAND = (
    "OMP_NUM_THREADS=1 nice -n 10 python benchmarks/ablation.py --arms GRPO OBLR-PO --seeds 0 1 2 "
    "--max_steps 20 --eval_every 10 --grpo_lr 1.5e-4 --eta_multiple 22.2 --lr_check_arms --long_arms "
    "--stability_seeds --power_seeds --earlier_grpo_lr --earlier_eta_multiple --parallel 1 "
    "--run_dir outputs/prompts_per_step/stage2 --records benchmarks/results/prompts_per_step_stage2_runs "
    "--out benchmarks/results/prompts_per_step_stage2 -- --per_device_train_batch_size 512 --micro_batch 32 "
    "> outputs/prompts_per_step/stage2.log 2>&1")
STAGE2_STATUS = (
    "Not run (2026-11-27). A step of 64 prompts x 8 costs about 8 demo steps (48 s each on a 2-core CPU at one "
    "thread, in the 15-step demo run above), so a 20-step run takes about 2 h and the six runs about 13 CPU-hours "
    "with their evaluations. Its memory at 512 completions a step is not measured yet: a 2-step pilot of each arm "
    "comes first. "
    "Note that both lrs were tuned at N = 8: at N = 64 OBLR-PO's factor, and so its applied lr, is about 2x what it "
    "was at N = 8 at the start and 6-9x after 15 steps (on the one-digit sums), while GRPO's lr stays where N = 8 "
    "put it. The lr window and this command use the ablation's 1-2 digit sums (its TASK_ARGS); this table's task: ")
DEFAULT_ESTIMATOR = "ema_soft"  # OBLRPOConfig.snr_estimator's default (checked in main against the config)


def draw_subsets(pool: int, n: int, draws: int, seed: int, replace: bool = False) -> torch.Tensor:
    """``(draws, n)`` indices into a pool of ``pool`` groups: each row ``n`` distinct groups (``replace=False``) or
    ``n`` independent uniform draws (``replace=True``, a bootstrap)."""
    if not replace and n > pool:
        raise ValueError(f"cannot draw n={n} of a pool of {pool} without replacement.")
    g = torch.Generator().manual_seed(seed)
    if replace:
        return torch.randint(pool, (draws, n), generator=g)
    return torch.stack([torch.randperm(pool, generator=g)[:n] for _ in range(draws)])


def subset_sums(gram: torch.Tensor, subset: torch.Tensor) -> tuple[float, float]:
    """``(sum_{q in S} ||H_q||^2, ||sum_{q in S} H_q||^2)`` of the groups ``subset`` (repeats count as often as they
    occur) from the Gram matrix ``gram`` of their gradients: the step's ``sum_sq`` and ``||G||^2``."""
    gram = torch.as_tensor(gram, dtype=torch.float64)
    counts = torch.bincount(subset.reshape(-1), minlength=gram.shape[0]).to(torch.float64)
    return float(counts @ gram.diagonal()), float(counts @ gram @ counts)


def step_decisions(gram: torch.Tensor, subsets: torch.Tensor, estimator: str = "per_step", **kw) -> list:
    """The trainer's decision (:func:`oblr_trl.snr_formulas.snr_step_size`) for each step, a step's batch being one row
    of ``subsets`` ``(draws, n)``; or, with ``subsets`` ``(draws, chain, n)``, the decision at the last of ``chain``
    consecutive steps, the estimator's state carried from step to step as the trainer carries it."""
    chains = subsets if subsets.dim() == 3 else subsets[:, None, :]
    out = []
    for chain in chains:
        state = SNRState()
        for batch in chain:
            sum_sq, grad_sq = subset_sums(gram, batch)
            decision, state = snr_step_size(estimator, sum_sq, grad_sq, batch.numel(), state, **kw)
        out.append(decision)
    return out


def summary(values: list[float]) -> dict:
    """mean, std (sample), 5/50/95th percentiles (linear interpolation) of finite ``values``, and how many."""
    v = sorted(x for x in values if math.isfinite(x))
    if not v:
        return dict(n=0, mean=math.nan, std=math.nan, p5=math.nan, p50=math.nan, p95=math.nan)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile's default
        lo, hi, pos = math.floor(p * (len(v) - 1)), math.ceil(p * (len(v) - 1)), p * (len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return dict(n=len(v), mean=statistics.fmean(v), std=statistics.stdev(v) if len(v) > 1 else 0.0, p5=pct(0.05),
                p50=pct(0.5), p95=pct(0.95))


def pooled(gram: torch.Tensor) -> dict:
    """The pool's own estimate (every group once, the per-step estimator): signal, noise, SNR."""
    pool = torch.as_tensor(gram).shape[0]
    d = step_decisions(gram, torch.arange(pool)[None, :])[0]
    return dict(signal=d.signal, noise=d.noise, snr=d.snr)


def n_row(gram: torch.Tensor, n: int, draws: int, seed: int, chain: int, replace: bool = False,
          estimator: str = DEFAULT_ESTIMATOR) -> dict:
    """One N's statistics: the per-step SNR and factor over ``draws`` steps of ``n`` groups, the share of those
    factors below 0.5, the default estimator's factor after ``chain`` steps, and the factor at the pool's SNR."""
    pool = torch.as_tensor(gram).shape[0]
    per = step_decisions(gram, draw_subsets(pool, n, draws, seed, replace))
    chains = draw_subsets(pool, n, draws * chain, seed + 1, replace).reshape(draws, chain, n)
    default = step_decisions(gram, chains, estimator)
    snr0 = pooled(gram)["snr"]
    return dict(
        n=n, draws=draws, replace=replace, snr=summary([d.snr for d in per]),
        factor=summary([d.scale for d in per]), below_half=sum(d.scale < 0.5 for d in per) / draws,
        zero=sum(d.scale == 0.0 for d in per) / draws,
        default=dict(estimator=estimator, chain=chain, factor=summary([d.scale for d in default]),
                     below_half=sum(d.scale < 0.5 for d in default) / draws),
        factor_at_pool_snr=n * snr0 / (1 + n * snr0) if math.isfinite(snr0) else math.nan)


def spread(stats: dict) -> float:
    """The spread the decision rule reads: the 5-95% range."""
    return stats["p95"] - stats["p5"]


def checkpoint_label(name: str) -> str:  # as a reader says it: "start" -> "the start", "step15" -> "step 15"
    return "the start" if name == "start" else re.sub(r"^step(\d+)$", r"step \1", name)


def stage2_decision(rows: dict[str, list[dict]], n: int = 64, threshold: float = 0.2) -> dict:
    """The study's rule: stage 2 runs if, at ``n`` prompts per step, the per-step factor's spread over the re-samples
    (5-95% range, without replacement) on any checkpoint, or the change of its mean between the first and last
    checkpoint, is >= ``threshold``. ``rows``: checkpoint -> its n_rows (in checkpoint order)."""
    at = {c: next(r for r in rs if r["n"] == n and not r["replace"]) for c, rs in rows.items()}
    spreads = {c: spread(r["factor"]) for c, r in at.items()}
    names = list(at)
    change = abs(at[names[-1]]["factor"]["mean"] - at[names[0]]["factor"]["mean"]) if len(names) > 1 else math.nan
    largest = max(spreads.values())
    run = largest >= threshold or (change == change and change >= threshold)
    label = checkpoint_label
    moves = f" and its mean moves by {change:.3f} between {label(names[0])} and {label(names[-1])}"
    why = (f"at N={n} the factor's 5-95% range over the re-samples is " + ", ".join(
        f"{spreads[c]:.3f} ({label(c)})" for c in names) + (moves if len(names) > 1 else "")
           + f": {'at least' if run else 'both below'} the threshold {threshold:g}")
    return dict(n=n, threshold=threshold, spreads=spreads, change=change, run_stage2=run, why=why)


def load_demo():
    spec = importlib.util.spec_from_file_location("oblr_demo_script", ROOT / "examples" / "demo.py")
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


def demo_args(args, extra: list[str] = ()):
    """The demo's own argument namespace (its preset) for this study's model."""
    flags = ["--model", args.model, "--seed", str(args.seed)]
    flags += shlex.split(args.demo_flags)
    if args.model == "tiny":
        flags += ["--warmup_steps", str(args.warmup_steps)]
    return load_demo().parse_args(flags + list(extra))


def train_checkpoint(args, steps: int) -> Path:
    """The demo run of ``steps`` steps (skipped when its saved model exists); returns its output folder."""
    out = args.work / f"demo_step{steps}"
    while is_running(out, real_demo_outputs()):  # started by hand (or another runner): wait for it, never twice
        time.sleep(20)
    if (out / "model" / "summary.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "examples" / "demo.py"), "--model", args.model, "--seed", str(args.seed),
           "--max_steps", str(steps), "--skip_before_eval", "--output_dir", str(out)]
    if args.model == "tiny":
        cmd += ["--warmup_steps", str(args.warmup_steps), "--num_eval", "8", "--eval_samples", "1"]
    cmd += shlex.split(args.demo_flags)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    return out


def build_trainer(args, d, trained: Path | None):
    """The demo's OBLRPOTrainer (its preset's config, reward and data) at the start (a fresh adapter, as the demo
    makes it) or at the model the demo run ``trained`` saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.demo import load_reference_model
    from oblr_trl.demo.tasks import PROMPT_TEMPLATES, make_dataset, make_reward_func, without_questions_of
    from oblr_trl.demo.tiny import load_or_build_warm_model

    set_seed(args.seed)
    template = PROMPT_TEMPLATES.get(d.prompt_template, d.prompt_template)
    peft_config = None
    if args.model == "tiny":
        if trained is None:
            model, tokenizer = load_or_build_warm_model(d.task, seed=d.warm_seed, steps=d.warmup_steps)
        else:
            model = AutoModelForCausalLM.from_pretrained(trained / "model")
            tokenizer = AutoTokenizer.from_pretrained(trained / "model", padding_side="left")
    else:
        model, tokenizer = load_reference_model(args.model)
        if trained is None:
            from peft import LoraConfig

            peft_config = LoraConfig(r=d.lora_r, lora_alpha=2 * d.lora_r, target_modules="all-linear",
                                     task_type="CAUSAL_LM")
        else:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(trained / "model"), is_trainable=True)
    eval_dataset = make_dataset(d.task, size=d.num_eval, seed=d.eval_seed, prompt_template=template, **d.task_config)
    train = make_dataset(d.task, size=d.num_train, seed=d.seed, prompt_template=template, **d.task_config)
    if d.exclude_held_out:
        train = without_questions_of(train, eval_dataset)
    options = {k: getattr(d, k) for k in load_demo().OBLR_OPTIONS if getattr(d, k) is not None}
    config = OBLRPOConfig(
        **options, output_dir=str(args.work / "trainer"), max_steps=1, gradient_accumulation_steps=1,
        per_device_train_batch_size=d.per_device_train_batch_size, num_generations=args.group_size,
        learning_rate=d.learning_rate,
        lr_scheduler_type=d.lr_scheduler_type, max_completion_length=d.max_completion_length, temperature=1.0,
        seed=d.seed, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True)
    reward = make_reward_func(d.task, **d.task_config)
    trainer = OBLRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config,
                            train_dataset=train, peft_config=peft_config)
    return trainer, train


def measure(args, name: str, trained: Path | None) -> dict:
    """One checkpoint's pool: sample, score, per-group gradients, their Gram matrix (see the module)."""
    from oblr_trl.advantages import compute_advantages
    from oblr_trl.estimators import mask_nonfinite_products
    from oblr_trl.grad_norms import per_sequence_grads
    from oblr_trl.loss_terms import sequence_shape
    from oblr_trl.trl_seam import sequence_inputs

    start = time.time()
    d = demo_args(args)
    trainer, train = build_trainer(args, d, trained)
    model, G = trainer.model, args.group_size
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(args.prompt_seed)  # the same prompts at every checkpoint
    picks = torch.randperm(len(train), generator=g)[: args.prompts].tolist()
    torch.manual_seed(args.sample_seed)
    vectors = torch.zeros(args.prompts, n_params, dtype=torch.float32)
    trainer_sq, rewards_all, lengths_all, zero_groups = [], [], [], 0
    for s in range(0, args.prompts, args.gen_prompts):
        rows = [train[i] for i in picks[s : s + args.gen_prompts] for _ in range(G)]
        with torch.no_grad():
            batch = trainer._generate_and_score_completions(rows)
        n = batch["oblr_reward"].shape[0]
        for m in range(0, n, args.micro_batch):
            part = {k: (v[m : m + args.micro_batch] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v)
                    for k, v in batch.items()}
            input_ids, attention_mask, mask = sequence_inputs(part)
            with torch.enable_grad(), trainer.accelerator.autocast():
                grads = per_sequence_grads(model, input_ids, attention_mask, mask, temperature=trainer.temperature,
                                           materialize=True)
            products, bad = mask_nonfinite_products(grads.inner_products(1))
            lengths = mask.sum(-1)
            result = compute_advantages(part["oblr_reward"], lengths, products.reshape(-1), args=trainer.args,
                                        loss_type=trainer.loss_type, group_size=G, local=slice(None), unscorable=bad)
            a = sequence_shape(trainer.loss_type, lengths) * result.values.reshape(-1).float()
            for p in params:
                p.grad = None
            trainer_sq += grads.accumulate_grad(-a, group_size=G).tolist()  # the trainer's ||H_q||^2
            for q in range(a.shape[0] // G):
                for p in params:
                    p.grad = None
                only = torch.zeros_like(a)
                only[q * G : (q + 1) * G] = a[q * G : (q + 1) * G]
                grads.accumulate_grad(-only)
                vectors[(s * G + m) // G + q] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                                           .reshape(-1).float() for p in params])
            for p in params:
                p.grad = None
            del grads
            r = part["oblr_reward"].reshape(-1, G)
            zero_groups += int((r.amax(1) == r.amin(1)).sum())
            rewards_all += part["oblr_reward"].tolist()
            lengths_all += lengths.tolist()
        print(f"{name}: {min(s + args.gen_prompts, args.prompts)}/{args.prompts} prompts "
              f"({time.time() - start:.0f}s)", flush=True)
    gram = torch.zeros(args.prompts, args.prompts, dtype=torch.float64)
    for c in range(0, n_params, 1 << 20):
        block = vectors[:, c : c + (1 << 20)].double()
        gram += block @ block.T
    diag_err = float(((gram.diagonal() - torch.tensor(trainer_sq, dtype=torch.float64)).abs().max())
                     / gram.diagonal().abs().max().clamp(min=1e-300))
    summary_path = (trained / "summary.json") if trained else None
    trained_summary = json.loads(summary_path.read_text()) if summary_path and summary_path.exists() else {}
    return dict(
        checkpoint=name, steps=trained_summary.get("steps", 0), model=args.model, prompts=args.prompts, group_size=G,
        task=d.task, task_config=d.task_config, max_completion_length=d.max_completion_length,
        prompt_seed=args.prompt_seed, sample_seed=args.sample_seed, seed=args.seed, trainable_params=n_params,
        snr_estimator=trainer.args.snr_estimator, baseline=trainer.args.baseline, weight_clip=trainer.args.weight_clip,
        loss_type=trainer.loss_type, reward_mean=statistics.fmean(rewards_all), groups_all_equal=zero_groups,
        mean_completion_tokens=statistics.fmean(lengths_all),
        trained_run=dict(mean_lr_scale=trained_summary.get("mean_lr_scale"),
                         mean_snr=trained_summary.get("mean_snr"),
                         final_lr_scale=trained_summary.get("final_lr_scale")) if trained_summary else None,
        diag_check_max_rel_err=diag_err, seconds=round(time.time() - start, 1), when=utc_now(), gram=gram.tolist())


def analyse(records: list[dict], args) -> dict:
    rows = {}
    for rec in records:
        gram = torch.tensor(rec["gram"], dtype=torch.float64)
        ns = [n for n in args.ns if n <= gram.shape[0]]
        rows[rec["checkpoint"]] = ([n_row(gram, n, args.draws, args.resample_seed + n, args.chain) for n in ns]
                                   + [n_row(gram, n, args.draws, args.resample_seed + n, args.chain, replace=True)
                                      for n in ns])
    decision = stage2_decision(rows, n=args.decision_n, threshold=args.threshold) if rows and all(
        any(r["n"] == args.decision_n for r in rs) for rs in rows.values()) else None
    pools = {rec["checkpoint"]: pooled(torch.tensor(rec["gram"], dtype=torch.float64)) for rec in records}
    return dict(rows=rows, pools=pools, decision=decision,
                records=[{k: v for k, v in rec.items() if k != "gram"} for rec in records])


def f(x, spec=".3f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def render(result: dict, args, command: str) -> str:
    recs = {r["checkpoint"]: r for r in result["records"]}
    lines = [
        "# Prompts per step: the SNR step factor against N at fixed parameters (stage 1)",
        "",
        f"Generated by `{command}` on {utc_now(minutes=True)} from the records in "
        f"`{args.records.relative_to(ROOT) if args.records.is_relative_to(ROOT) else args.records}`. "
        "Per checkpoint, one pool of prompts x completions sampled and scored by the demo's own OBLRPOTrainer; each "
        "group's gradient H_q formed as the trainer forms it (OBLR-PO's default baseline, exact per-sequence "
        "gradients, `accumulate_grad`); a step of N prompts is N groups drawn from the pool, its SNR and factor "
        "N SNR/(1+N SNR) from `oblr_trl.snr_formulas.snr_step_size` on that step's sum of ||H_q||^2 and ||G||^2. "
        f"{args.draws} draws per N, without replacement unless marked. `per_step`: the paper's estimate from the step "
        "alone (also every estimator's first step); SNR clipped at 0 as the trainer clips it; factor 0: steps whose "
        "signal estimate is <= 0 (they do not move). Default: `ema_soft` (beta 0.9) after "
        f"{args.chain} steps whose batches are independent draws at these same parameters. Without replacement, a "
        "draw of N of the pool's M groups varies less than a fresh batch of N would (by about sqrt((M-N)/(M-1)) for "
        "a mean: 0.71 at 64 of 128), and N = M does not vary at all; the rows with replacement (a bootstrap: fresh "
        "batches from the pool) show the spread of a fresh batch, but their SNR is the pool's plug-in value, biased "
        "up by about 1/M (doubled where the SNR is near 1/M): read their spread, not their mean.",
        "",
    ]
    for name, rec in recs.items():
        pool = result["pools"][name]
        lines += [
            f"## {rec['model']}, " + (f"after {rec['steps']} demo steps" if rec["steps"] else "before training"),
            "",
            f"{rec['prompts']} prompts x {rec['group_size']} completions (task {rec['task']} "
            f"{rec['task_config'] or ''}, max {rec['max_completion_length']} tokens, mean "
            f"{rec['mean_completion_tokens']:.1f}); mean reward "
            f"{rec['reward_mean']:.3f}; {rec['groups_all_equal']} of {rec['prompts']} groups with all rewards equal "
            f"(H_q = 0); {rec['trainable_params']:,} trainable parameters; {rec['seconds'] / 60:.0f} min. "
            f"The pool's own SNR (all {rec['prompts']} groups): {f(pool['snr'], '.4f')}. "
            f"||H_q||^2 against the trainer's: max relative difference {rec['diag_check_max_rel_err']:.1e}."
            + (f" The {rec['steps']}-step demo run's own log: mean SNR {f(run['mean_snr'], '.4f')}, mean factor "
               f"{f(run['mean_lr_scale'])} (N = 8, ema_soft)." if (run := rec.get("trained_run")) else ""),
            "",
        ]
        table = []
        for r in result["rows"][name]:
            s, fa, de = r["snr"], r["factor"], r["default"]["factor"]
            table.append([f"{r['n']}" + (" (with repl.)" if r["replace"] else ""), f(s["mean"], ".4f"),
                          f"{f(s['p5'], '.4f')}-{f(s['p95'], '.4f')}", f(r["factor_at_pool_snr"]),
                          f"{f(fa['mean'])} ± {f(fa['std'])}", f"{f(fa['p5'])}-{f(fa['p95'])}",
                          f(fa["p95"] - fa["p5"]), f"{100 * r['below_half']:.0f}%", f"{100 * r['zero']:.0f}%",
                          f"{f(de['mean'])} ± {f(de['std'])}", f"{f(de['p5'])}-{f(de['p95'])}",
                          f"{100 * r['default']['below_half']:.0f}%"])
        lines += md_table(["N", "SNR mean (per_step)", "SNR 5-95%", "factor at pool SNR", "factor mean ± std",
                           "factor 5-95%", "5-95% range", "factor < 0.5", "factor 0",
                           "default: factor mean ± std", "default: 5-95%", "default: < 0.5"], table) + [""]
    dec = result["decision"]
    if dec:
        lines += ["## Stage 2 (paired training at N = 64)", "",
                  f"**{'Run' if dec['run_stage2'] else 'Skip'} stage 2**: {dec['why']} (the rule: spread over "
                  f"the re-samples, or change between the checkpoints, >= {dec['threshold']:g}).", ""]
        if dec["run_stage2"] and result["records"][0]["model"] == "tiny" and not args.quick:
            lines += ["On the tiny policy, training at the paper's N = 128 is `benchmarks/paper_n.py` "
                      "(`benchmarks/paper_n.md`).", ""]
        elif dec["run_stage2"] and not args.quick:
            task = ", ".join(f"{r['task']} {r['task_config'] or '(one-digit)'}, max {r['max_completion_length']} "
                             f"tokens" for r in result["records"][:1])
            lines += [STAGE2_STATUS + task + ".", "", "The command that runs it (resumable):", "",
                      f"    {STAGE2_COMMAND}", ""]
    return "\n".join(lines)


def load_records(folder: Path, order: list[str]) -> list[dict]:
    found = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}
    return [found[c] for c in order if c in found] + [v for k, v in found.items() if k not in order]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (the demo's) or tiny")
    p.add_argument("--steps", type=int, default=15, help="demo steps before the second checkpoint")
    p.add_argument("--prompts", type=int, default=128, help="prompts in each checkpoint's pool")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--ns", type=int, nargs="+", default=NS, help="prompts per step re-sampled")
    p.add_argument("--draws", type=int, default=200, help="re-samples per N")
    p.add_argument("--chain", type=int, default=15, help="steps of the default estimator's chain")
    p.add_argument("--micro_batch", type=int, default=16, help="rows per gradient pass (a multiple of the group)")
    p.add_argument("--gen_prompts", type=int, default=8, help="prompts per generation call (the demo's step)")
    p.add_argument("--demo_flags", default="", help="more examples/demo.py flags, one shell-quoted string, for its "
                   "run and this study's trainer (e.g. \"--task_config '{\\\"max_digits\\\": 2}' "
                   "--max_completion_length 12\")")
    p.add_argument("--warmup_steps", type=int, default=200, help="the tiny model's SFT warm-up")
    p.add_argument("--seed", type=int, default=0, help="the demo's seed (its run, its training problems)")
    p.add_argument("--prompt_seed", type=int, default=58)
    p.add_argument("--sample_seed", type=int, default=1)
    p.add_argument("--resample_seed", type=int, default=2026)
    p.add_argument("--decision_n", type=int, default=64)
    p.add_argument("--threshold", type=float, default=0.2)
    p.add_argument("--records", type=Path, default=RECORDS)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--work", type=Path, default=WORK, help="the demo runs and the trainer's scratch folder")
    p.add_argument("--render", action="store_true", help="only tabulate the records")
    p.add_argument("--quick", action="store_true",
                   help="the tiny model, 16 prompts, N = 2..16, 2 demo steps, 50 draws (the tests' path)")
    args = p.parse_args(argv)
    command = shlex.join(["python", "benchmarks/prompts_per_step.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        vars(args).update(QUICK)
    if args.micro_batch % args.group_size or args.gen_prompts * args.group_size % args.micro_batch:
        p.error("--micro_batch must be a multiple of --group_size that divides --gen_prompts x --group_size")
    from oblr_trl import OBLRPOConfig

    if OBLRPOConfig.snr_estimator != DEFAULT_ESTIMATOR:
        raise SystemExit(f"OBLRPOConfig.snr_estimator is now {OBLRPOConfig.snr_estimator!r}: update DEFAULT_ESTIMATOR")
    order = ["start", f"step{args.steps}"]
    if not args.render:
        args.records.mkdir(parents=True, exist_ok=True)
        args.work.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(1)
        for name in order:
            path = args.records / f"{name}.json"
            if path.exists():
                continue
            trained = train_checkpoint(args, args.steps) if name != "start" else None
            record = measure(args, name, trained)
            path.with_suffix(".tmp").write_text(json.dumps(record))
            path.with_suffix(".tmp").replace(path)
    result = analyse(load_records(args.records, order), args)
    text = render(result, args, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=float))
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
