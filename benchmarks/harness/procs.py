"""The real-model runs of examples/demo.py: the command of one, and every one in flight on this machine (ours or
another runner's), so that a run is never started twice."""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def demo_command(seed: int, out: Path, extra: list[str]) -> tuple[list[str], dict]:
    """The examples/demo.py subprocess of one run (1 torch thread, offline) and its environment."""
    cmd = [sys.executable, str(DEMO), "--seed", str(seed), "--output_dir", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return cmd, env


def _demo_run(pid: str, clock: float) -> dict | None:
    """dict(out, pid, elapsed_s, max_steps) of process `pid` if it is an examples/demo.py run on the real model."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        if not (any(a.endswith("examples/demo.py") for a in argv) and "smollm2" in argv and "python" in argv[0]):
            return None
        with open(f"/proc/{pid}/stat") as f:  # field 22, after the command's parenthesis: start, in clock ticks
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / clock
        with open("/proc/uptime") as f:
            elapsed = float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None
    flag = lambda name: argv[argv.index(name) + 1] if name in argv[:-1] else ""  # noqa: E731
    out = flag("--output_dir")
    try:
        out = str(Path(os.readlink(f"/proc/{pid}/cwd")) / out) if out else ""
    except OSError:
        pass
    return dict(out=out, pid=int(pid), elapsed_s=elapsed, max_steps=int(flag("--max_steps") or 0))


def real_demo_runs() -> list[dict]:
    """Every examples/demo.py run on the real model on this machine, ours or anyone's (the machine holds 2 of ~11 GB;
    a run another runner started is not started twice), as dict(out, pid, elapsed_s, max_steps): its --output_dir
    (resolved against that run's working directory; "" without one), how long it has run and its --max_steps."""
    clock = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    runs = [_demo_run(pid, clock) for pid in (os.listdir("/proc") if os.path.isdir("/proc") else [])]
    return [run for run in runs if run is not None]


def real_demo_outputs() -> list[str]:
    """The --output_dir of every examples/demo.py run on the real model on this machine (``real_demo_runs``)."""
    return [run["out"] for run in real_demo_runs()]


def is_running(out: Path, running_outputs: list[str]) -> bool:
    return any(o and Path(o).resolve() == out.resolve() for o in running_outputs)


def stop_deadline(hhmm: str | None, now: datetime) -> datetime | None:
    """The next time the wall clock reads ``hhmm`` (UTC) after ``now``: a stop time earlier in the day than the start
    means tomorrow's (a run launched at 23:20 with ``--stop_launching 00:40`` stops launching 80 minutes later)."""
    if not hhmm:
        return None
    hh, mm = map(int, hhmm.split(":"))
    stop = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    return stop if stop > now else stop + timedelta(days=1)
