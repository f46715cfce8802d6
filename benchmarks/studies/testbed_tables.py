"""The testbed study's tables and figure from its run records (``benchmarks/testbed.py --no_run`` writes them)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from harness import md_table, utc_now

from . import testbed_study as S

DELTA = 3.0


def pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f}"


def lr_of(r: dict) -> str:
    return f"{r['lr']:.3g}"


def steps_text(runs: list[dict], default: int) -> str:
    """The steps per run, per N where they differ."""
    per_n = {r["prompts"]: r["steps"] for r in runs}
    if len(set(per_n.values())) <= 1:
        return f"{next(iter(per_n.values()), default)} steps"
    return "steps per run: " + ", ".join(f"{s} at N = {n}" for n, s in sorted(per_n.items(), reverse=True))


def spec_text(fields: str) -> str:
    from dataclasses import asdict

    from oblr_trl.demo.testbed import TestbedSpec

    spec = TestbedSpec(**json.loads(fields))
    return "`TestbedSpec(" + ", ".join(f"{k}={v!r}" for k, v in asdict(spec).items()) + f")`, key `{spec.key()}`"


def reference_b(runs: list[dict]) -> tuple[int, float] | tuple[None, None]:
    """(N, median B at the start) over the OBLR-PO runs at the largest N that has any: the steadiest estimate."""
    for n in sorted({r["prompts"] for r in runs}, reverse=True):
        bs = [b for r in runs if r["prompts"] == n and r["arm"] == "OBLR-PO" and (b := S.start_noise_scale(r)) is not None]
        if bs:
            return n, statistics.median(bs)
    return None, None


def regime_rows(runs: list[dict], prompts: list[int]) -> list[list[str]]:
    rows = []
    ref_n, ref_b = reference_b(runs)
    for n in prompts:
        mine = [r for r in runs if r["prompts"] == n]
        bs = sorted(b for r in mine if r["arm"] == "OBLR-PO" and (b := S.start_noise_scale(r)) is not None)
        starts = [r["curve"][0]["sampled"] for r in mine if r["curve"] and r["curve"][0]["step"] == 0]
        sps = {arm: statistics.median(r["seconds_per_step"] for r in mine if r["arm"] == arm)
               for arm in ("GRPO", "OBLR-PO") if any(r["arm"] == arm for r in mine)}
        cpu = statistics.median(r["cpu_seconds"] for r in mine) if mine else math.nan
        b = statistics.median(bs) if bs else None
        rows.append([str(n), pct(statistics.mean(starts)) if starts else "-",
                     "-" if b is None else f"{b:.1f} ({bs[0]:.1f}-{bs[-1]:.1f}, {len(bs)} runs)",
                     "-" if b is None else f"{S.factor(n, b):.2f}",
                     "-" if ref_b is None else f"{S.factor(n, ref_b):.2f}",
                     "; ".join(f"{a} {v:.1f}" for a, v in sps.items()), f"{cpu:.0f}", str(len(mine))])
    return rows


def search_rows(probes: list[dict]) -> list[list[str]]:
    """The search's probes (a few OBLR-PO steps of each candidate warm-up): its wrong answers, N, B at step 1, f."""
    rows = []
    for r in sorted(probes, key=lambda r: (r["spec"].get("testbed", {}).get("wrong", "copy"), r["prompts"])):
        t = r["spec"].get("testbed", {})
        b = S.start_noise_scale(r)
        rows.append([t.get("wrong", "copy"), f"{t.get('p_reverse', 0.35):.2f}", str(r["prompts"]),
                     pct(r["curve"][0]["sampled"]), pct(r["history"][0]["reward"]), f"{b:.1f}",
                     f"{S.factor(r['prompts'], b):.2f}", f"{S.factor(2, b):.2f}", f"{r['seconds_per_step']:.1f}"])
    return rows


def grid_rows(runs: list[dict], arm: str, prompts: int, seed: int) -> list[list[str]]:
    cells = sorted((r for r in runs if r["arm"] == arm and r["prompts"] == prompts and r["seed"] == seed),
                   key=lambda r: r["lr"])
    rows = []
    for r in cells:
        first, last = S.first_last(r)
        applied = [h["oblr/lr"] for h in r["history"] if "oblr/lr" in h]
        rows.append([arm, lr_of(r), r.get("lr_mode") or "-", f"{statistics.mean(applied):.3g}" if applied else lr_of(r),
                     pct(first), pct(last),
                     f"{100 * (last - first):+.1f}", pct(r["sampled"]), pct(r["greedy"])])
    return rows


def control_rows(runs: list[dict], prompts: int, lr: float) -> tuple[list[list[str]], dict]:
    rows, gains = [], {}
    for arm in ("GRPO", "GRPO-shuffled"):
        for r in sorted(S_pick(runs, arm, prompts, lr), key=lambda r: r["seed"]):
            first, last = S.first_last(r)
            gains.setdefault(arm, []).append(last - first)
            rows.append([arm, str(r["seed"]), pct(first), pct(last), f"{100 * (last - first):+.1f}", pct(r["sampled"])])
    return rows, gains


def S_pick(runs, arm, prompts, lr):
    return [r for r in runs if r["arm"] == arm and r["prompts"] == prompts and math.isclose(r["lr"], lr, rel_tol=1e-6)]


def best_of(runs: list[dict], arm: str, prompts: int, grid_seed: int, points: int = 5) -> float | None:
    """An arm's best lr on the grid seed, once its grid has at least `points` lrs there (None before)."""
    lrs = sorted({r["lr"] for r in runs if r["arm"] == arm and r["prompts"] == prompts and r["seed"] == grid_seed})
    if len(lrs) < points:
        return None
    return S.best_lr([r for r in runs if r["prompts"] == prompts], arm, lrs, [grid_seed])


METRICS = {"sampled (held-out)": lambda r: r["sampled"], "last-10 reward": S.last_reward,
           "greedy (held-out)": lambda r: r["greedy"]}


ARMS = ("GRPO", "OBLR-PO", "SNR-only", "baseline-only")


def compare_section(runs: list[dict], prompts: int, grid_seed: int, points: int = 5) -> tuple[list[str], dict]:
    """Each arm at its best lr against GRPO, paired by seed. ``out[metric]``: OBLR-PO's contrast; ``out["halves"]``
    the halves' (SNR-only, baseline-only) where they ran."""
    present = [a for a in ARMS if any(r["arm"] == a and r["prompts"] == prompts for r in runs)]
    best = {arm: best_of(runs, arm, prompts, grid_seed, points) for arm in present}
    lines = [f"Best lr on seed {grid_seed} (highest last-10 training reward): "
             + ", ".join(f"{a} {'-' if b is None else f'{b:.3g}'}" for a, b in best.items()) + ".", ""]
    out = dict(best=best)
    if best.get("GRPO") is None or best.get("OBLR-PO") is None:
        return lines, out
    best = {a: b for a, b in best.items() if b is not None}
    seeds = {arm: S_pick(runs, arm, prompts, best[arm]) for arm in best}
    modes = sorted({r.get("lr_mode") or "eta_max" for r in seeds["OBLR-PO"]})
    out["lr_mode"] = " and ".join(modes)
    rows = []
    for arm in best:
        if arm == "GRPO":
            continue
        for name, metric in METRICS.items():
            g = {r["seed"]: metric(r) for r in seeds["GRPO"]}
            o = {r["seed"]: metric(r) for r in seeds[arm]}
            c = S.contrast(o, g, DELTA)
            if arm == "OBLR-PO":
                out[name] = c
            else:
                out.setdefault("halves", {}).setdefault(arm, {})[name] = c
            ci = "-" if c["ci"] is None else f"[{c['ci'][0]:+.1f}, {c['ci'][1]:+.1f}]"
            common = c["seeds"]
            rows.append([arm, name, str(c["n"]), pct(statistics.mean(g[s] for s in common)) if common else "-",
                         pct(statistics.mean(o[s] for s in common)) if common else "-", f"{c['mean']:+.1f}", ci,
                         "-" if c["power"] != c["power"] else f"{100 * c['power']:.0f}%",
                         str(c["seeds_for_80"] or ">60")])
    lines += md_table(["arm", "metric", "paired seeds", "GRPO %", "arm %", "arm - GRPO (pts)", "95% interval",
                       f"power ({DELTA:g} pts)", "seeds for 80%"], rows)
    # rollouts to reach GRPO's final training reward, on the seed-mean curves (5-step trailing mean)
    per_step = prompts * 8
    target = statistics.mean(S.last_reward(r) for r in seeds["GRPO"])
    start = statistics.mean(S.rewards(r)[0] for r in seeds["GRPO"])
    nine_tenths = start + 0.9 * (target - start)
    reach = []
    for arm in best:
        curve = S.smoothed(S.mean_curve(seeds[arm]))
        k = S.rollouts_to_reach(curve, target, per_step)
        k90 = S.rollouts_to_reach(curve, nine_tenths, per_step)
        reach.append([arm, str(len(seeds[arm])), "not reached" if k is None else f"{k:,}",
                      "not reached" if k90 is None else f"{k90:,}", f"{len(curve) * per_step:,}"])
        out.setdefault("rollouts", {})[arm] = k
        out.setdefault("rollouts_90", {})[arm] = k90
    lines += ["", f"Rollouts each arm needs to reach GRPO's final training reward ({pct(target)}%: GRPO's mean last-10 "
              f"reward over its seeds), and 90% of GRPO's gain ({pct(nine_tenths)}%: its first step's reward plus 0.9 of "
              "the way to the final), on the seed-mean reward curve (5-step trailing mean; rollouts = steps x N x 8):",
              ""]
    lines += md_table(["arm", "seeds", f"rollouts to {pct(target)}%", f"rollouts to {pct(nine_tenths)}%",
                       "rollouts in the run"], reach)
    out["target"] = target
    return lines, out


def figure(runs: list[dict], prompts: int, best: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm, lr in best.items():
        if lr is None:
            continue
        rs = S_pick(runs, arm, prompts, lr)
        if not rs:
            continue
        curve = S.mean_curve(rs)
        ax.plot([(i + 1) * prompts * 8 for i in range(len(curve))], [100 * v for v in curve],
                label=f"{arm} (lr {lr:.3g}, {len(rs)} seeds)")
    ax.set_xlabel("rollouts")
    ax.set_ylabel("training reward (%)")
    ax.set_title(f"Testbed, N = {prompts} x 8: seed-mean training reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render_all(args, runs: list[dict], command: str) -> None:
    n = args.prompts
    grpo_best = best_of(runs, "GRPO", n, args.grid_seed, args.points)
    lines = ["# The paper's regime on a CPU: the testbed policy", "",
             f"Generated by `{command}` on {utc_now(minutes=True)} from the {len(runs)} records in "
             "`benchmarks/results/testbed_runs/`. Every run: `benchmarks/studies/testbed_run.py` on the testbed policy "
             f"(`oblr_trl.demo.testbed`, {spec_text(args.testbed)}), N prompts x 8 completions per step at T = 1, "
             f"{steps_text(runs, args.steps)}, constant lr, fresh training-split problems each step, 1 torch thread, `nice -n 10` on "
             "a 2-core CPU also running other work (seconds per step are wall-clock; each record has its CPU seconds). B: the trainer's "
             "`oblr/noise_scale` at step 1 of each OBLR-PO run (before any update); f = N / (N + B). Held-out "
             "problems: distinct problems of the held-out split (a hash of the digit string), never trained on.", "",
             "## The regime", ""]
    lines += md_table(["N", "start sampled accuracy %", "B at the start (prompts): median (range, runs)",
                       "f = N/(N+B)", "f from the B of the largest N", "s/step (median)", "CPU s per run (median)", "runs"],
                      regime_rows(runs, sorted({r["prompts"] for r in runs})))
    probes = [json.loads(p.read_text()) for p in sorted(args.search.glob("*.json"))]
    if probes:
        lines += ["", "## The search: candidate warm-ups", "",
                  "Each candidate: the warm-up's share of right answers and what its other answers were (`copy`: the "
                  "digits unchanged; `period`: the right digits then a period, which the verifier rejects; `mixed`: "
                  "half each), probed by a 2- or 3-step OBLR-PO run (`benchmarks/studies/testbed_run.py`, records in "
                  "`benchmarks/results/testbed_search/`). B at step 1 is before any update.", ""]
        lines += md_table(["wrong answers", "right share", "N", "start sampled held-out %", "step-1 reward %",
                           "B at step 1 (prompts)", "f at that N", "f at N = 2", "s/step"], search_rows(probes))
    lines += ["", f"## GRPO's lr grid (N = {n}, seed {args.grid_seed})", ""]
    lines += md_table(["arm", "lr", "lr reading", "applied lr (mean)", "first-10 reward %", "last-10 reward %",
                       "gain (pts)",
                       "sampled held-out %", "greedy held-out %"], grid_rows(runs, "GRPO", n, args.grid_seed))
    verdict = {}
    if grpo_best is not None:
        rows, gains = control_rows(runs, n, grpo_best)
        lines += ["", f"## Learning: GRPO against the shuffled-reward control (lr {grpo_best:.3g}, N = {n})", "",
                  "The control permutes each step's rewards across its completions: the same reward level, no "
                  "information. Training reward is on fresh training-split problems.", ""]
        lines += md_table(["arm", "seed", "first-10 reward %", "last-10 reward %", "gain (pts)", "sampled held-out %"],
                          rows)
        if gains.get("GRPO") and gains.get("GRPO-shuffled"):
            learned = min(gains["GRPO"]) > max(gains["GRPO-shuffled"])
            verdict = dict(grpo_gain_min=min(gains["GRPO"]), shuffled_gain_max=max(gains["GRPO-shuffled"]),
                           learns=learned)
            lines += ["", f"GRPO's smallest gain {100 * min(gains['GRPO']):+.1f} pts against the control's largest "
                      f"{100 * max(gains['GRPO-shuffled']):+.1f}: "
                      + ("GRPO learns beyond the control on every seed." if learned else
                         "not separated from the control.")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    (args.out.parent / (args.out.name + "_regime.md")).write_text("\n".join(lines) + "\n")
    # the comparison
    lines = ["# GRPO against OBLR-PO on the testbed policy", "", f"Generated by `{command}` on {utc_now(minutes=True)} "
             "from the records in `benchmarks/results/testbed_runs/` (runs as in `testbed_regime.md`). Each arm's lr "
             f"grid on seed {args.grid_seed} (the SNR arms' `learning_rate` read as the \"lr reading\" column says: "
             "`eta_max`, the paper's reading, in the runs made before the package's drop-in reading was installed; "
             "`calibrated`, the lr one would give GRPO, after), then seeds at each arm's best lr; paired by seed (the same "
             "warm policy, problems and first batch). Differences in points with Student-t 95% intervals; power of "
             f"the paired t-test to detect {DELTA:g} points at the observed spread.", ""]
    result = {}
    for prompts in sorted({r["prompts"] for r in runs}, reverse=True):
        if not any(r["arm"] == "OBLR-PO" for r in runs if r["prompts"] == prompts):
            continue
        lines += [f"## N = {prompts}", "", "### lr grids", ""]
        lines += md_table(["arm", "lr", "lr reading", "applied lr (mean)", "first-10 reward %", "last-10 reward %",
                       "gain (pts)",
                           "sampled held-out %", "greedy held-out %"],
                          [row for arm in ARMS for row in grid_rows(runs, arm, prompts, args.grid_seed)])
        lines += ["", "### Paired seeds at each arm's best lr", ""]
        section, out = compare_section(runs, prompts, args.grid_seed, args.points)
        lines += section
        fig = args.out.parent / f"{args.out.name}_compare_N{prompts}.png"
        if figure(runs, prompts, out["best"], fig):
            lines += ["", f"![seed-mean training reward, N = {prompts}]({fig.name})"]
        lines += [""]
        result[str(prompts)] = {k: v for k, v in out.items()}
    (args.out.parent / (args.out.name + "_compare.md")).write_text("\n".join(lines) + "\n")
    regime = {}
    for prompts in sorted({r["prompts"] for r in runs}):
        bs = [b for r in runs if r["prompts"] == prompts and r["arm"] == "OBLR-PO"
              and (b := S.start_noise_scale(r)) is not None]
        if bs:
            b = statistics.median(bs)
            ref_n, ref_b = reference_b(runs)
            regime[str(prompts)] = dict(B=b, f=S.factor(prompts, b), runs=len(bs), B_ref=ref_b, N_ref=ref_n,
                                        f_ref=S.factor(prompts, ref_b),
                                        steps=max(r["steps"] for r in runs if r["prompts"] == prompts))
    (args.out.parent / (args.out.name + "_when.md")).write_text(
        "# When to use: the paper's regime on the testbed policy\n\n" + when_text(verdict, regime, result) + "\n")
    (args.out.parent / (args.out.name + ".json")).write_text(json.dumps(dict(learning=verdict, regime=regime,
                                                                             compare=result),
                                                                        indent=1, default=str))


SHORT = {"sampled (held-out)": "sampled held-out", "last-10 reward": "last-10 reward", "greedy (held-out)": "greedy"}


def verdict_of(c: dict) -> str:
    if c.get("ci") is None:
        return f"{c['mean']:+.1f} pts ({c['n']} seeds, no interval yet)"
    lo, hi = c["ci"]
    word = "better" if lo > 0 else "worse" if hi < 0 else "no difference detected"
    return f"{c['mean']:+.1f} pts [{lo:+.1f}, {hi:+.1f}] {word}"


def contrast_text(cs: dict) -> str:
    """Per metric the difference, interval and verdict; then the powers' range and the seeds."""
    said = ". ".join(f"{SHORT[m].capitalize() if i else SHORT[m]} {verdict_of(cs[m])}"
                     for i, m in enumerate(m for m in METRICS if m in cs))
    powers = [cs[m]["power"] for m in METRICS if m in cs and cs[m]["power"] == cs[m]["power"]]
    seeds = max((cs[m]["n"] for m in METRICS if m in cs), default=0)
    if powers:
        said += (f" ({seeds} paired seeds; power {100 * min(powers):.0f}-{100 * max(powers):.0f}% for {DELTA:g} "
                 "pts)")
    return said


def when_text(learning: dict, regime: dict, compare: dict) -> str:
    """The sentence "When to use" quotes: per N, the regime (f at the start) and OBLR-PO against GRPO (the halves,
    where they ran, in the comparison's table only)."""
    parts = []
    for n, out in sorted(compare.items(), key=lambda kv: -int(kv[0])):
        reg = regime.get(n, {})
        f, b = reg.get("f_ref", reg.get("f", math.nan)), reg.get("B_ref", reg.get("B", math.nan))
        where = f" from N = {reg['N_ref']}" if reg.get("N_ref") not in (None, int(n)) else ""
        head = (f"**N = {n}** ({reg.get('steps', '?')} steps): f = {f:.2f} at the start (B = {b:.1f} prompts{where}). "
                f"OBLR-PO - GRPO")
        if "sampled (held-out)" not in out:
            parts.append(head + ": not run to its seeds yet.")
            continue
        mode = f", read as {out['lr_mode']}" if out.get("lr_mode") else ""
        text = f"{head} at best lrs ({out['best']['GRPO']:.3g}; {out['best']['OBLR-PO']:.3g}{mode}): {contrast_text(out)}"
        r90 = ", ".join(f"{a} {'never' if k is None else f'{k:,}'}" for a, k in out.get("rollouts_90", {}).items()
                        if a in ("GRPO", "OBLR-PO"))
        parts.append(text + f". Rollouts to 90% of GRPO's gain: {r90}.")
    learned = ""
    if learning:
        learned = (f"GRPO learns (reward gain {100 * learning['grpo_gain_min']:+.1f} pts or more; shuffled-reward "
                   f"control {100 * learning['shuffled_gain_max']:+.1f} or less). ")
    judged = [out[m] for out in compare.values() for m in METRICS if m in out and out[m].get("ci")]
    excluded = any(c["ci"][0] > 0 or c["ci"][1] < 0 for c in judged)
    tail = (" An interval excludes 0: on this policy only." if excluded else
            " No interval excludes 0: no default changes." if judged else "")
    return learned + " ".join(parts) + tail
