"""The paper's prompts per step in training: N = 128 prompts x G = 8 completions per step on the embedded tiny policy,
GRPO against OBLR-PO and its two halves, paired over seeds (``benchmarks/paper_n.md`` describes the study).

    python benchmarks/paper_n.py --pilot       # time one step of each pilot cell, write its record (skips recorded)
    python benchmarks/paper_n.py               # run the design's missing runs (resumable), then the tables
    python benchmarks/paper_n.py --no_run      # the tables from the records only
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from harness import RunnerLog, host, utc_now  # noqa: E402
from harness.grid import write_peak  # noqa: E402
from harness.memory import wait_peak_gb  # noqa: E402
from harness.procs import demo_command  # noqa: E402
from studies.ablation.design import ARMS, TASK_ARGS, run_dir_of  # noqa: E402
from studies.ablation.records import load_runs, record_path, sync_records  # noqa: E402
from studies.paper_n import (PAPER_ARMS, analyse, best_lr, cpu_hours, grid, pilot_of, render_pilot,  # noqa: E402
                              render_tables, when_text)

RESULTS = HERE / "results"
RECORDS = RESULTS / "paper_n_runs"
WORK = ROOT / "outputs" / "paper_n"
# name -> (model, arm, prompts N, steps, demo flags beyond the arm's): the pilot's cells. The tiny policy on the tiny
# demo's own task and held-out set; SmolLM2 on the ablation's task (its lrs were tuned there) in micro-batches of 32.
PILOTS = {
    "tiny_GRPO_N128": ("tiny", "GRPO", 128, 2, []),
    "tiny_OBLR-PO_N128": ("tiny", "OBLR-PO", 128, 2, []),
    "smollm2_OBLR-PO_N64": ("smollm2", "OBLR-PO", 64, 1, [*TASK_ARGS, "--micro_batch", "32"]),
}
GROUP = 8


def run_logged(cmd: list[str], env: dict, log_path: Path) -> tuple[int, float, float]:
    """Run `cmd` to its end, its output into `log_path`: (exit code, peak RSS in GB, CPU seconds)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return wait_peak_gb(proc.pid)


def pilot_argv(model: str, arm: str, prompts: int, steps: int, extra: list[str]) -> list[str]:
    """examples/demo.py's arguments of one pilot cell (beyond its seed and output folder)."""
    return ["--model", model, "--max_steps", str(steps), "--num_generations", str(GROUP),
            "--per_device_train_batch_size", str(prompts * GROUP), "--skip_before_eval", *arm_flags(arm), *extra]


def run_pilot(name: str, records: Path, work: Path) -> dict:
    """Run one pilot cell (examples/demo.py, 1 torch thread) and write its record: the demo's summary figures, the
    evaluation's seconds and the process's peak RSS (harness.memory.wait_peak_gb)."""
    model, arm, prompts, steps, extra = PILOTS[name]
    out = work / "pilot" / name
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = demo_command(0, out, pilot_argv(model, arm, prompts, steps, extra))
    code, peak_gb, cpu_s = run_logged(cmd, env, out / "log.txt")
    if code != 0:
        raise SystemExit(f"paper_n: pilot {name} failed; see {out / 'log.txt'}")
    summary = json.loads((out / "summary.json").read_text())
    train_s = summary["seconds_per_step"] * summary["steps"]
    record = dict(name=name, model=model, arm=arm, prompts=prompts, group_size=GROUP, steps=summary["steps"],
                  micro_batch=summary["micro_batch"], torch_threads=summary["torch_threads"],
                  seconds_per_step=summary["seconds_per_step"], model_seconds=summary["model_seconds"],
                  eval_seconds=round(summary["seconds"] - summary["model_seconds"] - train_s, 1),
                  seconds=summary["seconds"], peak_rss_gb=round(peak_gb, 2), cpu_seconds=round(cpu_s, 1),
                  mean_lr_scale=summary.get("mean_lr_scale"), num_eval=summary["num_eval"],
                  accuracy_after=summary["accuracy_after"], learning_rate=summary["learning_rate"],
                  command=shlex.join(["python", "examples/demo.py", *cmd[2:]]).replace(str(ROOT) + "/", ""),
                  host=host(), when=utc_now(minutes=True))
    (records / f"pilot_{name}.json").write_text(json.dumps(record, indent=1))
    return record


def pilot(args) -> None:
    args.records.mkdir(parents=True, exist_ok=True)
    for name in args.pilot_cells:
        if not (args.records / f"pilot_{name}.json").exists():
            t = time.time()
            print(f"pilot {name} ...", flush=True)
            run_pilot(name, args.records, args.work)
            print(f"pilot {name}: {time.time() - t:.0f}s", flush=True)
    found = [json.loads(p.read_text()) for n in PILOTS if (p := args.records / f"pilot_{n}.json").exists()]
    text = render_pilot(found, "python benchmarks/paper_n.py --pilot", utc_now(minutes=True))
    (args.out.parent / (args.out.name + "_pilot.md")).write_text(text)
    print(text)


# ------------------------------------------------------------------------------------------------ the design
def arm_flags(arm: str) -> list[str]:
    """The ablation's flags of an arm (``ARMS``) without its micro-batch: the tiny policy's step goes in one pass."""
    flags = list(ARMS[arm][0])
    if "--micro_batch" in flags:
        i = flags.index("--micro_batch")
        del flags[i : i + 2]
    return flags


def grids(args) -> dict[str, list[float]]:
    return {arm: grid(arm, args.grpo_lr, args.factor) for arm in args.arms}


def jobs(args, runs: list[dict]) -> list[tuple[str, float, int]]:
    """(arm, lr, seed) of every run in launch order, as far as the records decide it: per group of arms (GRPO and
    OBLR-PO first, the halves last) each arm's grid on ``--grid_seeds``, then, once an arm's grid is complete, its
    other ``--seeds`` at its best lr there, seed-major."""
    out, lrs = [], grids(args)
    for group in (args.arms[:2], args.arms[2:]):
        out += [(arm, lr, seed) for arm in group for seed in args.grid_seeds for lr in lrs[arm]]
        best = {arm: best_lr(runs, arm, lrs[arm], args.grid_seeds) for arm in group}
        out += [(arm, best[arm], seed) for seed in args.seeds if seed not in args.grid_seeds for arm in group
                if best[arm] is not None]
    return out


def demo_args(args, arm: str, lr: float) -> list[str]:
    return ["--model", "tiny", "--learning_rate", repr(lr), "--max_steps", str(args.steps), "--num_generations",
            str(GROUP), "--per_device_train_batch_size", str(args.prompts * GROUP), *arm_flags(arm), *args.demo_args]


def pending(args, failed: set) -> list[tuple[str, float, int, Path]]:
    runs = load_runs(args.records)
    todo = [(arm, lr, seed, run_dir_of(args.run_dir, arm, lr, seed)) for arm, lr, seed in jobs(args, runs)]
    return [job for job in todo if not record_path(args.records, job[3]).exists() and job[3] not in failed]


def run_one(args, arm: str, lr: float, seed: int, out: Path) -> int:
    """One training run (examples/demo.py, 1 torch thread), reusing a finished run's before-RL evaluation (the same
    warm model and held-out problems); its peak RSS (wait4) written beside its summary. Returns its exit code."""
    cmd, env = demo_command(seed, out, demo_args(args, arm, lr))
    before = sorted(args.run_dir.glob("*_lr*/seed*/before.json"))
    if before:
        cmd += ["--before_from", str(before[0])]
    out.mkdir(parents=True, exist_ok=True)
    code, peak_gb, cpu_s = run_logged(cmd, env, out / "log.txt")
    if code == 0:
        write_peak(out, peak_gb, 0, method="the run's process, at its end (wait4)", cpu_seconds=round(cpu_s, 1))
    return code


def run_all(args) -> None:
    """Run what `pending` lists, one at a time, recording each finished run; a run expected to end after
    ``--finish_by`` (``--minutes_per_run``) is not launched."""
    log, failed, expected_s = RunnerLog(args.run_dir), set(), 60 * args.minutes_per_run
    deadline = stop_time(args.finish_by)
    while todo := pending(args, failed):
        arm, lr, seed, out = todo[0]
        if deadline and time.time() + expected_s > deadline:
            log(f"stopping: {len(todo)} runs left, the next ({expected_s / 60:.0f} min, the longest run so far) would "
                f"not end by --finish_by {args.finish_by} UTC")
            return
        log(f"launched {arm} lr={lr:.3g} seed={seed}")
        start = time.time()
        code = run_one(args, arm, lr, seed, out)
        expected_s = max(expected_s, time.time() - start)
        if code:
            failed.add(out)
        log(f"finished {arm} lr={lr:.3g} seed={seed} rc={code}")
        for path in sync_records(args.run_dir, args.records):
            log(f"recorded {path.name}")


def stop_time(hhmm: str | None) -> float | None:
    from datetime import datetime, timezone

    from harness.procs import stop_deadline

    when = stop_deadline(hhmm, datetime.now(timezone.utc))
    return when.timestamp() if when else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pilot", action="store_true", help="run the pilot's missing cells and write its table")
    p.add_argument("--pilot_cells", nargs="+", default=list(PILOTS), choices=list(PILOTS))
    p.add_argument("--arms", nargs="+", default=PAPER_ARMS, choices=PAPER_ARMS,
                   help="the first two run (grid, then seeds) before the others")
    p.add_argument("--prompts", type=int, default=128, help="prompts per optimizer step (N)")
    p.add_argument("--steps", type=int, default=8,
                   help="optimizer steps per run (8: what fitted the CPU time at the pilot's step, benchmarks/paper_n.md)")
    p.add_argument("--grpo_lr", type=float, default=1e-4,
                   help="GRPO's best lr at N = 8 on the tiny policy (compare_5seeds.md: 1e-4 over 1e-3)")
    p.add_argument("--factor", type=float, default=None,
                   help="the SNR factor measured at N = --prompts (default: --factor_from's)")
    p.add_argument("--factor_from", type=Path, default=RESULTS / "prompts_per_step_tiny.json",
                   help="prompts_per_step.py's result on the tiny policy: its start checkpoint's factor at N")
    p.add_argument("--grid_seeds", type=int, nargs="+", default=[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--delta", type=float, default=3.0, help="the difference (points) the power is stated for")
    p.add_argument("--finish_by", default=None, help="HH:MM UTC by which every run launched should have ended")
    p.add_argument("--minutes_per_run", type=float, default=6.0, help="what --finish_by reckons a run takes")
    p.add_argument("--no_run", action="store_true", help="only record and tabulate the runs that finished")
    p.add_argument("--run_dir", type=Path, default=WORK / "runs")
    p.add_argument("demo_args", nargs="*", help="extra arguments for examples/demo.py (after --)")
    p.add_argument("--records", type=Path, default=RECORDS)
    p.add_argument("--work", type=Path, default=WORK)
    p.add_argument("--out", type=Path, default=RESULTS / "paper_n")
    return p


def measured_factor(path: Path, n: int) -> dict:
    """The SNR factor at N = `n` at the start of prompts_per_step.py's pool on the tiny policy (its result json): the
    factor at the pool's own SNR, every group once (the per-step estimate, every estimator's first step)."""
    if not path.exists():
        raise SystemExit(f"paper_n: {path} does not exist: run benchmarks/prompts_per_step.py --model tiny (see "
                         "benchmarks/paper_n.md) or pass --factor")
    result = json.loads(path.read_text())
    row = next(r for r in result["rows"]["start"] if r["n"] == n and not r["replace"])
    if row["factor_at_pool_snr"] > 0:
        return dict(factor=row["factor_at_pool_snr"], source=f"`{shown(path)}`, the factor at the pool's own SNR")
    # the pool's signal estimate is <= 0 (the step would not move): the default estimator's mean over its chains
    return dict(factor=row["default"]["factor"]["mean"],
                source=f"`{shown(path)}`, the default estimator's mean factor (the pool's own signal estimate is <= 0)")


def shown(path: Path) -> str:
    """A path as the tables show it: relative to the repository where it lies within."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def tabulate(args, command: str) -> None:
    sync_records(args.run_dir, args.records)
    runs = load_runs(args.records)
    pilots = [json.loads(p.read_text()) for p in sorted(args.records.glob("pilot_*.json"))]
    result = analyse(runs, args.arms, grids(args), args.grid_seeds, args.seeds, args.delta)
    done = {(r["arm"], r["lr"], r["seed"]) for r in runs}
    planned = len(args.arms) * (len(args.grid_seeds) * 3 + len(set(args.seeds) - set(args.grid_seeds)))
    design = dict(arms=args.arms, prompts=args.prompts, steps=args.steps)
    lines = ["# The paper's prompts per step in training: N = 128 on the embedded tiny policy", "",
             f"Generated by `{command}` on {utc_now(minutes=True)} from the records in "
             f"`{shown(args.records)}` ({len(done)} runs recorded there; this design plans {planned}). Every run: "
             f"`examples/demo.py --model tiny` (the embedded 130k-parameter Qwen3, warmed up as the tiny demo does), "
             f"{args.prompts} prompts x {GROUP} completions per optimizer step, {args.steps} steps, the tiny "
             "preset's linear lr decay, 1 torch thread; scored greedily (and sampled at T=1, 4 each) on the 1000 "
             "problems of the tiny demo's evaluation seed, the same for every run. These are not held out: the task "
             "has about 200 distinct problems and the tiny preset trains on all of them (`exclude_held_out=False`), so "
             "the scores measure training problems. Arms as in the N = 8 ablation "
             "(`benchmarks/ablation.py`): GRPO (trl.GRPOTrainer), OBLR-PO (the default), SNR-only (GRPO's "
             "advantages under the SNR step), baseline-only (the gradient-weighted baseline, no SNR step). The lr "
             f"grid: 1/3, 1 and 3 times each arm's centre: GRPO's best lr at N = 8 on this policy, {args.grpo_lr:.3g}, "
             f"for GRPO and baseline-only; for the SNR arms the eta_max whose first steps apply it, {args.grpo_lr:.3g} "
             f"/ {args.factor:.3g}, the SNR factor measured at N = {args.prompts} at the start ({args.factor_note}). "
             f"Grid on seed(s) {', '.join(map(str, args.grid_seeds))}, then seeds "
             f"{', '.join(str(s) for s in args.seeds if s not in args.grid_seeds)} at each arm's best lr.", ""]
    lines += render_tables(result)
    lines += ["", "## What it cost, and what the full design would", "", sizing(args, pilots, planned, runs), "",
              "## When to use", "", when_text(result, pilots, design), ""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps(dict(result, design=design, factor=args.factor,
                                                             pilots=pilots), indent=1, default=str))
    args.out.with_name(args.out.name + "_when.md").write_text("# At the paper's prompts per step\n\n"
                                                              + when_text(result, pilots, design) + "\n")
    print("\n".join(lines))


def sizing(args, pilots: list[dict], planned: int, runs: list[dict]) -> str:
    """The design's CPU-hours from the pilot's figures (a run: its steps at the piloted s/step, plus evaluation), and
    what the recorded runs took (their processes' CPU seconds, wait4)."""
    grpo, oblr = pilot_of(pilots, "tiny", "GRPO"), pilot_of(pilots, "tiny", "OBLR-PO")
    if grpo is None or oblr is None:
        return "The tiny policy's pilot has not run."
    per_arm = planned // len(args.arms)
    hours = (cpu_hours(grpo["seconds_per_step"], args.steps, grpo["eval_seconds"], per_arm)
             + cpu_hours(oblr["seconds_per_step"], args.steps, oblr["eval_seconds"], per_arm * (len(args.arms) - 1)))
    return (f"From the pilot (`{args.out.name}_pilot.md`): a step of {args.prompts} x {GROUP} on the tiny policy took "
            f"{grpo['seconds_per_step']:.1f} s for GRPO and {oblr['seconds_per_step']:.1f} s for OBLR-PO (1 torch "
            f"thread, peak RSS {max(grpo['peak_rss_gb'], oblr['peak_rss_gb']):.1f} GB), so the {planned} runs of "
            f"this design need about {hours:.1f} CPU-hours (the other arms counted at OBLR-PO's step). The "
            f"{len(runs)} runs recorded took {sum(r.get('cpu_seconds') or 0 for r in runs) / 3600:.2f} CPU-hours "
            f"({sum(r['seconds'] for r in runs if r.get('seconds')) / 3600:.2f} h of wall clock), 1 torch thread each.")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "benchmarks/paper_n.py", *(sys.argv[1:] if argv is None else argv)])
    if args.pilot:
        pilot(args)
        return
    args.factor_note = "given as --factor"
    if args.factor is None:
        measured = measured_factor(args.factor_from, args.prompts)
        args.factor = measured["factor"]
        args.factor_note = measured["source"]
    if not args.no_run:
        run_all(args)
    tabulate(args, command)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
