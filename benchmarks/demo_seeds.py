"""Does `make demo` learn by more than the seed-to-seed spread? Run the demo over several RL seeds and tabulate it.

Every run starts from the same model (SmolLM2-135M-Instruct, or the tiny model warmed up with the fixed
``--warm_seed``) and is scored on the same held-out problems (``--eval_seed``, fixed); only the RL seed (sampling,
data order) changes. Writes ``benchmarks/results/<--out>.{md,json}``: held-out accuracy (the share of exact answers,
greedy and sampled) and mean verifier score before and after OBLR-PO per seed, the mean gain and its standard deviation
across seeds, and each run's time per step.

    python benchmarks/demo_seeds.py --seeds 3 -- --model smollm2   # the demo (make demo-seeds), one at a time
    python benchmarks/demo_seeds.py --seeds 5 --parallel 2 -- --model tiny   # the tiny model (results/demo_seeds)
    python benchmarks/demo_seeds.py --seeds 3 -- --learning_rate 1e-3   # extra arguments go to examples/demo.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
from harness.procs import demo_command  # noqa: E402


def load_seed(seed: int, out_root: Path) -> dict:
    summary = json.loads((out_root / f"seed{seed}" / "summary.json").read_text())
    print(f"seed {seed}: accuracy (exact answers) greedy {summary['accuracy_before']:.1%} -> "
          f"{summary['accuracy_after']:.1%}, sampled {summary['sampled_accuracy_before']:.1%} -> "
          f"{summary['sampled_accuracy_after']:.1%}; mean score greedy {summary['mean_score_before']:.3f} -> "
          f"{summary['mean_score_after']:.3f} "
          f"({summary['seconds']:.0f}s, {summary.get('seconds_per_step', float('nan'))} s/step)", flush=True)
    return {**summary, "seed": seed}


def run_seed(seed: int, out_root: Path, extra: list[str], resume: bool = False) -> dict:
    """One seed's demo run (or, with `resume`, its earlier run's summary.json where one exists)."""
    if resume and (out_root / f"seed{seed}" / "summary.json").exists():
        print(f"seed {seed}: reusing {out_root / f'seed{seed}' / 'summary.json'} (--resume)", flush=True)
        return load_seed(seed, out_root)
    cmd, env = demo_command(seed, out_root / f"seed{seed}", extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed} failed:\n{proc.stderr[-3000:]}")
    return load_seed(seed, out_root)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (1 torch thread each)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file stem (the README block of the same name is filled from it); default "
                        "results/demo_seeds with `-- --model tiny`, else results/demo_seeds_smollm2")
    parser.add_argument("--run_dir", type=Path, default=Path("outputs/demo_seeds"))
    parser.add_argument("--no_run", action="store_true",
                        help="tabulate the seeds whose run_dir/seedN/summary.json exists (from an earlier invocation) "
                        "instead of running; the wall clock is then the sum of their run times")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the seeds whose run_dir/seedN/summary.json exists (an interrupted invocation) and "
                        "run the others; the wall clock then adds the reused runs' own times")
    parser.add_argument("demo_args", nargs="*", help="extra arguments for examples/demo.py (after --)")
    args = parser.parse_args()
    if args.out is None:
        real = "tiny" not in args.demo_args  # examples/demo.py's default model is smollm2
        args.out = HERE / "results" / ("demo_seeds_smollm2" if real else "demo_seeds")

    start = time.time()
    if args.no_run:
        seeds = [s for s in range(args.seeds) if (args.run_dir / f"seed{s}" / "summary.json").exists()]
        if not seeds:
            raise SystemExit(f"no seedN/summary.json under {args.run_dir}")
        runs = [load_seed(s, args.run_dir) for s in seeds]
        elapsed = sum(r["seconds"] for r in runs)
    else:
        # the first run alone: it fills the model cache (download + conversion, or the tiny model's warm-up) first
        reused = [s for s in range(args.seeds) if args.resume and (args.run_dir / f"seed{s}" / "summary.json").exists()]
        with ThreadPoolExecutor(args.parallel) as pool:
            first = run_seed(0, args.run_dir, args.demo_args, args.resume)
            runs = [first] + list(pool.map(lambda s: run_seed(s, args.run_dir, args.demo_args, args.resume),
                                           range(1, args.seeds)))
        elapsed = time.time() - start + sum(r["seconds"] for r in runs if r["seed"] in reused)

    def stats(key):
        gains = [100 * (r[f"{key}_after"] - r[f"{key}_before"]) for r in runs]
        return gains, statistics.mean(gains), statistics.stdev(gains) if len(gains) > 1 else float("nan")

    greedy, g_mean, g_std = stats("accuracy")
    sampled, s_mean, s_std = stats("sampled_accuracy")
    scores, m_mean, m_std = stats("mean_score")
    result = dict(
        command=" ".join(["python", "benchmarks/demo_seeds.py", "--seeds", str(args.seeds), "--parallel",
                          str(args.parallel), "--run_dir", str(args.run_dir), "--out",
                          os.path.relpath(args.out.resolve(), HERE.parent)]
                         + (["--no_run"] if args.no_run else []) + (["--resume"] if args.resume else [])
                         + (["--", *args.demo_args] if args.demo_args else [])),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.node()} ({platform.platform()}, {os.cpu_count()} CPUs, {args.parallel} runs in parallel, "
                "1 torch thread each)",
        elapsed_s=round(elapsed), runs=runs, greedy_gain_pts=[g_mean, g_std], sampled_gain_pts=[s_mean, s_std],
        mean_score_gain_pts=[m_mean, m_std],
    )
    n_eval, model = runs[0]["num_eval"], runs[0]["model"]
    lines = [
        f"# The demo over RL seeds: {model}",
        "",
        f"Generated by `{result['command']}` on {result['date']}, {result['machine']}; {elapsed / 60:.1f} min wall "
        f"clock. Same starting model and the "
        f"same {n_eval} held-out problems for every seed; only the RL seed changes. Accuracy: the share of exact "
        "answers, i.e. of replies whose final number the verifier gives full credit (`oblr_trl.demo.tasks.extract_answer`); "
        "greedy: greedy decoding; sampled: completions sampled at temperature 1 (what RL trains). Mean score: the "
        "verifier's mean score (greedy), partial credit included. s/step: training time per optimizer step; s: the "
        "whole run (evaluations, and the model download/conversion in the first run).",
        "",
        "Settings: " + ", ".join(f"{k}={runs[0][k]!r}" for k in ("task", "prompt_template", "answer_extractor",
                                                              "lora_r", "learning_rate", "lr_scheduler_type",
                                                              "format_reward", "weight_clip", "one_backward", "steps")
                                 if k in runs[0]) + ".",
        "",
        "| seed | accuracy, greedy, before % | after % | gain (pts) | accuracy, sampled, before % | after % | gain (pts) "
        "| mean score, greedy, before | after | train reward, first steps | last steps | steps with lr scale 0 "
        "| mean SNR | s/step | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, g, sg in zip(runs, greedy, sampled):
        lines.append(
            f"| {r['seed']} | {100 * r['accuracy_before']:.1f} | {100 * r['accuracy_after']:.1f} | {g:+.1f} | "
            f"{100 * r['sampled_accuracy_before']:.1f} | {100 * r['sampled_accuracy_after']:.1f} | {sg:+.1f} | "
            f"{r['mean_score_before']:.3f} | {r['mean_score_after']:.3f} | "
            f"{r['reward_first_steps']:.3f} | {r['reward_last_steps']:.3f} | "
            f"{r.get('steps_with_lr_scale_0', '?')}/{r['steps']} | {r['mean_snr']:.3f} | "
            f"{r.get('seconds_per_step', float('nan'))} | {r['seconds']:.0f} |"
        )

    def verdict(mean, std):
        return "exceeds" if mean > std else "does not exceed"

    lines += [
        "",
        f"Accuracy gain (exact answers), mean +- std over {len(runs)} seeds "
        f"({', '.join(str(r['seed']) for r in runs)}): greedy **{g_mean:+.1f} +- {g_std:.1f} pts** (the mean "
        f"{verdict(g_mean, g_std)} the seed-to-seed spread), sampled **{s_mean:+.1f} +- {s_std:.1f} pts** (the mean "
        f"{verdict(s_mean, s_std)} the spread). Mean score gain (greedy): {m_mean / 100:+.3f} +- {m_std / 100:.3f}.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
