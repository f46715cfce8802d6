"""Interleaved timing: the measured functions take turns, so a slow drift of a shared machine hits all alike."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable


def time_interleaved(fns: dict[str, Callable], names: list[str], repeats: int, budget_s: float,
                     sync: Callable[[], None] = lambda: None, log: Callable[[str], None] = print):
    """Median seconds of each named function over ``repeats`` rounds that call them in turn (so a slow drift of a
    shared machine hits all alike), after a warm-up round whose results are returned as the outputs.

    Rounds stop early past ``budget_s`` seconds (at least one timed round; when the warm-up alone exceeds the budget,
    its times are the measurement). Returns ``(medians, outputs)``.
    """
    times, warm, outputs = defaultdict(list), {}, {}
    start = time.perf_counter()
    for rnd in range(repeats + 1):
        if rnd == 1 and time.perf_counter() - start > budget_s:
            log(f"    (warm-up round alone took {time.perf_counter() - start:.0f}s: its times are the measurement)")
            return warm, outputs
        for name in names:
            sync()
            t0 = time.perf_counter()
            result = fns[name]()
            sync()
            dt = time.perf_counter() - t0
            if rnd == 0:
                outputs[name], warm[name] = result, dt
            else:
                times[name].append(dt)
        if rnd >= 1 and time.perf_counter() - start > budget_s and rnd < repeats:
            log(f"    (time budget reached after {rnd} timed round(s))")
            break
    return {name: statistics.median(v) for name, v in times.items()}, outputs
