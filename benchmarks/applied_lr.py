"""Does a GRPO learning rate carry over? The lr OBLR-PO applies over its first steps, against `learning_rate`.

With ``snr_lr_mode="calibrated"`` (the default) `learning_rate` is the lr you would give GRPO, and eta_max is
calibrated from the run's first 10 steps, which apply it as scheduled. This runs ``examples/demo.py`` for 20 steps
with a constant schedule (the start of a long run) at several prompts per step N and reads, from the run's log, the
trainer's ``oblr/lr_mean`` (the mean applied lr so far) at step 10 against `learning_rate` (within +-25% is the
goal), and the mean applied lr of steps 11-20, where each step applies ``f / f_ref`` of it. The mean SNR factor f of
the first 10 steps is what ``snr_lr_mode="eta_max"`` (the paper's reading) would apply, as a fraction of
`learning_rate`.

Cells: the embedded tiny policy (``--model tiny``, its demo task) at N = 2, 8, 32 and 128 prompts x 8 completions.
One run each, seed 0, 1 torch thread, one at a time; each finished run is kept as a small record (``--records``), and
a cell with a record is not run again. The held-out evaluation is cut to a few problems (it plays no part here).

SmolLM2-135M-Instruct with LoRA at N = 8: the rows are the lr window's runs of OBLR-PO in the calibrated mode
(``OBLR-PO-calibrated``, run by ``ablation.py``, records in ``--window_records``: chain_sum with 1-2 digit terms,
8 prompts x 8 completions, 20 steps, a constant lr, one row per `learning_rate` of GRPO's grid), read the same way
from the per-step log each record keeps. They are not run here (``lr_window.md`` has their command).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/applied_lr.py    # run what is missing, then tabulate
    python benchmarks/applied_lr.py --no_run                          # tabulate the records
    python benchmarks/update_readme.py                                # copy the table into the pages
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "examples" / "demo.py"
STEPS = 20
CALIBRATION = 10  # oblr_trl.snr_formulas.CALIBRATION_STEPS (checked in main)
GENERATIONS = 8
TOLERANCE = 0.25
# (model, prompts per step N, learning_rate): the tiny policy at a GRPO lr that works there, 3e-4 (GRPO at 3e-4 gained
# 7 points over 200 steps where 3e-3 collapsed, results/compare_full.md)
CELLS = [("tiny", 2, 3e-4), ("tiny", 8, 3e-4), ("tiny", 32, 3e-4), ("tiny", 128, 3e-4)]
# SmolLM2's rows: the lr window's runs of this arm (studies/ablation/design.py's CALIBRATED), 8 prompts x 8 each
WINDOW_ARM, WINDOW_PROMPTS = "OBLR-PO-calibrated", 8
PER_STEP = ("lr", "lr_scale", "snr_factor", "eta_max", "lr_mean")
KEEP = ("model", "learning_rate", "lr_scheduler_type", "snr_lr_mode", "snr_estimator", "steps", "lr_mean",
        "mean_applied_lr", "eta_max", "mean_snr_factor", "mean_lr_scale", "seconds_per_step", "torch_threads", "seed")
# The run's own per-step log (demo.py writes log_history.json): the applied lr, its multiplier, f, eta_max, lr_mean


def name_of(model: str, n: int, lr: float) -> str:
    return f"{model}_N{n}_lr{lr:.3g}"


def demo_argv(model: str, n: int, lr: float, out: Path, seed: int) -> list[str]:
    return [sys.executable, str(DEMO), "--model", model, "--seed", str(seed), "--output_dir", str(out),
            "--per_device_train_batch_size", str(n * GENERATIONS), "--num_generations", str(GENERATIONS),
            "--learning_rate", repr(lr), "--lr_scheduler_type", "constant", "--max_steps", str(STEPS),
            "--snr_lr_mode", "calibrated", "--num_eval", "8", "--eval_samples", "1"]


def run_cell(model: str, n: int, lr: float, args) -> None:
    out = args.run_dir / name_of(model, n, lr)
    shutil.rmtree(out, ignore_errors=True)
    argv = demo_argv(model, n, lr, out, args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.time()
    print(f"{datetime.now(timezone.utc):%H:%M} running {' '.join(argv[1:])}", flush=True)
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "log_history.json").read_text())
    record = {"name": name_of(model, n, lr), "prompts_per_step": n, "generations": GENERATIONS,
              "command": " ".join(["python", "examples/demo.py", *argv[2:]]).replace(str(out), "<run_dir>"),
              "wall_seconds": round(time.time() - start), "finished": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
              **{k: summary.get(k) for k in KEEP}, "per_step": per_step_of(history)}
    args.records.mkdir(parents=True, exist_ok=True)
    (args.records / f"{record['name']}.json").write_text(json.dumps(record, indent=1) + "\n")


def per_step_of(history: list[dict]) -> dict[str, list]:
    """{key: one value per optimizer step} of a run's log: `PER_STEP` (``oblr/<key>``) and the scheduled lr."""
    steps = [e for e in history if "oblr/lr" in e]
    per_step = {k: [e.get(f"oblr/{k}") for e in steps] for k in PER_STEP}
    per_step["scheduled"] = [e.get("learning_rate") for e in steps]
    return per_step


def window_records(records: Path) -> list[dict]:
    """SmolLM2's rows: the lr window's runs of `WINDOW_ARM` (``ablation.py``'s records, each with its per-step log cut
    to the ablation's keys) as this script's records, by learning_rate; a record whose log lacks ``oblr/lr_mean``
    or the first `CALIBRATION` steps is left out."""
    out = []
    for path in sorted(records.glob(f"{WINDOW_ARM}_lr*_seed*.json")):
        r = json.loads(path.read_text())
        per_step = per_step_of(r.get("history", []))
        if len(per_step["lr"]) < CALIBRATION or None in per_step["lr_mean"][:CALIBRATION]:
            continue
        out.append({"name": f"{path.stem} (lr window)", "prompts_per_step": WINDOW_PROMPTS, "generations": GENERATIONS,
                    "command": "python benchmarks/ablation.py --window_arms OBLR-PO-calibrated "
                               f"--window_seeds {r['seed']}", "finished": r["finished"],
                    **{k: r.get(k) for k in KEEP}, "per_step": per_step})
    return sorted(out, key=lambda r: (r["seed"], r["learning_rate"]))


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def fmt(x) -> str:
    return "-" if x is None or x != x else f"{x:.3g}"


def rows(records: list[dict]) -> list[dict]:
    out = []
    for r in records:
        s, lr = r["per_step"], r["learning_rate"]
        first = s["lr_mean"][CALIBRATION - 1]  # the trainer's own mean applied lr over steps 1-10
        ratio = first / lr
        # steps with no gradient at all (every group's rewards equal: status zero_gradient) log no factor and apply 0
        flat = [i for i in range(CALIBRATION) if s["snr_factor"][i] is None and s["lr_scale"][i] == 0.0]
        moved = [s["lr"][i] / s["scheduled"][i] for i in range(CALIBRATION) if i not in flat]
        out.append(dict(r, lr_mean_10=first, ratio=ratio, within=abs(ratio - 1) <= TOLERANCE, no_gradient=len(flat),
                        with_gradient=mean(moved),
                        later=mean(s["lr"][CALIBRATION:]) / lr, f_first=mean(s["snr_factor"][:CALIBRATION]),
                        f_later=mean(s["snr_factor"][CALIBRATION:]), eta_max_last=s["eta_max"][-1]))
    return out


def render(table: list[dict], device: str) -> str:
    dates = sorted(r["finished"] for r in table)
    window = [r for r in table if r["name"].endswith("(lr window)")]
    lines = [
        "# Applied lr over the first steps: does a GRPO lr carry over?",
        "",
        f"Generated by `python benchmarks/applied_lr.py` from {len(table) - len(window)} run records in "
        f"`benchmarks/results/applied_lr_runs` and {len(window)} of the lr window's in "
        f"`benchmarks/results/ablation_runs` ({device}, 1 torch thread; runs finished {dates[0][:10]} to "
        f"{dates[-1][:10]}). Each run: `examples/demo.py` for {STEPS} steps, seed 0, a constant schedule, "
        f"`snr_lr_mode=\"calibrated\"` (the default), N prompts x {GENERATIONS} completions per step. The tiny "
        "policy: its demo task. SmolLM2-135M-Instruct (LoRA r=16): the lr window's runs of "
        f"{WINDOW_ARM} (chain_sum with 1-2 digit terms, one run per `learning_rate` of GRPO's grid; "
        "`benchmarks/lr_window.md`). "
        f"`oblr/lr_mean` at step {CALIBRATION}: the trainer's mean applied lr over steps 1-{CALIBRATION}; the goal is "
        f"within +-{TOLERANCE:.0%} of `learning_rate`. Steps {CALIBRATION + 1}-{STEPS}: their mean applied lr over "
        f"`learning_rate` (each applies f / f_ref of it, at most 2x). Mean f: the mean SNR factor of steps "
        f"1-{CALIBRATION} (the fraction of `learning_rate` that `snr_lr_mode=\"eta_max\"`, the paper's reading, would "
        f"apply) and of steps {CALIBRATION + 1}-{STEPS}. eta_max: `oblr/eta_max` (`learning_rate` / f_ref). No "
        f"gradient: steps of 1-{CALIBRATION} whose gradient was exactly 0 (every group's rewards equal; they apply 0, "
        "as under every `snr_lr_mode`), and the applied lr of the others over the scheduled lr.",
        "",
        f"| model | N | learning_rate | oblr/lr_mean at step {CALIBRATION} | / learning_rate | within +-25% | "
        f"no gradient (of {CALIBRATION}) | the others: applied / scheduled | "
        f"steps {CALIBRATION + 1}-{STEPS}: applied / learning_rate | mean f, steps 1-{CALIBRATION} | "
        f"mean f, steps {CALIBRATION + 1}-{STEPS} | eta_max | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(f"| {r['model']} | {r['prompts_per_step']} | {r['learning_rate']:.3g} | {r['lr_mean_10']:.3g} | "
                     f"{r['ratio']:.2f} | {'yes' if r['within'] else 'no'} | {r['no_gradient']} | "
                     f"{r['with_gradient']:.2f} | {r['later']:.2f} | {r['f_first']:.3f} | "
                     f"{r['f_later']:.3f} | {fmt(r['eta_max_last'])} | {r['seconds_per_step']} |")
    missing = [name_of(*cell) for cell in CELLS if name_of(*cell) not in {r["name"] for r in table}]
    per_model = {}
    for r in table:
        per_model.setdefault(r["model"], []).append(r["within"])
    counts = "; ".join(f"{model}: {sum(w)} of {len(w)} runs" for model, w in per_model.items())
    lines += ["", f"Within +-{TOLERANCE:.0%}: {counts}." + (f" Not run yet: {', '.join(missing)}." if missing else "")
              + ("" if window else f" No lr window run of {WINDOW_ARM} recorded yet.")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, default=HERE / "results" / "applied_lr_runs")
    p.add_argument("--out", type=Path, default=HERE / "results" / "applied_lr")
    p.add_argument("--run_dir", type=Path, default=Path("outputs/applied_lr"))
    p.add_argument("--window_records", type=Path, default=HERE / "results" / "ablation_runs",
                   help=f"the lr window's records (ablation.py's --records), read for {WINDOW_ARM}'s SmolLM2 rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="2-core CPU")
    p.add_argument("--only", nargs="*", default=None, help="names of the cells to run (default: every missing one)")
    p.add_argument("--no_run", action="store_true")
    args = p.parse_args(argv)
    from oblr_trl.snr_formulas import CALIBRATION_STEPS
    assert CALIBRATION_STEPS == CALIBRATION, "CALIBRATION follows oblr_trl.snr_formulas.CALIBRATION_STEPS"
    if not args.no_run:
        for cell in CELLS:
            name = name_of(*cell)
            if (args.records / f"{name}.json").exists() or (args.only is not None and name not in args.only):
                continue
            run_cell(*cell, args)
    records = [json.loads(path.read_text()) for path in sorted(args.records.glob("*.json"))]
    order = {name_of(*cell): i for i, cell in enumerate(CELLS)}
    table = rows(sorted(records, key=lambda r: order.get(r["name"], len(order))) + window_records(args.window_records))
    if not table:
        print("no records yet", file=sys.stderr)
        return 1
    text = render(table, args.device)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(dict(rows=table, tolerance=TOLERANCE, steps=STEPS), indent=1)
                                             + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
