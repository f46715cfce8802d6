"""Which SNR estimator should size OBLR-PO's steps? The demo (`examples/demo.py`) over RL seeds, per estimator.

For each estimator (``--variants``, each ``name=demo args``) and seed, runs the demo from the same warm model and
scores it on the same held-out problems; tabulates the fraction of steps at lr scale 0 (skipped steps), the mean
lr scale and applied lr, and held-out greedy/sampled accuracy before and after. Writes
``benchmarks/results/snr_estimators.{md,json}`` (``--out``).

    python benchmarks/snr_estimators.py --seeds 3     # per_step, ema, ema_soft, window; 2 at a time, 1 thread each
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
from harness.procs import demo_command  # noqa: E402

DEFAULT_VARIANTS = [
    "per_step=--snr_estimator per_step",
    "ema(0.9)=--snr_estimator ema --snr_ema 0.9",
    "ema_soft(0.9)=--snr_estimator ema_soft --snr_ema 0.9",
    "window(10)=--snr_estimator window --snr_window 10",
]


def run(name: str, extra: list[str], seed: int, run_dir: Path, only_existing: bool = False) -> dict | None:
    out = run_dir / name.replace("(", "_").replace(")", "").replace(".", "p") / f"seed{seed}"
    if only_existing and not (out / "summary.json").exists():
        return None
    if not (out / "summary.json").exists():
        # the tiny model (its table's setting) unless the extra arguments name another
        cmd, env = demo_command(seed, out, ["--model", "tiny", *extra])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "log_history.json").read_text())
    scales = [h["oblr/lr_scale"] for h in history if "oblr/lr_scale" in h]
    lrs = [h["oblr/lr"] for h in history if "oblr/lr" in h]
    row = dict(variant=name, seed=seed, skipped=statistics.mean(s == 0.0 for s in scales),
               mean_scale=statistics.mean(scales), mean_lr=statistics.mean(lrs), steps=len(scales),
               greedy_before=s["accuracy_before"], greedy_after=s["accuracy_after"],
               sampled_before=s["sampled_accuracy_before"], sampled_after=s["sampled_accuracy_after"],
               reward_last=s["reward_last_steps"], seconds=s["seconds"])
    print(f"{name} seed {seed}: skipped {row['skipped']:.1%}, mean scale {row['mean_scale']:.3f}, greedy "
          f"{row['greedy_before']:.1%} -> {row['greedy_after']:.1%}, sampled {row['sampled_before']:.1%} -> "
          f"{row['sampled_after']:.1%} ({row['seconds']:.0f}s)", flush=True)
    return row


def mean_sd(values: list[float], digits: int = 1) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (1 torch thread each)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="'name=demo arguments' each")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "snr_estimators")
    parser.add_argument("--run_dir", type=Path, default=Path("outputs/snr_estimators"))
    parser.add_argument("--existing_only", action="store_true", help="tabulate the runs already in --run_dir only")
    args = parser.parse_args()
    variants = [(v.split("=", 1)[0], shlex.split(v.split("=", 1)[1])) for v in args.variants]
    jobs = [(name, extra, seed) for seed in range(args.seeds) for name, extra in variants]
    start = time.time()
    if args.existing_only:
        rows = [run(*j, args.run_dir, only_existing=True) for j in jobs]
        rows = [r for r in rows if r is not None]
        elapsed = sum(r["seconds"] for r in rows) / args.parallel  # what the runs took, 2 at a time
    else:
        run(*jobs[0], args.run_dir)  # builds and caches the warm model once, before parallel runs
        with ThreadPoolExecutor(args.parallel) as pool:
            rows = list(pool.map(lambda j: run(*j, args.run_dir), jobs))
        elapsed = time.time() - start
    command = "python benchmarks/snr_estimators.py --seeds %d --variants %s" % (
        args.seeds, " ".join(shlex.quote(v) for v in args.variants))
    if args.existing_only:
        command += " --existing_only"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{platform.node()} ({os.cpu_count()} CPUs, {args.parallel} runs in parallel, "
               "1 torch thread each)")
    lines = [
        "# SNR estimators on the demo (tiny model, chain_sum, 300 steps of 8 prompts x 8)",
        "",
        f"Generated by `{command}` on {date}, {machine}; "
        + ("runs made by earlier invocations (a seed missing for a variant was not run), "
           if args.existing_only else f"{elapsed / 60:.1f} min wall clock. ")
        + "Same warm model and "
        "held-out problems for every run; only the RL seed and the estimator change. Mean ± std over seeds. "
        "Wall-clock seconds are from CPUs that also ran other work: compare them within this table only.",
        "",
        "| estimator | seeds | steps at scale 0 % | mean lr scale | mean applied lr | greedy before % | greedy after % "
        "| sampled before % | sampled after % | train reward, last 10 steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _ in variants:
        rs = [r for r in rows if r["variant"] == name]
        if not rs:
            continue
        col = lambda k, f=100, digits=1: mean_sd([f * r[k] for r in rs], digits)  # noqa: E731
        lines.append(
            f"| {name} | {len(rs)} | {col('skipped')} | {statistics.mean(r['mean_scale'] for r in rs):.3f} | "
            f"{statistics.mean(r['mean_lr'] for r in rs):.3g} | {col('greedy_before')} | {col('greedy_after')} | "
            f"{col('sampled_before')} | {col('sampled_after')} | {col('reward_last', 1, 3)} |"
        )
    lines += ["", "Per run:", "",
              "| estimator | seed | scale 0 % | mean scale | greedy after % | sampled after % | s |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['seed']} | {100 * r['skipped']:.1f} | {r['mean_scale']:.3f} | "
                     f"{100 * r['greedy_after']:.1f} | {100 * r['sampled_after']:.1f} | {r['seconds']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(command=command, date=date, machine=machine,
                                                             elapsed_s=round(elapsed), runs=rows), indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
