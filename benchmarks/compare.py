"""Training comparison through TRL: GRPO, Dr. GRPO, RLOO, OPO, OBLR-PO and its ablations, several seeds.

Every run: the same warm tiny Qwen3 (`oblr_trl.demo.tiny.load_or_build_warm_model`, the demo's), the same reasoning-gym
task and verifier reward, the same sampling (8 prompts x 8 completions per step, temperature 1, top_k 0, at most 8
new tokens), the same optimizer (TRL's default AdamW, linear decay, max_grad_norm 1.0), loss_type "dapo", beta 0,
num_iterations 1, and the same number of steps. Only the advantage / step-size rule differs:

    grpo              trl.GRPOTrainer, GRPOConfig(scale_rewards="group")         group mean, / group std
    dr_grpo           trl.GRPOTrainer, GRPOConfig(scale_rewards="none")          group mean (loss_type kept "dapo")
    rloo              OBLRPOConfig(baseline="mean", leave_one_out=True, snr_lr=False)
    opo               OBLRPOConfig(grad_norm_estimator="length", snr_lr=False)   w = |o|, leave-one-out
    oblr              OBLRPOConfig()                                             the default: exact w, LOO, SNR step
    oblr_baseline     OBLRPOConfig(snr_lr=False)                                 ablation: baseline only
    oblr_snr          OBLRPOConfig(baseline="mean", leave_one_out=True)          ablation: SNR step only (RLOO + SNR)
    oblr_plain        OBLRPOConfig(leave_one_out=False)                          ablation: plain (not LOO) weighted mean
    oblr_lr10x        OBLRPOConfig() at 10x the learning rate (eta_max = 1e-2 here, the paper's eta_max)
    grpo_lr01x        GRPO at 0.1x the learning rate   \\  controls for the SNR step's mean lr scale (~0.1 here):
    rloo_lr01x        RLOO at 0.1x the learning rate   /  is OBLR-PO better, or just a smaller step?

Learning rate: every method uses the same `--learning_rate` (1e-3, the demo's). For OBLR-PO variants with the SNR
step size this is eta_max, the upper bound of the step, so at the same lr they take shorter steps; `oblr_lr10x` is
the separate row giving OBLR-PO a 10x larger eta_max, and `grpo_lr01x` / `rloo_lr01x` give GRPO and RLOO the
step OBLR-PO actually takes on average (its mean lr scale is ~0.1 on these tasks).

Seeds vary the training problems, their order and the sampling; the warm model (seed 0) and the held-out set
(reasoning-gym seed 12345, disjoint from the warm-up's 10000 and the training seeds) are the same for all runs.

    python benchmarks/compare.py --quick      # <= 15 min on 2 CPU cores: 2 tasks, 6 methods, 2 seeds, 100 steps
    python benchmarks/compare.py              # full: 2 tasks, 11 methods, 5 seeds, 300 steps (~1.5-2 h on 2 cores)

Each run is a subprocess (`--jobs` at a time, 1 torch thread each) writing results/compare_runs[_quick]/*.json; a
rerun skips runs already there (`--fresh` to redo). Tables: results/compare[_quick].md/.json; plots
results/compare[_quick]_<task>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from harness import host, host_id, utc_now  # noqa: E402

TASKS = {
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
}
WARM_KWARGS = {"chain_sum": {}, "basic_arithmetic": TASKS["basic_arithmetic"]}  # as benchmarks/grad_variance.py

# name -> (trainer, config options, lr multiplier, label)
METHODS = {
    "grpo": ("grpo", dict(scale_rewards="group"), 1.0, "GRPO"),
    "dr_grpo": ("grpo", dict(scale_rewards="none"), 1.0, "Dr. GRPO"),
    "rloo": ("oblr", dict(baseline="mean", leave_one_out=True, snr_lr=False), 1.0, "RLOO"),
    "opo": ("oblr", dict(grad_norm_estimator="length", snr_lr=False), 1.0, "OPO (w=|o|, LOO)"),
    "oblr": ("oblr", dict(), 1.0, "OBLR-PO (default)"),
    "oblr_baseline": ("oblr", dict(snr_lr=False), 1.0, "OBLR-PO baseline only"),
    "oblr_snr": ("oblr", dict(baseline="mean", leave_one_out=True), 1.0, "OBLR-PO SNR step only (RLOO+SNR)"),
    "oblr_plain": ("oblr", dict(leave_one_out=False), 1.0, "OBLR-PO plain (not LOO)"),
    "oblr_lr10x": ("oblr", dict(), 10.0, "OBLR-PO, eta_max 10x"),
    "grpo_lr01x": ("grpo", dict(scale_rewards="group"), 0.1, "GRPO, lr 0.1x"),
    "rloo_lr01x": ("oblr", dict(baseline="mean", leave_one_out=True, snr_lr=False), 0.1, "RLOO, lr 0.1x"),
    "oblr_baseline_lr01x": ("oblr", dict(snr_lr=False), 0.1, "OBLR-PO baseline only, lr 0.1x"),
}
QUICK_METHODS = ["grpo", "dr_grpo", "rloo", "opo", "oblr", "oblr_lr10x"]
EVAL_SEED = 12345


# ----------------------------------------------------------------------------------------------- one run
def single_run(task: str, method: str, seed: int, args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.demo.tasks import evaluate_accuracy, make_dataset, make_reward_func
    from oblr_trl.demo.tiny import load_or_build_warm_model

    start = time.time()
    set_seed(seed)
    kind, options, lr_mult, _ = METHODS[method]
    model, tokenizer = load_or_build_warm_model(task, steps=args.warmup_steps, **WARM_KWARGS[task])
    train = make_dataset(task, size=args.num_train, seed=seed, **TASKS[task])
    held_out = make_dataset(task, size=args.num_eval, seed=EVAL_SEED, **TASKS[task])
    reward = make_reward_func(task, **TASKS[task])

    def accuracy(m):
        return evaluate_accuracy(m, tokenizer, held_out, max_new_tokens=args.max_completion_length, task=task)

    curve = [(0, accuracy(model))]

    class EvalCallback(TrainerCallback):
        def on_step_end(self, targs, state, control, model=None, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == args.max_steps:
                curve.append((state.global_step, accuracy(model)))

    common = dict(
        output_dir=os.path.join(args.run_dir, "tmp", f"{task}-{method}-{seed}"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        learning_rate=args.learning_rate * lr_mult,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        loss_type="dapo",
        beta=0.0,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,  # TRL's default bf16=True would autocast the CPU runs to bf16
        **options,
    )
    if kind == "grpo":
        config, trainer_cls = GRPOConfig(**common), GRPOTrainer
    else:
        config, trainer_cls = OBLRPOConfig(**common), OBLRPOTrainer
    trainer = trainer_cls(
        model=model, processing_class=tokenizer, reward_funcs=[reward], args=config, train_dataset=train,
        callbacks=[EvalCallback()],
    )
    trainer.train()
    hist = [e for e in trainer.state.log_history if "reward" in e]
    return {
        "task": task,
        "method": method,
        "seed": seed,
        "learning_rate": config.learning_rate,
        "steps": trainer.state.global_step,
        "reward": [e["reward"] for e in hist],
        "grad_norm": [e.get("grad_norm") for e in hist],
        "lr_scale": [e.get("oblr/lr_scale") for e in hist],
        "snr": [e.get("oblr/snr") for e in hist],
        "accuracy_curve": curve,
        "seconds": round(time.time() - start, 1),
    }


# ------------------------------------------------------------------------------------------- aggregation
def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def moving_average(values, window):
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def steps_to_target(rewards, target, window):
    smoothed = moving_average(rewards, window)
    for i, v in enumerate(smoothed):
        if i + 1 >= window and v >= target:
            return i + 1
    return None


def aggregate(runs: list[dict], args) -> dict:
    table = {}
    for task in args.tasks:
        task_runs = [r for r in runs if r["task"] == task]
        if not task_runs:
            continue
        w = args.window
        initial = statistics.fmean(statistics.fmean(r["reward"][:w]) for r in task_runs)
        target = args.target_reward if args.target_reward is not None else initial + args.target_gain
        rows = {}
        for method in args.methods:
            mr = [r for r in task_runs if r["method"] == method]
            if not mr:
                continue
            finals = [r["accuracy_curve"][-1][1] for r in mr]
            starts = [r["accuracy_curve"][0][1] for r in mr]
            last_reward = [statistics.fmean(r["reward"][-w:]) for r in mr]
            reached = [steps_to_target(r["reward"], target, w) for r in mr]
            reward_std = [statistics.pstdev(r["reward"]) for r in mr]
            gn_var = [statistics.pvariance([g for g in r["grad_norm"] if g is not None]) for r in mr]
            scales = [statistics.fmean([s for s in r["lr_scale"] if s is not None]) for r in mr if any(s is not None for s in r["lr_scale"])]
            reached_steps = [s for s in reached if s is not None]
            rows[method] = {
                "label": METHODS[method][3],
                "learning_rate": mr[0]["learning_rate"],
                "seeds": len(mr),
                "accuracy_start": mean_std(starts),
                "accuracy_final": mean_std(finals),
                "accuracy_gain": mean_std([f - s for f, s in zip(finals, starts)]),
                "reward_last": mean_std(last_reward),
                "steps_to_target_median": statistics.median(reached_steps) if reached_steps else None,
                "reached_target": f"{len(reached_steps)}/{len(mr)}",
                "reward_std_across_steps": mean_std(reward_std),
                "grad_norm_variance": mean_std(gn_var),
                "mean_lr_scale": mean_std(scales) if scales else None,
                "seconds_per_run": mean_std([r["seconds"] for r in mr]),
            }
        table[task] = {"initial_reward": initial, "target_reward": target, "methods": rows}
    return table


def plot(runs, args, stem):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in args.tasks:
        task_runs = [r for r in runs if r["task"] == task]
        if not task_runs:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for method in args.methods:
            mr = [r for r in task_runs if r["method"] == method]
            if not mr:
                continue
            n = min(len(r["reward"]) for r in mr)
            curves = [moving_average(r["reward"][:n], args.window) for r in mr]
            mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
            std = [statistics.pstdev([c[i] for c in curves]) for i in range(n)]
            x = list(range(1, n + 1))
            (line,) = axes[0].plot(x, mean, label=f"{METHODS[method][3]} (n={len(mr)})")
            axes[0].fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                 color=line.get_color(), alpha=0.15)
            steps = [s for s, _ in mr[0]["accuracy_curve"]]
            accs = [[a for _, a in r["accuracy_curve"]] for r in mr if len(r["accuracy_curve"]) == len(steps)]
            am = [statistics.fmean(a[i] for a in accs) for i in range(len(steps))]
            asd = [statistics.pstdev([a[i] for a in accs]) for i in range(len(steps))]
            axes[1].plot(steps, am, marker="o", ms=3, color=line.get_color())
            axes[1].fill_between(steps, [m - s for m, s in zip(am, asd)], [m + s for m, s in zip(am, asd)],
                                 color=line.get_color(), alpha=0.15)
        axes[0].set_title(f"{task}: training reward ({args.window}-step moving average), mean +- std over seeds")
        axes[0].set_xlabel("step")
        axes[1].set_title(f"{task}: held-out greedy accuracy ({args.num_eval} problems)")
        axes[1].set_xlabel("step")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        path = f"{stem}_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def fmt_ms(ms, pct=False, digits=3):
    m, s = ms
    if m != m:
        return "-"
    if pct:
        return f"{100 * m:.1f} +- {100 * s:.1f}"
    return f"{m:.{digits}g} +- {s:.{digits - 1}g}" if abs(m) < 1e-2 or abs(m) >= 1e3 else f"{m:.{digits}f} +- {s:.{digits}f}"


def write_markdown(table, args, path, command, seconds, plots):
    lines = [
        "# Training comparison through TRL",
        "",
        f"Generated by `{command}` on {utc_now(minutes=True)}, "
        f"{host(f'{args.jobs} runs in parallel, 1 torch thread each')}; {seconds / 60:.1f} min wall clock. oblr_trl as of commit {args.commit[:10]} (a snapshot by "
        "`git archive`, so every run used the same code).",
        "",
        f"Warm tiny Qwen3 (the demo's), {args.max_steps} steps of {args.prompts_per_step} prompts x "
        f"{args.num_generations} completions, temperature 1, max {args.max_completion_length} new tokens, loss_type "
        f"dapo, beta 0, AdamW with TRL's linear decay, lr {args.learning_rate:g} for every method (eta_max for the SNR "
        f"variants) except the `eta_max 10x` row. Held-out: {args.num_eval} problems, greedy, the task's verifier; "
        "every method starts from the same warm model, so the starting accuracy is the same.",
        "",
        f"Columns: final held-out accuracy (%) and its gain over the start, mean +- std over seeds; reward over the last "
        f"{args.window} steps; steps until the {args.window}-step moving average of the training reward first reaches "
        "the target (median over the seeds that reached it; target = the mean reward of every run's first "
        f"{args.window} steps + {args.target_gain}); stability = std of the per-step reward across steps, and the "
        "variance across steps of the logged (pre-clip) grad norm, both averaged over seeds; mean lr scale (SNR step "
        "size factor, OBLR-PO variants with snr_lr).",
        "",
    ]
    for task, t in table.items():
        lines += [
            f"## {task} ({', '.join(f'{k}={v}' for k, v in TASKS[task].items())})",
            "",
            f"Initial reward {t['initial_reward']:.3f}; target reward {t['target_reward']:.3f}.",
            "",
            "| method | lr | seeds | final acc % | acc gain (pts) | reward last | steps to target (reached) | reward std across steps | grad-norm variance | mean lr scale | s/run |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m, row in t["methods"].items():
            gain = row["accuracy_gain"]
            lines.append(
                f"| {row['label']} | {row['learning_rate']:g} | {row['seeds']} | {fmt_ms(row['accuracy_final'], pct=True)} | "
                f"{100 * gain[0]:+.1f} +- {100 * gain[1]:.1f} | {fmt_ms(row['reward_last'])} | "
                f"{row['steps_to_target_median'] if row['steps_to_target_median'] is not None else '-'} "
                f"({row['reached_target']}) | {fmt_ms(row['reward_std_across_steps'])} | "
                f"{fmt_ms(row['grad_norm_variance'])} | "
                f"{fmt_ms(row['mean_lr_scale']) if row['mean_lr_scale'] else '-'} | {row['seconds_per_run'][0]:.0f} |"
            )
        lines.append("")
    if plots:
        lines += ["Plots: " + ", ".join(f"`{os.path.relpath(p, HERE)}`" for p in plots), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--max_steps", type=int, default=300)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--prompts_per_step", type=int, default=8)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_completion_length", type=int, default=8)
    p.add_argument("--num_train", type=int, default=2000)
    p.add_argument("--num_eval", type=int, default=200)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--warmup_steps", type=int, default=200)
    p.add_argument("--window", type=int, default=10, help="Moving-average window (steps) for rewards.")
    p.add_argument("--target_gain", type=float, default=0.05, help="Target reward = initial reward + this.")
    p.add_argument("--target_reward", type=float, default=None, help="Absolute target (overrides --target_gain).")
    p.add_argument("--jobs", type=int, default=2, help="Runs in parallel (subprocesses, 1 thread each).")
    p.add_argument("--quick", action="store_true",
                   help="<= 15 min on 2 cores: grpo, dr_grpo, rloo, opo, oblr, oblr_lr10x; 2 seeds; 100 steps.")
    p.add_argument("--fresh", action="store_true", help="Redo runs whose JSON already exists.")
    p.add_argument("--no_run", action="store_true", help="Only aggregate the runs already in the run directory.")
    p.add_argument("--out", default=None, help="Output stem (default results/compare[_quick]).")
    p.add_argument("--single", nargs=3, metavar=("TASK", "METHOD", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--run_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.max_steps, args.eval_every = 2, 100, 25
        if args.methods == list(METHODS):
            args.methods = QUICK_METHODS
    return args


def main(argv=None):
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    stem = args.out or os.path.join(HERE, "results", "compare" + ("_quick" if args.quick else ""))
    if args.run_dir is None:
        args.run_dir = os.path.join(os.path.dirname(stem), "compare_runs" + ("_quick" if args.quick else "")) \
            if args.out is None else stem + "_runs"
    if args.single:
        import oblr_trl

        print(f"oblr_trl from {os.path.dirname(oblr_trl.__file__)}", flush=True)
        task, method, seed = args.single
        result = single_run(task, method, int(seed), args)
        with open(os.path.join(args.run_dir, f"{task}-{method}-{seed}.json"), "w") as f:
            json.dump(result, f)
        return
    os.makedirs(args.run_dir, exist_ok=True)
    src = os.path.join(args.run_dir, "_src")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if args.fresh and not args.no_run and os.path.isdir(src):  # fresh runs measure today's code, not the snapshot's
        shutil.rmtree(src)
    if not os.path.isdir(os.path.join(src, "oblr_trl")):
        os.makedirs(src, exist_ok=True)
        archive = subprocess.run(["git", "archive", "HEAD", "oblr_trl"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        with open(os.path.join(src, "COMMIT"), "w") as f:
            f.write(commit)
    with open(os.path.join(src, "COMMIT")) as f:
        commit = f.read().strip()
    args.commit = commit
    jobs = [(t, m, s) for s in range(args.seeds) for t in args.tasks for m in args.methods]
    start = time.time()
    pending = [j for j in jobs if args.fresh or not os.path.exists(os.path.join(args.run_dir, "%s-%s-%d.json" % j))]
    if args.no_run:
        pending = []
    print(f"{len(jobs)} runs, {len(pending)} to do, {args.jobs} at a time; per-run JSON in {args.run_dir}", flush=True)
    running: list[tuple[subprocess.Popen, tuple, float, object]] = []
    # runs import oblr_trl from a snapshot of the last commit (git archive HEAD), taken once per comparison, so that
    # every run measures the same code while the working tree is being edited
    path = os.pathsep.join(p for p in (os.path.abspath(src), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            log = open(os.path.join(args.run_dir, "%s-%s-%d.log" % job), "w")
            cmd = [sys.executable, os.path.abspath(__file__), *raw, "--single", job[0], job[1], str(job[2]),
                   "--run_dir", args.run_dir]
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), job, time.time(), log))
        time.sleep(1)
        for item in list(running):
            proc, job, t0, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                status = "ok" if proc.returncode == 0 else f"FAILED rc={proc.returncode} (see log)"
                print(f"  {job[0]:<17} {job[1]:<14} seed {job[2]}: {status}, {time.time() - t0:.0f}s "
                      f"[{time.time() - start:.0f}s elapsed]", flush=True)
    seconds = time.time() - start
    runs = []
    for job in jobs:
        path = os.path.join(args.run_dir, "%s-%s-%d.json" % job)
        if os.path.exists(path):
            with open(path) as f:
                runs.append(json.load(f))
    table = aggregate(runs, args)
    plots = plot(runs, args, stem)
    command = ("python benchmarks/compare.py " + " ".join(raw)).strip()
    write_markdown(table, args, stem + ".md", command, seconds, plots)
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "date": utc_now(),
                   "machine": host_id(),
                   "seconds": round(seconds, 1), "args": {k: v for k, v in vars(args).items() if k != "single"},
                   "table": table, "runs": runs}, f, indent=1)

    shutil.rmtree(os.path.join(args.run_dir, "tmp"), ignore_errors=True)  # the trainers' (empty) output dirs
    print(open(stem + ".md").read())
    print(f"Wrote {stem}.md, {stem}.json, {', '.join(plots)} ({seconds / 60:.1f} min)")


if __name__ == "__main__":
    main()
