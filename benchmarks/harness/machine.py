"""The machine a benchmark ran on: the date, the host, its load and library versions, for the head of a result."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess


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


def host(extra: str = "") -> str:
    """``node (platform, N CPUs[, extra])``: the machine in one phrase."""
    return f"{platform.node()} ({platform.platform()}, {os.cpu_count()} CPUs{', ' + extra if extra else ''})"


def host_id() -> str:
    """``node platform N CPUs``: the machine field of a result JSON."""
    return f"{platform.node()} {platform.platform()} {os.cpu_count()} CPUs"


def uptime() -> str:
    """``uptime``'s line (the load average), for a runner's log."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
