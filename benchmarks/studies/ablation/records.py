"""The ablation's records: one small json per finished run (``<cell>_seed<s>.json`` in ``--records``; committed), made
from its output folder, and what the tables read from them. A cell whose record holds its large evaluation is done."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from .design import HISTORY_KEYS, parse_cell


def record_path(records: Path, out: Path) -> Path:
    """The record of the run in folder `out` (<cell>/seed<s>): <cell>_seed<s>.json."""
    return records / f"{out.parent.name}_{out.name}.json"

def base_path(records: Path, seed: int) -> Path:
    """The large evaluation of the model before RL on seed `seed`'s large set."""
    return records / f"large_before_seed{seed}.json"

def make_record(out: Path) -> dict:
    """A finished run's record: its summary.json (without the example replies), each optimizer step's log entry cut
    to HISTORY_KEYS, and its large evaluation when large_eval.py has written one."""
    record = {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if k != "examples"}
    history = out / "log_history.json"
    entries = json.loads(history.read_text()) if history.exists() else []
    finished = datetime.fromtimestamp((out / "summary.json").stat().st_mtime, timezone.utc)
    arm, lr, long = parse_cell(out.parent.name)
    record.update(arm=arm, lr=lr, seed=int(out.name[4:]), long=long, finished=f"{finished:%Y-%m-%d %H:%M UTC}",
                  history=[{k: e[k] for k in HISTORY_KEYS if k in e} for e in entries if "step" in e and "loss" in e])
    if (out / "large_eval.json").exists():
        record["large_eval"] = json.loads((out / "large_eval.json").read_text())
    if (out / "peak_rss.json").exists():
        record.update(json.loads((out / "peak_rss.json").read_text()))
    return record

def sync_records(run_dir: Path, records: Path) -> list[Path]:
    """Write (or complete with its large evaluation) the record of every finished run under run_dir
    (<arm>_lr<lr>/seed<s>/summary.json); the records written."""
    written = []
    records.mkdir(parents=True, exist_ok=True)
    for summary in sorted(run_dir.glob("*_lr*/seed*/summary.json")):
        out = summary.parent
        path = record_path(records, out)
        record = make_record(out)
        if path.exists() and json.loads(path.read_text()) == record:
            continue
        path.write_text(json.dumps(record, indent=1))
        written.append(path)
    return written

def load_runs(records: Path) -> list[dict]:
    """Every recorded run (<arm>_lr<lr>_seed<s>.json under records), with `large_accuracy_after` from its large
    evaluation and `large_accuracy_before` from its seed's evaluation before RL on the same problems."""
    runs = []
    for path in sorted(records.glob("*_lr*_seed*.json")):
        run = json.loads(path.read_text())
        run.setdefault("long", False)
        large = run.get("large_eval")
        if large:
            run["large_accuracy_after"] = large["accuracy"]
            base = base_path(records, run["seed"])
            if base.exists() and json.loads(base.read_text())["digest"] == large["digest"]:
                run["large_accuracy_before"] = json.loads(base.read_text())["accuracy"]
        runs.append(run)
    return runs

def by_seed(runs: list[dict], arm: str, lr: float, key: str) -> dict[int, float]:
    """{seed: 100 * run[key]} of one (arm, lr) cell."""
    return {r["seed"]: 100 * r[key] for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr)
            and r.get(key) is not None}

def large_correct(runs: list[dict], arm: str, lr: float) -> dict[int, tuple[str, list[bool]]]:
    """{seed: (digest of the problems, exact answer per problem)} of one cell's large evaluations."""
    return {r["seed"]: (r["large_eval"]["digest"], [s >= 1.0 for s in r["large_eval"]["scores"]])
            for r in runs if r["arm"] == arm and math.isclose(r["lr"], lr) and r.get("large_eval", {}).get("scores")}

def curve_at(run: dict, step: int, key: str) -> float | None:
    """The held-out metric `key` of a run at `step` (its `curve`), or None."""
    return next((100 * c[key] for c in run.get("curve", []) if c["step"] == step and c.get(key) is not None), None)

def applied_lrs(run: dict, until: int) -> list[float]:
    """The lr each optimizer step of a run applied, up to `until`: the SNR step's (eta_max x its factor) where it
    logs one, else the scheduler's (constant here)."""
    lrs = [e.get("oblr/lr", e.get("learning_rate")) for e in run.get("history", []) if e["step"] <= until]
    return [lr for lr in lrs if lr is not None]
