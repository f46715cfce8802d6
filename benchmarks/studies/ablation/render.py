"""The ablation's tables as markdown (``ablation.md``)."""

from __future__ import annotations

import math
import statistics

from .design import ARMS, BENCHMARKS, METRICS, POWER_SEEDS_WHY, PRIMARY, REFERENCE, SNR_ARMS, TASK_ARGS, TITLES


def lr_text(lr: float) -> str:
    return "-" if math.isnan(lr) else f"{lr:.2g}"

def fmt(x: float, signed: bool = False, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{'+' if signed else ''}.{digits}f}"

def _window(series: dict, lo: int, hi: int | None = None) -> float | None:
    """Mean of `series` over steps lo..hi, or over its last 5 steps (hi None)."""
    keys = sorted(series)
    chosen = keys[-5:] if hi is None else [k for k in keys if lo <= k <= hi]
    return statistics.mean(series[k] for k in chosen) if chosen else None

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


def header(args, all_runs: list[dict], lr_best: dict[str, dict]) -> list[str]:
    """The head of ``ablation.md``: how the runs were made, the design's lrs and seeds, the powered measurement."""
    checked_snr = [a for a in SNR_ARMS if a in args.lr_check_arms and a in args.arms]
    eta_status = ("not checked" if not checked_snr else "see the lr check below" if any(
        lr_best.get(a, {}).get("multiple") != 1.0 for a in checked_snr) else "their best in the lr check below")
    stamps = sorted(r["finished"] for r in all_runs)
    return [
        "# Which half of OBLR-PO helps? A paired ablation on SmolLM2-135M-Instruct",
        "",
        f"Generated by `python benchmarks/ablation.py --no_run` from {len(all_runs)} finished runs recorded in "
        f"`{args.records.relative_to(BENCHMARKS.parent) if args.records.is_relative_to(BENCHMARKS.parent) else args.records}` "
        f"(finished {stamps[0] if stamps else '?'} .. {stamps[-1] if stamps else '?'}; a 2-core CPU, 1 or 2 runs at "
        f"a time with 1 torch thread each). Every run: `examples/demo.py --model smollm2 "
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
