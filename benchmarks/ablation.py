"""Which half of OBLR-PO helps, if either? A paired ablation on the real model, with a stability window.

Every run is ``examples/demo.py --model smollm2`` (SmolLM2-135M-Instruct, LoRA r=16, 8 prompts x 8 completions per
step) on the task variant below, ``--max_steps`` steps, with held-out accuracy (greedy, and sampled at T=1) every
``--eval_every`` steps. Arms differ only in how the update is made; a seed fixes the training problems, their order
and the before-RL evaluation, so arm-vs-GRPO differences are taken **per seed** (paired) and reported with Student-t
intervals and the power of the paired t-test (``harness/stats.py``).

Arms (L = ``--grpo_lr``, GRPO's best lr on this task; the SNR arms' eta_max = ``--eta_multiple`` x L, 20/3 by default
(1e-3): the lr check's pick over the README's earlier advice of 2 L, "about twice GRPO's lr", below):

  GRPO            trl.GRPOTrainer, scale_rewards='group', lr L
  RLOO            leave-one-out mean baseline, no std scaling, no SNR step, lr L
  baseline-only   OBLR-PO's gradient-weighted leave-one-out baseline, no SNR step (``--snr_lr false``), lr L
  SNR-only        GRPO's advantages (group mean, std-scaled) under OBLR-PO's SNR step, eta_max
  OBLR-PO         the default: both halves, eta_max
  OBLR-PO-per_step  both halves with the paper's per-step SNR estimate instead of ema_soft, eta_max

The lr check runs GRPO (``--lr_check_arms``) also at L/3 and 10 L/3, 40 steps, seeds 0-2, and L is the lr of the
check with the best mean on the large set (the tables warn when it is not). The first round ran at L = 5e-4, GRPO's best
of a 10-step sweep on the demo's one-digit sums (real_compare.md); on this task GRPO at 1.5e-4 beat it on all three
seeds (+12.2, +3.2, +13.8 pts), so the design moved to L = 1.5e-4 and the round at 5e-4 is kept in its own section
(``--earlier_grpo_lr``).

The SNR arms' eta_max is checked the same way (``--eta_check_multiples``, of eta_max): at 2 L = 3e-4 and 20 L / 3 =
1e-3, the first round's eta_max. The README's "about twice GRPO's lr" came from a 10-step sweep, and over 40 steps the
SNR factor falls (0.13 on average for SNR-only at 2 L, seed 0: an applied lr of L / 4). The rule, set on 2026-11-26
when one SNR arm at 2 L had finished (SNR-only seed 0: 34.2% on the large set, against 43.2% at 1e-3): each SNR arm's
eta_max is its best mean on the large set over seeds 0-2 of the two, and the design's ``--eta_multiple`` moves from 2
to 20/3 if the check picks 1e-3 (the tables warn while the design's eta_max is not the check's pick). It did, for
every SNR arm (2026-11-26), so the design runs them at 1e-3 (``--eta_multiple`` 20/3; the check's other cell is 0.3 x
that, 3e-4), and their seeds 0-2 at 1e-3 are the first round's runs.

The long runs (``--long_arms``, default OBLR-PO and GRPO, ``--long_steps`` 120, seed 0, held-out accuracy every 20
steps) ask whether the SNR step, which falls to a few percent of eta_max within 40 steps, stalls a longer run: a
table and a plot (applied lr, reward, held-out accuracy against the step) beside GRPO's constant step.

The stability window runs each arm at 10/3 x and 10x its lr over ``--stability_seeds``, ``--stability_steps`` each. A
run *collapses* when its greedy held-out accuracy after RL is below the starting model's by more than
``--collapse_pts`` points. For GRPO, RLOO and baseline-only, 10/3 x L is the earlier round's lr (5e-4): with a
constant lr and a seed fixing the problems and their order, a 40-step run's first 20 steps are a 20-step run, so those
cells are the earlier round's runs evaluated at step 20, not run again (as the 1x cells are the ablation's own runs).
At ``--eta_multiple`` 20/3 the SNR arms' 1x cells are the earlier round's runs at 1e-3, and their 10/3 x and 10x
cells (3.33e-3, 1e-2) are run.

The final, powered measurement: after each run, ``large_eval.py`` scores its saved adapter greedily on
``--large_size`` distinct held-out problems that occur nowhere among that seed's training problems (the same problems
for every arm of the seed; the model before RL once per seed). On the runs' own 100 problems alone the difference of
two arms carries ~4-5 points of measurement noise, too much for any affordable number of seeds to detect 5 points.

The power seeds (``--power_seeds``, default seed 5, of ``--power_arms``, default GRPO, SNR-only and OBLR-PO): with
seeds 0-4 in, two contrasts, SNR-only vs GRPO and OBLR-PO vs GRPO, were short of 80% power to detect 5 points, and
at their observed spread needed 6 seeds. Those arms run one more seed at full length; a contrast between two of them
takes every seed both ran, every other contrast, the per-arm table and the curves keep seeds 0-4 (every arm paired).

Resumable and shareable like ``real_compare.py``, and safe against losing the machine: each finished run is kept as a
small record in ``--records`` (committed: benchmarks/results/ablation_runs/), and a cell whose record holds its large
evaluation is never run again. A run in flight on this machine is not started twice, and at most ``--parallel`` jobs
(1 torch thread each) run on the machine. With ``--finish_by HH:MM`` a training run launches only when it is
expected to end by then (a run killed with its session is lost whole). Large evaluations go first (minutes), then
main-ablation runs, seed-major (every arm's seed 0, then every arm's seed 1, ...), then the stability runs, then the
power seeds;
``--first_arms`` puts the named arms' training runs before the others', ``--first_lrs`` those at the named lrs (in
that order) before the rest; ``--no_large_eval`` trains only (the lr window reads the runs' own 100 problems), leaving
each trained run's large evaluation to a later call without it; a cell with a record is then not trained again.

    python benchmarks/ablation.py                       # run what is missing, then tabulate
    python benchmarks/ablation.py --no_run              # tabulate what exists under --run_dir
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from harness import RunnerLog, merged_log, uptime
from harness.grid import Costs, Limits, run_grid
from harness.procs import demo_command
from studies.ablation.design import (ARMS, CONTRASTS, METRICS, TASK_ARGS, build_parser, check_multiples, lr_of,
                                     parse_cell, run_dir_of, window_multiples)
from studies.ablation.plots import plot, plot_long
from studies.ablation.records import base_path, load_runs, record_path, sync_records
from studies.ablation.render import eta_check_note, header as render_header, lr_check_warning, render, render_round
from studies.ablation.tables import (against_best, arm_table, contrast_table, long_table, lr_check_best, lr_check_table,
                                     stability_table, step_curves)
from studies.ablation.when import render_baseline, render_when

HERE = Path(__file__).resolve().parent


def jobs(args) -> list[tuple[str, float, int, int, Path]]:
    """(arm, lr, seed, steps, output folder) of every run, in launch order: the ablation seed-major, with the lr check
    (``--lr_check_arms`` at `check_multiples` of their lr, full length) right after the last seed it shares
    with the ablation, then the long runs (``--long_arms`` at their lr, ``--long_steps``, ``--long_seeds``), then
    the stability window (3x before 10x, seed-major, ``--stability_steps`` each), then the power seeds
    (``--power_seeds`` of ``--power_arms``, at their lr, full length). ``--long_first``: the long runs
    before everything (start a session with them: a 120-step run needs two hours of one); ``--lr_check_first``: the
    lr check before the ablation (while it decides L)."""
    eta = args.eta_multiple
    out = [(arm, lr_of(arm, args.grpo_lr, eta=eta), seed, args.max_steps) for seed in args.seeds for arm in args.arms]
    check = [(arm, lr_of(arm, args.grpo_lr, m, eta=eta), seed, args.max_steps) for arm in args.lr_check_arms
             for m in check_multiples(args, arm) for seed in args.lr_check_seeds]
    cut = 0 if args.lr_check_first else max((i + 1 for i, job in enumerate(out) if job[2] in args.lr_check_seeds),
                                            default=len(out))
    out[cut:cut] = check
    out = [(*job, False) for job in out]
    long = [(arm, lr_of(arm, args.grpo_lr, eta=eta), seed, args.long_steps, True) for seed in args.long_seeds
            for arm in args.long_arms]
    out = long + out if args.long_first else out + long
    out += [(arm, lr_of(arm, args.grpo_lr, m, eta=eta), seed, args.stability_steps, False)
            for m in args.stability_multiples for seed in args.stability_seeds for arm in args.arms]
    out += [(arm, lr_of(arm, args.grpo_lr, eta=eta), seed, args.max_steps, False)
            for seed in args.power_seeds for arm in args.power_arms if arm in args.arms]
    listed = {(arm, lr, seed, long) for arm, lr, seed, _, long in out}  # the window's cells already listed serve
    window = [(arm, lr_of(arm, args.grpo_lr, m, eta=eta), seed) for seed in args.window_seeds
              for arm in args.window_arms for m in window_multiples(arm, args.window_arms)]
    out += [(arm, lr, seed, args.window_steps, False) for arm, lr, seed in window if (arm, lr, seed, False) not in listed]
    return [(arm, lr, seed, steps, run_dir_of(args.run_dir, arm, lr, seed, long))
            for arm, lr, seed, steps, long in out]

def demo_args(args, arm: str, lr: float, steps: int, long: bool = False) -> list[str]:
    return ["--model", "smollm2", "--learning_rate", repr(lr), "--max_steps", str(steps), "--eval_every",
            str(args.long_eval_every if long else args.eval_every), *ARMS[arm][0], *TASK_ARGS, *args.demo_args]

def cell_state(args, out: Path) -> str:
    """'done' (its record holds the large evaluation), 'large' (trained, its adapter not yet scored on the large set),
    or 'train' (not run; or recorded without a large evaluation and its adapter gone, as after losing the machine)."""
    record = record_path(args.records, out)
    if record.exists() and "large_eval" in json.loads(record.read_text()):
        return "done"
    if (out / "summary.json").exists():
        if (out / "large_eval.json").exists():
            return "done"  # recorded at the next sync
        if (out / "model" / "adapter_config.json").exists():
            return "large"
    return "train"

def pending(args) -> list[dict]:
    """Every job still to do as dict(kind, name, out, seed, argv), in launch order: the large evaluations (of the
    model before RL per seed, then of trained runs), then the training runs in ``jobs`` order, those of
    ``--first_arms`` first. `argv`: large_eval.py's arguments, or examples/demo.py's beyond the seed and output."""
    quick, train = [], []
    large = [str(HERE / "large_eval.py"), "--size", str(args.large_size)]
    for seed in dict.fromkeys(job[2] for job in jobs(args)):
        if not base_path(args.records, seed).exists():
            out = base_path(args.records, seed)
            quick.append(dict(kind="base", name=f"large eval before RL seed={seed}", out=out, seed=seed, arm=None,
                              argv=[*large, "--base", "--seed", str(seed), "--output", str(out)]))
    for arm, lr, seed, steps, out in jobs(args):
        state = cell_state(args, out)
        long = parse_cell(out.parent.name)[2]
        name = f"{arm} lr={lr:.3g} seed={seed}" + (f" ({steps} steps)" if long else "")
        if state == "large" and not args.no_large_eval:
            quick.append(dict(kind="large", name=f"large eval of {name}", out=out, seed=seed, arm=arm,
                              argv=[*large, str(out)]))
        elif state == "train" and not (args.no_large_eval and record_path(args.records, out).exists()):
            train.append(dict(kind="train", name=name, out=out, seed=seed, arm=arm, steps=steps,
                              argv=demo_args(args, arm, lr, steps, long)))
    def order(job: dict) -> tuple[bool, int]:  # --first_arms, then --first_lrs in their order; stable: jobs' order within
        lr = parse_cell(job["out"].parent.name)[1]
        at = [i for i, first in enumerate(args.first_lrs) if math.isclose(lr, first, rel_tol=1e-3)]
        return job["arm"] not in args.first_arms, at[0] if at else len(args.first_lrs)
    return quick + sorted(train, key=order)


# Peak memory (GB of RSS) of one run on this 24 GB machine, measured on 2026-11-25/26: the arms with per-sequence norms
# (baseline-only, SNR-only, OBLR-PO, per_step; OBLR-PO's chunked one-backward pass) 10.0-10.9 GB; the arms whose loss is
# TRL's own full-batch pass, GRPO (GRPOTrainer) 13.2-13.4 GB and RLOO (OBLRPOTrainer without norms) 13.0 GB. GRPO was
# OOM-killed beside RLOO (2026-11-25 21:04). A job launches only when the expected peaks of what runs and of it fit in
# the machine's memory less --margin_gb. Since 2026-11-26 04:25 GRPO and RLOO go through the backward in micro-batches
# of 16 (ARMS: --micro_batch 16, the same update): GRPO at 0.3 L seed 0 peaked at 4.7 GB over 40 steps (its record,
# 2026-11-26), RLOO at 4.6 GB over 2 steps; expected at 6 GB, so they run beside another arm.
PEAK_GB = {"GRPO": 6.0, "RLOO": 6.0}
DEFAULT_PEAK_GB = 11.0
EVAL_PEAK_GB = 1.5  # a large evaluation (large_eval.py)


def expected_peak_gb(job: dict) -> float:
    return PEAK_GB.get(job["arm"], DEFAULT_PEAK_GB) if job["kind"] == "train" else EVAL_PEAK_GB


def other_peak_gb(out: str) -> float:
    """Expected peak of a run this runner did not launch (another runner's, or one left by a runner restarted), read
    from its output folder ``<arm>_lr<lr>[_long]/seed<s>``."""
    return PEAK_GB.get(Path(out).parent.name.rsplit("_lr", 1)[0], DEFAULT_PEAK_GB)


# How long a job takes, to let a job overtake one that must wait (``harness.grid.next_job``): a 40-step run, its 4 evaluations
# included, took 29-43 min two at a time and 37-40 min alone on 2026-11-25/26; a large evaluation 1.5-2 min.
MINUTES_PER_STEP = 1.0
EVAL_MINUTES = 2.0
OVERTAKE_SLACK_MIN = 10.0


def expected_minutes(job: dict) -> float:
    return job["steps"] * MINUTES_PER_STEP if job["kind"] == "train" else EVAL_MINUTES


COSTS = Costs(peak_gb=expected_peak_gb, minutes=expected_minutes, other_peak_gb=other_peak_gb,
              other_minutes=lambda run: run["max_steps"] * MINUTES_PER_STEP, eval_minutes=EVAL_MINUTES,
              slack_min=OVERTAKE_SLACK_MIN)


def launch(args, job: dict) -> subprocess.Popen:
    """Start one job: a training run (examples/demo.py, reusing its seed's before-RL evaluation) or a large
    evaluation (large_eval.py), its output into its log file."""
    out = job["out"]
    cmd, env = demo_command(job["seed"], out, job["argv"])  # its environment: 1 torch thread, offline
    if job["kind"] == "train":
        before = sorted(args.run_dir.glob(f"*_lr*/seed{job['seed']}/before.json"))
        if before:  # the same model, problems and seed: its before-RL evaluation is this run's
            cmd += ["--before_from", str(before[0])]
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / "log.txt"
    else:
        cmd = [sys.executable, *job["argv"]]
        log_path = args.run_dir / f"{out.stem}.log.txt" if job["kind"] == "base" else out / "large_log.txt"
    with open(log_path, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def run_all(args, log) -> None:
    """Run what `pending` lists under the harness's grid runner, recording each finished run."""
    limits = Limits(parallel=args.parallel, min_free_gb=args.min_free_gb, margin_gb=args.margin_gb, poll_s=args.poll_s,
                    stop_launching=args.stop_launching, finish_by=args.finish_by)
    run_grid(lambda: pending(args), lambda job: launch(args, job), COSTS, limits, log,
             sync=lambda: sync_records(args.run_dir, args.records))


def main():
    args = build_parser(__doc__).parse_args()
    check_args(args)
    log = RunnerLog(args.run_dir)
    if not args.no_run:
        log(f"start: {len(jobs(args))} runs; {uptime()}")
        run_all(args, log)
        log(f"end; {uptime()}")
    tabulate(args, log.lines)


def check_args(args) -> None:
    """Refuse options that do not fit together, before anything runs."""
    if len(args.earlier_eta_multiple) != len(args.earlier_grpo_lr):
        raise SystemExit(f"--earlier_eta_multiple needs one value per --earlier_grpo_lr ({len(args.earlier_grpo_lr)}), "
                         f"got {len(args.earlier_eta_multiple)}: {args.earlier_eta_multiple}")


def tabulate(args, runner_log: list[str]) -> None:
    runner_log = merged_log(args.out.with_suffix(".json"), runner_log)
    sync_records(args.run_dir, args.records)
    runs = load_runs(args.records)
    if not runs:
        raise SystemExit(f"no run recorded under {args.records} (nor finished under {args.run_dir}) yet")
    lost: dict[tuple[str, float, int], list[int]] = {}
    for arm, lr, seed, steps, out in jobs(args):
        if cell_state(args, out) != "done":
            lost.setdefault((arm, lr, steps), []).append(seed)
    missing = [f"{arm} lr {lr:.3g}" + (f" ({steps} steps)" if steps == args.long_steps else "")
               + f" seeds {','.join(map(str, seeds))}" for (arm, lr, steps), seeds in lost.items()]
    before = {}
    for label, key in METRICS.items():
        per_seed = {r["seed"]: 100 * r[f"{key}_before"] for r in runs if r.get(f"{key}_before") is not None}
        if label == "large":  # every seed scored so far, trained on or not
            per_seed = {int(p.stem.rsplit("seed", 1)[1]): 100 * json.loads(p.read_text())["accuracy"]
                        for p in args.records.glob("large_before_seed*.json")}
        before[label] = statistics.mean(per_seed.values()) if per_seed else math.nan
    all_runs = runs
    long_rows = long_table([r for r in runs if r["long"]], short=[r for r in runs if not r["long"]],
                           short_steps=args.max_steps)
    runs = [r for r in runs if not r["long"]]
    main_runs = [r for r in runs if r["seed"] in args.seeds or r["seed"] in args.power_seeds]
    design_runs = [r for r in main_runs if r["seed"] in args.seeds]  # every arm paired on every seed
    eta = args.eta_multiple
    arms = arm_table(main_runs, args.arms, args.grpo_lr, args.seeds, eta=eta)
    design = [c for c in CONTRASTS if c[1] in args.arms and c[2] in args.arms]  # the contrasts of every round
    contrasts = contrast_table(main_runs, args.grpo_lr, args.seeds, args.delta, design, eta=eta,
                               power_seeds=args.power_seeds, power_arms=args.power_arms)
    stab = stability_table(runs, args.arms, args.grpo_lr, args.stability_multiples, args.stability_seeds,
                           args.stability_steps, args.collapse_pts, eta=eta)
    curves = step_curves(design_runs, args.arms, args.grpo_lr, eta=eta)
    lr_check = lr_check_table(runs, args)
    lr_best = lr_check_best(lr_check, args.lr_check_seeds)
    warning = lr_check_warning(lr_best)
    header = render_header(args, all_runs, lr_best)
    if warning:
        header += ["", warning]
    earlier = [dict(lr=lr, eta=e, plot=f"{args.out.name}_lr{lr:.3g}.png",
                    arms=arm_table(main_runs, args.arms, lr, args.seeds, eta=e),
                    contrasts=contrast_table(main_runs, lr, args.seeds, args.delta, design, eta=e),
                    against=against_best(main_runs, args.arms, lr, args.grpo_lr, args.seeds, args.delta, eta=e,
                                         power_seeds=args.power_seeds, power_arms=args.power_arms))
               for lr, e in zip(args.earlier_grpo_lr, args.earlier_eta_multiple)]
    rounds = [line for e in earlier for line in render_round(e, args.grpo_lr)]
    text = render(arms, contrasts, stab, curves, header, missing, before, args.delta, lr_check, long_rows, lr_best,
                  rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + f"\nPlot: `results/{args.out.name}.png`.\n")
    when = args.out.with_name(args.out.name + "_when.md")
    when.write_text(render_when(arms, contrasts, len(args.seeds), args.delta, before, long_rows, warning, earlier,
                                eta_check_note(lr_check, lr_best), stab, args.stability_steps, args.collapse_pts,
                                len(args.stability_seeds)))
    args.out.with_name(args.out.name + "_baseline.md").write_text(render_baseline(contrasts, len(args.seeds),
                                                                                   args.delta, earlier))
    compact = [{k: v for k, v in r.items() if k not in ("history", "large_eval")} for r in all_runs]  # records: the rest
    args.out.with_suffix(".json").write_text(json.dumps(dict(arms=arms, contrasts=contrasts, stability=stab,
                                                             lr_check=lr_check, long=long_rows, earlier=earlier,
                                                             curves=curves, missing=missing, before=before,
                                                             runs=compact, runner_log=runner_log),
                                                        indent=1, default=str))
    long_runs = [r for r in all_runs if r["long"]]
    if long_runs:
        plot_long(long_runs, args.out.with_name(args.out.name + "_long.png"), "SmolLM2-135M-Instruct, chain_sum "
                  f"(1-2 digit terms): {args.long_steps}-step runs")
    plot(curves, contrasts, args.out.with_suffix(".png"), "SmolLM2-135M-Instruct, chain_sum (1-2 digit terms): "
         f"the ablation, L = {args.grpo_lr:.3g}")
    for e in earlier:
        plot(step_curves(main_runs, args.arms, e["lr"], eta=e["eta"]), [*e["contrasts"], *e["against"]],
             args.out.with_name(e["plot"]), "SmolLM2-135M-Instruct, chain_sum (1-2 digit terms): the earlier round, "
             f"L = {e['lr']:.3g}")
    print(text)


if __name__ == "__main__":
    main()
