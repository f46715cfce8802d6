"""When to use OBLR-PO: three questions users ask, answered with intervals from the measured results.

1. Is there a regime where the gradient-weighted baseline cuts the gradient's variance a lot? From
   ``results/variance_long.json`` (``variance_long.py``): per completion-length bucket (a regime a user picks, through
   the task and ``max_completion_length``) and per within-group norm spread (measured after sampling, not picked),
   OBLR-PO's default reduction against RLOO's leave-one-out mean with its 95% bootstrap interval, beside the free
   proxies (the logit proxy, OPO's length weights, both leave-one-out); a reduction of at least ``--threshold`` (15%)
   is the bar set for a training comparison.
2. If I do not tune the lr, how likely am I to be fine? From ``results/lr_window.json`` (``lr_window.py``): per arm,
   the share of its runs over the lr grid (lrs ~3x apart, each the same number of seeds: an lr drawn log-uniformly
   over the grid's span) whose accuracy after 20 steps is within the tolerance of its best mean on the grid, and of
   the best arm's best mean; the same share within one grid step (~3x) of the arm's design lr; collapses above its
   lr. Exact (Clopper-Pearson) 95% intervals; arms compared with Fisher's exact test (two-sided).
3. Does it help in the paper's regime, where the SNR factor is near 1? From ``results/testbed.json``
   (``testbed.py``): per N on the testbed policy, OBLR-PO against GRPO paired over seeds, with the power.

    python benchmarks/when_to_use.py     # results/when_to_use.md (docs/evidence.md's "When to use OBLR-PO" block)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
from harness import md_table, utc_now  # noqa: E402
from harness.stats import clopper_pearson, fisher_exact  # noqa: E402

EXACT, PROXIES = "exact_loo", {"logit_loo": "logit proxy", "length_loo": "OPO length weights"}
NEAR = (0.25, 3.5)  # one grid step (~3x) either side of the design lr: multiples 1/3 (0.3 for eta_max), 1, 10/3


def reduction(row: dict, method: str) -> tuple[float, list[float] | None]:
    """1 - the method's variance ratio to RLOO in a bucket row, and the interval of that reduction (None: too few)."""
    ci = row["ci"].get(method)
    return 1 - row["ratio"][method], ([1 - ci[1], 1 - ci[0]] if ci else None)


def variance_answer(analysis: dict, threshold: float) -> dict:
    """Per table (length, spread), the buckets with an interval, OBLR-PO's reduction and each proxy's; the buckets
    at or over the threshold, whether their interval excludes 0, and whether a proxy reaches the same point."""
    out = {}
    for name, table in analysis["tables"].items():
        rows = []
        for bucket in analysis.get("orders", {}).get(name, list(table)):
            if bucket not in table:
                continue
            row = table[bucket]
            red, ci = reduction(row, EXACT)
            if ci is None or bucket == "all groups":
                continue
            proxies = {m: reduction(row, m) for m in PROXIES if m in row["ratio"]}
            rows.append(dict(bucket=bucket, groups=row["groups"], prompts=row["prompts"], reduction=red, ci=ci,
                             proxies=proxies, over=red >= threshold, excludes_zero=ci[0] > 0,
                             matched_by=[PROXIES[m] for m, (r, _) in proxies.items() if r >= red - 0.02]))
        out[name] = rows
    return out


def share(k: int, n: int) -> dict:
    lo, hi = clopper_pearson(k, n) if n else (float("nan"), float("nan"))
    return dict(k=k, n=n, p=k / n if n else float("nan"), ci=[lo, hi])


def lr_answer(window: dict, tolerance: float) -> dict:
    """Per arm: the shares of runs fine against its own best mean, against the best arm's, and within one grid step
    of its design lr; collapses above its lr. Fisher's exact test of each arm's shares against the others'."""
    summaries = {a: s for a, s in window["summaries"].items() if "best_mean" in s}
    best_any = max(s["best_mean"] for s in summaries.values())
    arms = {}
    for arm, s in summaries.items():
        cells = [r for r in window["rows"] if r["arm"] == arm and r["n"]]
        values = [v for r in cells for v in r["values"]]
        near = [v for r in cells if NEAR[0] <= r["multiple"] <= NEAR[1] for v in r["values"]]
        above = [r for r in cells if r["multiple"] > 1]
        arms[arm] = dict(
            own=share(sum(v >= s["best_mean"] - tolerance for v in values), len(values)),
            any=share(sum(v >= best_any - tolerance for v in values), len(values)),
            near=share(sum(v >= s["best_mean"] - tolerance for v in near), len(near)),
            collapsed_above=share(sum(len(r["collapsed"]) for r in above), sum(r["n"] for r in above)),
            best_mean=s["best_mean"], width=s["width"], open=s["open_lo"] or s["open_hi"], lo=s["lo"], hi=s["hi"],
            incomplete=len(s["incomplete"]), cells=s["cells"])
    tests = []
    names = list(arms)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for key in ("own", "any", "collapsed_above"):
                x, y = arms[a][key], arms[b][key]
                p = fisher_exact(x["k"], x["n"] - x["k"], y["k"], y["n"] - y["k"]) if x["n"] and y["n"] else float("nan")
                tests.append(dict(a=a, b=b, what=key, p=p))
    return dict(arms=arms, tests=tests, best_any=best_any, incomplete=sum(a["incomplete"] for a in arms.values()))


def pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def fmt_share(s: dict) -> str:
    if not s["n"]:
        return "-"
    return f"{s['k']}/{s['n']} ({100 * s['p']:.0f}%) [{100 * s['ci'][0]:.0f}%, {100 * s['ci'][1]:.0f}%]"


def render_variance(answer: dict, threshold: float) -> list[str]:
    lines = ["## Is there a regime where the gradient-weighted baseline cuts the variance a lot?", ""]
    rows = [[name, r["bucket"], r["groups"], f"{pct(r['reduction'])} [{pct(r['ci'][0])}, {pct(r['ci'][1])}]"]
            + [pct(r["proxies"][m][0]) if m in r["proxies"] else "-" for m in PROXIES]
            for name, table in answer.items() for r in table]
    lines += md_table(["bucket by", "bucket", "groups", "OBLR-PO default vs RLOO: variance reduction [95%]"]
                      + [f"{label} (leave-one-out)" for label in PROXIES.values()], rows) + [""]
    chosen = answer.get("length", [])
    best = max(chosen, key=lambda r: r["reduction"], default=None)
    if best is not None:
        verdict = "reaches" if best["over"] else "does not reach"
        lines.append(
            f"**By completion length (a regime you choose), no bucket reaches {threshold:.0%}** " if not best["over"]
            else f"**By completion length (a regime you choose), a bucket reaches {threshold:.0%}** ")
        lines[-1] += (f"(the largest reduction: {pct(best['reduction'])} [{pct(best['ci'][0])}, {pct(best['ci'][1])}] "
                      f"at {best['bucket']} tokens, which {verdict} it).")
    for r in answer.get("spread", []):
        if r["over"]:
            lines.append(
                f"By the within-group norm spread (measured after sampling, not chosen), {r['bucket']} reaches it: "
                f"{pct(r['reduction'])} [{pct(r['ci'][0])}, {pct(r['ci'][1])}] over {r['groups']} groups, "
                + ("its interval excluding 0" if r["excludes_zero"] else "its interval including 0")
                + ("; matched (within 2 points) by " + " and ".join(r["matched_by"])
                   + (", which need" if len(r["matched_by"]) > 1 else ", which needs") + " no norms"
                   if r["matched_by"] else "; no free proxy matches it") + ".")
    return lines + [""]


def render_lr(answer: dict, tolerance: float) -> list[str]:
    lines = ["## If I do not tune the lr, how likely am I to be fine?", ""]
    if answer["incomplete"]:
        lines += [f"**Partial: {answer['incomplete']} cells of the lr grid have fewer than their planned seeds "
                  "(`lr_window.md`); the shares count the runs that are in.**", ""]
    rows = [[arm, f"{a['best_mean']:.1f}", f"{a['width']:.3g}x" + (" (at least)" if a["open"] else ""),
             fmt_share(a["own"]), fmt_share(a["any"]), fmt_share(a["near"]), fmt_share(a["collapsed_above"])]
            for arm, a in answer["arms"].items()]
    lines += md_table(["arm", "best mean on the grid", "window width",
                       f"runs within {tolerance:g} pts of its own best", f"... of the best arm's best "
                       f"({answer['best_any']:.1f})", "... of its own best, within ~3x of its design lr",
                       "collapsed above its lr"], rows) + [""]
    lines.append("Fisher's exact test (two-sided) of the shares: " + "; ".join(
        f"{t['a']} vs {t['b']} ({ {'own': 'own best', 'any': 'best arm', 'collapsed_above': 'collapses'}[t['what']]}) "
        f"p = {t['p']:.2f}" for t in answer["tests"]) + ".")
    return lines + [""]


def render_regime(testbed: dict | None) -> list[str]:
    """Question 3: per regime (N and the SNR factor f = N / (N + B) at the start) on the testbed policy, OBLR-PO
    against GRPO, each at its best lr, paired over seeds: per metric the difference, its interval and the power."""
    lines = ["## 3. Does it help in the paper's regime, where the SNR factor is near 1?", ""]
    rows = []
    for n, cmp in sorted((testbed or {}).get("compare", {}).items(), key=lambda kv: -int(kv[0])):
        regime = testbed.get("regime", {}).get(n, {})
        for metric in ("sampled (held-out)", "last-10 reward", "greedy (held-out)"):
            c = cmp.get(metric)
            if not c or c.get("ci") is None:
                continue
            lo, hi = c["ci"]
            verdict = "better" if lo > 0 else "worse" if hi < 0 else "no difference detected"
            f, b = regime.get("f_ref", regime.get("f", float("nan"))), regime.get("B_ref", regime.get("B", float("nan")))
            rows.append([f"N = {n}, f = {f:.2f} (B = {b:.1f})",
                         metric, str(c["n"]), f"{c['mean']:+.1f} [{lo:+.1f}, {hi:+.1f}]", verdict,
                         f"{100 * c['power']:.0f}%", str(c.get("seeds_for_80") or ">60")])
    if not rows:
        return lines + ["Not measured yet (`python benchmarks/testbed.py`).", ""]
    lines += ["From `results/testbed.json` (`testbed.py`, `testbed.md`): the testbed policy (0.29M parameters, digit "
              "reversal, a warm-up that leaves the choice of behaviour to RL, so its per-prompt gradients agree), "
              "OBLR-PO against GRPO each at the best lr of its own grid, paired over seeds; differences in points, "
              "power to detect 3 points.", ""]
    lines += md_table(["regime", "metric", "seeds", "OBLR-PO - GRPO (pts) [95%]", "verdict", "power (3 pts)",
                       "seeds for 80%"], rows)
    return lines + [""]


def render(variance: dict, window: dict, args) -> str:
    lines = ["# When to use OBLR-PO: three questions, answered by measurement", "",
             f"Generated by `python benchmarks/when_to_use.py` on {utc_now(minutes=True)} from "
             "`results/variance_long.json` (SmolLM2-135M-Instruct, long show-your-work completions, fixed parameters) "
             "and `results/lr_window.json` (the ablation's task, 20-step runs); question 3 from `results/testbed.json` "
             "(the testbed policy). Intervals: 95% (bootstrap for the "
             "variance, Clopper-Pearson for shares of runs); a share over the grid is the chance of being fine with an "
             "lr drawn log-uniformly over the grid's span (lrs ~3x apart, 0.1x to 33x the arm's design lr).", ""]
    lines += render_variance(variance_answer(variance, args.threshold), args.threshold)
    lines += render_lr(lr_answer(window, args.tolerance), args.tolerance)
    testbed = getattr(args, "testbed", None)  # results/testbed.json (absent: question 3 says it is not measured)
    lines += render_regime(json.loads(testbed.read_text()) if testbed and testbed.exists() else None)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threshold", type=float, default=0.15, help="the variance reduction that would call for training")
    p.add_argument("--tolerance", type=float, default=5.0, help="points below the best mean still 'fine'")
    p.add_argument("--variance", type=Path, default=HERE / "results" / "variance_long.json")
    p.add_argument("--window", type=Path, default=HERE / "results" / "lr_window.json")
    p.add_argument("--testbed", type=Path, default=HERE / "results" / "testbed.json")
    p.add_argument("--out", type=Path, default=HERE / "results" / "when_to_use.md")
    args = p.parse_args(argv)
    text = render(json.loads(args.variance.read_text()), json.loads(args.window.read_text()), args)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
