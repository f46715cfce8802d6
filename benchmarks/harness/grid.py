"""Run a grid of jobs under a memory budget, resumably (after Snakemake and submitit: experiments as data).

A job is a dict: ``kind`` ("train", or an evaluation's kind), ``name``, ``out`` (its folder) and whatever the caller's
``launch`` needs. The caller says what is still to do (``pending()``, called afresh on every round: a job is done when
its record exists, so a restarted runner starts only what is missing), what a job is expected to cost (``Costs``) and
how to start one (``launch(job) -> Popen``). The runner keeps to ``--parallel`` jobs on the machine (counting the
real-model runs of other runners, which it never starts twice), to the machine's memory less a margin, and to the stop
times; it samples the RSS of what runs and writes each finished training run's peak to ``<out>/peak_rss.json``.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from .machine import uptime
from .memory import mem_available_gb, meminfo_gb, rss_gb
from .procs import is_running, real_demo_runs, stop_deadline


@dataclass(frozen=True)
class Costs:
    """What a job is expected to cost: its peak RSS (GB) and minutes; for a real-model run another runner launched,
    its peak from its output folder and its minutes from itself (``real_demo_runs``' dict). ``eval_minutes``: what
    follows a training run before it is done (``--finish_by`` counts it); ``slack_min``: how much later the first in
    line may start because a job overtook it (``next_job``)."""

    peak_gb: Callable[[dict], float]
    minutes: Callable[[dict], float]
    other_peak_gb: Callable[[str], float] = lambda out: 0.0
    other_minutes: Callable[[dict], float] = lambda run: 0.0
    eval_minutes: float = 0.0
    slack_min: float = 10.0


@dataclass(frozen=True)
class Limits:
    """The runner's options: jobs at a time, free memory to launch at all, memory left beside the expected peaks, the
    polling period, and HH:MM UTC after which no training run launches / by which every run launched should end."""

    parallel: int
    min_free_gb: float
    margin_gb: float = 0.0
    poll_s: float = 30.0
    stop_launching: str | None = None
    finish_by: str | None = None


def fits(running_gb: list[float], candidate_gb: float, total_gb: float, margin_gb: float) -> bool:
    """Whether a job expected to peak at `candidate_gb` may start beside jobs expected to peak at `running_gb`."""
    return sum(running_gb) + candidate_gb <= total_gb - margin_gb


def next_job(todo: list[dict], running: list[dict], total_gb: float, margin_gb: float, costs: Costs) -> dict | None:
    """The job to launch now, or None. `running`: dict(peak_gb, minutes_left, overtaker) per job running.

    The first in line, when its expected peak fits beside the running jobs'. When it does not (a job that runs
    alone, behind a run in flight), a later job that fits may overtake it if it would end within `costs.slack_min` of
    the last running job's expected end, so the core does not idle while the first in line waits and the first in
    line waits at most that much longer. One overtaker at a time: none launches beside a job that overtook, so the
    first in line cannot starve."""
    if not todo:
        return None
    busy = [r["peak_gb"] for r in running]
    if fits(busy, costs.peak_gb(todo[0]), total_gb, margin_gb):
        return todo[0]
    if not running or any(r["overtaker"] for r in running):
        return None
    limit = max(r["minutes_left"] for r in running) + costs.slack_min
    return next((job for job in todo[1:] if fits(busy, costs.peak_gb(job), total_gb, margin_gb)
                 and costs.minutes(job) <= limit), None)


def in_time(todo: list[dict], minutes_left: float | None, costs: Costs) -> tuple[list[dict], list[dict]]:
    """(the jobs that may launch, the training runs held back): with `minutes_left` before ``--finish_by``, a training
    run launches only when it and its evaluation are expected to end in time (a run killed with its session is lost
    whole: a 120-step run started an hour before the end would waste two core-hours). Evaluations always."""
    if minutes_left is None:
        return todo, []
    is_late = [j["kind"] == "train" and costs.minutes(j) + costs.eval_minutes > minutes_left for j in todo]
    return [j for j, late in zip(todo, is_late) if not late], [j for j, late in zip(todo, is_late) if late]


def write_peak(out: Path, peak_gb: float, every_s: float, **extra) -> None:
    (out / "peak_rss.json").write_text(json.dumps(dict(peak_rss_gb=round(peak_gb, 2), sampled_every_s=every_s, **extra)))


def watch_others(others: list[dict], watched: dict[int, dict], every_s: float, log) -> None:
    """Sample the RSS of runs this runner did not launch (another runner's, or one left by a runner restarted) while
    they run; when one has finished with no peak written, write the peak seen (a lower bound: watched only since this
    runner started)."""
    for run in others:
        seen = watched.setdefault(run["pid"], dict(out=Path(run["out"]), peak_gb=0.0))
        seen["peak_gb"] = max(seen["peak_gb"], rss_gb(run["pid"]))
    for pid in set(watched) - {run["pid"] for run in others}:
        seen = watched.pop(pid)
        if (seen["out"] / "summary.json").exists() and not (seen["out"] / "peak_rss.json").exists():
            write_peak(seen["out"], seen["peak_gb"], every_s, watched_part_of_the_run=True)
            log(f"finished {seen['out']} (not launched here), peak RSS >= {seen['peak_gb']:.1f} GB")


def reap(running: list[dict], poll_s: float, log) -> None:
    """Sample the RSS of our jobs; take the finished ones out of `running`, writing a successful training run's peak."""
    for job in list(running):
        job["peak_gb"] = max(job["peak_gb"], rss_gb(job["proc"].pid))
        if job["proc"].poll() is not None:
            running.remove(job)
            log(f"finished {job['name']} rc={job['proc'].returncode}, peak RSS >= {job['peak_gb']:.1f} GB "
                f"(sampled every {poll_s:g} s); {uptime()}")
            if job["kind"] == "train" and job["proc"].returncode == 0:
                write_peak(job["out"], job["peak_gb"], poll_s)


class _Clock:
    """The stop times of one runner, and what it has said about them (each held-back run named once)."""

    def __init__(self, limits: Limits, log):
        now = datetime.now(timezone.utc)
        self.limits, self.log, self.stopped, self.held = limits, log, False, set()
        self.deadline, self.finish = stop_deadline(limits.stop_launching, now), stop_deadline(limits.finish_by, now)

    def allowed(self, todo: list[dict], costs: Costs) -> list[dict]:
        """`todo` less the training runs past ``stop_launching`` and those that would not end by ``finish_by``."""
        now = datetime.now(timezone.utc)
        if self.deadline and now >= self.deadline and not self.stopped:
            self.stopped = True
            self.log(f"stop time {self.limits.stop_launching} UTC reached: not launching "
                     f"{sum(j['kind'] == 'train' for j in todo)} training runs")
        if self.stopped:
            todo = [j for j in todo if j["kind"] != "train"]
        todo, late = in_time(todo, (self.finish - now).total_seconds() / 60 if self.finish else None, costs)
        for j in late:
            if j["name"] not in self.held:
                self.held.add(j["name"])
                self.log(f"not launching {j['name']}: expected {costs.minutes(j) + costs.eval_minutes:.0f} min with "
                         f"its large evaluation, it would not end by --finish_by {self.limits.finish_by} UTC")
        return todo


def run_grid(pending: Callable[[], list[dict]], launch: Callable[[dict], subprocess.Popen], costs: Costs,
             limits: Limits, log, sync: Callable[[], list[Path]] = lambda: []) -> None:
    """Launch `pending()`'s jobs, first in line first (``next_job``), until none is left and none runs. Each round
    also calls `sync()` (records written, logged) and skips jobs that are running, here or under another runner."""
    running: list[dict] = []  # the jobs launched, with their process and peak RSS seen
    watched: dict[int, dict] = {}  # runs launched elsewhere, by pid: their output and peak RSS seen
    clock = _Clock(limits, log)
    while True:
        reap(running, limits.poll_s, log)
        ours = {str(job["out"].resolve()) for job in running}
        others = [r for r in real_demo_runs() if r["out"] and str(Path(r["out"]).resolve()) not in ours]
        watch_others(others, watched, limits.poll_s, log)
        for path in sync():
            log(f"recorded {path.name}")
        todo = clock.allowed([j for j in pending() if str(j["out"].resolve()) not in ours
                              and not is_running(j["out"], [r["out"] for r in others])], costs)
        if not todo and not running:
            return
        now = time.time()
        busy = ([dict(peak_gb=costs.peak_gb(j), overtaker=j["overtaker"],
                      minutes_left=costs.minutes(j) - (now - j["started"]) / 60) for j in running]
                + [dict(peak_gb=costs.other_peak_gb(r["out"]), overtaker=False,
                        minutes_left=costs.other_minutes(r) - r["elapsed_s"] / 60) for r in others])
        job = next_job(todo, busy, meminfo_gb("MemTotal"), limits.margin_gb, costs) \
            if len(busy) < limits.parallel and mem_available_gb() >= limits.min_free_gb else None
        if job is None:
            time.sleep(limits.poll_s)
            continue
        job["overtaker"] = job is not todo[0]
        job.update(proc=launch(job), peak_gb=0.0, started=time.time())
        log(f"launched {job['name']}{' (overtaking the first in line)' if job['overtaker'] else ''} "
            f"(pid {job['proc'].pid}); {uptime()}")
        running.append(job)
        time.sleep(5)  # let its memory show before the next round
