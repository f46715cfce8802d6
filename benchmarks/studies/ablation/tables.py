"""The ablation's tables, from its records: per arm, the paired contrasts, the lr check, the long runs, the step-size
curves and the stability window. Values only (dicts of numbers); ``render`` and ``when`` write them as text."""

from __future__ import annotations

import math
import statistics

from harness.stats import paired_difference, paired_power, problem_paired_se, seeds_for_power

from .design import ARMS, CONTRASTS, METRICS, PRIMARY, REFERENCE, check_multiples, lr_of, micro_batch_of
from .records import applied_lrs, by_seed, curve_at, large_correct


def verdict(diff: dict) -> str:
    """'better' / 'worse' when the 95% interval excludes 0, 'no difference detected', or 'too few seeds'."""
    if diff["ci"] is None:
        return f"too few seeds ({diff['n']})"
    lo, hi = diff["ci"]
    return "better" if lo > 0 else "worse" if hi < 0 else "no difference detected"

def measurement_se(runs: list[dict], a: str, lr_a: float, b: str, lr_b: float, seeds: list[int]) -> float | None:
    """Mean over the seeds both cells scored on the same large set of the problem-level standard error (points) of
    their difference: how much of a per-seed difference is measurement noise rather than the runs."""
    mine, ref = large_correct(runs, a, lr_a), large_correct(runs, b, lr_b)
    ses = [problem_paired_se(mine[s][1], ref[s][1]) for s in seeds
           if s in mine and s in ref and mine[s][0] == ref[s][0]]
    return statistics.mean(ses) if ses else None

def arm_table(runs: list[dict], arms: list[str], grpo_lr: float, seeds: list[int], *, eta: float) -> list[dict]:
    """Per arm at its lr in the round (L = `grpo_lr`, eta_max = `eta` L): seeds run, and per metric the mean and sd
    over them (points), and s/step."""
    rows = []
    for arm in arms:
        lr = lr_of(arm, grpo_lr, eta=eta)
        row = dict(arm=arm, lr=lr)
        for label, key in METRICS.items():
            values = [v for s, v in by_seed(runs, arm, lr, f"{key}_after").items() if s in seeds]
            row[label] = dict(n=len(values), mean=statistics.mean(values) if values else math.nan,
                              sd=statistics.stdev(values) if len(values) > 1 else math.nan)
        per_step = [r["seconds_per_step"] for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)
                    and r["seed"] in seeds]
        row["seconds_per_step"] = statistics.median(per_step) if per_step else math.nan
        row["seconds_per_step_range"] = (min(per_step), max(per_step)) if per_step else None  # sharing the machine
        applied = [r["mean_applied_lr"] for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)
                   and r["seed"] in seeds and r.get("mean_applied_lr") is not None]
        row["mean_applied_lr"] = statistics.mean(applied) if applied else math.nan  # eta_max x the SNR factor
        peaks = [r["peak_rss_gb"] for r in runs if r["arm"] == arm and r.get("peak_rss_gb") is not None
                 and (r.get("micro_batch") or None) == micro_batch_of(arm)]
        row["peak_rss_gb"] = max(peaks) if peaks else math.nan  # at any lr and seed, as the arm runs now
        rows.append(row)
    return rows

def contrast_row(runs: list[dict], name: str, a: str, lr_a: float, b: str, lr_b: float, seeds: list[int],
                 delta: float) -> dict:
    """One contrast (arm `a` at `lr_a` minus arm `b` at `lr_b`) over `seeds` (its planned seeds), per metric: the
    per-seed differences (points), their mean, sd, 95% interval, the power to detect `delta` points at the observed sd
    and n, and the seeds power 0.8 would need; on the powered measurement also the problem-level measurement noise of
    a difference."""
    row = dict(name=name, a=a, b=b, lr_a=lr_a, lr_b=lr_b, planned=len(seeds))
    for label, key in METRICS.items():
        mine = {s: v for s, v in by_seed(runs, a, lr_a, f"{key}_after").items() if s in seeds}
        ref = {s: v for s, v in by_seed(runs, b, lr_b, f"{key}_after").items() if s in seeds}
        diff = paired_difference(mine, ref)
        if diff["n"] >= 3 and diff["sd"] > 0:
            diff["power"] = paired_power(delta, diff["sd"], diff["n"])
            diff["seeds_for_80"] = seeds_for_power(delta, diff["sd"])
        diff["verdict"] = verdict(diff)
        if label == PRIMARY:
            diff["measurement_se"] = measurement_se(runs, a, lr_a, b, lr_b, seeds)
        row[label] = diff
    return row

def pair_seeds(a: str, b: str, seeds: list[int], power_seeds: list[int] = (), power_arms: list[str] = ()) -> list[int]:
    """The planned seeds of arm `a` against arm `b`: `seeds`, and `power_seeds` where both are among `power_arms`."""
    return [*seeds, *(power_seeds if a in power_arms and b in power_arms else ())]

def contrast_table(runs: list[dict], grpo_lr: float, seeds: list[int], delta: float,
                   contrasts=CONTRASTS, *, eta: float, power_seeds: list[int] = (),
                   power_arms: list[str] = ()) -> list[dict]:
    """Every contrast of the design at GRPO's lr `grpo_lr` (each arm at its lr in the round, the SNR arms' eta_max
    `eta` x it): `contrast_row`'s, over `seeds` and, where both its arms are among `power_arms`, `power_seeds` too."""
    return [contrast_row(runs, name, a, lr_of(a, grpo_lr, eta=eta), b, lr_of(b, grpo_lr, eta=eta),
                         pair_seeds(a, b, seeds, power_seeds, power_arms), delta)
            for name, a, b in contrasts]

def against_best(runs: list[dict], arms: list[str], earlier_lr: float, grpo_lr: float, seeds: list[int],
                 delta: float, *, eta: float, power_seeds: list[int] = (), power_arms: list[str] = ()) -> list[dict]:
    """Each arm of an earlier round (at its lr in that round: L = `earlier_lr`, eta_max = `eta` x it) minus GRPO at
    the design's `grpo_lr`, its best lr on this task, per seed: what the earlier round's arms give against a GRPO
    tuned on this task. Over `seeds`, and `power_seeds` too where the arm and GRPO are among `power_arms` (the runs
    there are at the design's lrs, so a cell the two rounds share gets the design's seeds)."""
    return [contrast_row(runs, f"{arm} at {lr_of(arm, earlier_lr, eta=eta):.3g} vs GRPO at {grpo_lr:.3g}", arm,
                         lr_of(arm, earlier_lr, eta=eta), REFERENCE, grpo_lr,
                         pair_seeds(arm, REFERENCE, seeds, power_seeds, power_arms), delta)
            for arm in arms if arm != REFERENCE]

def lr_check_table(runs: list[dict], args) -> list[dict]:
    """Is each checked arm at its best lr on this task (L, or the SNR arms' eta_max)? Per checked arm and lr multiple
    (1 first; `check_multiples`): the seeds run, the mean held-out accuracy after RL, and the per-seed difference to
    the arm at its own lr (same seeds)."""
    rows = []
    for arm in args.lr_check_arms:
        own = lr_of(arm, args.grpo_lr, eta=args.eta_multiple)
        at_own = {label: {s: v for s, v in by_seed(runs, arm, own, f"{key}_after").items()
                          if s in args.lr_check_seeds} for label, key in METRICS.items()}
        for m in [1.0, *check_multiples(args, arm)]:
            lr = lr_of(arm, args.grpo_lr, m, eta=args.eta_multiple)
            row = dict(arm=arm, multiple=m, lr=lr)
            for label, key in METRICS.items():
                mine = {s: v for s, v in by_seed(runs, arm, lr, f"{key}_after").items() if s in args.lr_check_seeds}
                diff = paired_difference(mine, at_own[label]) if m != 1.0 else None
                if diff is not None:
                    diff["verdict"] = verdict(diff)
                row[label] = dict(n=len(mine), mean=statistics.mean(mine.values()) if mine else math.nan, diff=diff)
            rows.append(row)
    return rows

def lr_check_best(rows: list[dict], seeds: list[int]) -> dict[str, dict]:
    """Per checked arm whose every lr of the check has all `seeds` on the powered measurement: the row with the best
    mean there (the lr a user tuning on these seeds would pick). Arms with a cell short of seeds are left out."""
    best = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        if all(r[PRIMARY]["n"] >= len(seeds) for r in mine):
            best[arm] = max(mine, key=lambda r: r[PRIMARY]["mean"])
    return best

def long_table(runs: list[dict], window: int = 10, short: list[dict] = (), short_steps: int = 40) -> list[dict]:
    """Per long run (arm, seed) and held-out evaluation: the step, the mean lr scale (the SNR factor; None without an
    SNR step) and training reward over the `window` steps up to it, and held-out greedy and sampled accuracy (%).
    Each row also carries the run's greedy accuracy on the large set after it (`large`, %) and that of the `short`
    run (the ablation's, `short_steps` long) of the same arm, lr and seed (`short_large`); None if not scored."""
    rows = []
    for r in sorted(runs, key=lambda r: (r["seed"], list(ARMS).index(r["arm"]))):
        by_step = {e["step"]: e for e in r["history"]}
        large = dict(large=by_seed([r], r["arm"], r["lr"], "large_accuracy_after").get(r["seed"]),
                     short_large=by_seed(short, r["arm"], r["lr"], "large_accuracy_after").get(r["seed"]),
                     short_steps=short_steps)
        for c in r.get("curve", []):
            steps = [by_step[t] for t in range(max(1, c["step"] - window + 1), c["step"] + 1) if t in by_step]
            scale = [e["oblr/lr_scale"] for e in steps if e.get("oblr/lr_scale") is not None]
            reward = [e["reward"] for e in steps if e.get("reward") is not None]
            rows.append(dict(arm=r["arm"], seed=r["seed"], step=c["step"], lr=r["lr"],
                             lr_scale=statistics.mean(scale) if scale else None,
                             reward=statistics.mean(reward) if reward else None,
                             greedy=100 * c["accuracy"], sampled=100 * c["sampled_accuracy"], **large))
    return rows

def step_curves(runs: list[dict], arms: list[str], grpo_lr: float, *, eta: float) -> dict:
    """Per arm at its lr in the round, the seed mean per step of the training reward and the lr scale (the SNR factor;
    1 where the arm has no SNR step), and of held-out greedy accuracy at each evaluated step."""
    out = {}
    for arm in arms:
        lr = lr_of(arm, grpo_lr, eta=eta)
        mine = [r for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)]
        if not mine:
            continue
        per_step: dict[str, dict[int, list[float]]] = {"reward": {}, "lr_scale": {}}
        for r in mine:
            for e in r["history"]:
                if "step" not in e:
                    continue
                if e.get("reward") is not None:
                    per_step["reward"].setdefault(e["step"], []).append(e["reward"])
                if e.get("oblr/lr_scale") is not None:
                    per_step["lr_scale"].setdefault(e["step"], []).append(e["oblr/lr_scale"])
        steps = sorted({c["step"] for r in mine for c in r.get("curve", [])})
        held = {s: [v for r in mine if (v := curve_at(r, s, "accuracy")) is not None] for s in steps}
        out[arm] = dict(
            seeds=len(mine),
            reward={s: statistics.mean(v) for s, v in sorted(per_step["reward"].items())},
            lr_scale={s: statistics.mean(v) for s, v in sorted(per_step["lr_scale"].items())},
            greedy={s: statistics.mean(v) for s, v in held.items() if v},
            skipped=statistics.mean(r.get("steps_with_lr_scale_0") or 0 for r in mine),  # steps with scale 0
        )
    return out

def stability_table(runs: list[dict], arms: list[str], grpo_lr: float, multiples: list[float], seeds: list[int],
                    step: int, collapse_pts: float, *, eta: float) -> list[dict]:
    """Per arm and lr multiple (1 = its own lr): greedy held-out accuracy at `step` over `seeds` (mean, min; for the
    arm's own lr, the 40-step run's evaluation at that step), the change from the arm's own lr in points, the runs
    that collapsed (accuracy at `step` below the starting model's by more than `collapse_pts`), and the lr the runs
    applied up to `step` (`applied`: the mean over runs of each run's mean; `applied_max`: the largest step's;
    `applied_per_run`: each run's seed, whether it collapsed, its mean and its largest step)."""
    rows, base_mean = [], math.nan
    for arm in arms:
        for m in (1.0, *multiples):
            lr = lr_of(arm, grpo_lr, m, eta=eta)
            cell = [(r, curve_at(r, step, "accuracy")) for r in runs
                    if r["arm"] == arm and math.isclose(r["lr"], lr) and r["seed"] in seeds]
            cell = [(r, v) for r, v in cell if v is not None]
            if not cell:
                rows.append(dict(arm=arm, multiple=m, lr=lr, n=0))
                continue
            values = [v for _, v in cell]
            if m == 1.0:
                base_mean = statistics.mean(values)
            collapsed = [r["seed"] for r, v in cell if 100 * r["accuracy_before"] - v > collapse_pts]
            applied = [dict(seed=r["seed"], collapsed=r["seed"] in collapsed, mean=statistics.mean(lrs), max=max(lrs))
                       for r, _ in cell if (lrs := applied_lrs(r, step))]
            rows.append(dict(arm=arm, multiple=m, lr=lr, n=len(cell), mean=statistics.mean(values), min=min(values),
                             change=statistics.mean(values) - base_mean if m != 1.0 else 0.0, collapsed=collapsed,
                             applied=statistics.mean(a["mean"] for a in applied) if applied else math.nan,
                             applied_max=max(a["max"] for a in applied) if applied else math.nan,
                             applied_per_run=applied))
        base_mean = math.nan
    return rows
