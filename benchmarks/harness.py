"""What the benchmark scripts share: interleaved timing, a description of the machine, table and result writers.

Used by ``step_cost.py``, ``grad_variance.py`` and ``compare.py`` (imported as ``harness`` with this folder on the
path, so each script still runs as ``python benchmarks/NAME.py``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable


def utc_now(minutes: bool = False) -> str:
    """The date and time now, in UTC: ISO-8601 (``minutes=False``) or ``YYYY-MM-DD HH:MM UTC``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%d %H:%M UTC") if minutes else now.isoformat(timespec="seconds")


def machine_info(threads: int | None = None, device: str = "cpu", precision: str = "float32") -> dict:
    """Host, platform, CPUs, load average and library versions, for the head of every result file."""
    import torch

    info = dict(node=platform.node(), platform=platform.platform(), cpus=os.cpu_count(),
                threads=threads if threads is not None else torch.get_num_threads(), device=device,
                precision=precision, python=platform.python_version(), torch=torch.__version__, date=utc_now(),
                loadavg_start=[round(x, 2) for x in os.getloadavg()])
    for name in ("transformers", "trl"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "absent"
    return info


def machine_line(m: dict) -> str:
    """One sentence naming the machine, for a markdown header."""
    load = f" Load average at start {m['loadavg_start']}"
    load += f", at end {m['loadavg_end']}" if "loadavg_end" in m else ""
    return (f"Machine: {m['node']} ({m['platform']}, {m['cpus']} CPUs, {m['threads']} torch threads), device "
            f"{m['device']}, {m['precision']}; Python {m['python']}, torch {m['torch']}, transformers "
            f"{m['transformers']}, trl {m['trl']}.{load} (other processes shared the CPUs if it exceeds the CPU count).")


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


def fmt(x, spec: str = ".2f") -> str:
    """``format(x, spec)``, or ``n/a`` for None and NaN."""
    return "n/a" if x is None or x != x else format(x, spec)


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    """Lines of a markdown table (cells are str()-ed)."""
    return (["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_results(out_dir: Path, stem: str, result: dict, markdown: str) -> tuple[Path, Path]:
    """``out_dir/stem.json`` (indented; NaN kept as NaN) and ``out_dir/stem.md``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(result, indent=1, default=float))
    md.write_text(markdown)
    return js, md


class Log:
    """``log(msg)`` prints ``[elapsed s] msg``, flushed."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


def host(extra: str = "") -> str:
    """``node (platform, N CPUs[, extra])``: the machine in one phrase."""
    return f"{platform.node()} ({platform.platform()}, {os.cpu_count()} CPUs{', ' + extra if extra else ''})"


def host_id() -> str:
    """``node platform N CPUs``: the machine field of a result JSON."""
    return f"{platform.node()} {platform.platform()} {os.cpu_count()} CPUs"
