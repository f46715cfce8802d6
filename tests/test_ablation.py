"""benchmarks/ablation.py on fake finished runs (no training): the launch order, the per-seed contrasts and their
intervals, the stability window's collapses, the step-size curves and the generated "When to use" text."""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import sys

import pytest

from harness import grid  # noqa: E402
from studies.ablation import design as abl_design, render as abl_render, when as abl_when  # noqa: E402


@pytest.fixture(scope="module")
def ab():
    return importlib.import_module("ablation")


def args_for(ab, tmp_path, **kw):
    base = dict(arms=list(abl_design.ABLATION_ARMS), grpo_lr=5e-4, seeds=[0, 1, 2, 3], max_steps=40, eval_every=10,
                stability_multiples=[3.0, 10.0], stability_seeds=[0, 1, 2], stability_steps=20, collapse_pts=10.0,
                lr_check_arms=["GRPO"], lr_check_multiples=[0.3], lr_check_seeds=[0, 1, 2],
                delta=5.0, run_dir=tmp_path / "runs", out=tmp_path / "results" / "ablation", demo_args=[],
                records=tmp_path / "records", large_size=500, long_arms=["OBLR-PO", "GRPO"], long_steps=120,
                long_seeds=[0], long_eval_every=20, finish_by=None, long_first=False, earlier_grpo_lr=[],
                lr_check_first=False, eta_multiple=2.0, eta_check_multiples=[10 / 3], earlier_eta_multiple=[],
                first_arms=[], power_seeds=[], power_arms=[], window_arms=["GRPO", "RLOO", "OBLR-PO"], window_seeds=[],
                window_steps=20, first_lrs=[], no_large_eval=False)
    return argparse.Namespace(**{**base, **kw})


# greedy accuracy after RL (fraction) per arm and seed: OBLR-PO beats GRPO by 10 points on every seed (+-1)
AFTER = {"GRPO": [0.40, 0.50, 0.45, 0.42], "RLOO": [0.41, 0.47, 0.46, 0.44],
         "baseline-only": [0.42, 0.52, 0.44, 0.43], "SNR-only": [0.30, 0.31, 0.29, 0.35],
         "OBLR-PO": [0.51, 0.59, 0.56, 0.52], "OBLR-PO-per_step": [0.45, 0.50, 0.46, 0.44]}


def write_run(ab, root, arm, lr, seed, after, steps=40, collapsed=False, large=None, adapter=False, long=False):
    """A finished run's folder: summary.json, log_history.json, and (optional) its large evaluation and adapter."""
    out = ab.run_dir_of(root, arm, lr, seed, long)
    out.mkdir(parents=True)
    curve = [dict(step=0, accuracy=0.25, sampled_accuracy=0.06)]
    curve += [dict(step=s, accuracy=0.05 if collapsed else after - 0.01 * (steps - s) / 10, sampled_accuracy=after)
              for s in range(10, steps + 1, 10)]
    summary = dict(accuracy_before=0.25, sampled_accuracy_before=0.06, accuracy_after=curve[-1]["accuracy"],
                   mean_applied_lr=lr / 4 if "SNR" in arm or "OBLR" in arm else lr,
                   sampled_accuracy_after=after, seconds_per_step=60.0 if arm == "GRPO" else 66.0, curve=curve,
                   steps=steps)
    (out / "summary.json").write_text(json.dumps(summary))
    history = [dict(step=s, loss=0.0, reward=0.1 + s / 100, learning_rate=lr,
                    **({"oblr/lr_scale": 0.5 / s, "oblr/lr": lr * 0.5 / s} if "SNR" in arm or "OBLR" in arm else {}))
               for s in range(1, steps + 1)]
    (out / "log_history.json").write_text(json.dumps(history + [dict(step=steps, train_runtime=1.0)]))
    if large is not None:  # the first round(500 * large) problems right
        scores = [1.0] * round(500 * large) + [0.2] * (500 - round(500 * large))
        (out / "large_eval.json").write_text(json.dumps(dict(accuracy=large, digest=f"seed{seed}", size=500,
                                                             scores=scores)))
    if adapter:
        (out / "model").mkdir()
        (out / "model" / "adapter_config.json").write_text("{}")
    return out


def test_jobs_run_the_ablation_seed_major_then_the_stability_window(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0, 1], stability_seeds=[0], lr_check_seeds=[])
    order = [(arm, lr, seed, steps) for arm, lr, seed, steps, _ in ab.jobs(a)]
    assert order[:6] == [(arm, ab.lr_of(arm, 5e-4, eta=2.0), 0, 40) for arm in abl_design.ABLATION_ARMS]
    assert order[6][2] == 1 and len(order) == 12 + 2 + 12
    assert order[12:14] == [("OBLR-PO", 1e-3, 0, 120), ("GRPO", 5e-4, 0, 120)]  # the long runs, in their own folders
    assert order[14] == ("GRPO", 1.5e-3, 0, 20) and order[20] == ("GRPO", 5e-3, 0, 20)
    outs = [out for *_, out in ab.jobs(a)]
    assert outs[12].parent.name == "OBLR-PO_lr0.001_long" and outs[4].parent.name == "OBLR-PO_lr0.001"
    assert ab.parse_cell("OBLR-PO_lr0.001_long") == ("OBLR-PO", 1e-3, True)
    assert ab.parse_cell("OBLR-PO-per_step_lr0.001") == ("OBLR-PO-per_step", 1e-3, False)
    first = [(arm, lr, seed, steps) for arm, lr, seed, steps, _ in ab.jobs(args_for(
        ab, tmp_path, seeds=[0, 1], stability_seeds=[0], lr_check_seeds=[], long_first=True))]
    assert first[:2] == order[12:14] and first[2:] == order[:12] + order[14:]  # --long_first: only the long runs move


def test_the_lr_check_runs_after_the_seeds_it_shares_with_the_ablation(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0, 1, 2, 3], stability_seeds=[0], lr_check_seeds=[0, 1])
    order = [(arm, lr, seed, steps) for arm, lr, seed, steps, _ in ab.jobs(a)]
    assert order[12:14] == [("GRPO", 1.5e-4, 0, 40), ("GRPO", 1.5e-4, 1, 40)]  # after seeds 0 and 1 of every arm
    assert [job[2] for job in order[14:26]] == [2] * 6 + [3] * 6 and order[28] == ("GRPO", 1.5e-3, 0, 20)
    first = [(arm, lr, seed, steps) for arm, lr, seed, steps, _ in ab.jobs(args_for(
        ab, tmp_path, seeds=[0, 1, 2, 3], stability_seeds=[0], lr_check_seeds=[0, 1], lr_check_first=True))]
    assert first[:2] == order[12:14] and first[2:] == order[:12] + order[14:]  # --lr_check_first: only the check moves


def test_the_lr_check_table_is_per_seed_against_the_arm_at_its_own_lr(ab, tmp_path):
    a = args_for(ab, tmp_path)
    for seed, (own, low) in enumerate([(0.40, 0.50), (0.50, 0.62), (0.45, 0.53)]):
        write_run(ab, a.run_dir, "GRPO", 5e-4, seed, own)
        write_run(ab, a.run_dir, "GRPO", 1.5e-4, seed, low)
    write_run(ab, a.run_dir, "GRPO", 1.5e-4, 3, 0.9)  # not a checked seed: left out
    ab.sync_records(a.run_dir, a.records)
    rows = ab.lr_check_table(ab.load_runs(a.records), a)
    assert [(r["multiple"], r["lr"]) for r in rows] == [(1.0, 5e-4), (0.3, 1.5e-4)]
    low = rows[1]["sampled"]
    assert low["n"] == 3 and low["mean"] == pytest.approx(100 * (0.50 + 0.62 + 0.53) / 3)
    assert low["diff"]["diffs"] == pytest.approx([10.0, 12.0, 8.0]) and low["diff"]["verdict"] == "better"
    text = "\n".join(abl_render.render_lr_check(rows))
    assert "| GRPO | 0.3x | 0.00015 | 3 |" in text and "better" in text and "(own lr)" in text
    assert ab.lr_of("OBLR-PO", 5e-4, eta=2.0) == 1e-3 and ab.lr_of("RLOO", 5e-4, eta=2.0) == 5e-4


def write_check(ab, a, own, low, seeds=(0, 1, 2)):
    """GRPO at L and at 0.3 L on `seeds`, with large-set scores `own` and `low` (fractions)."""
    for seed, (o, lo) in zip(seeds, zip(own, low)):
        write_run(ab, a.run_dir, "GRPO", 5e-4, seed, o, large=o)
        write_run(ab, a.run_dir, "GRPO", 1.5e-4, seed, lo, large=lo)
    ab.sync_records(a.run_dir, a.records)
    return ab.lr_check_table(ab.load_runs(a.records), a)


def test_a_complete_lr_check_that_finds_a_better_lr_warns(ab, tmp_path):
    a = args_for(ab, tmp_path)
    rows = write_check(ab, a, [0.31, 0.40, 0.32], [0.43, 0.38, 0.40])
    best = ab.lr_check_best(rows, a.lr_check_seeds)
    assert best["GRPO"]["lr"] == 1.5e-4  # the higher mean (40.3 against 34.3), whatever the interval says
    warning = ab.lr_check_warning(best)
    assert "GRPO's best lr" in warning and "0.00015 (0.3x" in warning and "--grpo_lr" in warning
    assert warning in "\n".join(abl_render.render_lr_check(rows, best))
    when = ab.render_when([], [], 5, 5.0, dict(greedy=26.0, sampled=6.0, large=15.0), lr_warning=warning)
    assert warning in when


def test_an_lr_check_that_keeps_L_or_lacks_seeds_does_not_warn(ab, tmp_path):
    a = args_for(ab, tmp_path)
    rows = write_check(ab, a, [0.41, 0.40, 0.42], [0.33, 0.38, 0.40])
    best = ab.lr_check_best(rows, a.lr_check_seeds)
    assert best["GRPO"]["multiple"] == 1.0 and ab.lr_check_warning(best) is None
    assert "the design's lr." in "\n".join(abl_render.render_lr_check(rows, best))
    b = args_for(ab, tmp_path / "short")
    rows = write_check(ab, b, [0.31, 0.40], [0.43, 0.48])  # 2 of the 3 check seeds: no pick yet
    assert ab.lr_check_best(rows, b.lr_check_seeds) == {}


def test_the_snr_arms_eta_max_is_checked_like_grpos_lr_and_the_check_warns_with_the_option_to_move_it(ab, tmp_path):
    assert ab.lr_of("OBLR-PO", 1.5e-4, eta=20 / 3) == 1e-3 and ab.lr_of("GRPO", 1.5e-4, eta=20 / 3) == 1.5e-4
    assert ab.lr_of("SNR-only", 1.5e-4, 0.3, eta=20 / 3) == 3e-4  # 2 L, as the 0.3x multiple of 20 L / 3
    a = args_for(ab, tmp_path, grpo_lr=1.5e-4, seeds=[0, 1, 2], lr_check_arms=["GRPO", *abl_design.SNR_ARMS],
                 lr_check_multiples=[1 / 3], eta_check_multiples=[10 / 3], stability_seeds=[], long_seeds=[])
    check = [(arm, lr, seed) for arm, lr, seed, steps, _ in ab.jobs(a)][18:]
    assert check == [("GRPO", 5e-5, s) for s in range(3)] + [(arm, 1e-3, s) for arm in abl_design.SNR_ARMS for s in range(3)]
    for seed in range(3):  # SNR-only: 1e-3 beats 2 L = 3e-4 on every seed; OBLR-PO: 2 L wins; per_step: 2 seeds only
        write_run(ab, a.run_dir, "SNR-only", 3e-4, seed, 0.40, large=0.34)
        write_run(ab, a.run_dir, "SNR-only", 1e-3, seed, 0.50, large=0.43 + 0.01 * seed)
        write_run(ab, a.run_dir, "OBLR-PO", 3e-4, seed, 0.50, large=0.44)
        write_run(ab, a.run_dir, "OBLR-PO", 1e-3, seed, 0.50, large=0.40)
        write_run(ab, a.run_dir, "OBLR-PO-per_step", 1e-3, seed, 0.50, large=0.40)
        if seed < 2:
            write_run(ab, a.run_dir, "OBLR-PO-per_step", 3e-4, seed, 0.50, large=0.30)
    ab.sync_records(a.run_dir, a.records)
    todo = [j["name"] for j in ab.pending(a) if j["kind"] == "train"]
    assert not any("lr=0.001" in name for name in todo)  # the check's runs at 1e-3 exist: nothing new to run there
    assert "OBLR-PO-per_step lr=0.0003 seed=2" in todo
    rows = ab.lr_check_table(ab.load_runs(a.records), a)
    snr = [(r["arm"], r["multiple"], r["lr"], r["large"]["n"]) for r in rows if r["arm"] == "SNR-only"]
    assert snr == [("SNR-only", 1.0, 3e-4, 3), ("SNR-only", pytest.approx(10 / 3), 1e-3, 3)]
    d = next(r for r in rows if r["arm"] == "SNR-only" and r["multiple"] != 1.0)["large"]["diff"]
    assert d["diffs"] == pytest.approx([9.0, 10.0, 11.0]) and d["verdict"] == "better"
    best = ab.lr_check_best(rows, a.lr_check_seeds)
    assert best["SNR-only"]["lr"] == 1e-3 and best["OBLR-PO"]["multiple"] == 1.0 and "OBLR-PO-per_step" not in best
    assert "GRPO" not in best  # GRPO has no run at all here
    warning = ab.lr_check_warning(best)
    assert "SNR-only's best lr on greedy (large set) at 0.001 (3.33x" in warning
    assert "`--eta_multiple` for the SNR arms' eta_max" in warning and "--grpo_lr" not in warning
    assert "OBLR-PO's best" not in warning
    text = "\n".join(abl_render.render_lr_check(rows, best))
    assert "## Is each arm at its best lr? (the lr check)" in text and "| SNR-only | 3.33x | 0.001 | 3 |" in text
    note = ab.eta_check_note(rows, best)  # per_step lacks seed 2 at 2 L: the check is open for it only
    assert note.startswith("**The SNR arms' eta_max is not settled yet**") and "SNR-only" not in note
    assert ("OBLR-PO-per_step 30.0% at 0.0003 (2 seeds), 40.0% at 0.001 (3 seeds) (0.001 minus 0.0003: +10.0 pts over "
            "2 paired seeds)") in note
    assert ab.eta_check_note([r for r in rows if r["arm"] != "OBLR-PO-per_step"], best) is None  # done: the warning's
    ab.tabulate(a, [])
    head = a.out.with_suffix(".md").read_text().split("\n")[2]
    assert "the SNR arms at eta_max = 2 L = 0.0003 (see the lr check below)" in head
    when = a.out.with_name("ablation_when.md").read_text()
    assert warning in when and note in when
    moved = args_for(ab, tmp_path / "moved", grpo_lr=1.5e-4, eta_multiple=20 / 3, earlier_grpo_lr=[5e-4],
                     earlier_eta_multiple=[2.0, 2.0])
    with pytest.raises(SystemExit, match="--earlier_eta_multiple needs one value per --earlier_grpo_lr"):
        ab.check_args(moved)
    ab.check_args(a)


def test_the_design_runs_the_snr_arms_at_the_checks_pick_and_checks_the_readmes_earlier_advice(ab):
    """The check picked 1e-3 (20 L / 3) for every SNR arm: the design runs them there, and its check's other cell is the
    README's earlier 2 L = 3e-4; the earlier round (L = 5e-4, eta 2) shares the runs at 1e-3."""
    a = ab.build_parser().parse_args([])
    ab.check_args(a)
    assert a.grpo_lr == 1.5e-4
    for arm in abl_design.SNR_ARMS:
        assert ab.lr_of(arm, a.grpo_lr, eta=a.eta_multiple) == 1e-3
        assert [ab.lr_of(arm, a.grpo_lr, m, eta=a.eta_multiple) for m in ab.check_multiples(a, arm)] == [3e-4]
        assert [ab.lr_of(arm, lr, eta=e) for lr, e in zip(a.earlier_grpo_lr, a.earlier_eta_multiple)] == [1e-3]
        assert [ab.lr_of(arm, a.grpo_lr, m, eta=a.eta_multiple) for m in a.stability_multiples] == [3.33e-3, 1e-2]
    assert ab.lr_of("GRPO", a.grpo_lr, eta=a.eta_multiple) == 1.5e-4


def test_a_round_at_another_eta_max_reuses_the_runs_at_its_lrs(ab, tmp_path):
    """The design moved to eta_max = 20 L / 3 = 1e-3 keeps the earlier round (L = 5e-4, eta_max 2 L = 1e-3) whole: the
    SNR arms' runs at 1e-3 belong to both, the earlier round's GRPO and RLOO stay at 5e-4."""
    a = args_for(ab, tmp_path, grpo_lr=1.5e-4, eta_multiple=20 / 3, earlier_grpo_lr=[5e-4], earlier_eta_multiple=[2.0],
                 seeds=[0, 1, 2], lr_check_arms=[], stability_seeds=[], long_seeds=[])
    for seed in range(3):
        for arm in abl_design.ABLATION_ARMS:
            write_run(ab, a.run_dir, arm, ab.lr_of(arm, 5e-4, eta=2.0), seed, AFTER[arm][seed], large=AFTER[arm][seed])
        write_run(ab, a.run_dir, "GRPO", 1.5e-4, seed, 0.5, large=0.5)
    ab.tabulate(a, [])
    text = a.out.with_suffix(".md").read_text()
    main, earlier = text.split("## An earlier round: L = 0.0005", 1)
    assert "| OBLR-PO | 0.001 | 3 |" in main and "| RLOO | 0.00015 | 0 |" in main and "| GRPO | 0.00015 | 3 |" in main
    assert "eta_max = 6.67 L = 0.001" in main.split("\n")[2] and "README's advice" not in main.split("\n")[2]
    assert "| OBLR-PO | 0.001 | 3 | 55.3 +- 4.0 |" in earlier and "| RLOO | 0.0005 | 3 |" in earlier
    row = next(c for c in json.loads(a.out.with_suffix(".json").read_text())["contrasts"] if c["a"] == "OBLR-PO"
               and c["b"] == "GRPO")
    assert (row["lr_a"], row["lr_b"]) == (1e-3, 1.5e-4) and row["large"]["diffs"] == pytest.approx([1.0, 9.0, 6.0])


def test_an_earlier_round_is_tabulated_in_its_own_section(ab, tmp_path):
    a = args_for(ab, tmp_path, grpo_lr=1.5e-4, earlier_grpo_lr=[5e-4], earlier_eta_multiple=[2.0], seeds=[0, 1, 2],
                 lr_check_multiples=[],
                 lr_check_seeds=[])
    for arm, values in AFTER.items():
        for seed, after in enumerate(values[:3]):
            write_run(ab, a.run_dir, arm, ab.lr_of(arm, 5e-4, eta=2.0), seed, after, large=after)
    ab.tabulate(a, [])
    text = a.out.with_suffix(".md").read_text()
    section = text.split("## An earlier round: L = 0.0005", 1)[1]
    assert "| OBLR-PO | 0.001 | 3 | 55.3 +- 4.0 |" in section
    assert "| OBLR-PO vs GRPO | 3 | +11.0, +9.0, +11.0 | +10.3 [" in section and "| better |" in section
    main = text.split("## An earlier round", 1)[0]
    assert "| OBLR-PO | 0.0003 | 0 |" in main  # the current round at L = 1.5e-4 has no run yet


def test_contrasts_are_per_seed_with_t_intervals(ab, tmp_path):
    a = args_for(ab, tmp_path)
    for arm, values in AFTER.items():
        for seed, after in enumerate(values):
            write_run(ab, a.run_dir, arm, ab.lr_of(arm, a.grpo_lr, eta=2.0), seed, after)
    ab.sync_records(a.run_dir, a.records)
    runs = ab.load_runs(a.records)
    rows = {c["name"]: c for c in ab.contrast_table(runs, a.grpo_lr, a.seeds, a.delta, eta=2.0)}
    d = rows["OBLR-PO vs GRPO"]["greedy"]
    expected = [100 * (o - g) for o, g in zip(AFTER["OBLR-PO"], AFTER["GRPO"])]
    assert d["diffs"] == pytest.approx(expected) and d["mean"] == pytest.approx(statistics.mean(expected))
    half = 3.182446 * statistics.stdev(expected) / 2  # t_{0.975, 3} sd / sqrt(4)
    assert d["ci"] == pytest.approx((d["mean"] - half, d["mean"] + half), abs=1e-3)
    assert d["verdict"] == "better" and rows["SNR-only vs GRPO"]["greedy"]["verdict"] == "worse"
    assert rows["RLOO vs GRPO"]["greedy"]["verdict"] == "no difference detected"
    assert 0 < d["power"] <= 1 and d["seeds_for_80"] >= 3


def test_the_stability_cells_at_an_earlier_rounds_lr_are_its_40_step_runs_at_step_20(ab, tmp_path):
    a = args_for(ab, tmp_path, grpo_lr=1.5e-4, seeds=[0], stability_seeds=[0], stability_multiples=[10 / 3, 10.0],
                 lr_check_seeds=[], long_seeds=[])
    assert [ab.lr_of(arm, 1.5e-4, 10 / 3, eta=2.0) for arm in abl_design.ABLATION_ARMS] == [5e-4, 5e-4, 5e-4, 1e-3, 1e-3, 1e-3]
    write_run(ab, a.run_dir, "OBLR-PO", 1e-3, 0, 0.55, large=0.40)  # the earlier round's 40-step run
    write_run(ab, a.run_dir, "OBLR-PO", 3e-4, 0, 0.50, large=0.40)  # the design's 1x run
    ab.sync_records(a.run_dir, a.records)
    todo = [(j["arm"], j["out"].parent.name, j.get("steps")) for j in ab.pending(a)]
    assert ("OBLR-PO", "OBLR-PO_lr0.001", 20) not in todo and ("OBLR-PO", "OBLR-PO_lr0.003", 20) in todo
    rows = {(r["arm"], r["lr"]): r for r in ab.stability_table(ab.load_runs(a.records), ["OBLR-PO"], 1.5e-4,
                                                                 a.stability_multiples, [0], 20, 10.0, eta=2.0)}
    reused = rows[("OBLR-PO", 1e-3)]
    assert reused["n"] == 1 and reused["mean"] == pytest.approx(100 * (0.55 - 0.01 * 2))  # its evaluation at step 20
    assert reused["change"] == pytest.approx(100 * (0.55 - 0.50))
    text = ab.render([], [], list(rows.values()), {}, [], [], dict(greedy=26.0, sampled=6.0, large=15.0), 5.0)
    assert "at its lr and at 3.33x and 10x it" in text and "| OBLR-PO | 3.33x | 0.001 | 1 |" in text


def test_tabulate_writes_tables_the_when_section_and_counts_collapses(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0, 1, 2], stability_seeds=[0, 1, 2])
    for arm, values in AFTER.items():
        for seed in range(3):
            write_run(ab, a.run_dir, arm, ab.lr_of(arm, a.grpo_lr, eta=2.0), seed, values[seed],
                      large=values[seed] - 0.1)
    for seed in range(3):  # OBLR-PO at 10x its lr collapses on seeds 0 and 1
        write_run(ab, a.run_dir, "OBLR-PO", ab.lr_of("OBLR-PO", a.grpo_lr, 10.0, eta=2.0), seed, 0.5, steps=20,
                  collapsed=seed < 2)
    summary = ab.run_dir_of(a.run_dir, "GRPO", 5e-4, 2) / "summary.json"  # one GRPO run in micro-batches, slowed
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "micro_batch": 16, "seconds_per_step": 90.0}))
    ab.tabulate(a, [])
    text = a.out.with_suffix(".md").read_text()
    assert "so that they fit beside another arm: 1 of GRPO's 3 runs, 0 of RLOO's 3 runs." in text
    when = a.out.with_name("ablation_when.md").read_text()  # the cost: median s/step, with its range over the runs
    assert "GRPO 60 s (60-90), RLOO 66 s (66-66)," in when.split("**Cost**")[1]
    assert "the SNR arms at eta_max = 2 L = 0.001 (not checked)" in text  # no SNR arm among --lr_check_arms
    assert "| OBLR-PO | 10x | 0.01 | 3 |" in text and "| 2/3 | 0.0009 | 0.005 |" in text  # applied: 0.01 x 0.5 / s
    assert "| GRPO | 1x | 0.0005 | 3 |" in text and "| 0/3 | 0.0005 | 0.0005 |" in text  # constant lr
    tolerance = when.split("**A too-large lr**")[1].split("\n\n")[0]
    change = 100 * (statistics.mean([0.05, 0.05, 0.5]) - (0.51 + 0.59 + 0.56) / 3 + 0.02)  # at step 20 (curves)
    assert f"OBLR-PO at 10x (eta_max 0.01, applied 0.0009 on average, 0.005 at most) 2/3 collapsed, {change:+.1f} " \
        "pts." in tolerance
    assert "runs of 20 steps" in tolerance and "more than 10 points below" in tolerance
    assert "The largest lr a run applied and held: 0.0009 on average (OBLR-PO at 10x, seed 2); the smallest a run " \
        "applied and collapsed: 0.0009 on average (OBLR-PO at 10x, seed 0)." in tolerance  # its seed 2 held
    assert "Fewer than 3 seeds so far: GRPO 3x, GRPO 10x, RLOO 3x," in tolerance and "OBLR-PO 10x" not in tolerance
    assert "| 0.00025 | 66 |" in text and "| 0.0005 | 60 |" in text  # OBLR-PO's and GRPO's mean applied lr, s/step
    assert "Not finished when this table was made" in text  # the other stability runs
    when = a.out.with_name("ablation_when.md").read_text()
    head = when.split("\n")[2]  # every seed planned is in: the header says so, and which contrasts stay underpowered
    assert "every contrast has its 3 planned seeds." in head and "so far" not in head and "yet" not in head
    assert "**With the planned seeds in, 1 of the 9 contrasts reaches 80% power to detect 5 points; for the other 8 " \
        "(RLOO vs GRPO: 52%, " in head and "SNR-only vs GRPO: 20%, " in head and "OBLR-PO vs GRPO" not in head
    assert "**OBLR-PO vs GRPO** over 3 seeds: greedy (large set) +" in when
    assert "over 3 seeds: greedy (large set) +10.3 pts" in when  # (51+59+56)/3 - (40+50+45)/3, large set first
    assert "SNR-only vs GRPO (greedy (100), sampled (100), greedy (large set))" in when.split("**Where it loses**")[1]
    assert "| OBLR-PO vs GRPO | 3 | +10.3 [" in text
    # seed 0 differs on the 55 problems OBLR-PO has right and GRPO wrong: sd of 55 ones among 500, / sqrt(500)
    se0 = 100 * statistics.stdev([1] * 55 + [0] * 445) / 500 ** 0.5
    assert f"(seeds 0,1,2, large set); of each, +-" in text and "OBLR-PO vs GRPO: +11.0, +9.0, +11.0" in text
    row = next(c for c in json.loads(a.out.with_suffix(".json").read_text())["contrasts"] if c["a"] == "OBLR-PO"
               and c["b"] == "GRPO")
    se = [100 * statistics.stdev([1] * k + [0] * (500 - k)) / 500 ** 0.5 for k in (55, 45, 55)]
    assert row["large"]["measurement_se"] == pytest.approx(statistics.mean(se)) and se[0] == pytest.approx(se0) and "Not finished" in text and "GRPO lr 0.0005 seeds" not in text
    assert "SNR-only vs GRPO" in when.split("**Where it loses**")[1]
    assert "OBLR-PO 66 s (66-66)" in when and "x GRPO's" not in when
    saved = json.loads(a.out.with_suffix(".json").read_text())
    assert len(saved["runs"]) == 21 and "history" not in saved["runs"][0]
    record = json.loads(ab.record_path(a.records, ab.run_dir_of(a.run_dir, "GRPO", 5e-4, 0)).read_text())
    assert [e["reward"] for e in record["history"][:2]] == pytest.approx([0.11, 0.12]) and len(record["history"]) == 40
    assert a.out.with_suffix(".png").stat().st_size > 10_000
    curves = saved["curves"]["OBLR-PO"]
    assert curves["lr_scale"]["1"] == pytest.approx(0.5) and curves["greedy"]["40"] == pytest.approx(
        100 * statistics.mean(AFTER["OBLR-PO"][:3]))


def test_records_keep_finished_runs_when_their_folders_are_lost(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0], stability_seeds=[], lr_check_seeds=[])
    out = write_run(ab, a.run_dir, "GRPO", 5e-4, 0, 0.5, large=0.3)
    assert [p.name for p in ab.sync_records(a.run_dir, a.records)] == ["GRPO_lr0.0005_seed0.json"]
    assert ab.sync_records(a.run_dir, a.records) == []  # unchanged: not rewritten
    for f in out.iterdir():
        f.unlink()
    out.rmdir()
    (runs,) = ab.load_runs(a.records)
    assert runs["arm"] == "GRPO" and runs["accuracy_after"] == 0.5 and runs["large_accuracy_after"] == 0.3
    assert "large_accuracy_before" not in runs  # no evaluation of the model before RL on that seed's set yet
    ab.base_path(a.records, 0).write_text(json.dumps(dict(accuracy=0.1, digest="seed0")))
    ab.base_path(a.records, 1).write_text(json.dumps(dict(accuracy=0.2, digest="other")))
    assert ab.load_runs(a.records)[0]["large_accuracy_before"] == 0.1
    assert ab.cell_state(a, out) == "done"  # never run again


def test_pending_scores_trained_runs_first_and_reruns_runs_without_a_large_evaluation(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0, 1], stability_seeds=[], lr_check_seeds=[], arms=["GRPO", "RLOO", "OBLR-PO"],
                 long_seeds=[])
    write_run(ab, a.run_dir, "GRPO", 5e-4, 0, 0.5, large=0.3)                  # done
    write_run(ab, a.run_dir, "RLOO", 5e-4, 0, 0.5, adapter=True)               # trained, to be scored
    lost = write_run(ab, a.run_dir, "OBLR-PO", 1e-3, 0, 0.5)                   # no adapter, no large set: rerun
    ab.base_path(a.records, 1).parent.mkdir(parents=True)
    ab.base_path(a.records, 1).write_text("{}")
    jobs = ab.pending(a)
    assert [(j["kind"], j["name"]) for j in jobs] == [
        ("base", "large eval before RL seed=0"), ("large", "large eval of RLOO lr=0.0005 seed=0"),
        ("train", "OBLR-PO lr=0.001 seed=0"), ("train", "GRPO lr=0.0005 seed=1"), ("train", "RLOO lr=0.0005 seed=1"),
        ("train", "OBLR-PO lr=0.001 seed=1")]
    assert jobs[0]["argv"][-4:] == ["--seed", "0", "--output", str(ab.base_path(a.records, 0))]
    assert jobs[1]["argv"][-1] == str(ab.run_dir_of(a.run_dir, "RLOO", 5e-4, 0)) and jobs[2]["out"] == lost
    assert "--learning_rate" in jobs[2]["argv"] and "--eval_every" in jobs[2]["argv"]


def test_long_runs_get_their_own_table_sentence_and_plot_and_stay_out_of_the_ablation(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0], stability_seeds=[], lr_check_seeds=[])
    write_run(ab, a.run_dir, "GRPO", 5e-4, 0, 0.40, large=0.3)
    out = write_run(ab, a.run_dir, "OBLR-PO", 1e-3, 0, 0.55, steps=120, large=0.5, long=True)
    history = [dict(step=t, loss=0.0, reward=0.5, **{"oblr/lr_scale": 0.2 if t <= 60 else 0.02}) for t in range(1, 121)]
    (out / "log_history.json").write_text(json.dumps(history))
    ab.tabulate(a, [])
    runs = ab.load_runs(a.records)
    assert sorted((r["arm"], r["long"]) for r in runs) == [("GRPO", False), ("OBLR-PO", True)]
    rows = ab.long_table([r for r in runs if r["long"]])
    assert [r["step"] for r in rows] == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120]
    assert rows[0]["lr_scale"] is None and rows[6]["lr_scale"] == pytest.approx(0.2)
    assert rows[7]["lr_scale"] == pytest.approx(0.02)  # the mean over steps 61-70
    (sentence,) = abl_render.long_summary(rows)
    assert sentence.startswith("OBLR-PO seed 0: lr scale 0.200 (steps to 10) -> 0.020 (last window)")
    assert "an applied lr of 0.0002 -> 2e-05" in sentence and "over the second half" in sentence
    text = a.out.with_suffix(".md").read_text()
    assert "## The step size over a long run" in text and "| OBLR-PO | 0 | 120 | 0.020 | 2e-05 |" in text
    assert "| OBLR-PO | 0.001 | 0 | - +- -" in text  # the long run is not the 40-step cell
    assert "**Over a long run**" in a.out.with_name("ablation_when.md").read_text()
    assert a.out.with_name("ablation_long.png").stat().st_size > 10_000
    assert sentence.endswith("; greedy on the large set after it 50.0%.")  # no 40-step run of its cell yet
    write_run(ab, a.run_dir, "OBLR-PO", 1e-3, 0, 0.45, large=0.4)  # the ablation's run of the same arm, lr and seed
    ab.tabulate(a, [])
    runs = ab.load_runs(a.records)
    (sentence,) = abl_render.long_summary(ab.long_table([r for r in runs if r["long"]], short=[r for r in runs if not r["long"]]))
    assert sentence.endswith("; greedy on the large set after it 50.0% (its 40-step run, same lr and seed: 40.0%).")
    assert sentence in a.out.with_suffix(".md").read_text()


def test_a_job_starts_only_when_the_expected_peaks_fit_in_memory(ab):
    grpo, oblr = dict(kind="train", arm="GRPO"), dict(kind="train", arm="OBLR-PO")
    rloo, evaluation = dict(kind="train", arm="RLOO"), dict(kind="large", arm="GRPO")
    total = 23.4  # this machine's MemTotal
    assert grid.fits([ab.expected_peak_gb(oblr)], ab.expected_peak_gb(oblr), total, 1.0)  # two OBLR-PO arms
    # GRPO and RLOO in micro-batches of 16 (4.5-4.6 GB): beside any arm, and beside each other
    assert "--micro_batch" in ab.ARMS["GRPO"][0] and "--micro_batch" in ab.ARMS["RLOO"][0]
    assert grid.fits([ab.expected_peak_gb(oblr)], ab.expected_peak_gb(grpo), total, 1.0)
    assert grid.fits([ab.expected_peak_gb(grpo)], ab.expected_peak_gb(rloo), total, 1.0)
    assert grid.fits([ab.expected_peak_gb(oblr), ab.expected_peak_gb(rloo)], ab.expected_peak_gb(evaluation), total, 1.0)
    assert not grid.fits([ab.expected_peak_gb(oblr), ab.expected_peak_gb(oblr)], ab.expected_peak_gb(grpo), total, 1.0)
    # a run another runner launched counts at its arm's peak, read from its folder
    other_grpo, other_long = "/w/outputs/ablation/GRPO_lr0.0005/seed1", "/w/outputs/ablation/OBLR-PO_lr0.001_long/seed0"
    assert ab.other_peak_gb(other_grpo) == ab.expected_peak_gb(grpo)
    assert ab.other_peak_gb(other_long) == ab.expected_peak_gb(oblr)


@pytest.fixture
def heavy_grpo(ab, monkeypatch):
    """GRPO and RLOO as they were before micro-batching (13-13.4 GB): they must run alone on this machine."""
    monkeypatch.setattr(ab, "PEAK_GB", {"GRPO": 14.0, "RLOO": 14.0})


def test_a_job_overtakes_one_that_must_run_alone_only_if_it_ends_about_as_soon_and_only_one_at_a_time(
        ab, heavy_grpo):
    def train(arm, steps=40):
        return dict(kind="train", arm=arm, steps=steps)

    def in_flight(arm, minutes_left, overtaker=False):
        return dict(peak_gb=ab.expected_peak_gb(train(arm)), minutes_left=minutes_left, overtaker=overtaker)

    total, margin = 23.4, 1.0
    grpo, bo, stab, evaluation = train("GRPO"), train("baseline-only"), train("SNR-only", 20), dict(kind="large",
                                                                                                     arm="GRPO")
    assert grid.next_job([grpo, bo], [], total, margin, ab.COSTS) is grpo  # alone: the first in line
    assert grid.next_job([bo, grpo], [in_flight("OBLR-PO", 30)], total, margin, ab.COSTS) is bo
    # GRPO must wait for the run in flight; baseline-only (40 min) ends within 10 min of it (38 min left): it goes
    assert grid.next_job([grpo, bo], [in_flight("OBLR-PO-per_step", 38)], total, margin, ab.COSTS) is bo
    # ... but not when the run in flight is nearly done: GRPO would wait 40 min instead of 5
    assert grid.next_job([grpo, bo], [in_flight("OBLR-PO-per_step", 5)], total, margin, ab.COSTS) is None
    assert grid.next_job([grpo, bo, stab], [in_flight("OBLR-PO-per_step", 10)], total, margin, ab.COSTS) is stab  # 20 <= 10 + 10
    # once a job has overtaken, nothing else does: after the first run ends the first in line waits for it only
    assert grid.next_job([grpo, stab], [in_flight("baseline-only", 15, overtaker=True)], total, margin, ab.COSTS) is None
    # a job that does not fit never goes, and an evaluation fits beside GRPO
    assert grid.next_job([grpo, train("RLOO")], [in_flight("OBLR-PO", 40)], total, margin, ab.COSTS) is None
    assert grid.next_job([evaluation, bo], [in_flight("GRPO", 30)], total, margin, ab.COSTS) is evaluation
    assert grid.next_job([], [], total, margin, ab.COSTS) is None


def test_a_run_launched_elsewhere_gets_the_peak_seen_while_it_ran(ab, tmp_path, monkeypatch):
    out = tmp_path / "SNR-only_lr0.001" / "seed1"
    out.mkdir(parents=True)
    watched, lines = {}, []
    rss = iter([9.5, 10.9, 10.2])
    monkeypatch.setattr(grid, "rss_gb", lambda pid: next(rss))
    for _ in range(3):
        grid.watch_others([dict(out=str(out), pid=4242, elapsed_s=60.0, max_steps=40)], watched, 30, lines.append)
    assert not (out / "peak_rss.json").exists()  # still running
    (out / "summary.json").write_text("{}")
    grid.watch_others([], watched, 30, lines.append)  # gone, finished
    peak = json.loads((out / "peak_rss.json").read_text())
    assert peak["peak_rss_gb"] == 10.9 and peak["watched_part_of_the_run"] and watched == {}
    assert "not launched here" in lines[-1]
    grid.write_peak(out, 12.0, 30)  # the launching runner's own peak is not overwritten by a watcher
    watched[7] = dict(out=out, peak_gb=1.0)
    grid.watch_others([], watched, 30, lines.append)
    assert json.loads((out / "peak_rss.json").read_text())["peak_rss_gb"] == 12.0


def test_a_runs_peak_memory_reaches_its_record_and_the_arm_table(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0, 1])
    out = write_run(ab, a.run_dir, "GRPO", 5e-4, 0, 0.5, large=0.3)
    (out / "peak_rss.json").write_text(json.dumps(dict(peak_rss_gb=4.7, sampled_every_s=30)))
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps(dict(summary, micro_batch=16)))  # as ARMS runs GRPO now
    whole = write_run(ab, a.run_dir, "GRPO", 5e-4, 1, 0.5, large=0.3)  # an earlier whole-batch run: not GRPO's now
    (whole / "peak_rss.json").write_text(json.dumps(dict(peak_rss_gb=13.3, sampled_every_s=30)))
    ab.sync_records(a.run_dir, a.records)
    runs = ab.load_runs(a.records)
    assert [r["peak_rss_gb"] for r in runs] == [4.7, 13.3]
    (row,) = ab.arm_table(runs, ["GRPO"], 5e-4, [0, 1], eta=2.0)
    assert row["peak_rss_gb"] == 4.7 and abl_design.micro_batch_of("GRPO") == 16 and abl_design.micro_batch_of("OBLR-PO") is None


def test_the_runner_keeps_memory_and_parallel_limits_launches_in_order_and_stops_launching_at_its_stop_time(
        ab, tmp_path, monkeypatch, heavy_grpo):
    """run_all end to end on fake runs (a python process sleeping, then writing summary.json): GRPO, first in line,
    runs alone; the norm arms then run two at a time, never three (by memory here, by --parallel with more memory);
    past the stop time nothing more trains."""
    import time as real_time
    from datetime import timedelta

    def fake_pending(args):
        return [dict(kind="train", name=arm, out=args.run_dir / arm / "seed0", seed=0, arm=arm,
                     steps=args.steps.get(arm, 40), argv=[])
                for arm in args.arms if not (args.run_dir / arm / "seed0" / "summary.json").exists()]

    def fake_command(seed, out, argv):
        script = (f"import time, pathlib; t = time.time(); time.sleep(1.5); "
                  f"open({str(out.parent.parent / 'timeline.txt')!r}, 'a').write(f'{out.parent.name} {{t}} "
                  f"{{time.time()}}\\n'); pathlib.Path({str(out)!r}, 'summary.json').write_text('{{}}')")
        return [sys.executable, "-c", script], {}

    def run(arms, total_gb, parallel, stop_launching=None, finish_by=None, steps=None):
        a = args_for(ab, tmp_path, arms=arms, parallel=parallel, poll_s=0.01, margin_gb=1.0, min_free_gb=0.0,
                     stop_launching=stop_launching, finish_by=finish_by, run_dir=tmp_path / "_".join(arms),
                     steps=steps or {})
        monkeypatch.setattr(grid, "meminfo_gb", lambda key: total_gb)
        lines = []
        ab.run_all(a, lines.append)
        timeline = a.run_dir / "timeline.txt"
        spans = {name: (float(t0), float(t1)) for name, t0, t1 in
                 (line.split() for line in (timeline.read_text().splitlines() if timeline.exists() else []))}
        return spans, [line.split()[1] for line in lines if line.startswith("launched")], lines, a

    sleep = real_time.sleep
    monkeypatch.setattr(ab, "pending", fake_pending)
    monkeypatch.setattr(ab, "demo_command", fake_command)
    monkeypatch.setattr(grid, "real_demo_runs", lambda: [])
    monkeypatch.setattr(ab, "sync_records", lambda run_dir, records: [])
    monkeypatch.setattr(grid, "mem_available_gb", lambda: 20.0)
    monkeypatch.setattr(grid.time, "sleep", lambda s: sleep(min(s, 0.01)))

    arms = ["GRPO", "SNR-only", "OBLR-PO", "OBLR-PO-per_step"]
    spans, launched, _, a = run(arms, 23.4, parallel=3)  # this machine's memory; --parallel allows three
    assert launched == arms and set(spans) == set(arms)  # in line: nothing to overtake GRPO with no run in flight
    assert all(spans[arm][0] >= spans["GRPO"][1] for arm in arms[1:])  # GRPO ran alone
    assert spans["SNR-only"][0] < spans["OBLR-PO"][1] and spans["OBLR-PO"][0] < spans["SNR-only"][1]  # two at once
    assert spans["OBLR-PO-per_step"][0] >= min(spans["SNR-only"][1], spans["OBLR-PO"][1])  # never three: memory
    assert all((a.run_dir / arm / "seed0" / "peak_rss.json").exists() for arm in arms)

    norm_arms = ["SNR-only", "OBLR-PO", "OBLR-PO-per_step"]
    spans, launched, _, _ = run(norm_arms, 100.0, parallel=2)  # memory for three; --parallel 2
    assert spans["OBLR-PO-per_step"][0] >= min(spans["SNR-only"][1], spans["OBLR-PO"][1])  # never three: --parallel

    # 30 minutes before --finish_by: a 40-step run (40 min + its large evaluation) is held back, a 20-step one goes
    monkeypatch.setattr(grid, "stop_deadline", lambda hhmm, now: hhmm and now + timedelta(minutes=30))
    spans, launched, lines, _ = run(["OBLR-PO", "SNR-only"], 50.0, parallel=2, finish_by="05:00",
                                    steps={"SNR-only": 20})
    assert launched == ["SNR-only"] and set(spans) == {"SNR-only"}
    assert "not launching OBLR-PO: expected 42 min with its large evaluation, it would not end by --finish_by 05:00" \
        in lines[0]

    monkeypatch.setattr(grid, "stop_deadline", lambda hhmm, now: hhmm and now)  # past the stop time
    spans, launched, lines, _ = run(["RLOO", "baseline-only"], 50.0, parallel=2, stop_launching="00:00")
    assert not launched and not spans and "not launching 2 training runs" in lines[-1]


def test_the_when_section_says_how_far_the_evidence_goes_while_only_some_contrasts_have_three_seeds(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0, 1, 2, 3, 4], stability_seeds=[], lr_check_seeds=[], long_seeds=[])
    for arm, values in AFTER.items():
        for seed in range(3 if arm in ("GRPO", "baseline-only") else 2):
            write_run(ab, a.run_dir, arm, ab.lr_of(arm, a.grpo_lr, eta=2.0), seed, values[seed],
                      large=values[seed] - 0.1)
    ab.tabulate(a, [])
    when = a.out.with_name("ablation_when.md").read_text()
    head, loses = when.split("\n")[2], when.split("**Where it loses**: ")[1].split("\n")[0]
    assert "has 3 of its 5 planned seeds so far; 1 of the 9 contrasts has the 3 seeds a verdict needs" in head
    assert "**Not powered yet: 0 of the 9 contrasts reach 80% power to detect 5 points" in head
    assert "no correction for multiplicity: of the 3 drawn here, about 0.1 would exclude 0 by chance" in head
    assert "**baseline-only vs GRPO** over 3 seeds: greedy (large set) +" in when
    assert "**OBLR-PO vs GRPO** over 2 seeds: greedy (large set): too few seeds (2)" in when
    assert "- RLOO: greedy (100) 44.0% (2 seeds)" in when  # every arm's means stay listed
    assert "2 of 5 planned seeds, no verdict yet" in a.out.with_name("ablation_baseline.md").read_text()
    assert loses == ("the one contrast with 3 or more seeds is not detected worse than its reference (underpowered: "
                     "see above); 8 have too few seeds to tell.")


def test_the_readme_says_what_the_default_baseline_does_in_training_from_the_contrast_with_rloo(ab):
    def contrasts(lr=1.5e-4, **d):
        return [dict(name=abl_design.BASELINE_CONTRAST, lr_a=lr, **{abl_design.PRIMARY: d})]

    text = ab.render_baseline(contrasts(n=2, ci=None, verdict="too few seeds (2)"), 5, 5.0)
    assert text.startswith("# The baseline in training") and "2 of 5 planned seeds, no verdict yet." in text
    worse = ab.render_baseline(contrasts(n=3, ci=(-11.6, -1.3), mean=-6.5, verdict="worse", power=0.59), 5, 5.0)
    assert "over 3 of 5 planned seeds, -6.5 pts [-11.6, -1.3], worse (power 59% for 5 pts)." in worse
    assert "learns worse than RLOO's" in worse and "can still move" in worse and 'baseline="mean"' in worse
    powered = ab.render_baseline(contrasts(n=5, ci=(-9.0, -4.0), mean=-6.5, verdict="worse", power=0.9), 5, 5.0)
    assert "can still move" not in powered
    tie = ab.render_baseline(contrasts(n=5, ci=(-3.0, 2.0), mean=-0.5, verdict="no difference detected", power=0.9),
                             5, 5.0)
    assert "no difference detected (power 90% for 5 pts)." in tie and "stays" not in tie
    assert ("the default gradient-weighted baseline learns neither better nor worse than RLOO's plain leave-one-out "
            "mean (power 90% to detect 5 pts) at lr 0.00015.") in tie
    weak_tie = ab.render_baseline(contrasts(n=3, ci=(-9.0, 8.0), mean=-0.5, verdict="no difference detected",
                                            power=0.3), 5, 5.0)
    assert "So far" not in weak_tie and "learns" not in weak_tie  # an underpowered tie is no finding
    # an earlier round's verdict (at its own lr) is said beside the design's, and its "worse" is not dropped
    earlier = [dict(contrasts=contrasts(5e-4, n=3, ci=(-11.6, -1.3), mean=-6.5, verdict="worse", power=0.59))]
    both = ab.render_baseline(contrasts(n=0, ci=None, verdict="too few seeds (0)"), 5, 5.0, earlier)
    assert "at lr 0.00015, 0 of 5 planned seeds, no verdict yet; at lr 0.0005 (the earlier round, GRPO's lr off its " \
           "best), over 3 seeds, -6.5 pts [-11.6, -1.3], worse (power 59% for 5 pts)." in both
    assert "learns worse than RLOO's" in both and "can still move" in both
    # a powered tie at the design's lr and a worse verdict at the earlier round's are each said at their own lr
    mixed = ab.render_baseline(contrasts(n=4, ci=(-1.5, 2.1), mean=0.3, verdict="no difference detected", power=1.0),
                               5, 5.0, earlier)
    assert ("baseline learns neither better nor worse than RLOO's plain leave-one-out mean (power 100% to detect 5 "
            "pts) at lr 0.00015; it learns worse than RLOO's plain leave-one-out mean at lr 0.0005.") in mixed
    assert "The default stays until the planned seeds are in (a verdict at this power can still move)" in mixed
    # with the design's planned seeds in, the default stays only where it did not learn worse at GRPO's best lr
    done = ab.render_baseline(contrasts(n=5, ci=(-1.4, 1.5), mean=0.0, verdict="no difference detected", power=1.0),
                              5, 5.0, earlier)
    assert ("The default stays: with the planned seeds in, it did not learn worse at GRPO's best lr, the lr a GRPO "
            "user has tuned. Where it did (a verdict at this power can still move), `baseline=\"mean\"`") in done
    assert "until the planned seeds" not in done
    lost = ab.render_baseline(contrasts(n=5, ci=(-9.0, -4.0), mean=-6.5, verdict="worse", power=0.9), 5, 5.0)
    assert "**With the planned seeds in, it learned worse at GRPO's best lr: set `baseline=\"mean\"`.**" in lost
    assert "stays" not in lost


def test_the_when_sections_word_on_a_too_large_lr_compares_the_lr_runs_applied(ab):
    def row(arm, multiple, lr, n, collapsed, applied, applied_max, per_run=None):
        per_run = per_run or [(s, applied, applied_max) for s in range(n)]  # (seed, its mean, its largest step)
        return dict(arm=arm, multiple=multiple, lr=lr, n=n, collapsed=collapsed, applied=applied,
                    applied_max=applied_max, mean=50.0, min=40.0, change=0.0,
                    applied_per_run=[dict(seed=s, collapsed=s in collapsed, mean=m, max=top) for s, m, top in per_run])

    assert abl_when.render_tolerance([row("GRPO", 1.0, 1e-4, 3, [], 1e-4, 1e-4)], 20, 10.0, 3) == \
        "not measured yet (no stability run finished)."
    held = [row("GRPO", 1.0, 1e-4, 3, [], 1e-4, 1e-4), row("GRPO", 10.0, 1e-3, 3, [], 1e-3, 1e-3),
            row("OBLR-PO", 10.0, 1e-2, 2, [], 4e-4, 2e-3)]
    text = abl_when.render_tolerance(held, 20, 10.0, 3)
    assert "GRPO at 10x (0.001) 0/3 collapsed, +0.0 pts; OBLR-PO at 10x (eta_max 0.01, applied 0.0004 on average, " \
        "0.002 at most) 0/2 collapsed, +0.0 pts." in text
    assert "held: 0.001 on average (GRPO at 10x, seed 0)." in text and "and collapsed" not in text  # none did
    assert text.endswith("Fewer than 3 seeds so far: OBLR-PO 10x.")
    fell = held[:2] + [row("OBLR-PO", 10.0, 1e-2, 3, [1, 2], 4e-4, 2e-3,
                           per_run=[(0, 1.2e-3, 2e-3), (1, 3e-4, 5e-4), (2, 7e-4, 9e-4)])]
    text = abl_when.render_tolerance(fell, 20, 10.0, 3)  # per run: seed 0 held at the cell's largest; 1 and 2 fell
    assert "held: 0.0012 on average (OBLR-PO at 10x, seed 0); the smallest a run applied and collapsed: 0.0003 on " \
        "average (OBLR-PO at 10x, seed 1)." in text and "Fewer than" not in text


def test_the_runners_log_outlives_a_lost_run_dir(ab, tmp_path):
    saved = tmp_path / "ablation.json"
    assert ab.merged_log(saved, ["a", "b"]) == ["a", "b"]  # nothing kept yet
    saved.write_text(json.dumps(dict(runner_log=["old 1", "a"])))
    assert ab.merged_log(saved, ["a", "b"]) == ["old 1", "a", "b"]  # a new machine's log after the kept one, no repeats


def test_first_arms_launch_their_training_runs_first_in_the_same_order(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0], stability_seeds=[0, 1], lr_check_seeds=[], long_seeds=[])
    plain = [(j["kind"], j["name"]) for j in ab.pending(a)]
    first = [(j["kind"], j["name"]) for j in ab.pending(args_for(ab, tmp_path, seeds=[0], stability_seeds=[0, 1],
                                                                  lr_check_seeds=[], long_seeds=[],
                                                                  first_arms=["OBLR-PO", "SNR-only"]))]
    assert sorted(first) == sorted(plain) and first[0][0] == "base"  # the same jobs; evaluations still first
    train = [name for kind, name in first if kind == "train"]
    snr = [name for kind, name in plain if kind == "train" and name.split()[0] in ("OBLR-PO", "SNR-only")]
    assert train[:len(snr)] == snr and len(snr) == 10  # each: seed 0 at 1x, the window's seeds 0-1 at 3x and 10x
    assert train[len(snr):] == [name for kind, name in plain if kind == "train" and name not in snr]


def test_first_lrs_launch_in_their_order_and_no_large_eval_trains_only(ab, tmp_path):
    kw = dict(seeds=[], stability_seeds=[], lr_check_seeds=[], long_seeds=[], grpo_lr=1.5e-4,
              window_arms=[abl_design.CALIBRATED], window_seeds=[0])
    a = args_for(ab, tmp_path, **kw)
    ab.base_path(a.records, 0).parent.mkdir(parents=True)
    ab.base_path(a.records, 0).write_text("{}")
    plain = [j["name"] for j in ab.pending(a)]  # the calibrated arm's grid: GRPO's, with the midpoint of L and 10L/3
    assert plain == [f"OBLR-PO-calibrated lr={lr:.3g} seed=0"
                     for lr in (1.5e-5, 5e-5, 1.5e-4, 2.74e-4, 5e-4, 1.5e-3, 5e-3)]
    first = [j["name"] for j in ab.pending(args_for(ab, tmp_path, **kw, first_lrs=[1.5e-4, 5e-4, 5e-5]))]
    assert first == [plain[2], plain[4], plain[1], plain[0], plain[3], plain[5], plain[6]]  # the rest in own order
    out = write_run(ab, a.run_dir, abl_design.CALIBRATED, 1.5e-4, 0, 0.5, steps=20, adapter=True)  # not scored
    assert [j["kind"] for j in ab.pending(a)][0] == "large"
    skipped = ab.pending(args_for(ab, tmp_path, **kw, no_large_eval=True))
    assert [j["kind"] for j in skipped] == ["train"] * 6 and plain[2] not in [j["name"] for j in skipped]
    # its record written and its output folder lost: --no_large_eval does not train it again; a plain call must
    ab.sync_records(a.run_dir, a.records)
    shutil.rmtree(out)
    assert plain[2] not in [j["name"] for j in ab.pending(args_for(ab, tmp_path, **kw, no_large_eval=True))]
    assert plain[2] in [j["name"] for j in ab.pending(a) if j["kind"] == "train"]


def test_power_seeds_run_last_for_their_arms_and_serve_only_the_contrasts_between_them(ab, tmp_path):
    a = args_for(ab, tmp_path, seeds=[0, 1, 2], stability_seeds=[0], lr_check_seeds=[], long_seeds=[],
                 power_seeds=[3], power_arms=["GRPO", "OBLR-PO"])
    order = [(arm, lr, seed, steps) for arm, lr, seed, steps, _ in ab.jobs(a)]
    assert order[-2:] == [("GRPO", 5e-4, 3, 40), ("OBLR-PO", 1e-3, 3, 40)]  # after the stability window
    assert len(order) == 18 + 12 + 2
    for arm, values in AFTER.items():
        for seed in range(3):
            write_run(ab, a.run_dir, arm, ab.lr_of(arm, a.grpo_lr, eta=2.0), seed, values[seed],
                      large=values[seed] - 0.1)
    write_run(ab, a.run_dir, "GRPO", 5e-4, 3, AFTER["GRPO"][3], large=AFTER["GRPO"][3] - 0.1)
    ab.tabulate(a, [])
    when = a.out.with_name("ablation_when.md").read_text()
    head = when.split("\n")[2]  # OBLR-PO's seed 3 not run: the contrast it serves is short of its 4 planned seeds
    assert "every contrast has its 3 planned seeds (4 for OBLR-PO vs GRPO, the seeds added for power; not all in " \
        "yet: OBLR-PO vs GRPO: 3 of 4)." in head
    assert "; OBLR-PO lr 0.001 seeds 3." in a.out.with_suffix(".md").read_text()  # not finished (last, as launched)
    write_run(ab, a.run_dir, "OBLR-PO", 1e-3, 3, AFTER["OBLR-PO"][3], large=AFTER["OBLR-PO"][3] - 0.1)
    ab.tabulate(a, [])
    text, when = a.out.with_suffix(".md").read_text(), a.out.with_name("ablation_when.md").read_text()
    saved = json.loads(a.out.with_suffix(".json").read_text())
    rows = {c["name"]: c for c in saved["contrasts"]}
    assert rows["OBLR-PO vs GRPO"]["large"]["seeds"] == [0, 1, 2, 3] and rows["OBLR-PO vs GRPO"]["planned"] == 4
    assert rows["OBLR-PO vs GRPO"]["large"]["diffs"][3] == pytest.approx(100 * (AFTER["OBLR-PO"][3] - AFTER["GRPO"][3]))
    assert rows["RLOO vs GRPO"]["large"]["seeds"] == [0, 1, 2] and rows["RLOO vs GRPO"]["planned"] == 3
    assert rows["the SNR step on OBLR-PO's baseline (OBLR-PO - baseline-only)"]["large"]["n"] == 3
    assert all(r["large"]["n"] == 3 for r in saved["arms"])  # the per-arm table stays paired on every arm's seeds
    assert saved["curves"]["GRPO"]["seeds"] == 3
    assert "every contrast has its 3 planned seeds (4 for OBLR-PO vs GRPO, the seeds added for power)." \
        in when.split("\n")[2]
    assert "and seed 3 of GRPO, OBLR-PO for power (added on" in text and "OBLR-PO lr 0.001 seeds 3" not in text
    against = {r["a"]: r for r in ab.against_best(ab.load_runs(a.records), ["GRPO", "RLOO", "OBLR-PO"], 5e-4, 5e-4,
                                                  [0, 1, 2], 5.0, eta=2.0, power_seeds=[3],
                                                  power_arms=["GRPO", "OBLR-PO"])}
    assert against["OBLR-PO"]["large"]["seeds"] == [0, 1, 2, 3] and against["RLOO"]["large"]["seeds"] == [0, 1, 2]


def test_the_when_section_says_which_intervals_still_reach_delta_once_every_contrast_is_powered(ab):
    def contrast(name, n, ci, power, planned=5):
        d = dict(n=n, ci=ci, mean=sum(ci) / 2, verdict="no difference detected", power=power, sd=1.0)
        return dict(name=name, planned=planned, **{m: d for m in ab.METRICS})

    before = {m: 20.0 for m in ab.METRICS}
    rows = [contrast("A vs GRPO", 5, (-2.0, 1.0), 0.99), contrast("B vs GRPO", 6, (-6.1, 0.6), 0.86, planned=6)]
    head = ab.render_when([], rows, 5, 5.0, before).split("\n")[2]
    assert "every contrast has its 5 planned seeds (6 for B vs GRPO, the seeds added for power)." in head
    assert "**With the planned seeds in, all 2 contrasts reach 80% power to detect 5 points at their observed " \
        "spread** (a power estimated from the same runs); where a 95% interval still reaches 5 points (B vs GRPO: " \
        "[-6.1, +0.6]), a difference that large is not ruled out." in head
    narrow = ab.render_when([], rows[:1], 5, 5.0, before).split("\n")[2]
    assert "every 95% interval lies within 5 points of 0." in narrow
    waiting = ab.render_when([], [rows[0], contrast("B vs GRPO", 5, (-6.1, 0.6), 0.74, planned=6)], 5, 5.0,
                             before).split("\n")[2]
    assert "not all in yet: B vs GRPO: 5 of 6" in waiting and "**So far, 1 of the 2 contrasts reaches 80%" in waiting
    assert "With the planned seeds in" not in waiting
