"""The README's words from the ablation's tables: "When to use OBLR-PO" (``ablation_when.md``) and the baseline in
training (``ablation_baseline.md``)."""

from __future__ import annotations

import math

from .design import BASELINE_CONTRAST, CONTRASTS, INGREDIENTS, METRICS, POWER_GOAL, PRIMARY, REFERENCE, SNR_ARMS, TITLES
from .render import fmt, long_summary, lr_text


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
    lines += ["Each arm (held-out accuracy after the run, mean over its seeds; the starting model: "
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
    lines += ["", "**Cost** (median s/step of the ablation's runs on a 2-core CPU, evaluations included, with its "
              "range over the runs, and peak memory): " + (", ".join(costs) if costs else "not measured yet")
              + ". No ratio is given here: the runs did not run under the same conditions (GRPO's and RLOO's "
              "whole-batch runs of the earlier round one at a time, for their memory; every other run two or three at "
              "a time, which the range shows); `benchmarks/results/step_cost.md` measures OBLR-PO's step against GRPO's "
              "in one process.",
              "", "**Where it loses**: " + loses + "."]
    lines += ["", "**A too-large lr** (the stability window): " + render_tolerance(list(stab), stab_steps, collapse_pts,
                                                                                  stab_seeds)]
    sentences = long_summary(list(long_rows))
    lines += ["", "**Over a long run** (does the shrinking step stall?): " + (" ".join(sentences) if sentences else
                                                                             "no long run finished yet.")]
    return "\n".join(lines) + "\n"
