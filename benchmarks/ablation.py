"""Which half of OBLR-PO helps, if either? A paired ablation on the real model, with a stability window.

Every run is ``examples/demo.py --model smollm2`` (SmolLM2-135M-Instruct, LoRA r=16, 8 prompts x 8 completions per
step) on the task variant below, ``--max_steps`` steps, with held-out accuracy (greedy, and sampled at T=1) every
``--eval_every`` steps. Arms differ only in how the update is made; a seed fixes the training problems, their order
and the before-RL evaluation, so arm-vs-GRPO differences are taken **per seed** (paired) and reported with Student-t
intervals and the power of the paired t-test (``paired_stats.py``).

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
``--first_arms`` puts the named arms' training runs before the others'.

    python benchmarks/ablation.py                       # run what is missing, then tabulate
    python benchmarks/ablation.py --no_run              # tabulate what exists under --run_dir
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from demo_seeds import demo_command
from paired_stats import paired_difference, paired_power, problem_paired_se, seeds_for_power
from real_compare import is_running, mem_available_gb, meminfo_gb, real_demo_runs, stop_deadline, uptime

HERE = Path(__file__).resolve().parent
# arm -> (examples/demo.py flags, whether it has OBLR-PO's SNR step: its lr is then eta_max, --eta_multiple x L)
ARMS: dict[str, tuple[list[str], bool]] = {
    "GRPO": (["--trainer", "grpo", "--micro_batch", "16"], False),
    "RLOO": (["--baseline", "mean", "--snr_lr", "false", "--micro_batch", "16"], False),
    "baseline-only": (["--snr_lr", "false"], False),
    "SNR-only": (["--baseline", "mean", "--leave_one_out", "false", "--scale_rewards", "group"], True),
    "OBLR-PO": ([], True),
    "OBLR-PO-per_step": (["--snr_estimator", "per_step"], True),
}
SNR_ARMS = [arm for arm, (_, snr) in ARMS.items() if snr]
REFERENCE = "GRPO"
# The task variant: chain_sum sums of two numbers of one or two digits. The demo's one-digit sums start at 50% greedy
# and reach ~70% within 15 steps (benchmarks/results/demo_seeds_smollm2.md): no headroom over 40 steps. This one
# starts at 22% greedy, 3% sampled on 100 problems (measured 2026-11-24), and a reply "37 + 58 = 95" needs ~10
# tokens, hence 12. Its one-digit sums (a quarter of the problems) give a first reward to learn the reply's form from.
TASK_ARGS = ["--task_config", '{"max_digits": 2}', "--max_completion_length", "12"]
# label -> summary key (<key>_before / <key>_after): the runs' own 100 problems (greedy; 4 samples at T=1), and the
# large unseen set of large_eval.py (greedy), the one the power is sized on
METRICS = {"greedy": "accuracy", "sampled": "sampled_accuracy", "large": "large_accuracy"}
TITLES = {"greedy": "greedy (100)", "sampled": "sampled (100)", "large": "greedy (large set)"}
PRIMARY = "large"
RECORDS = HERE / "results" / "ablation_runs"
LONG_TAG = "_long"  # the folder and record suffix of a long run's cell
POWER_SEEDS_WHY = ("added on 2026-11-27 because, with seeds 0-4 in, SNR-only vs GRPO and OBLR-PO vs GRPO were the "
                   "contrasts short of 80% power to detect 5 points, at 6 seeds needed at their observed spread; the "
                   "rule looked at the spread only, and the added seed is reported whatever it shows")
HISTORY_KEYS = ("step", "reward", "oblr/lr_scale", "oblr/snr", "oblr/lr", "learning_rate")
# (what it measures, arm, minus arm): every arm against GRPO, then each ingredient alone, the rest held fixed
CONTRASTS = [
    ("RLOO vs GRPO", "RLOO", "GRPO"),
    ("baseline-only vs GRPO", "baseline-only", "GRPO"),
    ("SNR-only vs GRPO", "SNR-only", "GRPO"),
    ("OBLR-PO vs GRPO", "OBLR-PO", "GRPO"),
    ("OBLR-PO-per_step vs GRPO", "OBLR-PO-per_step", "GRPO"),
    ("the gradient-weighted baseline (baseline-only - RLOO: same lr, no SNR step)", "baseline-only", "RLOO"),
    ("the SNR step on GRPO's advantages (SNR-only - GRPO)", "SNR-only", "GRPO"),
    ("the SNR step on OBLR-PO's baseline (OBLR-PO - baseline-only)", "OBLR-PO", "baseline-only"),
    ("the paper's per-step SNR instead of ema_soft (OBLR-PO-per_step - OBLR-PO)", "OBLR-PO-per_step", "OBLR-PO"),
]


# The lr window (issue 49): each arm's held-out accuracy after --window_steps steps over a grid of lrs ~3x apart, as
# multiples of its lr in the design (L, or eta_max for an SNR arm), from "learns too slowly" to "collapses". The
# grid holds the cells that exist: L/3, 10 L/3 and 10 L of the lr check and stability window, 0.3 eta_max of the eta
# check; a 40-step run at a constant lr (or under the SNR step, which looks only at past steps) is a 20-step run
# evaluated at step 20, so those runs serve. Opt-in (--window_seeds) so that the ablation's own tables are unchanged.
WINDOW_ARMS = ["GRPO", "RLOO", "OBLR-PO"]
WINDOW_MULTIPLES = [0.1, 1 / 3, 1.0, 10 / 3, 10.0, 100 / 3]  # of L, for the arms without an SNR step
WINDOW_ETA_MULTIPLES = [0.1, 0.3, 1.0, 10 / 3, 10.0, 100 / 3]  # of eta_max, for the SNR arms


def window_multiples(arm: str) -> list[float]:
    """The lr window's multiples of an arm's lr (``WINDOW_ETA_MULTIPLES`` for an SNR arm)."""
    return WINDOW_ETA_MULTIPLES if ARMS[arm][1] else WINDOW_MULTIPLES


def lr_of(arm: str, grpo_lr: float, multiple: float = 1.0, *, eta: float) -> float:
    """An arm's lr in a round (GRPO's lr `grpo_lr` = L, the SNR arms' eta_max = `eta` x L), times `multiple`."""
    return float(f"{(eta if ARMS[arm][1] else 1.0) * grpo_lr * multiple:.3g}")


def check_multiples(args, arm: str) -> list[float]:
    """The lr check's multiples of a checked arm's lr: ``--eta_check_multiples`` for an SNR arm (of its eta_max),
    ``--lr_check_multiples`` for the others."""
    return args.eta_check_multiples if ARMS[arm][1] else args.lr_check_multiples


def micro_batch_of(arm: str) -> int | None:
    """The arm's ``--micro_batch`` in ARMS (None: the step's whole batch in one backward)."""
    flags = ARMS[arm][0]
    return int(flags[flags.index("--micro_batch") + 1]) if "--micro_batch" in flags else None


def run_dir_of(root: Path, arm: str, lr: float, seed: int, long: bool = False) -> Path:
    return root / f"{arm}_lr{lr:.3g}{LONG_TAG * long}" / f"seed{seed}"


def parse_cell(folder: str) -> tuple[str, float, bool]:
    """(arm, lr, long) of a cell's folder name (run_dir_of's)."""
    arm, rest = folder.rsplit("_lr", 1)
    return arm, float(rest.removesuffix(LONG_TAG)), rest.endswith(LONG_TAG)


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
              for arm in args.window_arms for m in window_multiples(arm)]
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
        if state == "large":
            quick.append(dict(kind="large", name=f"large eval of {name}", out=out, seed=seed, arm=arm,
                              argv=[*large, str(out)]))
        elif state == "train":
            train.append(dict(kind="train", name=name, out=out, seed=seed, arm=arm, steps=steps,
                              argv=demo_args(args, arm, lr, steps, long)))
    return quick + sorted(train, key=lambda job: job["arm"] not in args.first_arms)  # stable: jobs' order within


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


def fits(running_gb: list[float], candidate_gb: float, total_gb: float, margin_gb: float) -> bool:
    """Whether a job expected to peak at `candidate_gb` may start beside jobs expected to peak at `running_gb`."""
    return sum(running_gb) + candidate_gb <= total_gb - margin_gb


# How long a job takes, to let a job overtake one that must wait (``next_job``): a 40-step run, its 4 evaluations
# included, took 29-43 min two at a time and 37-40 min alone on 2026-11-25/26; a large evaluation 1.5-2 min.
MINUTES_PER_STEP = 1.0
EVAL_MINUTES = 2.0
OVERTAKE_SLACK_MIN = 10.0


def expected_minutes(job: dict) -> float:
    return job["steps"] * MINUTES_PER_STEP if job["kind"] == "train" else EVAL_MINUTES


def next_job(todo: list[dict], running: list[dict], total_gb: float, margin_gb: float,
             slack_min: float = OVERTAKE_SLACK_MIN) -> dict | None:
    """The job to launch now, or None. `running`: dict(peak_gb, minutes_left, overtaker) per job running.

    The first in line, when its expected peak fits beside the running jobs'. When it does not (GRPO, which runs
    alone, behind a run in flight), a later job that fits may overtake it if it would end within `slack_min` of the
    last running job's expected end, so the core does not idle while the first in line waits and the first in line
    waits at most `slack_min` longer. One overtaker at a time: none launches beside a job that overtook, so the first
    in line cannot starve."""
    if not todo:
        return None
    busy = [r["peak_gb"] for r in running]
    if fits(busy, expected_peak_gb(todo[0]), total_gb, margin_gb):
        return todo[0]
    if not running or any(r["overtaker"] for r in running):
        return None
    limit = max(r["minutes_left"] for r in running) + slack_min
    return next((job for job in todo[1:] if fits(busy, expected_peak_gb(job), total_gb, margin_gb)
                 and expected_minutes(job) <= limit), None)


def in_time(todo: list[dict], minutes_left: float | None) -> tuple[list[dict], list[dict]]:
    """(the jobs that may launch, the training runs held back): with `minutes_left` before ``--finish_by``, a training
    run launches only when it and its large evaluation are expected to end in time (a run killed with its session
    is lost whole: a 120-step run started an hour before the end would waste two core-hours). Evaluations always."""
    if minutes_left is None:
        return todo, []
    is_late = [j["kind"] == "train" and expected_minutes(j) + EVAL_MINUTES > minutes_left for j in todo]
    return [j for j, late in zip(todo, is_late) if not late], [j for j, late in zip(todo, is_late) if late]


def rss_gb(pid: int) -> float:
    """Resident memory of a process (GB), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) / 2**20 for line in f if line.startswith("VmRSS:")), 0.0)
    except OSError:
        return 0.0


def write_peak(out: Path, peak_gb: float, every_s: float, **extra) -> None:
    (out / "peak_rss.json").write_text(json.dumps(dict(peak_rss_gb=round(peak_gb, 2), sampled_every_s=every_s, **extra)))


def watch_others(others: list[dict], watched: dict[int, dict], every_s: float, log) -> None:
    """Sample the RSS of runs this runner did not launch (another runner's, or one left by a runner restarted) while
    they run; when one has finished with no peak written, write the peak seen (a lower bound: watched only since this
    runner started)."""
    for run in others:
        seen = watched.setdefault(run["pid"], dict(out=Path(run["out"]), peak_gb=0.0))
        seen["peak_gb"] = max(seen["peak_gb"], rss_gb(run["pid"]))
    for pid in set(watched) - {run["pid"] for run in others}:
        seen = watched.pop(pid)
        if (seen["out"] / "summary.json").exists() and not (seen["out"] / "peak_rss.json").exists():
            write_peak(seen["out"], seen["peak_gb"], every_s, watched_part_of_the_run=True)
            log(f"finished {seen['out']} (not launched here), peak RSS >= {seen['peak_gb']:.1f} GB")


def launch(args, job: dict, log) -> None:
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
        job.update(proc=subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), peak_gb=0.0,
                   started=time.time())
    log(f"launched {job['name']}{' (overtaking the first in line)' if job['overtaker'] else ''} "
        f"(pid {job['proc'].pid}); {uptime()}")


def run_all(args, log) -> None:
    running: list[dict] = []  # the jobs launched (pending's dicts) with their process and peak RSS seen
    watched: dict[int, dict] = {}  # runs launched elsewhere, by pid: their output and peak RSS seen
    deadline = stop_deadline(args.stop_launching, datetime.now(timezone.utc))
    finish = stop_deadline(args.finish_by, datetime.now(timezone.utc))
    stopped, held = False, set()
    while True:
        for job in list(running):
            job["peak_gb"] = max(job["peak_gb"], rss_gb(job["proc"].pid))
            if job["proc"].poll() is not None:
                running.remove(job)
                log(f"finished {job['name']} rc={job['proc'].returncode}, peak RSS >= {job['peak_gb']:.1f} GB "
                    f"(sampled every {args.poll_s:g} s); {uptime()}")
                if job["kind"] == "train" and job["proc"].returncode == 0:
                    write_peak(job["out"], job["peak_gb"], args.poll_s)
        ours = {str(job["out"].resolve()) for job in running}
        others = [r for r in real_demo_runs() if r["out"] and str(Path(r["out"]).resolve()) not in ours]
        watch_others(others, watched, args.poll_s, log)
        for path in sync_records(args.run_dir, args.records):
            log(f"recorded {path.name}")
        todo = [j for j in pending(args) if str(j["out"].resolve()) not in ours
                and not is_running(j["out"], [r["out"] for r in others])]
        if deadline and datetime.now(timezone.utc) >= deadline and not stopped:
            stopped = True
            log(f"stop time {args.stop_launching} UTC reached: not launching "
                f"{sum(j['kind'] == 'train' for j in todo)} training runs")
        if stopped:
            todo = [j for j in todo if j["kind"] != "train"]
        todo, late = in_time(todo, (finish - datetime.now(timezone.utc)).total_seconds() / 60 if finish else None)
        for j in late:
            if j["name"] not in held:
                held.add(j["name"])
                log(f"not launching {j['name']}: expected {expected_minutes(j) + EVAL_MINUTES:.0f} min with its "
                    f"large evaluation, it would not end by --finish_by {args.finish_by} UTC")
        if not todo and not running:
            return
        now = time.time()
        busy = ([dict(peak_gb=expected_peak_gb(j), overtaker=j["overtaker"],
                      minutes_left=expected_minutes(j) - (now - j["started"]) / 60) for j in running]
                + [dict(peak_gb=other_peak_gb(r["out"]), overtaker=False,
                        minutes_left=r["max_steps"] * MINUTES_PER_STEP - r["elapsed_s"] / 60) for r in others])
        job = next_job(todo, busy, meminfo_gb("MemTotal"), args.margin_gb) \
            if len(busy) < args.parallel and mem_available_gb() >= args.min_free_gb else None
        if job is not None:
            job["overtaker"] = job is not todo[0]
            launch(args, job, log)
            running.append(job)
            time.sleep(5)
            continue
        time.sleep(args.poll_s)


def record_path(records: Path, out: Path) -> Path:
    """The record of the run in folder `out` (<cell>/seed<s>): <cell>_seed<s>.json."""
    return records / f"{out.parent.name}_{out.name}.json"


def base_path(records: Path, seed: int) -> Path:
    """The large evaluation of the model before RL on seed `seed`'s large set."""
    return records / f"large_before_seed{seed}.json"


def make_record(out: Path) -> dict:
    """A finished run's record: its summary.json (without the example replies), each optimizer step's log entry cut
    to HISTORY_KEYS, and its large evaluation when large_eval.py has written one."""
    record = {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if k != "examples"}
    history = out / "log_history.json"
    entries = json.loads(history.read_text()) if history.exists() else []
    finished = datetime.fromtimestamp((out / "summary.json").stat().st_mtime, timezone.utc)
    arm, lr, long = parse_cell(out.parent.name)
    record.update(arm=arm, lr=lr, seed=int(out.name[4:]), long=long, finished=f"{finished:%Y-%m-%d %H:%M UTC}",
                  history=[{k: e[k] for k in HISTORY_KEYS if k in e} for e in entries if "step" in e and "loss" in e])
    if (out / "large_eval.json").exists():
        record["large_eval"] = json.loads((out / "large_eval.json").read_text())
    if (out / "peak_rss.json").exists():
        record.update(json.loads((out / "peak_rss.json").read_text()))
    return record


def sync_records(run_dir: Path, records: Path) -> list[Path]:
    """Write (or complete with its large evaluation) the record of every finished run under run_dir
    (<arm>_lr<lr>/seed<s>/summary.json); the records written."""
    written = []
    records.mkdir(parents=True, exist_ok=True)
    for summary in sorted(run_dir.glob("*_lr*/seed*/summary.json")):
        out = summary.parent
        path = record_path(records, out)
        record = make_record(out)
        if path.exists() and json.loads(path.read_text()) == record:
            continue
        path.write_text(json.dumps(record, indent=1))
        written.append(path)
    return written


def load_runs(records: Path) -> list[dict]:
    """Every recorded run (<arm>_lr<lr>_seed<s>.json under records), with `large_accuracy_after` from its large
    evaluation and `large_accuracy_before` from its seed's evaluation before RL on the same problems."""
    runs = []
    for path in sorted(records.glob("*_lr*_seed*.json")):
        run = json.loads(path.read_text())
        run.setdefault("long", False)
        large = run.get("large_eval")
        if large:
            run["large_accuracy_after"] = large["accuracy"]
            base = base_path(records, run["seed"])
            if base.exists() and json.loads(base.read_text())["digest"] == large["digest"]:
                run["large_accuracy_before"] = json.loads(base.read_text())["accuracy"]
        runs.append(run)
    return runs


def by_seed(runs: list[dict], arm: str, lr: float, key: str) -> dict[int, float]:
    """{seed: 100 * run[key]} of one (arm, lr) cell."""
    return {r["seed"]: 100 * r[key] for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)
            and r.get(key) is not None}


def large_correct(runs: list[dict], arm: str, lr: float) -> dict[int, tuple[str, list[bool]]]:
    """{seed: (digest of the problems, exact answer per problem)} of one cell's large evaluations."""
    return {r["seed"]: (r["large_eval"]["digest"], [s >= 1.0 for s in r["large_eval"]["scores"]])
            for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr) and r.get("large_eval", {}).get("scores")}


def measurement_se(runs: list[dict], a: str, lr_a: float, b: str, lr_b: float, seeds: list[int]) -> float | None:
    """Mean over the seeds both cells scored on the same large set of the problem-level standard error (points) of
    their difference: how much of a per-seed difference is measurement noise rather than the runs."""
    mine, ref = large_correct(runs, a, lr_a), large_correct(runs, b, lr_b)
    ses = [problem_paired_se(mine[s][1], ref[s][1]) for s in seeds
           if s in mine and s in ref and mine[s][0] == ref[s][0]]
    return statistics.mean(ses) if ses else None


def curve_at(run: dict, step: int, key: str) -> float | None:
    """The held-out metric `key` of a run at `step` (its `curve`), or None."""
    return next((100 * c[key] for c in run.get("curve", []) if c["step"] == step and c.get(key) is not None), None)


def arm_table(runs: list[dict], arms: list[str], grpo_lr: float, seeds: list[int], *, eta: float) -> list[dict]:
    """Per arm at its lr in the round (L = `grpo_lr`, eta_max = `eta` L): seeds run, and per metric the mean and sd
    over them (points), and s/step."""
    rows = []
    for arm in arms:
        lr = lr_of(arm, grpo_lr, eta=eta)
        row = dict(arm=arm, lr=lr)
        for label, key in METRICS.items():
            values = [v for s, v in by_seed(runs, arm, lr, f"{key}_after").items() if s in seeds]
            row[label] = dict(n=len(values), mean=statistics.mean(values) if values else math.nan,
                              sd=statistics.stdev(values) if len(values) > 1 else math.nan)
        per_step = [r["seconds_per_step"] for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)
                    and r["seed"] in seeds]
        row["seconds_per_step"] = statistics.median(per_step) if per_step else math.nan
        row["seconds_per_step_range"] = (min(per_step), max(per_step)) if per_step else None  # sharing the machine
        applied = [r["mean_applied_lr"] for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)
                   and r["seed"] in seeds and r.get("mean_applied_lr") is not None]
        row["mean_applied_lr"] = statistics.mean(applied) if applied else math.nan  # eta_max x the SNR factor
        peaks = [r["peak_rss_gb"] for r in runs if r["arm"] == arm and r.get("peak_rss_gb") is not None
                 and (r.get("micro_batch") or None) == micro_batch_of(arm)]
        row["peak_rss_gb"] = max(peaks) if peaks else math.nan  # at any lr and seed, as the arm runs now
        rows.append(row)
    return rows


def contrast_row(runs: list[dict], name: str, a: str, lr_a: float, b: str, lr_b: float, seeds: list[int],
                 delta: float) -> dict:
    """One contrast (arm `a` at `lr_a` minus arm `b` at `lr_b`) over `seeds` (its planned seeds), per metric: the
    per-seed differences (points), their mean, sd, 95% interval, the power to detect `delta` points at the observed sd
    and n, and the seeds power 0.8 would need; on the powered measurement also the problem-level measurement noise of
    a difference."""
    row = dict(name=name, a=a, b=b, lr_a=lr_a, lr_b=lr_b, planned=len(seeds))
    for label, key in METRICS.items():
        mine = {s: v for s, v in by_seed(runs, a, lr_a, f"{key}_after").items() if s in seeds}
        ref = {s: v for s, v in by_seed(runs, b, lr_b, f"{key}_after").items() if s in seeds}
        diff = paired_difference(mine, ref)
        if diff["n"] >= 3 and diff["sd"] > 0:
            diff["power"] = paired_power(delta, diff["sd"], diff["n"])
            diff["seeds_for_80"] = seeds_for_power(delta, diff["sd"])
        diff["verdict"] = verdict(diff)
        if label == PRIMARY:
            diff["measurement_se"] = measurement_se(runs, a, lr_a, b, lr_b, seeds)
        row[label] = diff
    return row


def pair_seeds(a: str, b: str, seeds: list[int], power_seeds: list[int] = (), power_arms: list[str] = ()) -> list[int]:
    """The planned seeds of arm `a` against arm `b`: `seeds`, and `power_seeds` where both are among `power_arms`."""
    return [*seeds, *(power_seeds if a in power_arms and b in power_arms else ())]


def contrast_table(runs: list[dict], grpo_lr: float, seeds: list[int], delta: float,
                   contrasts=CONTRASTS, *, eta: float, power_seeds: list[int] = (),
                   power_arms: list[str] = ()) -> list[dict]:
    """Every contrast of the design at GRPO's lr `grpo_lr` (each arm at its lr in the round, the SNR arms' eta_max
    `eta` x it): `contrast_row`'s, over `seeds` and, where both its arms are among `power_arms`, `power_seeds` too."""
    return [contrast_row(runs, name, a, lr_of(a, grpo_lr, eta=eta), b, lr_of(b, grpo_lr, eta=eta),
                         pair_seeds(a, b, seeds, power_seeds, power_arms), delta)
            for name, a, b in contrasts]


def against_best(runs: list[dict], arms: list[str], earlier_lr: float, grpo_lr: float, seeds: list[int],
                 delta: float, *, eta: float, power_seeds: list[int] = (), power_arms: list[str] = ()) -> list[dict]:
    """Each arm of an earlier round (at its lr in that round: L = `earlier_lr`, eta_max = `eta` x it) minus GRPO at
    the design's `grpo_lr`, its best lr on this task, per seed: what the earlier round's arms give against a GRPO
    tuned on this task. Over `seeds`, and `power_seeds` too where the arm and GRPO are among `power_arms` (the runs
    there are at the design's lrs, so a cell the two rounds share gets the design's seeds)."""
    return [contrast_row(runs, f"{arm} at {lr_of(arm, earlier_lr, eta=eta):.3g} vs GRPO at {grpo_lr:.3g}", arm,
                         lr_of(arm, earlier_lr, eta=eta), REFERENCE, grpo_lr,
                         pair_seeds(arm, REFERENCE, seeds, power_seeds, power_arms), delta)
            for arm in arms if arm != REFERENCE]


def lr_check_table(runs: list[dict], args) -> list[dict]:
    """Is each checked arm at its best lr on this task (L, or the SNR arms' eta_max)? Per checked arm and lr multiple
    (1 first; `check_multiples`): the seeds run, the mean held-out accuracy after RL, and the per-seed difference to
    the arm at its own lr (same seeds)."""
    rows = []
    for arm in args.lr_check_arms:
        own = lr_of(arm, args.grpo_lr, eta=args.eta_multiple)
        at_own = {label: {s: v for s, v in by_seed(runs, arm, own, f"{key}_after").items()
                          if s in args.lr_check_seeds} for label, key in METRICS.items()}
        for m in [1.0, *check_multiples(args, arm)]:
            lr = lr_of(arm, args.grpo_lr, m, eta=args.eta_multiple)
            row = dict(arm=arm, multiple=m, lr=lr)
            for label, key in METRICS.items():
                mine = {s: v for s, v in by_seed(runs, arm, lr, f"{key}_after").items() if s in args.lr_check_seeds}
                diff = paired_difference(mine, at_own[label]) if m != 1.0 else None
                if diff is not None:
                    diff["verdict"] = verdict(diff)
                row[label] = dict(n=len(mine), mean=statistics.mean(mine.values()) if mine else math.nan, diff=diff)
            rows.append(row)
    return rows


def lr_check_best(rows: list[dict], seeds: list[int]) -> dict[str, dict]:
    """Per checked arm whose every lr of the check has all `seeds` on the powered measurement: the row with the best
    mean there (the lr a user tuning on these seeds would pick). Arms with a cell short of seeds are left out."""
    best = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        if all(r[PRIMARY]["n"] >= len(seeds) for r in mine):
            best[arm] = max(mine, key=lambda r: r[PRIMARY]["mean"])
    return best


def lr_check_warning(best: dict[str, dict]) -> str | None:
    """The warning owed when a complete lr check finds an arm's best lr below (or above) the one the design runs it
    at: its contrasts compare against (or with) an arm off its best lr."""
    off = [r for r in best.values() if r["multiple"] != 1.0]
    if not off:
        return None
    return ("**Warning: the lr check finds " + "; ".join(
        f"{r['arm']}'s best lr on {TITLES[PRIMARY]} at {r['lr']:.3g} ({r['multiple']:.3g}x the design's, "
        f"{r[PRIMARY]['mean']:.1f}% over {r[PRIMARY]['n']} seeds)" for r in off)
        + ", not the lr the tables above use. Every contrast with that arm compares against it off its best lr; "
        "rerun the design at the best lr (" + " and ".join(dict.fromkeys(
            "`--eta_multiple` for the SNR arms' eta_max" if ARMS[r["arm"]][1] else "`--grpo_lr`" for r in off))
        + ").**")


def eta_check_note(rows: list[dict], best: dict[str, dict]) -> str | None:
    """"When to use"'s word while the lr check has not yet all its seeds for an SNR arm: per such arm, its mean on the
    powered measurement at each eta_max of the check and the paired difference so far (a finished check that moves
    an arm is `lr_check_warning`'s)."""
    open_arms = list(dict.fromkeys(r["arm"] for r in rows if ARMS[r["arm"]][1] and r["arm"] not in best))
    if not open_arms:
        return None
    parts = []
    for arm in open_arms:
        mine = [r for r in rows if r["arm"] == arm]
        cells = [f"{fmt(r[PRIMARY]['mean'])}% at {r['lr']:.3g} ({r[PRIMARY]['n']} seed{'s' * (r[PRIMARY]['n'] != 1)})"
                 for r in mine]
        diffs = [f"{r['lr']:.3g} minus {mine[0]['lr']:.3g}: {fmt(d['mean'], True)} pts over {d['n']} paired "
                 f"seed{'s' * (d['n'] != 1)}" for r in mine[1:] if (d := r[PRIMARY]["diff"]) and d["n"]]
        parts.append(f"{arm} " + ", ".join(cells) + (f" ({'; '.join(diffs)})" if diffs else ""))
    return ("**The SNR arms' eta_max is not settled yet** (the lr check, `ablation.md`, \"Is each arm at its best "
            f"lr?\"), on {TITLES[PRIMARY]}: " + "; ".join(parts) + ". Their numbers below are at the design's "
            "eta_max; once the check has all its seeds, the design moves to each arm's better one.")


def verdict(diff: dict) -> str:
    """'better' / 'worse' when the 95% interval excludes 0, 'no difference detected', or 'too few seeds'."""
    if diff["ci"] is None:
        return f"too few seeds ({diff['n']})"
    lo, hi = diff["ci"]
    return "better" if lo > 0 else "worse" if hi < 0 else "no difference detected"


def long_table(runs: list[dict], window: int = 10, short: list[dict] = (), short_steps: int = 40) -> list[dict]:
    """Per long run (arm, seed) and held-out evaluation: the step, the mean lr scale (the SNR factor; None without an
    SNR step) and training reward over the `window` steps up to it, and held-out greedy and sampled accuracy (%).
    Each row also carries the run's greedy accuracy on the large set after it (`large`, %) and that of the `short`
    run (the ablation's, `short_steps` long) of the same arm, lr and seed (`short_large`); None if not scored."""
    rows = []
    for r in sorted(runs, key=lambda r: (r["seed"], list(ARMS).index(r["arm"]))):
        by_step = {e["step"]: e for e in r["history"]}
        large = dict(large=by_seed([r], r["arm"], r["lr"], "large_accuracy_after").get(r["seed"]),
                     short_large=by_seed(short, r["arm"], r["lr"], "large_accuracy_after").get(r["seed"]),
                     short_steps=short_steps)
        for c in r.get("curve", []):
            steps = [by_step[t] for t in range(max(1, c["step"] - window + 1), c["step"] + 1) if t in by_step]
            scale = [e["oblr/lr_scale"] for e in steps if e.get("oblr/lr_scale") is not None]
            reward = [e["reward"] for e in steps if e.get("reward") is not None]
            rows.append(dict(arm=r["arm"], seed=r["seed"], step=c["step"], lr=r["lr"],
                             lr_scale=statistics.mean(scale) if scale else None,
                             reward=statistics.mean(reward) if reward else None,
                             greedy=100 * c["accuracy"], sampled=100 * c["sampled_accuracy"], **large))
    return rows


def long_summary(rows: list[dict]) -> list[str]:
    """Per long run, one sentence: how the lr scale moved from the first to the last evaluation window, and what
    held-out greedy accuracy did over each half of the run, then greedy accuracy on the large set after it (beside its
    short run's, when both were scored)."""
    out = []
    for (arm, seed) in dict.fromkeys((r["arm"], r["seed"]) for r in rows):
        mine = [r for r in rows if r["arm"] == arm and r["seed"] == seed]
        if len(mine) < 3:
            continue
        first, mid, last = mine[1], mine[(len(mine) - 1) // 2], mine[-1]
        scale = (f"lr scale {first['lr_scale']:.3f} (steps to {first['step']}) -> {last['lr_scale']:.3f} (last "
                 f"window), an applied lr of {first['lr'] * first['lr_scale']:.2g} -> {last['lr'] * last['lr_scale']:.2g}"
                 if first["lr_scale"] is not None else f"constant lr {first['lr']:.3g}")
        large = ""
        if last.get("large") is not None:
            large = f"; greedy on the large set after it {last['large']:.1f}%"
            if last.get("short_large") is not None:
                large += f" (its {last['short_steps']}-step run, same lr and seed: {last['short_large']:.1f}%)"
        out.append(f"{arm} seed {seed}: {scale}; held-out greedy {mine[0]['greedy']:.0f}% -> {mid['greedy']:.0f}% "
                   f"(step {mid['step']}) -> {last['greedy']:.0f}% (step {last['step']}), a gain of "
                   f"{last['greedy'] - mid['greedy']:+.0f} pts over the second half{large}.")
    return out


def step_curves(runs: list[dict], arms: list[str], grpo_lr: float, *, eta: float) -> dict:
    """Per arm at its lr in the round, the seed mean per step of the training reward and the lr scale (the SNR factor;
    1 where the arm has no SNR step), and of held-out greedy accuracy at each evaluated step."""
    out = {}
    for arm in arms:
        lr = lr_of(arm, grpo_lr, eta=eta)
        mine = [r for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)]
        if not mine:
            continue
        per_step: dict[str, dict[int, list[float]]] = {"reward": {}, "lr_scale": {}}
        for r in mine:
            for e in r["history"]:
                if "step" not in e:
                    continue
                if e.get("reward") is not None:
                    per_step["reward"].setdefault(e["step"], []).append(e["reward"])
                if e.get("oblr/lr_scale") is not None:
                    per_step["lr_scale"].setdefault(e["step"], []).append(e["oblr/lr_scale"])
        steps = sorted({c["step"] for r in mine for c in r.get("curve", [])})
        held = {s: [v for r in mine if (v := curve_at(r, s, "accuracy")) is not None] for s in steps}
        out[arm] = dict(
            seeds=len(mine),
            reward={s: statistics.mean(v) for s, v in sorted(per_step["reward"].items())},
            lr_scale={s: statistics.mean(v) for s, v in sorted(per_step["lr_scale"].items())},
            greedy={s: statistics.mean(v) for s, v in held.items() if v},
            skipped=statistics.mean(r.get("steps_with_lr_scale_0") or 0 for r in mine),  # steps with scale 0
        )
    return out


def applied_lrs(run: dict, until: int) -> list[float]:
    """The lr each optimizer step of a run applied, up to `until`: the SNR step's (eta_max x its factor) where it
    logs one, else the scheduler's (constant here)."""
    lrs = [e.get("oblr/lr", e.get("learning_rate")) for e in run.get("history", []) if e["step"] <= until]
    return [lr for lr in lrs if lr is not None]


def stability_table(runs: list[dict], arms: list[str], grpo_lr: float, multiples: list[float], seeds: list[int],
                    step: int, collapse_pts: float, *, eta: float) -> list[dict]:
    """Per arm and lr multiple (1 = its own lr): greedy held-out accuracy at `step` over `seeds` (mean, min; for the
    arm's own lr, the 40-step run's evaluation at that step), the change from the arm's own lr in points, the runs
    that collapsed (accuracy at `step` below the starting model's by more than `collapse_pts`), and the lr the runs
    applied up to `step` (`applied`: the mean over runs of each run's mean; `applied_max`: the largest step's;
    `applied_per_run`: each run's seed, whether it collapsed, its mean and its largest step)."""
    rows, base_mean = [], math.nan
    for arm in arms:
        for m in (1.0, *multiples):
            lr = lr_of(arm, grpo_lr, m, eta=eta)
            cell = [(r, curve_at(r, step, "accuracy")) for r in runs
                    if r["arm"] == arm and math.isclose(r["lr"], lr) and r["seed"] in seeds]
            cell = [(r, v) for r, v in cell if v is not None]
            if not cell:
                rows.append(dict(arm=arm, multiple=m, lr=lr, n=0))
                continue
            values = [v for _, v in cell]
            if m == 1.0:
                base_mean = statistics.mean(values)
            collapsed = [r["seed"] for r, v in cell if 100 * r["accuracy_before"] - v > collapse_pts]
            applied = [dict(seed=r["seed"], collapsed=r["seed"] in collapsed, mean=statistics.mean(lrs), max=max(lrs))
                       for r, _ in cell if (lrs := applied_lrs(r, step))]
            rows.append(dict(arm=arm, multiple=m, lr=lr, n=len(cell), mean=statistics.mean(values), min=min(values),
                             change=statistics.mean(values) - base_mean if m != 1.0 else 0.0, collapsed=collapsed,
                             applied=statistics.mean(a["mean"] for a in applied) if applied else math.nan,
                             applied_max=max(a["max"] for a in applied) if applied else math.nan,
                             applied_per_run=applied))
        base_mean = math.nan
    return rows


def lr_text(lr: float) -> str:
    return "-" if math.isnan(lr) else f"{lr:.2g}"


def fmt(x: float, signed: bool = False, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{'+' if signed else ''}.{digits}f}"


def _window(series: dict, lo: int, hi: int | None = None) -> float | None:
    """Mean of `series` over steps lo..hi, or over its last 5 steps (hi None)."""
    keys = sorted(series)
    chosen = keys[-5:] if hi is None else [k for k in keys if lo <= k <= hi]
    return statistics.mean(series[k] for k in chosen) if chosen else None


def render_lr_check(rows: list[dict], best: dict[str, dict] | None = None) -> list[str]:
    best = best or {}
    if not rows:
        return []
    lines = ["", "## Is each arm at its best lr? (the lr check)", "",
             "Each checked arm also runs at other multiples of its lr, 40 steps, on the first seeds; differences are "
             "per seed, to the arm at the design's lr. The design's L should be GRPO's best mean on the large set "
             "here (the first round's L = 5e-4 came from a 10-step sweep on the demo's one-digit sums and lost here), "
             "and the SNR arms' eta_max theirs, checked against 2 L, the README's earlier \"about twice GRPO's lr\" "
             "(also from a 10-step sweep); 20 L / 3 = 1e-3 is the first round's eta_max, whose runs serve. An arm's "
             "best lr is the better mean, interval or not.", "",
             "| arm | lr multiple | lr | seeds | "
             + " | ".join(f"{TITLES[m]} % | minus own lr (pts) [95% CI]" for m in METRICS) + " |",
             "|---|---|---|---|" + "---|---|" * len(METRICS)]
    for r in rows:
        cells = []
        for label in METRICS:
            d = r[label]["diff"]
            ci = f" [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}], {d['verdict']}" if d and d["ci"] else \
                f", {d['verdict']}" if d else ""
            cells += [fmt(r[label]["mean"]), f"{fmt(d['mean'], True)}{ci}" if d else "(own lr)"]
        lines.append(f"| {r['arm']} | {r['multiple']:.3g}x | {r['lr']:.3g} | {r['greedy']['n']} | " + " | ".join(cells)
                     + " |")
    for r in best.values():
        lines += ["", f"{r['arm']}'s best lr on {TITLES[PRIMARY]} over the check's seeds: {r['lr']:.3g} "
                  f"({r['multiple']:.3g}x, {r[PRIMARY]['mean']:.1f}%)" + (", the design's lr." if r["multiple"] == 1.0
                                                                           else ".")]
    warning = lr_check_warning(best)
    return lines + (["", warning] if warning else [])


def render_round(earlier: dict, grpo_lr: float) -> list[str]:
    """An earlier round of the design (every arm at its multiple of an earlier L; `earlier`: lr, arms, contrasts,
    against), kept beside the current one: each arm's powered measurement, each contrast's per-seed differences on
    it, and each arm against GRPO at the design's `grpo_lr`."""
    lines = ["", f"## An earlier round: L = {earlier['lr']:.3g}", "",
             f"The same design with GRPO's lr L = {earlier['lr']:.3g} (every arm at its multiple of it), run before "
             f"the lr check put GRPO's best lr on this task at {grpo_lr:.3g}. Kept: it is what a user who took GRPO's "
             "lr from an easier task would run, and its same-lr contrasts hold at that lr. Its missing seeds are not run.",
             "", f"| arm | lr (eta_max) | seeds | {TITLES[PRIMARY]} % |", "|---|---|---|---|"]
    lines += [f"| {r['arm']} | {r['lr']:.3g} | {r[PRIMARY]['n']} | {fmt(r[PRIMARY]['mean'])} +- "
              f"{fmt(r[PRIMARY]['sd'])} |" for r in earlier["arms"]]
    for title, rows in (("", earlier["contrasts"]),
                        (f"Each arm of this round against GRPO at the design's L = {grpo_lr:.3g}, its best lr on this "
                         "task (same seeds; that lr was picked on the lr check's seeds, which favours GRPO a little):",
                         earlier["against"])):
        lines += ["", title] if title else []
        lines += ["", f"| contrast | seeds | per-seed differences (pts) | {TITLES[PRIMARY]}: pts [95% CI] | verdict |",
                  "|---|---|---|---|---|"]
        for c in rows:
            d = c[PRIMARY]
            ci = f" [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]" if d["ci"] else ""
            lines.append(f"| {c['name']} | {d['n']} | {', '.join(f'{x:+.1f}' for x in d['diffs'])} | "
                         f"{fmt(d['mean'], True)}{ci} | {d['verdict']} |")
    return lines + ["", f"Plot: `results/{earlier['plot']}`."]


def render_long(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## The step size over a long run", "", "Does OBLR-PO's step shrink into a stall? Each long run at "
             "its arm's lr, evaluated along the way; lr scale and reward are means over the 10 steps up to the "
             "evaluation (plot: `results/ablation_long.png`).", ""]
    lines += [f"- {sentence}" for sentence in long_summary(rows)]
    lines += ["", "| arm | seed | step | lr scale | applied lr | reward | greedy (100) % | sampled (100) % |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        applied = r["lr"] * (r["lr_scale"] if r["lr_scale"] is not None else 1.0)
        lines.append(f"| {r['arm']} | {r['seed']} | {r['step']} | {fmt(r['lr_scale'], digits=3)} | {applied:.2g} | "
                     f"{fmt(r['reward'], digits=3)} | {fmt(r['greedy'])} | {fmt(r['sampled'])} |")
    return lines


def render(arms: list[dict], contrasts: list[dict], stab: list[dict], curves: dict, header: list[str],
           missing: list[str], before: dict, delta: float, lr_check: list[dict] = (), long_rows: list[dict] = (),
           lr_best: dict[str, dict] | None = None, rounds: list[str] = ()) -> str:
    lines = header + ["", "Before RL (seed mean; the 100 problems are the same for every seed): "
                      + ", ".join(f"{TITLES[m]} {fmt(before[m])}%" for m in METRICS) + ".", "",
                      "## Held-out accuracy after RL, per arm", "",
                      "| arm | lr (eta_max) | " + " | ".join(f"{TITLES[m]}: seeds | %" for m in METRICS)
                      + " | mean applied lr | s/step (median) | peak RSS (GB) |",
                      "|---|---|" + "---|---|" * len(METRICS) + "---|---|---|"]
    for r in arms:
        lines.append(f"| {r['arm']} | {r['lr']:.3g} | " + " | ".join(
            f"{r[m]['n']} | {fmt(r[m]['mean'])} +- {fmt(r[m]['sd'])}" for m in METRICS)
            + f" | {'-' if math.isnan(r['mean_applied_lr']) else format(r['mean_applied_lr'], '.2g')} "
            f"| {fmt(r['seconds_per_step'], digits=0)} | {fmt(r['peak_rss_gb'])} |")
    lines += ["", "## Paired differences (same seed: same problems, same order)", "",
              "| contrast | " + " | ".join(f"{TITLES[m]}: seeds | pts [95% CI] | verdict | power" for m in METRICS)
              + " |", "|---|" + "---|---|---|---|" * len(METRICS)]
    for c in contrasts:
        cells = []
        for label in METRICS:
            d = c[label]
            ci = f" [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]" if d["ci"] else ""
            cells += [str(d["n"]), f"{fmt(d['mean'], True)}{ci}", d["verdict"],
                      f"{d['power']:.0%}" if "power" in d else "-"]
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    lines += ["", f"Power: of a two-sided paired t-test at the 5% level to detect a true difference of {delta:g} points, "
              "at the observed spread of the per-seed differences and the seeds run ('verdict' is whether the 95% "
              "interval excludes 0). Per-seed differences (greedy, large set; 100 problems where no large set "
              "yet):", ""]
    for c in contrasts:
        d = c[PRIMARY] if c[PRIMARY]["n"] else c["greedy"]
        if d["n"]:
            need, se = d.get("seeds_for_80"), d.get("measurement_se")
            lines.append(f"- {c['name']}: {', '.join(f'{x:+.1f}' for x in d['diffs'])} (seeds "
                         f"{','.join(map(str, d['seeds']))}" + (", large set" if d is c[PRIMARY] else ", 100 problems")
                         + ")" + (f"; of each, +-{se:.1f} pts is measurement (problem-level standard error)"
                                  if se is not None else "")
                         + (f"; 80% power at this spread needs {need} seeds" if need else ""))
    lines += ["", "## The step size over the run", "",
              "| arm | seeds | lr scale, steps 1-5 | steps 16-20 | last 5 | steps skipped (scale 0), mean | reward, "
              "steps 1-5 | last 5 | greedy % at each evaluation |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, c in curves.items():
        scale = [fmt(_window(c["lr_scale"], 1, 5), digits=3), fmt(_window(c["lr_scale"], 16, 20), digits=3),
                 fmt(_window(c["lr_scale"], 0), digits=3)] if c["lr_scale"] else ["1 (no SNR step)", "", ""]
        greedy = ", ".join(f"{s}: {v:.1f}" for s, v in c["greedy"].items())
        lines.append(f"| {arm} | {c['seeds']} | " + " | ".join(scale) + f" | {fmt(c['skipped'])} "
                     f"| {fmt(_window(c['reward'], 1, 5), digits=3)} "
                     f"| {fmt(_window(c['reward'], 0), digits=3)} | {greedy} |")
    lines += render_lr_check(list(lr_check), lr_best)
    lines += list(rounds)
    lines += render_long(list(long_rows))
    multiples = list(dict.fromkeys(r["multiple"] for r in stab if r["multiple"] != 1.0))
    lines += ["", "## Stability window", "", "Each arm at its lr and at "
              + " and ".join(f"{m:.3g}x" for m in multiples) + " it, compared on greedy held-out accuracy at the "
              "stability runs' last step. A cell whose lr a 40-step run already ran (the 1x runs; the earlier round's "
              "at 3.33x) is that run's evaluation at that step: with a constant lr and the seed's problems in the "
              "same order, its first steps are the shorter run's. The SNR arms' multiples are of eta_max; the lr "
              "a run applied (eta_max x its SNR factor; the constant lr for the others) is given over the same steps, "
              "as the mean over the cell's runs of each run's mean and as the largest single step's.", "",
              "| arm | lr multiple | lr (eta_max) | seeds | greedy % (mean, min) | change from its own lr (pts) | "
              "collapsed | applied lr, mean | applied lr, largest step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in stab:
        if not r["n"]:
            lines.append(f"| {r['arm']} | {r['multiple']:.3g}x | {r['lr']:.3g} | 0 | not run yet | | | | |")
            continue
        lines.append(f"| {r['arm']} | {r['multiple']:.3g}x | {r['lr']:.3g} | {r['n']} | {fmt(r['mean'])} "
                     f"({fmt(r['min'])}) "
                     f"| {fmt(r['change'], True)} | {len(r['collapsed'])}/{r['n']} | {lr_text(r['applied'])} "
                     f"| {lr_text(r['applied_max'])} |")
    if missing:
        lines += ["", "Not finished when this table was made: " + "; ".join(missing) + "."]
    lines.append("")
    return "\n".join(lines)


POWER_GOAL = 0.8  # a contrast is "powered" when its paired t-test would detect delta points this often
BASELINE_CONTRAST = CONTRASTS[5][0]  # the gradient-weighted baseline against RLOO's, same lr, no SNR step
INGREDIENTS = [name for name, _, _ in CONTRASTS[5:]]  # each half alone, the rest held fixed


def difference_text(d: dict, delta: float) -> str:
    """A paired difference with 3+ seeds as prose: "+1.3 pts [-6.9, +9.5], <verdict> (power 32% for 5 pts)"."""
    return (f"{d['mean']:+.1f} pts [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}], {d['verdict']}"
            + (f" (power {d['power']:.0%} for {delta:g} pts)" if "power" in d else ""))


def render_baseline(contrasts: list[dict], planned_seeds: int, delta: float, earlier: list[dict] = ()) -> str:
    """The README's word, beside the variance table, on what the default baseline does in training (the ablation's
    baseline-only - RLOO contrast on the powered measurement), at the design's lr and at each earlier round's."""
    rounds = [(next(c for c in cs if c["name"] == BASELINE_CONTRAST), planned, tag) for cs, planned, tag in
              [(contrasts, f" of {planned_seeds} planned", ""),
               *((e["contrasts"], "", " (the earlier round, GRPO's lr off its best)") for e in earlier)]]
    said = []
    for c, planned, tag in rounds:
        d = c[PRIMARY]
        said.append(f"at lr {c['lr_a']:.3g}{tag}, " + (
            f"{d['n']}{planned} seeds, no verdict yet" if d["ci"] is None
            else f"over {d['n']}{planned} seeds, {difference_text(d, delta)}"))
    text = ("**In training** (the paired ablation, \"When to use OBLR-PO\" above: baseline-only against RLOO at the "
            f"same lr, no SNR step, {TITLES[PRIMARY]}): " + "; ".join(said) + ".")
    found = [(c, d) for c, _, _ in rounds if (d := c[PRIMARY])["ci"] is not None
             and (d["verdict"] in ("worse", "better") or d.get("power", 0.0) >= POWER_GOAL)]
    if found:  # each lr's verdict in words, where it is one: worse, better, or a tie powered to see delta points
        words = [(f"learns {d['verdict']} than RLOO's plain leave-one-out mean" if d["verdict"] in ("worse", "better")
                 else f"learns neither better nor worse than RLOO's plain leave-one-out mean (power {d['power']:.0%} to "
                      f"detect {delta:g} pts)") + f" at lr {c['lr_a']:.3g}" for c, d in found]
        text += (" **So far, on this task, the default gradient-weighted baseline " + "; it ".join(words)
                 + ". Its gradient variance at fixed parameters ties RLOO's (above).**")
    worse = [d for _, d in found if d["verdict"] == "worse"]
    design, rloo = rounds[0][0][PRIMARY], "`baseline=\"mean\"` (leave-one-out by default) trains with RLOO's baseline"
    if worse:
        weak = " (a verdict at this power can still move)" if any(d.get("power", 0.0) < POWER_GOAL for d in worse) else ""
        if design["n"] < planned_seeds:
            text += f" The default stays until the planned seeds are in{weak}; {rloo}, with or without the SNR step."
        elif design["verdict"] == "worse":
            text += (" **With the planned seeds in, it learned worse at GRPO's best lr: set `baseline=\"mean\"`.** "
                     f"{rloo[0].upper()}{rloo[1:]}, with or without the SNR step.")
        else:
            text += (" The default stays: with the planned seeds in, it did not learn worse at GRPO's best lr, the lr a "
                     f"GRPO user has tuned. Where it did{weak}, {rloo}, with or without the SNR step.")
    return "# The baseline in training\n\n" + text + "\n"


def said_line(c: dict, delta: float, labels=None) -> str:
    """A contrast as a README bullet: per metric (the powered measurement first) its paired difference or verdict."""
    parts = []
    for label in labels or [PRIMARY, *(m for m in METRICS if m != PRIMARY)]:
        d = c[label]
        parts.append(f"{TITLES[label]}: {d['verdict']}" if d["ci"] is None
                     else f"{TITLES[label]} {difference_text(d, delta)}")
    return f"- **{c['name']}** over {c[PRIMARY]['n']} seeds: " + "; ".join(parts) + "."


def render_earlier(earlier: dict, grpo_lr: float, delta: float) -> list[str]:
    """"When to use"'s word on an earlier round with 3 or more seeds: its same-lr contrasts, and each of its arms
    against GRPO at its best lr on this task (the powered measurement only)."""
    if max((c[PRIMARY]["n"] for c in earlier["contrasts"]), default=0) < 3:
        return []
    lines = [f"**The earlier round** (every arm at its multiple of L = {earlier['lr']:.3g}, GRPO's best lr on the "
             f"demo's easier task and {earlier['lr'] / grpo_lr:.3g}x its best on this one; `ablation.md`, \"An earlier "
             "round\"). What each half does at that lr:", ""]
    lines += [said_line(c, delta, [PRIMARY]) for c in earlier["contrasts"] if c["name"] in INGREDIENTS]
    lines += ["", f"Its arms against GRPO at its best lr on this task ({grpo_lr:.3g}), same seeds (that lr was picked "
              "on these seeds, which favours GRPO a little):", ""]
    lines += [said_line(c, delta, [PRIMARY]) for c in earlier["against"]]
    return lines + [""]


def render_tolerance(stab: list[dict], steps: int, collapse_pts: float, planned_seeds: int) -> str:
    """The README's word on a too-large lr, from the stability window: per arm, the collapses at each multiple of its
    lr and the lr it applied there; then, across arms, the largest mean applied lr of a run that held and the
    smallest of one that collapsed (the SNR step's case: its arms apply a fraction of their eta_max)."""
    tried = [r for r in stab if r["n"] and r["multiple"] != 1.0]
    if not tried:
        return "not measured yet (no stability run finished)."
    per_arm = {}
    for r in tried:
        snr = r["arm"] in SNR_ARMS
        per_arm.setdefault(r["arm"], []).append(
            f"at {r['multiple']:.3g}x ({'eta_max ' if snr else ''}{r['lr']:.3g}"
            + (f", applied {lr_text(r['applied'])} on average, {lr_text(r['applied_max'])} at most" if snr else "")
            + f") {len(r['collapsed'])}/{r['n']} collapsed, {fmt(r['change'], True)} pts")
    text = (f"runs of {steps} steps at multiples of each arm's lr; a run collapses when its greedy held-out accuracy "
            f"ends more than {collapse_pts:g} points below the starting model's; the points are the cell's mean "
            f"change from the arm's own lr at step {steps}. "
            + "; ".join(f"{arm} {', '.join(cells)}" for arm, cells in per_arm.items()) + ".")
    runs = [(r, a) for r in tried for a in r.get("applied_per_run", [])]
    held = [(r, a) for r, a in runs if not a["collapsed"]]
    fell = [(r, a) for r, a in runs if a["collapsed"]]

    def which(r, a):
        return f"{lr_text(a['mean'])} on average ({r['arm']} at {r['multiple']:.3g}x, seed {a['seed']})"

    if held:
        text += " The largest lr a run applied and held: " + which(*max(held, key=lambda ra: ra[1]["mean"]))
        if fell:
            text += "; the smallest a run applied and collapsed: " + which(*min(fell, key=lambda ra: ra[1]["mean"]))
        text += "."
    short = [f"{r['arm']} {r['multiple']:.3g}x" for r in stab if r["multiple"] != 1.0 and r["n"] < planned_seeds]
    if short:
        text += f" Fewer than {planned_seeds} seeds so far: {', '.join(short)}."
    return text


def render_when(arms: list[dict], contrasts: list[dict], planned_seeds: int, delta: float, before: dict,
                long_rows: list[dict] = (), lr_warning: str | None = None, earlier: list[dict] = (),
                eta_note: str | None = None, stab: list[dict] = (), stab_steps: int = 20, collapse_pts: float = 10.0,
                stab_seeds: int = 3) -> str:
    """The README's "When to use OBLR-PO", written from the tables: what each half buys, what it costs, where it
    loses, and how far the evidence goes (at the design's lr, then in each earlier round)."""
    by_name = {c["name"]: c for c in contrasts}
    grpo_lr = next((r["lr"] for r in arms if r["arm"] == REFERENCE), None)

    n = max((c[PRIMARY]["n"] for c in contrasts), default=0)
    best_planned = max((c.get("planned", planned_seeds) for c in contrasts if c[PRIMARY]["n"] == n),
                       default=planned_seeds)
    judged = [c for c in contrasts if c[PRIMARY]["n"] >= 3]  # a verdict needs 3 paired seeds
    powered = [c for c in judged if c[PRIMARY].get("power", 0.0) >= POWER_GOAL]
    complete = bool(contrasts) and all(c[PRIMARY]["n"] >= planned_seeds for c in contrasts)
    waiting = [f"{c['name']}: {c[PRIMARY]['n']} of {c['planned']}" for c in contrasts
               if c[PRIMARY]["n"] < c.get("planned", planned_seeds)]  # short of the seeds added for power
    extra = [c for c in contrasts if c.get("planned", planned_seeds) > planned_seeds]  # served by the power seeds
    more = sorted({c["planned"] for c in extra})
    lines = ["# When to use OBLR-PO", "",
             f"From the paired ablation on SmolLM2-135M-Instruct (`benchmarks/results/ablation.md`), with GRPO at its "
             f"best lr on this task{f' ({grpo_lr:.3g})' if grpo_lr else ''} and every arm at its multiple of it: on "
             f"the powered measurement ({TITLES[PRIMARY]}) "
             + (f"every contrast has its {planned_seeds} planned seeds"
                + (f" ({'/'.join(map(str, more))} for {', '.join(c['name'] for c in extra)}, the seeds added for power"
                   + (f"; not all in yet: {', '.join(waiting)}" if waiting else "") + ")" if more else "")
                + "." if complete
                else f"the best-paired contrast has {n} of its {best_planned} planned seeds so far; {len(judged)} of "
                     f"the {len(contrasts)} contrasts {'has' if len(judged) == 1 else 'have'} the 3 seeds a verdict "
                     "needs.")]
    if n < 3:
        lines[-1] += " **Too few seeds for any verdict yet: what follows is what the runs show, not a recommendation.**"
    elif complete and len(powered) < len(contrasts):
        weak = ", ".join(f"{c['name']}: {c[PRIMARY].get('power', 0.0):.0%}" for c in contrasts if c not in powered)
        lines[-1] += (f" **{'So far' if waiting else 'With the planned seeds in'}, {len(powered)} of the "
                      f"{len(contrasts)} contrasts "
                      f"{'reaches' if len(powered) == 1 else 'reach'} {POWER_GOAL:.0%} power "
                      f"to detect {delta:g} points; for the other {len(contrasts) - len(powered)} ({weak}), \"no "
                      "difference detected\" is not evidence of no difference.**")
    elif complete and not waiting:  # every contrast powered
        wide = ", ".join(f"{c['name']}: [{c[PRIMARY]['ci'][0]:+.1f}, {c[PRIMARY]['ci'][1]:+.1f}]" for c in contrasts
                         if c[PRIMARY]["ci"] and max(-c[PRIMARY]["ci"][0], c[PRIMARY]["ci"][1]) >= delta)
        lines[-1] += (f" **With the planned seeds in, all {len(contrasts)} contrasts reach {POWER_GOAL:.0%} power to "
                      f"detect {delta:g} points at their observed spread** (a power estimated from the same runs)"
                      + (f"; where a 95% interval still reaches {delta:g} points ({wide}), a difference that large is "
                         "not ruled out." if wide else f"; every 95% interval lies within {delta:g} points of 0."))
    elif len(powered) < len(contrasts):
        best = max(c[PRIMARY].get("power", 0.0) for c in judged)
        lines[-1] += (f" **Not powered yet: {len(powered)} of the {len(contrasts)} contrasts reach {POWER_GOAL:.0%} "
                      f"power to detect {delta:g} points (the best {best:.0%}). \"No difference detected\" below is not evidence of no "
                      "difference, and nothing here is a recommendation yet.**")
    intervals = sum(c[m]["ci"] is not None for c in contrasts for m in METRICS) + sum(  # and render_earlier's
        c[PRIMARY]["ci"] is not None for e in earlier
        for c in [*(c for c in e["contrasts"] if c["name"] in INGREDIENTS), *e["against"]])
    if intervals:
        lines[-1] += (f" Each interval is a 95% one with no correction for multiplicity: of the {intervals} drawn here, "
                      f"about {intervals / 20:.1f} would exclude 0 by chance alone where no difference exists.")
    for note in (lr_warning, eta_note):
        lines += ["", note] if note else []
    lines.append("")
    if n >= 3:
        lines += ["What each half does, the rest held fixed (held-out accuracy after the run, per-seed differences):",
                  ""]
        lines += [said_line(by_name[name], delta) for name in INGREDIENTS if name in by_name]
        lines += ["", "Against GRPO at its best lr:", ""]
        lines += [said_line(by_name[name], delta) for name, _, _ in CONTRASTS[:5] if name in by_name]
        lines.append("")
    for e in earlier:
        lines += render_earlier(e, grpo_lr, delta)
    lines += ["Finished so far (held-out accuracy after the run, mean over its seeds; the starting model: "
              + ", ".join(f"{TITLES[m]} {fmt(before[m])}%" for m in METRICS) + "):", ""]
    lines += [f"- {r['arm']}: " + ", ".join(f"{TITLES[m]} {fmt(r[m]['mean'])}% ({r[m]['n']} seed"
                                             f"{'s' * (r[m]['n'] != 1)})" for m in METRICS if r[m]["n"])
              for r in arms if any(r[m]["n"] for m in METRICS)]
    worse = [f"{c['name']} ({', '.join(TITLES[m] for m in METRICS if c[m]['verdict'] == 'worse')})"
             for c in contrasts if any(c[m]["verdict"] == "worse" for m in METRICS)]
    worse += [f"{c['name']} (the earlier round at L = {e['lr']:.3g}, {TITLES[PRIMARY]})"
              for e in earlier for c in [*e["contrasts"], *e["against"]] if c[PRIMARY]["verdict"] == "worse"]
    if worse:
        loses = "; ".join(worse)
    elif not judged:
        loses = "not known yet (fewer than 3 paired seeds)"
    else:
        loses = (("the one contrast" if len(judged) == 1 else f"none of the {len(judged)} contrasts")
                 + " with 3 or more seeds is " + ("not " if len(judged) == 1 else "") + "detected worse than its "
                 "reference"
                 + ("" if len(powered) == len(judged) else " (underpowered: see above)")
                 + (f"; {len(contrasts) - len(judged)} have too few seeds to tell" if len(judged) < len(contrasts)
                    else ""))
    costs = [f"{r['arm']} {r['seconds_per_step']:.0f} s ({r['seconds_per_step_range'][0]:.0f}-"
             f"{r['seconds_per_step_range'][1]:.0f})" + (f" and {r['peak_rss_gb']:.1f} GB" if not
                                                         math.isnan(r["peak_rss_gb"]) else "")
             for r in arms if not math.isnan(r["seconds_per_step"])]
    lines += ["", "**Cost** (median s/step of the ablation's runs on this 2-core CPU, evaluations included, with its "
              "range over the runs, and peak memory): " + (", ".join(costs) if costs else "not measured yet")
              + ". No ratio is given here: the runs shared the machine differently (GRPO's and RLOO's whole-batch "
              "runs of the earlier round alone, for their memory; every other run two at a time, some beside a third "
              "job, which the range shows); `benchmarks/results/step_cost.md` measures OBLR-PO's step against GRPO's "
              "in one process.",
              "", "**Where it loses**: " + loses + "."]
    lines += ["", "**A too-large lr** (the stability window): " + render_tolerance(list(stab), stab_steps, collapse_pts,
                                                                                  stab_seeds)]
    sentences = long_summary(list(long_rows))
    lines += ["", "**Over a long run** (does the shrinking step stall?): " + (" ".join(sentences) if sentences else
                                                                             "no long run finished yet.")]
    return "\n".join(lines) + "\n"


def plot(curves: dict, contrasts: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.4), layout="constrained")
    axes = fig.subplots(1, 4)
    palette = dict(zip(ARMS, ("tab:red", "tab:gray", "tab:green", "tab:orange", "tab:blue", "tab:purple")))
    for arm, c in curves.items():
        if c["lr_scale"]:
            axes[0].plot(list(c["lr_scale"]), list(c["lr_scale"].values()), color=palette[arm], label=arm)
        axes[1].plot(list(c["reward"]), list(c["reward"].values()), color=palette[arm], label=arm)
        axes[2].plot(list(c["greedy"]), list(c["greedy"].values()), marker="o", color=palette[arm], label=arm)
    axes[0].set(xlabel="optimizer step", ylabel="lr scale (SNR factor), seed mean", title="step size")
    axes[1].set(xlabel="optimizer step", ylabel="training reward, seed mean", title="reward")
    axes[2].set(xlabel="optimizer step", ylabel="held-out greedy accuracy (%), seed mean", title="held-out")
    metric = PRIMARY if any(c[PRIMARY]["n"] for c in contrasts) else "greedy"
    shown = [c for c in contrasts if c[metric]["n"]]
    for i, c in enumerate(shown):
        d = c[metric]
        axes[3].scatter(d["diffs"], [i] * len(d["diffs"]), color=palette[c["a"]], alpha=0.6)
        if d["ci"]:
            axes[3].errorbar([d["mean"]], [i], xerr=[[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]],
                             color="black", capsize=4, marker="|")
    axes[3].axvline(0, color="gray", linestyle="--")
    axes[3].set_yticks(range(len(shown)), [f"{c['a']} ({c['lr_a']:.2g}) - {c['b']} ({c['lr_b']:.2g})" for c in shown],
                       fontsize=7)
    axes[3].set(xlabel=f"{TITLES[metric]} difference, same seed (pts)", title="paired differences, 95% CI")
    for ax in axes[:3]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[3].grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def plot_long(runs: list[dict], path: Path, title: str) -> None:
    """The long runs: applied lr, training reward (10-step running mean) and held-out accuracy against the step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    palette = dict(zip(ARMS, ("tab:red", "tab:gray", "tab:green", "tab:orange", "tab:blue", "tab:purple")))
    for r in sorted(runs, key=lambda r: (r["seed"], r["arm"])):
        label, color = f"{r['arm']} seed {r['seed']}", palette[r["arm"]]
        steps = [e["step"] for e in r["history"]]
        applied = [r["lr"] * (e.get("oblr/lr_scale") if e.get("oblr/lr_scale") is not None else 1.0)
                   for e in r["history"]]
        reward = [e.get("reward") or 0.0 for e in r["history"]]
        smooth = [statistics.mean(reward[max(0, i - 9):i + 1]) for i in range(len(reward))]
        axes[0].plot(steps, applied, color=color, label=label)
        axes[1].plot(steps, smooth, color=color, label=label)
        curve = r.get("curve", [])
        axes[2].plot([c["step"] for c in curve], [100 * c["accuracy"] for c in curve], marker="o", color=color,
                     label=f"{label}, greedy")
        axes[2].plot([c["step"] for c in curve], [100 * c["sampled_accuracy"] for c in curve], marker="x",
                     linestyle="--", color=color, label=f"{label}, sampled")
    axes[0].set(xlabel="optimizer step", ylabel="applied lr (eta_max x SNR factor)", yscale="log", title="step size")
    axes[1].set(xlabel="optimizer step", ylabel="training reward (10-step running mean)", title="reward")
    axes[2].set(xlabel="optimizer step", ylabel="held-out accuracy, 100 problems (%)", title="held-out")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    """The runner's options; their defaults are the design (the arms, L, eta_max, the seeds, the checks)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--grpo_lr", type=float, default=1.5e-4,
                        help="GRPO's best lr on this task: the best mean on the large set of the lr check (the "
                             "tables warn when another lr of the check beats it)")
    parser.add_argument("--eta_multiple", type=float, default=20 / 3,
                        help="the SNR arms' eta_max as a multiple of L (20/3: 1e-3, the lr check's pick on every SNR "
                             "arm over 2, the README's earlier advice 'about twice GRPO's lr'); checked by the lr "
                             "check (--eta_check_multiples)")
    parser.add_argument("--earlier_grpo_lr", type=float, nargs="*", default=[5e-4],
                        help="earlier rounds' L, tabulated in their own section (never run again)")
    parser.add_argument("--earlier_eta_multiple", type=float, nargs="*", default=[2.0],
                        help="each earlier round's --eta_multiple, one per --earlier_grpo_lr")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--lr_check_arms", nargs="*", default=[REFERENCE, *SNR_ARMS], choices=list(ARMS),
                        help="arms also run at other multiples of their lr (is L, or eta_max, their best lr here?)")
    parser.add_argument("--lr_check_multiples", type=float, nargs="*", default=[1 / 3, 10 / 3],
                        help="the lr check's multiples of L, for the checked arms without an SNR step")
    parser.add_argument("--eta_check_multiples", type=float, nargs="*", default=[0.3],
                        help="the lr check's multiples of eta_max, for the checked SNR arms (0.3 of 20 L / 3: 2 L = "
                             "3e-4, the README's earlier advice)")
    parser.add_argument("--lr_check_seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--lr_check_first", action="store_true",
                        help="launch the lr check before the ablation's runs (while it decides L)")
    parser.add_argument("--long_arms", nargs="*", default=["OBLR-PO", REFERENCE], choices=list(ARMS),
                        help="arms also run for --long_steps (does the shrinking SNR step stall a long run?)")
    parser.add_argument("--long_steps", type=int, default=120)
    parser.add_argument("--long_seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--long_eval_every", type=int, default=20)
    parser.add_argument("--long_first", action="store_true",
                        help="launch the long runs before the rest (at a session's start, with --finish_by)")
    parser.add_argument("--stability_multiples", type=float, nargs="*", default=[10 / 3, 10.0],
                        help="multiples of each arm's lr (10/3: the earlier round's lrs, whose runs serve)")
    parser.add_argument("--stability_seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--stability_steps", type=int, default=20,
                        help="steps of the stability runs (a collapse shows within them; half the ablation's cost)")
    parser.add_argument("--collapse_pts", type=float, default=10.0)
    parser.add_argument("--power_seeds", type=int, nargs="*", default=[5],
                        help="seeds run beyond --seeds for --power_arms only (full length, at their lr): "
                             + POWER_SEEDS_WHY)
    parser.add_argument("--power_arms", nargs="*", default=["GRPO", "SNR-only", "OBLR-PO"], choices=list(ARMS),
                        help="the arms of the contrasts that --power_seeds serve")
    parser.add_argument("--window_arms", nargs="*", default=WINDOW_ARMS, choices=list(ARMS),
                        help="arms of the lr window (issue 49; benchmarks/lr_window.py tabulates it)")
    parser.add_argument("--window_seeds", type=int, nargs="*", default=[],
                        help="seeds of the lr window's cells (WINDOW_MULTIPLES of each arm's lr; 0 1 2 to run it; "
                             "none by default, so that the ablation's tables do not list its cells as missing)")
    parser.add_argument("--window_steps", type=int, default=20, help="steps of the lr window's runs")
    parser.add_argument("--first_arms", nargs="*", default=[], choices=list(ARMS),
                        help="arms whose training runs launch before the others' (e.g. the SNR arms' stability "
                             "cells, while a default waits on them); the tables are unchanged")
    parser.add_argument("--delta", type=float, default=5.0, help="the difference (points) the power is stated for")
    parser.add_argument("--parallel", type=int, default=2, help="real-model runs at a time on this machine")
    parser.add_argument("--min_free_gb", type=float, default=6.0)
    parser.add_argument("--margin_gb", type=float, default=1.0,
                        help="memory left free beside the expected peaks of the jobs running (PEAK_GB)")
    parser.add_argument("--stop_launching", default=None, help="HH:MM UTC after which no run is launched")
    parser.add_argument("--finish_by", default=None,
                        help="HH:MM UTC by which every run launched should have ended (the machine's session end): a "
                             "training run launches only if expected to end by then (MINUTES_PER_STEP, EVAL_MINUTES); "
                             "shorter runs further down the list may go instead")
    parser.add_argument("--poll_s", type=float, default=30)
    parser.add_argument("--run_dir", type=Path, default=Path("outputs/ablation"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ablation")
    parser.add_argument("--records", type=Path, default=RECORDS,
                        help="where each finished run's record is kept (committed; the tables are made from these)")
    parser.add_argument("--large_size", type=int, default=500,
                        help="distinct unseen held-out problems of each run's large evaluation (large_eval.py)")
    parser.add_argument("--no_run", action="store_true", help="only record and tabulate the runs that finished")
    parser.add_argument("demo_args", nargs="*", help="extra arguments for examples/demo.py (after --)")
    return parser


def main():
    args = build_parser().parse_args()
    check_args(args)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    state_path = args.run_dir / "runner.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else dict(log=[])

    def log(message):
        line = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC {message}"
        print(line, flush=True)
        state["log"].append(line)
        state_path.write_text(json.dumps(state, indent=1))

    if not args.no_run:
        log(f"start: {len(jobs(args))} runs; {uptime()}")
        run_all(args, log)
        log(f"end; {uptime()}")
    tabulate(args, state["log"])


def check_args(args) -> None:
    """Refuse options that do not fit together, before anything runs."""
    if len(args.earlier_eta_multiple) != len(args.earlier_grpo_lr):
        raise SystemExit(f"--earlier_eta_multiple needs one value per --earlier_grpo_lr ({len(args.earlier_grpo_lr)}), "
                         f"got {len(args.earlier_eta_multiple)}: {args.earlier_eta_multiple}")


def merged_log(saved: Path, runner_log: list[str]) -> list[str]:
    """The runner's log kept in the tables' json (`saved`) followed by this machine's lines not yet in it: the log
    outlives a lost --run_dir, as the records do."""
    kept = json.loads(saved.read_text()).get("runner_log", []) if saved.exists() else []
    seen = set(kept)
    return kept + [line for line in runner_log if line not in seen]


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
    stamps = sorted(r["finished"] for r in all_runs)
    checked_snr = [a for a in SNR_ARMS if a in args.lr_check_arms and a in args.arms]
    eta_status = ("not checked" if not checked_snr else "see the lr check below" if any(
        lr_best.get(a, {}).get("multiple") != 1.0 for a in checked_snr) else "their best in the lr check below")
    header = [
        "# Which half of OBLR-PO helps? A paired ablation on SmolLM2-135M-Instruct",
        "",
        f"Generated by `python benchmarks/ablation.py --no_run` from {len(all_runs)} finished runs recorded in "
        f"`{args.records.relative_to(HERE.parent) if args.records.is_relative_to(HERE.parent) else args.records}` "
        f"(finished {stamps[0] if stamps else '?'} .. {stamps[-1] if stamps else '?'}; a 2-core CPU, 1 or 2 runs at "
        f"a time with 1 torch thread each, sharing it with other jobs). Every run: `examples/demo.py --model smollm2 "
        f"{' '.join(TASK_ARGS)}` (chain_sum with one- or two-digit terms, LoRA r=16, 8 prompts x 8 completions per "
        f"step, constant lr), {args.max_steps} steps, held-out accuracy (exact answers; 100 problems; greedy, and 4 "
        f"samples each at T=1) every {args.eval_every} steps. GRPO's lr L = {args.grpo_lr:g} ("
        + ("its best on this task in the lr check below" if lr_best.get(REFERENCE, {}).get("multiple") == 1.0 else
           "see the lr check below") + "); RLOO and the baseline alone run at L, the SNR arms at eta_max = "
        f"{args.eta_multiple:.3g} L = {args.eta_multiple * args.grpo_lr:.3g} ("
        + eta_status + f"). Planned: seeds {','.join(map(str, args.seeds))} per arm"
        + (f", and seed{'s' * (len(args.power_seeds) > 1)} {','.join(map(str, args.power_seeds))} of "
           f"{', '.join(a for a in args.power_arms if a in args.arms)} for power ({POWER_SEEDS_WHY}; a contrast "
           "between two of these arms takes every seed both ran, the others and the per-arm table and curves the "
           "seeds every arm ran)" if args.power_seeds and args.power_arms else "")
        + "; a seed fixes the problems and their order, so every difference is taken per seed. The task: the demo's "
        "one-digit sums start at 50% greedy and reach ~70% within 15 steps (no headroom over 40); sums with two-digit "
        "terms start at ~25% greedy, 6% sampled, and leave room for 40 steps. GRPO and RLOO, whose loss is TRL's "
        "whole-batch pass (13 GB of memory), "
        "go through the backward in micro-batches of 16 since 2026-11-26 (`--micro_batch 16`: the same update up to "
        "float rounding, tested on the tiny model; the record says `micro_batch`), so that they fit beside another "
        "arm: " + ", ".join(f"{sum(bool(r.get('micro_batch')) for r in all_runs if r['arm'] == arm)} of {arm}'s "
                            f"{sum(r['arm'] == arm for r in all_runs)} runs" for arm in ("GRPO", "RLOO")) + ".",
        "",
        f"**The powered measurement** is the last column group, *greedy (large set)*: after each run, "
        f"`large_eval.py` scores its adapter greedily on {args.large_size} distinct held-out problems, none of them "
        "among that seed's training problems, the same problems for every arm of a seed. On the runs' own 100 "
        "problems (which repeat questions) the difference of two arms carries ~4-5 points of measurement noise "
        "alone. Runs recorded before the large evaluation existed (their adapters lost with the machine) have no "
        "large-set score and are run again.",
    ]
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
