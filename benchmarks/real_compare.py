"""GRPO, RLOO, OPO and OBLR-PO trained on the real model: an lr sweep over seeds, at a fixed step budget.

Runs a grid of (method, lr) x seeds of ``examples/demo.py --model smollm2`` (SmolLM2-135M-Instruct, chain_sum, LoRA
r=16, 8 prompts x 8 completions per step; see the demo) as subprocesses, ``--parallel`` at a time with 1 torch thread
each, and tabulates held-out accuracy after RL per cell (mean +- std over seeds), the gain over the starting model, the
mean applied lr and the fraction of steps OBLR-PO's SNR factor was 0. It answers two questions: does OBLR-PO at its
default eta_max match or beat GRPO at GRPO's best lr, and over how wide an lr range is each method within 2 points of
its best?

Methods (the lr is GRPO's / RLOO's / OPO's learning rate, OBLR-PO's eta_max):
  OBLR-PO  the demo's default (gradient-weighted leave-one-out baseline, exact norms, SNR step)
  GRPO     --trainer grpo (trl.GRPOTrainer, scale_rewards="group"; everything else the same)
  RLOO     --baseline mean --snr_lr false
  OPO      --grad_norm_estimator length --snr_lr false
  OBLR-PO-per_step  --snr_estimator per_step (the paper's per-step SNR estimate; the default is ema_soft)
  OBLR-PO-logit     --grad_norm_estimator logit (forward-only logit-proxy weights instead of the exact norms)
An lr of ``auto`` is OBLR-PO's measured mean applied lr at its default eta_max (``--default_lr``), read from those
runs' summary.json once all their seeds have finished: the same average step, without the SNR factor.

Resumable: a run whose summary.json exists is not run again; each run reuses the before-RL accuracy of any run of the
same seed (examples/demo.py --before_from; identical by construction). Cells are run in the order given, seeds of a
cell after one another (``--seed_major``: every cell's first seed, then every cell's second, ...). A run another runner
on this machine has in flight is not started again, and the machine-wide count of real-model runs is kept at
``--parallel``, so a second runner can join with other cells.

    python benchmarks/real_compare.py --max_steps 10 --cells OBLR-PO:1e-3 GRPO:5.5e-4 GRPO:1e-4,3e-3 \\
        OBLR-PO:5.5e-3,3e-2 RLOO:auto OPO:auto
    python benchmarks/real_compare.py --no_run     # tabulate what exists under --run_dir
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path

from harness import RunnerLog, uptime
from harness.grid import Costs, Limits, run_grid
from harness.procs import demo_command

HERE = Path(__file__).resolve().parent
METHODS = {
    "OBLR-PO": [],
    "GRPO": ["--trainer", "grpo"],
    "RLOO": ["--baseline", "mean", "--snr_lr", "false"],
    "OPO": ["--grad_norm_estimator", "length", "--snr_lr", "false"],
    "OBLR-PO-per_step": ["--snr_estimator", "per_step"],  # the paper's per-step SNR instead of the default ema_soft
    "OBLR-PO-logit": ["--grad_norm_estimator", "logit"],  # verl's forward-only proxy weights instead of exact norms
}
WITHIN_PTS = 2.0


def cell_dir(run_dir: Path, method: str, lr: float) -> Path:
    return run_dir / f"{method}_lr{lr:.3g}"


def parse_cells(specs: list[str]) -> list[tuple[str, str]]:
    """'GRPO:1e-4,3e-3' -> [('GRPO', '1e-4'), ('GRPO', '3e-3')]; lr strings stay strings ('auto' is resolved later)."""
    cells = []
    for spec in specs:
        method, _, lrs = spec.partition(":")
        if method not in METHODS or not lrs:
            raise SystemExit(f"--cells {spec!r}: expected METHOD:LR[,LR...] with METHOD in {sorted(METHODS)}")
        for lr in lrs.split(","):
            if lr != "auto":
                float(lr)
            cells.append((method, lr))
    return cells


def load_runs(run_dir: Path) -> list[dict]:
    """Every finished run under run_dir (<method>_lr<lr>/seed<s>/summary.json), with its method and seed."""
    runs = []
    for path in sorted(run_dir.glob("*_lr*/seed*/summary.json")):
        method = path.parent.parent.name.rsplit("_lr", 1)[0]
        summary = json.loads(path.read_text())
        runs.append(dict(summary, method=method, seed=int(path.parent.name[4:]), dir=str(path.parent)))
    return runs


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, math.nan
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def tabulate(runs: list[dict], default_lr: float, within: float = WITHIN_PTS) -> dict:
    """Per (method, lr) cell: accuracies after RL in points (mean, std, min, max over seeds), gains, applied lr,
    skipped-step fraction; then the two answers. Pure: `runs` are summary.json dicts with `method` and `seed`."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], float(r["learning_rate"])), []).append(r)
    cells = []
    for (method, lr), rs in sorted(groups.items(), key=lambda kv: (list(METHODS).index(kv[0][0])
                                                                   if kv[0][0] in METHODS else 99, kv[0][1])):
        rs = sorted(rs, key=lambda r: r["seed"])
        cell = dict(method=method, lr=lr, seeds=[r["seed"] for r in rs], steps=sorted({r["steps"] for r in rs}))
        for key, label in (("accuracy", "greedy"), ("sampled_accuracy", "sampled")):
            after = [100 * r[f"{key}_after"] for r in rs]
            gains = [100 * (r[f"{key}_after"] - r[f"{key}_before"]) for r in rs if r[f"{key}_before"] is not None]
            cell[label] = dict(zip(("mean", "std"), mean_std(after)), min=min(after), max=max(after))
            cell[f"{label}_gain"] = dict(zip(("mean", "std"), mean_std(gains)))
        cell["mean_applied_lr"] = mean_std([r.get("mean_applied_lr") for r in rs])[0]
        skipped = [r["steps_with_lr_scale_0"] / r["steps"] for r in rs if r.get("mean_lr_scale") is not None]
        cell["skipped_fraction"] = statistics.mean(skipped) if skipped else None
        cell["seconds_per_step"] = statistics.mean(r["seconds_per_step"] for r in rs)
        cells.append(cell)

    before = {}
    for key, label in (("accuracy", "greedy"), ("sampled_accuracy", "sampled")):
        values = {r["seed"]: 100 * r[f"{key}_before"] for r in runs if r[f"{key}_before"] is not None}
        before[label] = statistics.mean(values.values()) if values else math.nan

    answers = {}
    for label in ("greedy", "sampled"):
        def best(method):
            mine = [c for c in cells if c["method"] == method]
            return max(mine, key=lambda c: c[label]["mean"]) if mine else None

        oblr = next((c for c in cells if c["method"] == "OBLR-PO" and math.isclose(c["lr"], default_lr)), None)
        grpo = best("GRPO")
        answer = dict(oblrpo_default=oblr and oblr["lr"], grpo_best_lr=grpo and grpo["lr"])
        if oblr and grpo:
            diff = oblr[label]["mean"] - grpo[label]["mean"]
            # standard error of the difference of two seed means (nan with one seed: no spread to compare to)
            se = math.sqrt(oblr[label]["std"] ** 2 / len(oblr["seeds"]) + grpo[label]["std"] ** 2 / len(grpo["seeds"]))
            verdict = ("unknown (one seed)" if math.isnan(se) else "beats" if diff > 2 * se
                       else "loses to" if diff < -2 * se else "matches")
            answer.update(diff_pts=diff, se_pts=se, verdict=verdict,
                          oblrpo_std=oblr[label]["std"], grpo_std=grpo[label]["std"])
        widths = {}
        for method in METHODS:
            mine = [c for c in cells if c["method"] == method]
            if not mine:
                continue
            top = best(method)
            near = [c["lr"] for c in mine if c[label]["mean"] >= top[label]["mean"] - within]
            widths[method] = dict(best_lr=top["lr"], best=top[label]["mean"], lrs_tested=[c["lr"] for c in mine],
                                  lrs_within=near, ratio=max(near) / min(near))
        answer["within"] = widths
        answers[label] = answer
    return dict(cells=cells, before=before, answers=answers, default_lr=default_lr, within_pts=within)


def fmt_cell(stat: dict, signed: bool = False) -> str:
    return f"{stat['mean']:{'+' if signed else ''}.1f}" + ("" if math.isnan(stat["std"]) else f" +- {stat['std']:.1f}")


def render(table: dict, header: list[str], missing: list[str]) -> str:
    lines = header + [
        "",
        f"Before RL (the same model for every run; mean over seeds): greedy {table['before']['greedy']:.1f}%, "
        f"sampled {table['before']['sampled']:.1f}%.",
        "",
        "| method | lr (eta_max for OBLR-PO) | seeds | steps | greedy after % | gain (pts) | sampled after % | gain (pts) "
        "| mean applied lr | steps at lr scale 0 | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in table["cells"]:
        skipped = "-" if c["skipped_fraction"] is None else f"{c['skipped_fraction']:.0%}"
        lines.append(
            f"| {c['method']} | {c['lr']:.3g} | {','.join(map(str, c['seeds']))} | {','.join(map(str, c['steps']))} "
            f"| {fmt_cell(c['greedy'])} | {fmt_cell(c['greedy_gain'], True)} | {fmt_cell(c['sampled'])} "
            f"| {fmt_cell(c['sampled_gain'], True)} | {c['mean_applied_lr']:.3g} | {skipped} | {c['seconds_per_step']:.0f} |"
        )
    lines += ["", "Means +- standard deviation over seeds. The answers:", ""]
    for label in ("greedy", "sampled"):
        a = table["answers"][label]
        if "diff_pts" in a:
            lines.append(
                f"- **{label}**: OBLR-PO at its default eta_max {a['oblrpo_default']:.3g} **{a['verdict']}** GRPO at "
                f"its best lr of those tried ({a['grpo_best_lr']:.3g}): {a['diff_pts']:+.1f} pts (standard error of "
                f"the difference {a['se_pts']:.1f}; seed std {a['oblrpo_std']:.1f} vs {a['grpo_std']:.1f}; 'matches' "
                "= within 2 standard errors)."
            )
        else:
            lines.append(f"- **{label}**: OBLR-PO default vs GRPO's best: not measured (a cell is missing).")
        for method, w in a["within"].items():
            if len(w["lrs_tested"]) == 1:
                lines.append(f"  - {method}: {w['best']:.1f}% at lr {w['best_lr']:.3g}, the only lr run: no range "
                             "measured.")
                continue
            lines.append(
                f"  - {method}: best {w['best']:.1f}% at lr {w['best_lr']:.3g}; within {table['within_pts']:g} pts of "
                f"it: lr {', '.join(f'{x:.3g}' for x in w['lrs_within'])} of {len(w['lrs_tested'])} tried "
                f"(a {w['ratio']:.3g}x range of the tried values)."
            )
    if missing:
        lines += ["", "Missing (not run, or not finished, when the table was made): " + "; ".join(missing) + "."]
    lines.append("")
    return "\n".join(lines)


def plot(table: dict, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    palette = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive")
    colors = {method: palette[i % len(palette)] for i, method in enumerate(METHODS)}
    for ax, label in zip(fig.subplots(1, 2), ("greedy", "sampled")):
        for method in METHODS:
            mine = [c for c in table["cells"] if c["method"] == method]
            if not mine:
                continue
            lrs = [c["lr"] for c in mine]
            means = [c[label]["mean"] for c in mine]
            ax.fill_between(lrs, [c[label]["min"] for c in mine], [c[label]["max"] for c in mine],
                            color=colors[method], alpha=0.15, linewidth=0)
            ax.plot(lrs, means, marker="o", color=colors[method], label=method)
            if len(mine) == 1:  # a single lr: the band as an error bar
                c = mine[0]
                ax.errorbar(lrs, means, yerr=[[c[label]["mean"] - c[label]["min"]], [c[label]["max"] - c[label]["mean"]]],
                            color=colors[method], capsize=4)
        oblr = [c for c in table["cells"] if c["method"] == "OBLR-PO" and c["mean_applied_lr"] == c["mean_applied_lr"]]
        if oblr:  # where OBLR-PO's steps actually were: eta_max times its mean SNR factor
            ax.plot([c["mean_applied_lr"] for c in oblr], [c[label]["mean"] for c in oblr], linestyle="none",
                    marker="o", markerfacecolor="none", color=colors["OBLR-PO"], label="OBLR-PO at its mean applied lr")
        ax.axhline(table["before"][label], color="gray", linestyle="--", label="before RL")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (eta_max for OBLR-PO)")
        ax.set_ylabel(f"held-out {label} accuracy after RL (%)")
        ax.set_title(f"{label}: seed mean, band = min-max over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def resolve_auto(run_dir: Path, default_lr: float, seeds: list[int]) -> float | None:
    """OBLR-PO's mean applied lr at its default eta_max, fixed once all its seeds finished (kept in auto_lr.json)."""
    saved = run_dir / "auto_lr.json"
    if saved.exists():
        return json.loads(saved.read_text())["lr"]
    done = [r for r in load_runs(run_dir) if r["method"] == "OBLR-PO" and math.isclose(r["learning_rate"], default_lr)
            and r["seed"] in seeds]
    if len(done) < len(seeds):
        return None
    lr = float(f"{statistics.mean(r['mean_applied_lr'] for r in done):.3g}")
    saved.write_text(json.dumps(dict(lr=lr, from_runs=[r["dir"] for r in done]), indent=1))
    return lr


def pending(args, cells, seeds, launched: set) -> list[dict]:
    """The runs still to do, in launch order (cell-major, or ``--seed_major``): not finished, not launched by this
    runner before (a run that failed is not retried), and with a known lr (``auto`` waits for OBLR-PO's runs)."""
    order = [(m, lr, s) for s in seeds for m, lr in cells] if args.seed_major else [(m, lr, s) for m, lr in cells
                                                                                    for s in seeds]
    todo = []
    for method, lr, seed in order:
        lr = resolve_auto(args.run_dir, args.default_lr, seeds) if lr == "auto" else float(lr)
        out = None if lr is None else cell_dir(args.run_dir, method, lr) / f"seed{seed}"
        if out is None or out in launched or (out / "summary.json").exists():
            continue
        todo.append(dict(kind="train", name=f"{method} lr={lr:.3g} seed={seed}", out=out, seed=seed, steps=args.max_steps,
                         argv=["--model", "smollm2", "--learning_rate", repr(lr), "--max_steps", str(args.max_steps),
                               *METHODS[method], *args.demo_args]))
    return todo


def launch(args, job: dict, launched: set) -> subprocess.Popen:
    """One examples/demo.py run, reusing any run's before-RL evaluation of the same seed (identical by construction)."""
    launched.add(job["out"])
    before = sorted(args.run_dir.glob(f"*_lr*/seed{job['seed']}/before.json"))
    cmd, env = demo_command(job["seed"], job["out"], job["argv"] + (["--before_from", str(before[0])] if before else []))
    job["out"].mkdir(parents=True, exist_ok=True)
    with open(job["out"] / "log.txt", "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def run_cells(args, cells, seeds, log) -> None:
    """The grid under the harness's runner: ``--parallel`` real-model runs on the machine (another runner's count),
    each launched when ``--min_free_gb`` is free (no memory model: every run counts 0 GB against the budget)."""
    launched: set = set()
    costs = Costs(peak_gb=lambda job: 0.0, minutes=lambda job: job["steps"])
    limits = Limits(parallel=args.parallel, min_free_gb=args.min_free_gb, poll_s=args.poll_s,
                    stop_launching=args.stop_launching)
    run_grid(lambda: pending(args, cells, seeds, launched), lambda job: launch(args, job, launched), costs, limits, log)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", default=["OBLR-PO:1e-3", "GRPO:5.5e-4", "GRPO:1e-4,3e-3",
                                                        "OBLR-PO:5.5e-3,3e-2", "RLOO:auto", "OPO:auto"],
                        help="METHOD:LR[,LR...] in priority order (methods: %(choices)s)" % dict(choices=list(METHODS)))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max_steps", type=int, default=10, help="RL steps of every run (a fixed step budget)")
    parser.add_argument("--default_lr", type=float, default=1e-3, help="OBLR-PO's default eta_max (the demo's)")
    parser.add_argument("--seed_major", action="store_true",
                        help="run every cell's first seed, then every cell's second, ... (default: a cell's seeds in turn)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (1 torch thread each, ~8 GB each)")
    parser.add_argument("--min_free_gb", type=float, default=9.0, help="launch only when this much memory is free")
    parser.add_argument("--stop_launching", default=None, help="HH:MM UTC after which no run is launched")
    parser.add_argument("--poll_s", type=float, default=30)
    parser.add_argument("--run_dir", type=Path, default=Path("outputs/real_compare"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "real_compare")
    parser.add_argument("--no_run", action="store_true", help="only tabulate the runs that exist under --run_dir")
    parser.add_argument("demo_args", nargs="*", help="extra arguments for examples/demo.py (after --)")
    args = parser.parse_args()
    cells = parse_cells(args.cells)
    log = RunnerLog(args.run_dir)
    if not args.no_run:
        log(f"start: {len(cells)} cells x {len(args.seeds)} seeds, {args.max_steps} steps; {uptime()}")
        run_cells(args, cells, args.seeds, log)
        log(f"end; {uptime()}")

    runs = load_runs(args.run_dir)
    if not runs:
        raise SystemExit(f"no <method>_lr<lr>/seed<s>/summary.json under {args.run_dir}")
    auto = resolve_auto(args.run_dir, args.default_lr, args.seeds)
    done = {(r["method"], f"{float(r['learning_rate']):.3g}", r["seed"]) for r in runs}
    missing = []
    for method, lr in cells:
        lr_text = "auto (not yet known)" if lr == "auto" and auto is None else f"{auto if lr == 'auto' else float(lr):.3g}"
        lost = [s for s in args.seeds if (method, lr_text, s) not in done]
        if lost:
            missing.append(f"{method} lr {lr_text} seeds {','.join(map(str, lost))}")
    table = tabulate(runs, args.default_lr)
    launches = [line for line in log.lines if " launched " in line or " finished " in line or "start:" in line
                or " end;" in line or "stop time" in line]
    first, last = (launches[0][:23], launches[-1][:23]) if launches else ("?", "?")
    command = ("python benchmarks/real_compare.py --max_steps " + str(args.max_steps) + " --cells " + " ".join(args.cells)
               + (" --stop_launching " + args.stop_launching if args.stop_launching else "")
               + (" -- " + " ".join(args.demo_args) if args.demo_args else ""))
    header = [
        "# Training on the real model: GRPO, RLOO, OPO and OBLR-PO over learning rates",
        "",
        f"Generated by `{command}` (then `--no_run` to tabulate) from runs between {first} and {last} on "
        f"{platform.node()} ({os.cpu_count()} CPUs, {args.parallel} runs at a time, 1 torch thread each). Every run is "
        "`examples/demo.py --model smollm2` "
        f"(SmolLM2-135M-Instruct, chain_sum, LoRA r=16 all-linear, 8 prompts x 8 completions of <= 8 tokens per "
        f"step, constant lr, format reward 0.2) for **{args.max_steps} steps** (the demo's default is 15)"
        ", scored on the same 100 held-out problems: greedy, and 4 samples each at T=1. GRPO: "
        "trl.GRPOTrainer with scale_rewards='group'; RLOO: `--baseline mean --snr_lr false`; OPO: "
        "`--grad_norm_estimator length --snr_lr false` (both with OBLR-PO's leave-one-out; no std scaling); "
        "OBLR-PO-per_step: `--snr_estimator per_step` (the paper's per-step SNR; the default is ema_soft); "
        "OBLR-PO-logit: `--grad_norm_estimator logit` (the forward-only logit-proxy weights; the default is exact). "
        + (f"RLOO and OPO run at OBLR-PO's mean applied lr at eta_max {args.default_lr:g} ({auto:.3g}): the same "
           "average step without the SNR factor. " if auto else "")
        + "The lr is eta_max for OBLR-PO; 'mean applied lr' is the lr the optimizer used, averaged over steps.",
    ]
    loads = [line for line in log.lines if "load average" in line]
    if loads:
        header += ["", "Load (`uptime`) at the first and last launch/finish: "
                   f"`{loads[0].split('; ', 1)[-1]}` ... `{loads[-1].split('; ', 1)[-1]}`."]
    text = render(table, header, missing)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + f"\nPlot: `results/{args.out.name}.png` (accuracy after RL vs lr; "
                                          "OBLR-PO's open markers at its mean applied lr).\n")
    args.out.with_suffix(".json").write_text(json.dumps(dict(command=command, runner_log=log.lines, auto_lr=auto,
                                                             missing=missing, **table,
                                                             runs=runs), indent=1, default=str))
    plot(table, args.out.with_suffix(".png"), f"SmolLM2-135M-Instruct, chain_sum, {args.max_steps} steps: "
         "held-out accuracy after RL vs lr")
    print(text)


if __name__ == "__main__":
    main()
