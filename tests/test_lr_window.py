"""benchmarks/lr_window.py (issue 49) on synthetic run records: Fisher's exact test against enumeration, each arm's
window and its open ends, the share of runs within the tolerance, collapses, and the ablation runner's window cells."""

from __future__ import annotations

import itertools
import json
import math

import pytest

import ablation  # noqa: E402
import lr_window  # noqa: E402


def brute_fisher(a, b, c, d):
    """Enumerate every labelling of the n subjects with a + c events (rows fixed): the share of labellings whose
    table is no more likely than the observed one, likelihood counted as the number of labellings giving it."""
    row1, n, events = a + b, a + b + c + d, a + c
    counts = {}
    for chosen in itertools.combinations(range(n), events):
        x = sum(i < row1 for i in chosen)
        counts[x] = counts.get(x, 0) + 1
    total = sum(counts.values())
    return sum(k for k in counts.values() if k <= counts[a]) / total


@pytest.mark.parametrize("table", [(3, 1, 1, 3), (1, 5, 3, 3), (0, 6, 6, 0), (2, 2, 2, 2), (0, 9, 3, 6), (4, 0, 0, 1)])
def test_fisher_exact_matches_enumeration(table):
    assert lr_window.fisher_exact(*table) == pytest.approx(brute_fisher(*table), rel=1e-9)


def test_fisher_exact_known_value_and_refusal():
    assert lr_window.fisher_exact(3, 1, 1, 3) == pytest.approx(0.4857142857)  # the lady tasting tea
    assert lr_window.fisher_exact(0, 0, 0, 0) == 1.0
    with pytest.raises(ValueError, match="stats.fisher_exact"):
        lr_window.fisher_exact(-1, 2, 3, 4)


def run(arm, lr, seed, acc20, before=0.25, long=False):
    return dict(arm=arm, lr=lr, seed=seed, long=long, accuracy_before=before,
                curve=[dict(step=0, accuracy=before), dict(step=20, accuracy=acc20), dict(step=40, accuracy=0.9)])


def design(tmp_path, **kw):
    base = dict(window_arms=["GRPO", "OBLR-PO"], window_seeds=[0, 1, 2], window_steps=20, collapse_pts=10.0,
                tolerance=5.0, grpo_lr=1.5e-4, eta_multiple=20 / 3, records=tmp_path / "records",
                out=tmp_path / "out" / "lr_window")
    return type("Args", (), {**base, **kw})()


# accuracy at step 20 per multiple of the arm's lr (fractions), the same on every seed but a 1-point spread
GRPO_ACC = [0.30, 0.47, 0.56, 0.53, 0.10, 0.0]
OBLR_ACC = [0.40, 0.52, 0.55, 0.57, 0.54, 0.05]


def synthetic_runs(skip=()):
    runs = []
    for arm, accs in (("GRPO", GRPO_ACC), ("OBLR-PO", OBLR_ACC)):
        for m, acc in zip(ablation.window_multiples(arm), accs):
            lr = ablation.lr_of(arm, 1.5e-4, m, eta=20 / 3)
            for seed in range(3):
                if (arm, m, seed) not in skip:
                    runs.append(run(arm, lr, seed, acc + 0.01 * (seed - 1)))
    runs.append(run("GRPO", 1.5e-4, 0, 0.0, long=True))  # a long run is not a window cell
    runs.append(run("GRPO", 1.5e-4, 4, 0.0))  # nor a seed outside the window's
    return runs


def test_window_rows_and_summary(tmp_path):
    args = design(tmp_path)
    rows = lr_window.window_rows(synthetic_runs(), args)
    grpo = [r for r in rows if r["arm"] == "GRPO"]
    assert [r["mean"] for r in grpo] == pytest.approx([100 * a for a in GRPO_ACC])
    assert [r["in_window"] for r in grpo] == [False, False, True, True, False, False]
    assert grpo[4]["collapsed"] == [0, 1, 2] and grpo[1]["collapsed"] == []  # 10 vs 25 before: collapsed
    s = lr_window.window_summary(rows, "GRPO", 5.0, 3)
    assert (s["best_lr"], s["lo"], s["hi"]) == (1.5e-4, 1.5e-4, 5e-4)
    assert s["width"] == pytest.approx(5e-4 / 1.5e-4) and not s["open_lo"] and not s["open_hi"]
    # fine: runs >= best mean - 5 = 51: the 1x and 10/3 x cells' 6 runs
    assert (s["fine"], s["runs"], s["collapsed"], s["collapsed_above"], s["runs_above"]) == (6, 18, 6, 6, 9)
    o = lr_window.window_summary(rows, "OBLR-PO", 5.0, 3)
    assert (o["lo"], o["hi"], o["best_lr"]) == (3e-4, 1e-2, 3.33e-3)
    assert o["width"] == pytest.approx(1e-2 / 3e-4) and o["incomplete"] == []


def test_open_ends_and_incomplete_cells(tmp_path):
    skip = {("OBLR-PO", 0.1, s) for s in range(3)} | {("OBLR-PO", 0.3, 2)}
    rows = lr_window.window_rows(synthetic_runs(skip), design(tmp_path, tolerance=40.0))
    o = lr_window.window_summary(rows, "OBLR-PO", 40.0, 3)
    assert o["open_lo"] and o["lo"] == 3e-4  # next to a cell not run: the window may reach further down
    assert o["incomplete"] == [1e-4, 3e-4]
    g = lr_window.window_summary(rows, "GRPO", 40.0, 3)
    assert g["lo"] == 1.5e-5 and g["open_lo"] and not g["open_hi"]  # at the grid's end


def test_collapse_tests_pair_the_arms(tmp_path):
    rows = lr_window.window_rows(synthetic_runs(), design(tmp_path))
    summaries = {arm: lr_window.window_summary(rows, arm, 5.0, 3) for arm in ("GRPO", "OBLR-PO")}
    above, whole = lr_window.collapse_tests(summaries, [("GRPO", "OBLR-PO")])
    assert (above["a_collapsed"], above["a_runs"], above["b_collapsed"], above["b_runs"]) == (6, 9, 3, 9)
    assert above["p"] == pytest.approx(brute_fisher(6, 3, 3, 6))
    assert whole["scope"] == "whole grid" and (whole["a_collapsed"], whole["b_collapsed"]) == (6, 3)


def test_main_renders_table_and_plot_from_records(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    for r in synthetic_runs({("GRPO", 0.1, 0)}):
        name = f"{r['arm']}_lr{r['lr']:.3g}{'_long' * r['long']}_seed{r['seed']}.json"
        (records / name).write_text(json.dumps(r))
    out = tmp_path / "res" / "lr_window"
    lr_window.main(["--out", str(out), "--records", str(records), "--window_arms", "GRPO", "OBLR-PO"])
    text = out.with_suffix(".md").read_text()
    assert "PARTIAL" in text and "1 of 12 cells" in text
    assert "| GRPO | 1.5e-05 | 0.1 | 2/3 |" in text and "Fisher" in text
    assert out.with_suffix(".png").stat().st_size > 1000
    assert json.loads(out.with_suffix(".json").read_text())["summaries"]["GRPO"]["best_lr"] == 1.5e-4


def test_the_runner_lists_each_window_cell_once(tmp_path):
    a = ablation.build_parser().parse_args(["--run_dir", str(tmp_path), "--records", str(tmp_path / "rec")])
    before = ablation.jobs(a)
    a.window_seeds = [0, 1, 2]
    after = ablation.jobs(a)
    assert after[: len(before)] == before  # the design before it is unchanged
    added = [(arm, lr, seed, steps) for arm, lr, seed, steps, _ in after[len(before):]]
    cells = {(arm, lr, seed) for arm, lr, seed, _, _ in after}
    for arm in ("GRPO", "RLOO", "OBLR-PO"):
        for m in ablation.window_multiples(arm):
            for seed in (0, 1, 2):
                assert (arm, ablation.lr_of(arm, a.grpo_lr, m, eta=a.eta_multiple), seed) in cells
    assert len({(arm, lr, seed) for arm, lr, seed, _ in added}) == len(added)
    assert all(steps == 20 for *_, steps in added)
    assert ("GRPO", 1.5e-5, 0, 20) in added and ("RLOO", 5e-5, 0, 20) in added and ("OBLR-PO", 0.0333, 2, 20) in added
    assert not any(arm == "GRPO" and math.isclose(lr, 1.5e-4) for arm, lr, _, _ in added)  # the ablation's cells serve
    assert len(added) == 21


@pytest.mark.parametrize("a, b, expected", [
    (1.5e-4, 1.5e-4, "the same lr"),
    (1.5e-4, 5e-4, "one grid step apart (3.33x; the grid's step is 3.33x, the finest it tells apart)"),
    (5e-4, 1.5e-4, "one grid step apart (3.33x; the grid's step is 3.33x, the finest it tells apart)"),
    (5e-5, 1.5e-3, "3 grid steps apart (30x; the grid's step is 3.11x, the finest it tells apart)"),
    (1.5e-4, 3e-4, "2x apart"),  # off the grid: its ratio alone
])
def test_grid_verdict_counts_the_grids_steps_between_two_best_lrs(a, b, expected):
    grid = [1.5e-5, 5e-5, 1.5e-4, 5e-4, 1.5e-3, 5e-3]
    assert lr_window.grid_verdict(a, b, grid) == expected


def test_with_the_calibrated_arm_grpo_and_it_also_run_the_grids_midpoint(tmp_path):
    """GRPO's best lr against the calibrated arm's: the midpoint of 1x and 10/3x (1.83x) makes the grid's step there
    finer than 2x, for those two arms only, and only when the window holds the calibrated arm."""
    a = ablation.build_parser().parse_args(["--run_dir", str(tmp_path), "--records", str(tmp_path / "rec"),
                                            "--window_seeds", "0", "--window_arms", "GRPO", "OBLR-PO-calibrated"])
    cells = {(arm, lr) for arm, lr, *_ in ablation.jobs(a)}
    assert {("GRPO", 2.74e-4), ("OBLR-PO-calibrated", 2.74e-4)} <= cells
    assert ablation.window_multiples("GRPO") == ablation.window_multiples("GRPO", ["GRPO", "OBLR-PO"])
    fine = ablation.window_multiples("GRPO", ["GRPO", "OBLR-PO-calibrated"])
    assert len(fine) == 7 and fine == sorted(fine)
    steps = [b / x for x, b in zip(fine, fine[1:])]
    assert max(steps[2:4]) < 2 and steps[2] * steps[3] == pytest.approx(10 / 3)
    assert ablation.window_multiples("OBLR-PO", ["GRPO", "OBLR-PO-calibrated"]) == ablation.window_multiples("OBLR-PO")
