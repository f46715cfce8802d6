"""How wide is each arm's working learning-rate window?

Reads the ablation's run records (``ablation.py``'s ``--records``; the design, its grid of lrs and its cells, is
``WINDOW_*`` in ``studies/ablation/design.py`` and ``--window_*``) and tabulates, per arm of ``--window_arms`` (GRPO, RLOO, OBLR-PO) and per lr
of its grid (multiples ~3x apart of its lr in the ablation: L for the constant-lr arms, eta_max for OBLR-PO's SNR
step), the greedy held-out accuracy after ``--window_steps`` (20) steps over ``--window_seeds``:

* the **window**: the lrs whose mean accuracy is within ``--tolerance`` (5) points of the arm's best mean on the grid,
  and the contiguous span of them around the best, with its width in factors of lr (open when it reaches the grid's
  end: the grid does not find the edge there);
* "if I do not tune the lr, how likely am I to be fine?": the share of the grid's runs (lrs x seeds) within the
  tolerance of the arm's best mean;
* **collapses** (accuracy at that step below the starting model's by more than ``--collapse_pts``, the stability
  window's rule), per arm, compared between arms with Fisher's exact test (two-sided) over the grid's lrs above the
  arm's own (multiples > 1) and over the whole grid;
* a plot: accuracy against lr (log axis), one curve per arm (the mean), its band the seeds' min-max.

    python benchmarks/lr_window.py          # results/lr_window.md, .json, .png from the records so far
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
from harness import md_table, utc_now  # noqa: E402
from harness.stats import fisher_exact  # noqa: E402,F401  (re-exported: lr_window.fisher_exact)
from studies.ablation.design import ARMS, CALIBRATED, REFERENCE, build_parser, lr_of, window_multiples  # noqa: E402
from studies.ablation.records import curve_at, load_runs  # noqa: E402


def cell_values(runs: list[dict], arm: str, lr: float, seeds: list[int], step: int) -> list[tuple[int, float, bool]]:
    """(seed, greedy accuracy in points at `step`, the starting model's accuracy in points) of one (arm, lr) cell's
    runs of `seeds` (not the long runs), by seed; runs without an evaluation at `step` are left out."""
    out = []
    for r in sorted((r for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr) and r["seed"] in seeds
                     and not r.get("long")), key=lambda r: r["seed"]):
        value = curve_at(r, step, "accuracy")
        if value is not None:
            out.append((r["seed"], value, 100 * r["accuracy_before"]))
    return out


def window_rows(runs: list[dict], args) -> list[dict]:
    """Per arm and lr of the grid: the seeds in, mean, min and max accuracy (points), the collapsed seeds, and
    whether the mean is within the tolerance of the arm's best mean (``in_window``)."""
    rows = []
    for arm in args.window_arms:
        arm_rows = []
        for m in window_multiples(arm, args.window_arms):
            lr = lr_of(arm, args.grpo_lr, m, eta=args.eta_multiple)
            cell = cell_values(runs, arm, lr, args.window_seeds, args.window_steps)
            values = [v for _, v, _ in cell]
            arm_rows.append(dict(
                arm=arm, multiple=m, lr=lr, seeds=[s for s, _, _ in cell], values=values, n=len(values),
                mean=statistics.mean(values) if values else math.nan, min=min(values, default=math.nan),
                max=max(values, default=math.nan),
                collapsed=[s for s, v, before in cell if before - v > args.collapse_pts]))
        best = max((r["mean"] for r in arm_rows if r["n"]), default=math.nan)
        for r in arm_rows:
            r["in_window"] = bool(r["n"]) and r["mean"] >= best - args.tolerance
        rows += arm_rows
    return rows


def window_summary(rows: list[dict], arm: str, tolerance: float, planned_seeds: int) -> dict:
    """One arm's window: its best lr and mean, the contiguous span of in-window lrs around the best (its ends, the
    width hi/lo, and whether each end is open: at the grid's end or next to a cell not yet run), the share of its
    runs within the tolerance of the best mean, its collapses, and the cells not complete."""
    mine = [r for r in rows if r["arm"] == arm]
    done = [r for r in mine if r["n"]]
    out = dict(arm=arm, cells=len(mine), incomplete=[r["lr"] for r in mine if r["n"] < planned_seeds])
    if not done:
        return out
    i = max(range(len(mine)), key=lambda j: mine[j]["mean"] if mine[j]["n"] else -math.inf)
    lo = hi = i
    while lo > 0 and mine[lo - 1]["in_window"]:
        lo -= 1
    while hi < len(mine) - 1 and mine[hi + 1]["in_window"]:
        hi += 1
    best_mean = mine[i]["mean"]
    values = [v for r in done for v in r["values"]]
    out.update(
        best_lr=mine[i]["lr"], best_mean=best_mean, lo=mine[lo]["lr"], hi=mine[hi]["lr"],
        width=mine[hi]["lr"] / mine[lo]["lr"], open_lo=lo == 0 or not mine[lo - 1]["n"],
        open_hi=hi == len(mine) - 1 or not mine[hi + 1]["n"], in_window_lrs=[r["lr"] for r in mine if r["in_window"]],
        fine=sum(v >= best_mean - tolerance for v in values), runs=len(values),
        collapsed=sum(len(r["collapsed"]) for r in done),
        collapsed_above=sum(len(r["collapsed"]) for r in done if r["multiple"] > 1),
        runs_above=sum(r["n"] for r in done if r["multiple"] > 1))
    return out


def collapse_tests(summaries: dict[str, dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """Fisher's exact test of the collapse rates of each pair of arms, above the arms' own lrs and over the grid."""
    tests = []
    for a, b in pairs:
        sa, sb = summaries.get(a, {}), summaries.get(b, {})
        if "runs" not in sa or "runs" not in sb:
            continue
        for scope, k, n in (("above its lr", "collapsed_above", "runs_above"), ("whole grid", "collapsed", "runs")):
            ca, na, cb, nb = sa[k], sa[n], sb[k], sb[n]
            tests.append(dict(a=a, b=b, scope=scope, a_collapsed=ca, a_runs=na, b_collapsed=cb, b_runs=nb,
                              p=fisher_exact(ca, na - ca, cb, nb - cb) if na and nb else math.nan))
    return tests


def calibrated_section(rows: list[dict], summaries: dict[str, dict], args) -> list[str]:
    """Where the window has both GRPO and OBLR-PO with ``snr_lr_mode="calibrated"`` (``CALIBRATED``, whose lr is the
    lr one would give GRPO): their best lrs and how far apart, in the grid's steps (`grid_verdict`), and the cells
    where the calibrated arm is below GRPO at the same lr."""
    g, c = summaries.get(REFERENCE, {}), summaries.get(CALIBRATED, {})
    if "best_lr" not in g or "best_lr" not in c:
        return []
    grid = sorted(r["lr"] for r in rows if r["arm"] == REFERENCE)
    run = [r["lr"] for r in rows if r["arm"] == CALIBRATED and r["n"]]
    partial = (f" Partial: {CALIBRATED} has run {len(run)} of the grid's {len(grid)} lrs "
               f"({', '.join(f'{lr:.3g}' for lr in run)}), so its best is the best of those."
               if len(run) < len(grid) else "")
    lines = ["", f"## GRPO's lr in OBLR-PO (`snr_lr_mode=\"calibrated\"`)", "",
             f"{CALIBRATED}: OBLR-PO with `learning_rate` read as the lr one would give GRPO, on GRPO's grid. GRPO's "
             f"best lr {g['best_lr']:.3g} ({g['best_mean']:.1f}), {CALIBRATED}'s best {c['best_lr']:.3g} "
             f"({c['best_mean']:.1f}): {grid_verdict(g['best_lr'], c['best_lr'], grid)}.{partial} Per lr (same "
             f"seeds), {CALIBRATED} minus GRPO:", ""]
    table = []
    for r in (r for r in rows if r["arm"] == CALIBRATED and r["n"]):
        other = next((o for o in rows if o["arm"] == REFERENCE and math.isclose(o["lr"], r["lr"])), None)
        if other is None:
            continue
        paired = [(v, w) for s, v in zip(r["seeds"], r["values"]) for t, w in zip(other["seeds"], other["values"])
                  if s == t]
        diff = statistics.mean(v - w for v, w in paired) if paired else math.nan
        table.append([f"{r['lr']:.3g}", fmt(r["mean"]), fmt(statistics.mean(w for _, w in paired) if paired else
                                                             math.nan), fmt(diff, "+.1f"), str(len(paired)),
                      "OBLR-PO loses" if diff < 0 else "OBLR-PO ties or wins" if diff == diff else "-"])
    return lines + md_table(["lr", CALIBRATED, "GRPO (same seeds)", "difference (pts)", "seeds", ""], table)


def grid_verdict(a: float, b: float, grid: list[float]) -> str:
    """How far apart two best lrs of the same grid are, in its steps: "the same lr", "one grid step apart (<ratio>x)",
    or "<k> grid steps apart (<ratio>x)"; the grid's step (~3x here) is the finest it can tell, so a goal of 2x reads
    as "the same lr or one step". An lr off the grid is stated by its ratio alone."""
    ratio = max(a, b) / min(a, b)
    at = [next((i for i, lr in enumerate(grid) if math.isclose(lr, x, rel_tol=1e-3)), None) for x in (a, b)]
    if None in at:
        return f"{ratio:.3g}x apart"
    steps = abs(at[0] - at[1])
    if steps == 0:
        return "the same lr"
    return (f"{'one grid step' if steps == 1 else f'{steps} grid steps'} apart ({ratio:.3g}x; the grid's step is "
            f"{ratio ** (1 / steps):.3g}x, the finest it tells apart)")


def fmt(x: float, spec: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def render(rows: list[dict], summaries: dict[str, dict], tests: list[dict], args, n_records: int) -> str:
    planned = len(args.window_seeds)
    incomplete = sum(len(s["incomplete"]) for s in summaries.values())
    lines = [
        "# The learning-rate window of " + " and ".join([", ".join(args.window_arms[:-1]), args.window_arms[-1]]
                                                        if len(args.window_arms) > 1 else args.window_arms)
        + (" - PARTIAL" if incomplete else ""),
        "",
        (f"**Partial: {incomplete} of {len(rows)} cells have fewer than {planned} seeds (or none) yet.** "
         if incomplete else "")
        + f"Generated by `python benchmarks/lr_window.py` on {utc_now(minutes=True)} from {n_records} run records in "
        f"`{args.records.relative_to(HERE.parent) if args.records.is_relative_to(HERE.parent) else args.records}` "
        f"(the ablation's: SmolLM2-135M-Instruct, LoRA r=16, chain_sum with 1-2 digit terms, 8 prompts x 8 "
        f"completions per step). Cell: greedy held-out accuracy (100 problems) after {args.window_steps} steps, seeds "
        f"{','.join(map(str, args.window_seeds))} (40-step runs evaluated at step {args.window_steps} serve: the "
        "first steps of a run do not depend on its length). OBLR-PO's lr is its eta_max (the SNR step applies a "
        "fraction of it)" + (f"; {CALIBRATED}'s is the lr one would give GRPO (`snr_lr_mode=\"calibrated\"`)"
                             if CALIBRATED in args.window_arms else "")
        + f". In the window: mean within {args.tolerance:g} points of the arm's best mean on the grid. "
        f"Collapsed: more than {args.collapse_pts:g} points below the starting model.",
        "",
    ]
    table = []
    for r in rows:
        table.append([r["arm"], f"{r['lr']:.3g}", f"{r['multiple']:.3g}", f"{r['n']}/{planned}", fmt(r["mean"]),
                      f"{fmt(r['min'])}-{fmt(r['max'])}" if r["n"] else "-",
                      ", ".join(f"{v:.0f}" for v in r["values"]) or "not run yet",
                      "yes" if r["in_window"] else "no" if r["n"] else "-",
                      f"{len(r['collapsed'])}/{r['n']}" if r["n"] else "-"])
    lines += md_table(["arm", "lr", "x its lr", "seeds", "mean", "min-max", "per seed", "in window", "collapsed"],
                      table) + ["", "## Each arm's window", ""]
    summary_rows = []
    for arm, s in summaries.items():
        if "best_lr" not in s:
            summary_rows.append([arm] + ["-"] * 6)
            continue
        span = (f"{'<=' if s['open_lo'] else ''}{s['lo']:.3g} to {s['hi']:.3g}{' or more' if s['open_hi'] else ''}")
        summary_rows.append([
            arm, f"{s['best_lr']:.3g} ({s['best_mean']:.1f})", span,
            f"{s['width']:.3g}x" + (" (at least)" if s["open_lo"] or s["open_hi"] else ""),
            f"{s['fine']}/{s['runs']} ({100 * s['fine'] / s['runs']:.0f}%)",
            f"{s['collapsed_above']}/{s['runs_above']}", f"{s['collapsed']}/{s['runs']}"])
    lines += md_table(["arm", "best lr (mean)", "window (contiguous, around the best)", "width",
                       f"runs within {args.tolerance:g} pts of the best mean", "collapsed above its lr",
                       "collapsed, whole grid"], summary_rows)
    lines += calibrated_section(rows, summaries, args)
    lines += ["", "## Collapse rates, Fisher's exact test (two-sided)", ""]
    lines += md_table(["arms", "lrs", "collapsed", "p"],
                      [[f"{t['a']} vs {t['b']}", t["scope"], f"{t['a_collapsed']}/{t['a_runs']} vs "
                        f"{t['b_collapsed']}/{t['b_runs']}", fmt(t["p"], ".3f")] for t in tests])
    lines += ["", f"Plot: `results/{args.out.name}.png` (mean over seeds, band: the seeds' min-max).", ""]
    return "\n".join(lines)


def plot(rows: list[dict], summaries: dict[str, dict], path: Path, tolerance: float, before: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, s in summaries.items():
        cells = [r for r in rows if r["arm"] == arm and r["n"]]
        if not cells:
            continue
        x = [r["lr"] for r in cells]
        line, = ax.plot(x, [r["mean"] for r in cells], marker="o", label=arm + (" (eta_max)" if
                                                                                ARMS[arm][1] else ""))
        ax.fill_between(x, [r["min"] for r in cells], [r["max"] for r in cells], color=line.get_color(), alpha=0.2)
        ax.axhline(s["best_mean"] - tolerance, color=line.get_color(), ls=":", lw=1)
    if before == before:
        ax.axhline(before, color="gray", ls="--", lw=1, label="before RL (mean over seeds)")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (OBLR-PO: eta_max)")
    ax.set_ylabel("greedy held-out accuracy after 20 steps (%)")
    ax.set_title(f"lr window (dotted: each arm's best mean - {tolerance:g} pts; band: seeds' min-max)", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tolerance", type=float, default=5.0, help="points below the arm's best mean still 'fine'")
    p.add_argument("--window_seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=HERE / "results" / "lr_window")
    args, rest = p.parse_known_args(argv)
    design = build_parser().parse_args(rest)  # L, eta_max, --window_arms/steps, --collapse_pts, --records
    for key in ("grpo_lr", "eta_multiple", "window_arms", "window_steps", "collapse_pts", "records"):
        setattr(args, key, getattr(design, key))
    runs = load_runs(args.records)
    rows = window_rows(runs, args)
    summaries = {arm: window_summary(rows, arm, args.tolerance, len(args.window_seeds)) for arm in args.window_arms}
    pairs = [(a, b) for i, a in enumerate(args.window_arms) for b in args.window_arms[i + 1:]]
    tests = collapse_tests(summaries, pairs)
    text = render(rows, summaries, tests, args, len(runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(dict(rows=rows, summaries=summaries, tests=tests), indent=1))
    starts = {r["seed"]: 100 * r["accuracy_before"] for r in runs if r["seed"] in args.window_seeds}
    plot(rows, summaries, args.out.with_suffix(".png"), args.tolerance,
         statistics.mean(starts.values()) if starts else math.nan)
    print(text)


if __name__ == "__main__":
    main()
