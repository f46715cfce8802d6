"""Logs: ``Log`` for a measurement's progress (elapsed seconds), ``RunnerLog`` for a runner of long jobs (UTC time
stamps, kept in ``<run_dir>/runner.json`` so that a restarted runner goes on with it), and ``merged_log``, which keeps
that log in the tables' json so that it outlives a lost run folder."""

from __future__ import annotations

import contextlib
import logging
import warnings

import json
import time
from datetime import datetime, timezone
from pathlib import Path


class Log:
    """``log(msg)`` prints ``[elapsed s] msg``, flushed."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


class RunnerLog:
    """``log(msg)`` prints ``YYYY-MM-DD HH:MM:SS UTC msg`` and appends it to ``<run_dir>/runner.json``'s ``log``
    (created with the folder; an existing one is continued). ``lines``: the whole log so far."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "runner.json"
        self.state = json.loads(self.path.read_text()) if self.path.exists() else dict(log=[])

    @property
    def lines(self) -> list[str]:
        return self.state["log"]

    def __call__(self, message: str) -> None:
        line = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC {message}"
        print(line, flush=True)
        self.state["log"].append(line)
        self.path.write_text(json.dumps(self.state, indent=1))


def merged_log(saved: Path, runner_log: list[str]) -> list[str]:
    """The runner's log kept in the tables' json (`saved`) followed by this machine's lines not yet in it: the log
    outlives a lost --run_dir, as the records do."""
    kept = json.loads(saved.read_text()).get("runner_log", []) if saved.exists() else []
    seen = set(kept)
    return kept + [line for line in runner_log if line not in seen]


@contextlib.contextmanager
def quiet(names=("transformers", "trl", "oblr_trl", "accelerate", "peft")):
    """The libraries' loggers at ERROR and Python's warnings off inside the block, as they were after it (a test may
    call a script's ``main`` in a process that other tests share)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
