"""The one reader of memory: a process's RSS and its peak (``/proc/<pid>/status``), the machine's memory
(``/proc/meminfo``), and the peak RSS of a block of code in this process."""

from __future__ import annotations

import gc
import math
import resource
from contextlib import contextmanager
from pathlib import Path


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of ``/proc/<pid>/status`` in kB (``VmRSS``: resident now; ``VmHWM``: its peak). KeyError when the
    field is missing, OSError when the process is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_gb(pid: int) -> float:
    """Resident memory of a process (GB), 0 when it is gone."""
    try:
        return status_kb("VmRSS", pid) / 2**20
    except (OSError, KeyError):
        return 0.0


def peak_rss_gb() -> float:
    """This process's peak RSS so far (GB, ``ru_maxrss``), rounded to 0.01."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def meminfo_gb(field: str = "MemAvailable") -> float:
    """A /proc/meminfo field in GB (inf where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return math.inf


def mem_available_gb() -> float:
    return meminfo_gb("MemAvailable")


@contextmanager
def peak_rss():
    """Peak RSS above the RSS at entry (``VmHWM`` reset through ``/proc/self/clear_refs``; fallback ``ru_maxrss``).
    Yields a dict that holds ``peak_bytes`` and ``method`` on exit."""
    gc.collect()
    out = {}
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    base = status_kb("VmRSS") * 1024
    yield out
    if reset:
        out.update(peak_bytes=status_kb("VmHWM") * 1024 - base, method="peak RSS (VmHWM, reset via clear_refs) above RSS")
    else:
        out.update(peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
                   method="ru_maxrss above RSS")


def wait_peak_gb(pid: int) -> tuple[int, float, float]:
    """Wait for the child process `pid` to end: (its exit code, its peak RSS in GB, its CPU seconds, user and system),
    from wait4's resource usage: that process's own, read by the operating system, not sampled. On a shared machine
    the CPU seconds are what it cost, whatever the wall clock said."""
    import os

    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20, usage.ru_utime + usage.ru_stime
