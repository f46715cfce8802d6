"""Paired, interleaved timing for ``benchmarks/bench_gpu.py``: every trainer of a row alive at once, one step of each
per round, the order rotated each round, and each mode's time against the base's (GRPO's) taken round by round.

Why: timed one mode after another, minutes apart, identical paths differed by up to 1.5x on an H100 (the device's
clocks, the allocator's state, the host's load drift between them), so a ratio of two such medians says as much
about the drift as about the modes. Within a round the modes run seconds apart under the same conditions; the
median of the per-round ratios drops a round that drift spoiled, and their range shows how far to trust it. Pure:
the steps are callables that return their own seconds, so the logic is tested on the CPU with fake ones."""

from __future__ import annotations

import statistics
from typing import Callable, Mapping, Sequence


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: ``names`` rotated left by the round's index, so that over ``len(names)``
    rounds each runs first once (none always right after a warm-up, or always in another's wake)."""
    k = round_index % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def interleave(steps: Mapping[str, Callable[[], float]], rounds: int) -> tuple[dict[str, list[float]], dict]:
    """``rounds`` rounds of one call of every step, in :func:`rotation`'s order: each name's seconds, round by round.
    A step that raises is dropped from that round on and its times with it (a mode with a missing round has no
    per-round ratio); the others go on. Returns ``(times, errors)``, ``errors``: name -> the exception."""
    names, times, errors = list(steps), {name: [] for name in steps}, {}
    for r in range(rounds):
        for name in rotation([n for n in names if n not in errors], r):
            try:
                times[name].append(float(steps[name]()))
            except Exception as error:  # noqa: BLE001 - an OOM in one mode: recorded, the row goes on
                errors[name] = error
    return {n: t for n, t in times.items() if n not in errors}, errors


def round_ratios(times: Mapping[str, Sequence[float]], base: str) -> dict[str, list[float]]:
    """Each name's seconds over the base's, round by round (its i-th step against the base's i-th); empty where
    the base did not run or the rounds do not line up."""
    ref = times.get(base, ())
    return {name: [t / b for t, b in zip(ts, ref)] if ref and len(ts) == len(ref) else []
            for name, ts in times.items()}


def summarise(times: Mapping[str, Sequence[float]], base: str) -> dict[str, dict]:
    """Per name: ``seconds`` (the median step), ``ratio`` (the median of the per-round ratios to ``base``, NaN
    without them) and ``ratio_range`` (their smallest and largest: a row that drift or noise spoiled shows wide)."""
    nan, out = float("nan"), {}
    for name, ratios in round_ratios(times, base).items():
        out[name] = dict(seconds=statistics.median(times[name]) if times[name] else nan,
                         ratio=statistics.median(ratios) if ratios else nan,
                         ratio_range=[min(ratios), max(ratios)] if ratios else [nan, nan])
    return out


def with_ratios(modes: Mapping[str, dict], base: str) -> dict[str, dict]:
    """A row's mode records (each with its ``times``; a failed one without) with :func:`summarise`'s ``ratio`` and
    ``ratio_range`` added."""
    summary = summarise({m: v["times"] for m, v in modes.items() if "times" in v}, base)
    return {m: dict(v, ratio=summary[m]["ratio"], ratio_range=summary[m]["ratio_range"]) if m in summary else dict(v)
            for m, v in modes.items()}
