"""benchmarks/real_compare.py's tabulation on fake run summaries (no training): cells, gains, the two answers, the
missing cells and the plot, against values worked out by hand."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

import pytest



def module():
    return importlib.import_module("real_compare")


def fake(method, lr, seed, greedy, sampled=None, before=(0.30, 0.20), skipped=None, applied=None, steps=10):
    """A summary.json as examples/demo.py writes it, accuracies in points."""
    return dict(
        method=method, seed=seed, learning_rate=lr, steps=steps, accuracy_before=before[0],
        sampled_accuracy_before=before[1], accuracy_after=greedy / 100,
        sampled_accuracy_after=(greedy if sampled is None else sampled) / 100,
        steps_with_lr_scale_0=skipped or 0, mean_lr_scale=None if skipped is None else 0.5,
        mean_applied_lr=lr if applied is None else applied, seconds_per_step=40.0,
    )


def grid():
    runs = []
    # GRPO: best at 5.5e-4 (mean 50); 1e-4 within 2 pts (49), 3e-3 far (30)
    for lr, accs in ((1e-4, (48, 49, 50)), (5.5e-4, (49, 50, 51)), (3e-3, (29, 30, 31))):
        runs += [fake("GRPO", lr, s, a) for s, a in enumerate(accs)]
    # OBLR-PO: default 1e-3 mean 46 (loses by 4 with a standard error of sqrt(1/3 + 1/3) = 0.82), flat over 30x
    for lr, accs in ((1e-3, (45, 46, 47)), (5.5e-3, (46, 47, 48)), (3e-2, (45, 46, 47))):
        runs += [fake("OBLR-PO", lr, s, a, skipped=s, applied=lr / 100) for s, a in enumerate(accs)]
    runs += [fake("RLOO", 1e-5, 0, 40), fake("RLOO", 1e-5, 1, 44)]
    return runs


def test_cells_gains_and_applied_lr():
    table = module().tabulate(grid(), default_lr=1e-3)
    cells = {(c["method"], c["lr"]): c for c in table["cells"]}
    assert [c["method"] for c in table["cells"]][:3] == ["OBLR-PO"] * 3  # method order, then lr
    g = cells[("GRPO", 5.5e-4)]
    assert g["seeds"] == [0, 1, 2] and g["greedy"]["mean"] == pytest.approx(50) and g["greedy"]["std"] == pytest.approx(1)
    assert (g["greedy"]["min"], g["greedy"]["max"]) == (pytest.approx(49), pytest.approx(51))
    assert g["greedy_gain"]["mean"] == pytest.approx(20) and g["sampled_gain"]["mean"] == pytest.approx(30)
    assert g["skipped_fraction"] is None  # no SNR factor: not applicable, not 0
    o = cells[("OBLR-PO", 1e-3)]
    assert o["skipped_fraction"] == pytest.approx((0 + 1 + 2) / 3 / 10) and o["mean_applied_lr"] == pytest.approx(1e-5)
    r = cells[("RLOO", 1e-5)]
    assert r["greedy"]["std"] == pytest.approx(math.sqrt(8)) and table["before"]["greedy"] == pytest.approx(30)


def test_the_two_answers():
    table = module().tabulate(grid(), default_lr=1e-3)
    a = table["answers"]["greedy"]
    assert a["grpo_best_lr"] == 5.5e-4 and a["diff_pts"] == pytest.approx(-4)
    assert a["se_pts"] == pytest.approx(math.sqrt(2 / 3)) and a["verdict"] == "loses to"
    w = a["within"]
    assert w["GRPO"]["lrs_within"] == [1e-4, 5.5e-4] and w["GRPO"]["ratio"] == pytest.approx(5.5)
    assert w["OBLR-PO"]["lrs_within"] == [1e-3, 5.5e-3, 3e-2] and w["OBLR-PO"]["ratio"] == pytest.approx(30)
    assert w["RLOO"]["ratio"] == 1
    # within the spread -> "matches"; one seed each -> no verdict
    close = [dict(r, accuracy_after=r["accuracy_after"] + (0.035 if r["method"] == "OBLR-PO" else 0)) for r in grid()]
    assert module().tabulate(close, default_lr=1e-3)["answers"]["greedy"]["verdict"] == "matches"
    one = [r for r in grid() if r["seed"] == 0]
    assert module().tabulate(one, default_lr=1e-3)["answers"]["greedy"]["verdict"] == "unknown (one seed)"
    # no OBLR-PO run at its default: said, not invented
    text = module().render(module().tabulate([r for r in grid() if r["learning_rate"] != 1e-3], 1e-3), ["# t"], [])
    assert "not measured (a cell is missing)" in text


def test_no_run_mode_reads_summaries_lists_missing_cells_and_plots(tmp_path, monkeypatch):
    rc = module()
    run_dir = tmp_path / "runs"
    for r in grid():
        out = rc.cell_dir(run_dir, r["method"], r["learning_rate"]) / f"seed{r['seed']}"
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({k: v for k, v in r.items() if k not in ("method", "seed")}))
    out = tmp_path / "res" / "real_compare"
    monkeypatch.setattr(sys, "argv", ["real_compare.py", "--no_run", "--run_dir", str(run_dir), "--out", str(out),
                                      "--cells", "OBLR-PO:1e-3", "GRPO:5.5e-4", "RLOO:1e-5", "OPO:auto"])
    rc.main()
    md = out.with_suffix(".md").read_text()
    assert "| GRPO | 0.00055 | 0,1,2 | 10 | 50.0 +- 1.0 | +20.0 +- 1.0 |" in md
    assert "**loses to**" in md and "-4.0 pts" in md
    assert "RLOO: 42.0% at lr 1e-05, the only lr run: no range measured" in md
    assert "OBLR-PO: best 47.0% at lr 0.0055; within 2 pts of it: lr 0.001, 0.0055, 0.03 of 3 tried (a 30x range" in md
    # RLOO ran seeds 0 and 1 of 0-2; OPO's lr is unknown until OBLR-PO's default has its mean applied lr (auto_lr.json)
    assert "RLOO lr 1e-05 seeds 2" in md
    assert "OPO lr 1e-05 seeds 0,1,2" in md  # auto = the OBLR-PO default runs' mean applied lr, 1e-3 / 100
    assert json.loads((run_dir / "auto_lr.json").read_text())["lr"] == pytest.approx(1e-5)
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert json.loads(out.with_suffix(".json").read_text())["answers"]["greedy"]["verdict"] == "loses to"


def test_every_method_is_plotted(tmp_path):
    rc = module()
    cells = [dict(method=m, lr=lr, greedy=dict(mean=10.0 + i, min=9.0, max=12.0 + i),
                  sampled=dict(mean=5.0 + i, min=4.0, max=6.0 + i), mean_applied_lr=lr / 5)
             for i, m in enumerate(rc.METHODS) for lr in (1e-4, 1e-3)]
    rc.plot({"cells": cells, "before": dict(greedy=6.5, sampled=1.6)}, tmp_path / "all.png", "every method")
    assert (tmp_path / "all.png").stat().st_size > 10_000


def test_bad_cells_are_refused():
    with pytest.raises(SystemExit, match="METHOD:LR"):
        module().parse_cells(["PPO:1e-3"])
    assert module().parse_cells(["GRPO:1e-4,3e-3", "RLOO:auto"]) == [("GRPO", "1e-4"), ("GRPO", "3e-3"), ("RLOO", "auto")]


def test_a_stop_time_earlier_in_the_day_than_the_start_means_tomorrow():
    from datetime import datetime, timezone
    module()
    procs = importlib.import_module("harness.procs")
    late = datetime(2026, 11, 25, 23, 22, 57, tzinfo=timezone.utc)
    assert procs.stop_deadline("00:40", late) == datetime(2026, 11, 26, 0, 40, tzinfo=timezone.utc)
    assert procs.stop_deadline("23:50", late) == datetime(2026, 11, 25, 23, 50, tzinfo=timezone.utc)
    assert procs.stop_deadline("23:22", late) == datetime(2026, 11, 26, 23, 22, tzinfo=timezone.utc)
    assert procs.stop_deadline(None, late) is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_real_model_run_on_this_machine_is_seen_with_its_output_elapsed_time_and_steps(tmp_path):
    import subprocess
    import time
    module()
    procs = importlib.import_module("harness.procs")
    fake = [sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "examples" / "demo.py"),
            "--model", "smollm2", "--output_dir", "outputs/x/seed3", "--max_steps", "7"]
    proc = subprocess.Popen(fake, cwd=tmp_path)
    try:
        time.sleep(1.2)
        mine = [r for r in procs.real_demo_runs() if r["pid"] == proc.pid]
        assert len(mine) == 1 and mine[0]["out"] == str(tmp_path / "outputs/x/seed3") and mine[0]["max_steps"] == 7
        assert 0.5 < mine[0]["elapsed_s"] < 30
        assert str(tmp_path / "outputs/x/seed3") in procs.real_demo_outputs()
    finally:
        proc.kill()
        proc.wait()
    assert not [r for r in procs.real_demo_runs() if r["pid"] == proc.pid]


def test_a_run_in_flight_is_recognised_by_its_output_dir(tmp_path):
    rc, procs = module(), importlib.import_module("harness.procs")
    out = tmp_path / "OBLR-PO_lr0.001" / "seed0"
    assert procs.is_running(out, [str(out), ""])
    assert not procs.is_running(out, [str(tmp_path / "OBLR-PO_lr0.001" / "seed1"), ""])
    assert "OBLR-PO-per_step" in rc.METHODS and rc.METHODS["OBLR-PO-per_step"] == ["--snr_estimator", "per_step"]


def test_step_cost_compares_each_kind_with_grpo_of_its_checkpointing_setting():
    step_cost = importlib.import_module("step_cost")
    assert step_cost.grpo_of("default") == step_cost.grpo_of("one_backward") == "grpo"
    assert step_cost.grpo_of("one_backward_no_ckpt") == step_cost.grpo_of("default_no_ckpt") == "grpo_no_ckpt"
    assert set(step_cost.STEP_MODE) == set(step_cost.STEP_KINDS) - {"grpo", "grpo_no_ckpt"}


def test_the_runner_lists_what_is_left_in_order_and_waits_for_auto(tmp_path):
    """real_compare's jobs for the harness's grid runner: cell-major (or seed-major), finished runs and runs this
    runner already launched left out (a failed run is not retried), an 'auto' lr only once OBLR-PO's mean applied lr
    is known."""
    rc = module()
    args = argparse.Namespace(run_dir=tmp_path, default_lr=1e-3, seed_major=False, max_steps=10, demo_args=[])
    cells = [("OBLR-PO", "1e-3"), ("RLOO", "auto")]
    names = lambda jobs: [j["name"] for j in jobs]  # noqa: E731
    assert names(rc.pending(args, cells, [0, 1], set())) == ["OBLR-PO lr=0.001 seed=0", "OBLR-PO lr=0.001 seed=1"]
    args.seed_major = True
    for seed in (0, 1):
        out = rc.cell_dir(tmp_path, "OBLR-PO", 1e-3) / f"seed{seed}"
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps(dict(learning_rate=1e-3, mean_applied_lr=2e-4)))
    jobs = rc.pending(args, cells + [("GRPO", "5e-4")], [0, 1], set())
    assert names(jobs) == ["RLOO lr=0.0002 seed=0", "GRPO lr=0.0005 seed=0", "RLOO lr=0.0002 seed=1",
                           "GRPO lr=0.0005 seed=1"]
    assert jobs[0]["argv"][:6] == ["--model", "smollm2", "--learning_rate", "0.0002", "--max_steps", "10"]
    assert "--baseline" in jobs[0]["argv"] and jobs[0]["kind"] == "train" and jobs[0]["steps"] == 10
    assert names(rc.pending(args, cells, [0, 1], {jobs[0]["out"]})) == ["RLOO lr=0.0002 seed=1"]
