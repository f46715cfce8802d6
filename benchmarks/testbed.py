"""The paper's regime on a CPU: GRPO against OBLR-PO on the testbed policy (``oblr_trl.demo.testbed``), whose
per-prompt gradients agree, so that its SNR factor N / (N + B) is large at a modest N (``benchmarks/testbed.md``).

    python benchmarks/testbed.py --phase regime     # GRPO's lr grid, its seeds, the shuffled-reward control
    python benchmarks/testbed.py --phase compare    # OBLR-PO's lr grid, then both arms' seeds at their best lr
    python benchmarks/testbed.py --no_run           # the tables and the figure from the records only

Resumable: a run is done when its record (``benchmarks/results/testbed_runs/<name>.json``) exists. Runs go one at a
time, each in its own process (``benchmarks/studies/testbed_run.py``, 1 torch thread); a run expected to end after
``--finish_by`` (HH:MM UTC) is not launched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from harness import md_table, utc_now  # noqa: E402
from harness.memory import wait_peak_gb  # noqa: E402
from studies import testbed_study as S  # noqa: E402

RESULTS = HERE / "results"
RECORDS = RESULTS / "testbed_runs"
WORK = ROOT / "outputs" / "testbed"
DELTA = 3.0  # points: the difference the power is stated for


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["regime", "compare", "low_n"], default=None)
    p.add_argument("--no_run", action="store_true")
    p.add_argument("--arms", nargs="+", default=["GRPO", "OBLR-PO"], choices=["GRPO", "OBLR-PO", "SNR-only", "baseline-only"],
                   help="the arms of the compare and low_n phases")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (N)")
    p.add_argument("--low_prompts", type=int, default=2, help="N of the low-N phase")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--low_steps", type=int, default=100, help="steps of the low-N phase")
    p.add_argument("--lr_centre", type=float, default=5e-4)
    p.add_argument("--ratio", type=float, default=2.0)
    p.add_argument("--points", type=int, default=5)
    p.add_argument("--grid_seed", type=int, default=0)
    p.add_argument("--control_seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    p.add_argument("--testbed", default="{}", help="TestbedSpec fields (JSON; default: TestbedSpec's defaults)")
    p.add_argument("--finish_by", default=None, help="HH:MM UTC by which every launched run should end")
    p.add_argument("--records", type=Path, default=RECORDS)
    p.add_argument("--search", type=Path, default=RESULTS / "testbed_search", help="the search's probe records")
    p.add_argument("--cache_dir", type=Path, default=WORK / "cache")
    p.add_argument("--out", type=Path, default=RESULTS / "testbed")
    return p


def load(records: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]


def spec(args, arm: str, lr: float, seed: int, prompts: int) -> dict:
    steps = args.low_steps if prompts == args.low_prompts else args.steps
    return dict(arm=arm, lr=lr, seed=seed, prompts=prompts, steps=steps, testbed=json.loads(args.testbed),
                cache_dir=str(args.cache_dir), output_dir=str(WORK / "tmp"))


def jobs(args, runs: list[dict], phase: str) -> list[dict]:
    """The runs of `phase` as far as the records decide them, in launch order."""
    grid = S.lr_grid(args.lr_centre, args.ratio, args.points)
    n, g0 = args.prompts if phase != "low_n" else args.low_prompts, [args.grid_seed]
    mine = [r for r in runs if r["prompts"] == n]
    out = []
    arms = ["GRPO"] if phase == "regime" else args.arms
    for arm in arms:
        lrs = S.extended_grid(mine, arm, grid, args.ratio, g0)
        out += [spec(args, arm, lr, args.grid_seed, n) for lr in lrs]
        best = S.best_lr(mine, arm, lrs, g0)
        if best is None:
            continue
        if phase == "regime" and arm == "GRPO":
            out += [spec(args, "GRPO", best, s, n) for s in args.control_seeds]
            out += [spec(args, "GRPO-shuffled", best, s, n) for s in args.control_seeds]
        else:
            out += [spec(args, arm, best, s, n) for s in args.seeds]
    if phase != "regime":  # seed-major, so the pairs complete together
        head = [j for j in out if j["seed"] == args.grid_seed]
        rest = sorted((j for j in out if j["seed"] != args.grid_seed), key=lambda j: (j["seed"], j["arm"]))
        out = head + rest
    seen, unique = set(), []
    for j in out:
        key = S.run_name(j["arm"], j["lr"], j["seed"], j["prompts"], j["steps"])
        if key not in seen:
            seen.add(key)
            unique.append(dict(j, name=key))
    return unique


def run_all(args, phase: str) -> None:
    args.records.mkdir(parents=True, exist_ok=True)
    log_dir = WORK / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = stop_time(args.finish_by)
    expected = 240.0
    while True:
        todo = [j for j in jobs(args, load(args.records), phase) if not (args.records / f"{j['name']}.json").exists()]
        if not todo:
            return
        job = todo[0]
        if deadline and time.time() + expected > deadline:
            print(f"{utc_now(minutes=True)} stopping: {len(todo)} runs left; the next would not end by "
                  f"{args.finish_by} UTC", flush=True)
            return
        print(f"{utc_now(minutes=True)} launch {job['name']}", flush=True)
        t = time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        cmd = ["nice", "-n", "10", sys.executable, str(HERE / "studies" / "testbed_run.py"),
               json.dumps({k: v for k, v in job.items() if k != "name"}), str(args.records / f"{job['name']}.json")]
        with open(log_dir / f"{job['name']}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            code, peak_gb, cpu_s = wait_peak_gb(proc.pid)
        if code == 0:  # the process's peak RSS and CPU seconds, imports and evaluation included (wait4)
            path = args.records / f"{job['name']}.json"
            record = json.loads(path.read_text())
            path.write_text(json.dumps(dict(record, peak_rss_gb=round(peak_gb, 2), process_cpu_seconds=round(cpu_s, 1)),
                                       indent=1))
        expected = max(expected, time.time() - t)
        print(f"{utc_now(minutes=True)} done {job['name']} rc={code} ({time.time() - t:.0f}s)", flush=True)
        if code:
            raise SystemExit(f"testbed: {job['name']} failed; see {log_dir / (job['name'] + '.log')}")


def stop_time(hhmm: str | None) -> float | None:
    from datetime import datetime, timezone

    from harness.procs import stop_deadline

    when = stop_deadline(hhmm, datetime.now(timezone.utc))
    return when.timestamp() if when else None


if __name__ == "__main__":
    args = build_parser().parse_args()
    if args.phase and not args.no_run:
        run_all(args, args.phase)
    from studies.testbed_tables import render_all

    render_all(args, load(args.records), " ".join(["python benchmarks/testbed.py --no_run"]))
