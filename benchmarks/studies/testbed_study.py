"""The testbed study's design and its analysis: pure functions of run records (dicts), so the tables are tested on
synthetic ones (``benchmarks/testbed.py`` runs the study; ``benchmarks/testbed.md`` says why)."""

from __future__ import annotations

import math
import statistics

from harness.stats import paired_difference, paired_power, seeds_for_power

WINDOW = 10  # steps: "the first 10" and "the last 10" rewards


def run_name(arm: str, lr: float, seed: int, prompts: int, steps: int) -> str:
    return f"{arm}_N{prompts}_T{steps}_lr{lr:.3g}_seed{seed}"


def lr_grid(centre: float, ratio: float, points: int) -> list[float]:
    """`points` lrs spaced by `ratio`, centred (in log) on `centre`."""
    half = (points - 1) / 2
    return [float(f"{centre * ratio ** (i - half):.3g}") for i in range(points)]


def rewards(record: dict) -> list[float]:
    return [h["reward"] for h in record["history"]]


def first_last(record: dict, window: int = WINDOW) -> tuple[float, float]:
    """Mean training reward over the first and over the last `window` steps."""
    r = rewards(record)
    return statistics.mean(r[:window]), statistics.mean(r[-window:])


def gain(record: dict, window: int = WINDOW) -> float:
    """Last-`window` minus first-`window` mean training reward."""
    first, last = first_last(record, window)
    return last - first


def last_reward(record: dict) -> float:
    return first_last(record)[1]


def start_noise_scale(record: dict) -> float | None:
    """B at the first step (before any update, so the same for every lr): the trainer's ``oblr/noise_scale``."""
    first = record["history"][0] if record["history"] else {}
    return first.get("oblr/noise_scale")


def factor(prompts: int, b: float) -> float:
    """The SNR factor N / (N + B)."""
    return prompts / (prompts + b)


def best_lr(records: list[dict], arm: str, lrs: list[float], seeds: list[int]) -> float | None:
    """The lr of `lrs` with the highest mean last-10 training reward over `seeds` (None until every cell is in)."""
    cells = {}
    for lr in lrs:
        found = [r for r in records if r["arm"] == arm and math.isclose(r["lr"], lr, rel_tol=1e-6)
                 and r["seed"] in seeds]
        if len(found) < len(seeds):
            return None
        cells[lr] = statistics.mean(last_reward(r) for r in found)
    return max(cells, key=cells.get)


def extended_grid(records: list[dict], arm: str, lrs: list[float], ratio: float, seeds: list[int]) -> list[float]:
    """`lrs`, extended one `ratio` step beyond an edge for as long as the best lr lies at that edge."""
    lrs = sorted(lrs)
    while (best := best_lr(records, arm, lrs, seeds)) is not None:
        if math.isclose(best, lrs[-1]):
            lrs = lrs + [float(f"{lrs[-1] * ratio:.3g}")]
        elif math.isclose(best, lrs[0]):
            lrs = [float(f"{lrs[0] / ratio:.3g}")] + lrs
        else:
            break
        if len(lrs) > 9:
            break
    return lrs


def by_seed(records: list[dict], arm: str, lr: float, metric) -> dict[int, float]:
    return {r["seed"]: metric(r) for r in records if r["arm"] == arm and math.isclose(r["lr"], lr, rel_tol=1e-6)}


def smoothed(values: list[float], span: int = 5) -> list[float]:
    """Trailing mean over `span` values (fewer at the start)."""
    return [statistics.mean(values[max(0, i - span + 1): i + 1]) for i in range(len(values))]


def rollouts_to_reach(curve: list[float], target: float, per_step: int) -> int | None:
    """Rollouts (steps x `per_step`) until the curve (one value per step) first reaches `target`; None if never."""
    for i, v in enumerate(curve):
        if v >= target:
            return (i + 1) * per_step
    return None


def mean_curve(records: list[dict]) -> list[float]:
    curves = [rewards(r) for r in records]
    return [statistics.mean(c[i] for c in curves) for i in range(min(map(len, curves)))]


def contrast(values: dict[int, float], reference: dict[int, float], delta: float) -> dict:
    """Paired difference (points) over the common seeds, its 95% interval and the power to detect `delta` points at
    the observed spread, and the seeds needed for 80%."""
    d = paired_difference({s: 100 * v for s, v in values.items()}, {s: 100 * v for s, v in reference.items()})
    if d["n"] >= 3 and d["sd"] == d["sd"]:
        d["power"] = paired_power(delta, d["sd"], d["n"])
        d["seeds_for_80"] = seeds_for_power(delta, d["sd"])
    else:
        d["power"], d["seeds_for_80"] = math.nan, None
    return d
