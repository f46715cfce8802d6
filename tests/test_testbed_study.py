"""benchmarks/testbed.py's design and analysis on synthetic records (no training): the lr grid and its extension past
an edge, the best lr, the launch order, rollouts to reach a target, the paired contrast, the shuffled-reward control
and the generated tables."""

from __future__ import annotations

import argparse
import importlib
import json
import statistics

import pytest

from harness.stats import paired_difference
from studies import testbed_run
from studies import testbed_study as S
from studies import testbed_tables as T


def rec(arm, lr, seed, curve_rewards, prompts=16, sampled=0.5, greedy=0.6, b=None):
    history = [dict(step=i + 1, reward=r) for i, r in enumerate(curve_rewards)]
    if b is not None:
        history[0]["oblr/noise_scale"] = b
    return dict(arm=arm, lr=lr, seed=seed, prompts=prompts, steps=len(history), history=history, sampled=sampled,
                greedy=greedy, curve=[dict(step=0, sampled=0.3)], seconds_per_step=1.0, cpu_seconds=30.0)


def flat(level, steps=20):
    return [level] * steps


def test_the_grid_is_log_spaced_and_extends_past_an_edge_while_the_best_lies_there():
    assert S.lr_grid(1e-3, 2.0, 5) == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    grid = [1e-3, 2e-3, 4e-3]
    runs = [rec("GRPO", lr, 0, flat(lr * 100)) for lr in grid]  # the top is best
    assert S.best_lr(runs, "GRPO", grid, [0]) == 4e-3
    assert S.extended_grid(runs, "GRPO", grid, 2.0, [0]) == [1e-3, 2e-3, 4e-3, 8e-3]
    runs.append(rec("GRPO", 8e-3, 0, flat(0.1)))  # one step further is worse: the best is inside
    assert S.extended_grid(runs, "GRPO", grid, 2.0, [0]) == [1e-3, 2e-3, 4e-3, 8e-3]
    low = [rec("GRPO", lr, 0, flat(1 - lr * 100)) for lr in grid]  # the bottom is best
    assert S.extended_grid(low, "GRPO", grid, 2.0, [0])[0] == 5e-4
    assert S.best_lr(runs[:2], "GRPO", grid, [0]) is None  # a cell missing: no best yet


def test_first_last_gain_and_rollouts_to_reach():
    r = rec("GRPO", 1e-3, 0, [0.1] * 10 + [0.5] * 10 + [0.9] * 10)
    assert S.first_last(r) == (pytest.approx(0.1), pytest.approx(0.9))
    assert S.gain(r) == pytest.approx(0.8)
    assert S.rollouts_to_reach([0.1, 0.4, 0.6, 0.7], 0.6, 128) == 3 * 128
    assert S.rollouts_to_reach([0.1, 0.2], 0.6, 128) is None
    assert S.smoothed([0, 1, 2, 3], span=2) == [0, 0.5, 1.5, 2.5]
    assert S.factor(16, 4.0) == pytest.approx(0.8)


def test_the_contrast_is_the_paired_difference_in_points_with_its_power():
    a = {0: 0.50, 1: 0.60, 2: 0.55, 3: 0.58}
    b = {0: 0.48, 1: 0.57, 2: 0.55, 3: 0.52, 9: 0.99}  # seed 9 unpaired: left out
    c = S.contrast(a, b, 3.0)
    ref = paired_difference({s: 100 * v for s, v in a.items()}, {s: 100 * v for s, v in b.items()})
    assert c["n"] == 4 and c["mean"] == pytest.approx(ref["mean"]) and c["ci"] == pytest.approx(ref["ci"])
    assert 0 < c["power"] < 1


def test_the_shuffled_control_keeps_the_rewards_and_loses_their_order():
    scores = [float(i % 2) for i in range(64)]
    fn = testbed_run.shuffled(lambda *a, **k: list(scores), seed=1)
    out = fn()
    assert sorted(out) == sorted(scores) and out != scores


def test_the_launch_order_runs_the_grid_then_control_seeds_then_both_arms_paired(tmp_path):
    script = importlib.import_module("testbed")
    args = script.build_parser().parse_args(["--lr_centre", "1e-3", "--points", "3", "--seeds", "0", "1", "2"])
    names = [j["name"] for j in script.jobs(args, [], "regime")]
    assert names == [S.run_name("GRPO", lr, 0, 16, 50) for lr in (5e-4, 1e-3, 2e-3)]
    runs = [rec("GRPO", lr, 0, flat(0.5 + (lr == 1e-3) * 0.1), 16) for lr in (5e-4, 1e-3, 2e-3)]
    arms = [(j["arm"], j["seed"]) for j in script.jobs(args, runs, "regime")[3:]]
    assert arms == [("GRPO", 1), ("GRPO", 2), ("GRPO-shuffled", 0), ("GRPO-shuffled", 1), ("GRPO-shuffled", 2)]
    runs += [rec("OBLR-PO", lr, 0, flat(0.5 + (lr == 2e-3) * 0.1 - (lr == 4e-3) * 0.2), 16)
             for lr in (5e-4, 1e-3, 2e-3, 4e-3)]
    compare = script.jobs(args, runs, "compare")
    assert {j["lr"] for j in compare if j["arm"] == "OBLR-PO" and j["seed"] != 0} == {2e-3}
    seeds = [(j["seed"], j["arm"]) for j in compare if j["seed"] != 0]
    assert seeds == [(1, "GRPO"), (1, "OBLR-PO"), (2, "GRPO"), (2, "OBLR-PO")]


def test_the_tables_render_from_records(tmp_path):
    runs = [rec("GRPO", lr, 0, [0.3] * 10 + [0.3 + lr * 100] * 10) for lr in (5e-4, 1e-3, 2e-3)]
    runs += [rec("OBLR-PO", lr, 0, [0.3] * 10 + [0.3 + lr * 90] * 10, b=4.0) for lr in (5e-4, 1e-3, 2e-3)]
    for s in (1, 2, 3):
        runs += [rec("GRPO", 2e-3, s, [0.3] * 10 + [0.5 + s / 100] * 10, sampled=0.5 + s / 100),
                 rec("OBLR-PO", 2e-3, s, [0.3] * 10 + [0.52 + s / 90] * 10, sampled=0.52 + s / 90, b=4.0),
                 rec("GRPO-shuffled", 2e-3, s, flat(0.3))]
    args = argparse.Namespace(prompts=16, grid_seed=0, steps=20, points=3, testbed="{}", out=tmp_path / "testbed",
                              search=tmp_path / "none")
    T.render_all(args, runs, "cmd")
    regime = (tmp_path / "testbed_regime.md").read_text()
    assert "| 16 | 30.0 | 4.0 (4.0-4.0, 6 runs) | 0.80 | 0.80 |" in regime
    assert "GRPO learns beyond the control on every seed" in regime
    result = json.loads((tmp_path / "testbed.json").read_text())
    c = result["compare"]["16"]["sampled (held-out)"]
    # seed 0 (the grid's, at both best lrs: 0.5 each) pairs too
    diffs = [0.0] + [100 * (s / 90 - s / 100) + 2 for s in (1, 2, 3)]
    assert c["n"] == 4 and c["mean"] == pytest.approx(statistics.mean(diffs))
    assert result["regime"]["16"]["f"] == pytest.approx(0.8)
