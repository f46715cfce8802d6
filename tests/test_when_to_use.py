"""benchmarks/when_to_use.py and its statistics (issue 49): the exact binomial interval against the binomial law,
the variance verdicts and the lr-window shares on synthetic results."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
from harness import stats as paired_stats  # noqa: E402
import when_to_use  # noqa: E402


def binom_cdf(k, n, p):
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


@pytest.mark.parametrize("k,n", [(0, 10), (5, 10), (10, 10), (3, 12), (1, 3), (6, 9)])
def test_clopper_pearson_tails_are_the_level(k, n):
    lo, hi = paired_stats.clopper_pearson(k, n)
    assert 0 <= lo <= k / n <= hi <= 1
    if k > 0:
        assert 1 - binom_cdf(k - 1, n, lo) == pytest.approx(0.025, abs=1e-9)
    else:
        assert lo == 0
    if k < n:
        assert binom_cdf(k, n, hi) == pytest.approx(0.025, abs=1e-9)
    else:
        assert hi == 1


def test_clopper_pearson_known_values_and_refusal():
    assert paired_stats.clopper_pearson(0, 10)[1] == pytest.approx(0.30849710781876, abs=1e-9)  # R binom.test
    assert paired_stats.clopper_pearson(3, 12) == pytest.approx((0.0548606445, 0.5718584619), abs=1e-8)
    with pytest.raises(ValueError, match="clopper_pearson"):
        paired_stats.clopper_pearson(4, 3)


def bucket(ratio_exact, ci_exact, logit, groups=30):
    return dict(groups=groups, prompts=10, ratio=dict(exact_loo=ratio_exact, logit_loo=logit, length_loo=1.0, rloo=1.0),
                ci=dict(exact_loo=ci_exact, logit_loo=None, length_loo=None, rloo=None))


def test_variance_answer_verdicts():
    analysis = dict(orders=dict(length=["0-32", "32-64"], spread=["4-16x"]), tables=dict(
        length={"0-32": bucket(0.7, None, 0.7), "32-64": bucket(0.9, [0.8, 1.0], 0.95),
                "all groups": bucket(0.5, [0.4, 0.6], 0.5)},
        spread={"4-16x": bucket(0.8, [0.7, 0.95], 0.79)}))
    answer = when_to_use.variance_answer(analysis, 0.15)
    assert [r["bucket"] for r in answer["length"]] == ["32-64"]  # no interval, and 'all groups', left out
    (length,), (spread,) = answer["length"], answer["spread"]
    assert length["reduction"] == pytest.approx(0.1) and not length["over"] and length["matched_by"] == []
    assert spread["over"] and spread["excludes_zero"] and spread["ci"] == pytest.approx([0.05, 0.3])
    assert spread["matched_by"] == ["logit proxy"]
    text = "\n".join(when_to_use.render_variance(answer, 0.15))
    assert "no bucket reaches 15%" in text and "4-16x reaches it" in text and "excluding 0" in text


def cell(arm, multiple, values, collapsed=()):
    return dict(arm=arm, multiple=multiple, lr=multiple, n=len(values), values=values, collapsed=list(collapsed))


def test_lr_answer_shares_and_tests():
    rows = [cell("A", 0.1, [10, 12, 11], [0, 1, 2]), cell("A", 1 / 3, [50, 52, 51]), cell("A", 1.0, [55, 56, 54]),
            cell("A", 10 / 3, [30, 56, 20], [2]),
            cell("B", 1 / 3, [40, 41, 42]), cell("B", 1.0, [45, 44, 46]), cell("B", 10 / 3, [45, 46, 40])]
    summaries = {a: dict(best_mean=m, width=3.33, open_lo=False, open_hi=False, lo=1, hi=3, incomplete=[], cells=4)
                 for a, m in (("A", 55.0), ("B", 45.0))}
    answer = when_to_use.lr_answer(dict(rows=rows, summaries=summaries), tolerance=5.0)
    a, b = answer["arms"]["A"], answer["arms"]["B"]
    assert (a["own"]["k"], a["own"]["n"]) == (7, 12)  # 50 is the edge (55 - 5): in
    assert (a["near"]["k"], a["near"]["n"]) == (7, 9)
    assert (a["collapsed_above"]["k"], a["collapsed_above"]["n"]) == (1, 3)
    assert (b["own"]["k"], b["any"]["k"]) == (9, 0)  # 40 is B's edge; against A's best, 55: none of B's runs within 5 points
    test = next(t for t in answer["tests"] if t["what"] == "any")
    assert test["p"] == pytest.approx(paired_stats.fisher_exact(7, 5, 0, 9))
    lo, hi = a["own"]["ci"]
    assert (lo, hi) == pytest.approx(paired_stats.clopper_pearson(7, 12))
    text = "\n".join(when_to_use.render_lr(answer, 5.0))
    assert "7/12 (58%)" in text and "0/9 (0%)" in text


def test_render_runs_on_the_stored_results(tmp_path):
    results = Path(BENCH) / "results"
    args = SimpleNamespace(threshold=0.15, tolerance=5.0)
    import json
    text = when_to_use.render(json.loads((results / "variance_long.json").read_text()),
                              json.loads((results / "lr_window.json").read_text()), args)
    assert "## Is there a regime" in text and "## If I do not tune the lr" in text


def test_the_regime_question_states_each_contrast_with_its_verdict_and_power():
    contrast = dict(n=8, mean=-1.5, ci=[-3.0, 0.2], power=0.61, seeds_for_80=12)
    worse = dict(n=8, mean=-4.0, ci=[-6.0, -2.0], power=0.9, seeds_for_80=6)
    testbed = dict(regime={"16": dict(B=3.6, f=0.82)},
                   compare={"16": {"sampled (held-out)": contrast, "last-10 reward": worse}})
    text = "\n".join(when_to_use.render_regime(testbed))
    assert "| N = 16, f = 0.82 (B = 3.6) | sampled (held-out) | 8 | -1.5 [-3.0, +0.2] | no difference detected | 61% | 12 |" in text
    assert "| last-10 reward | 8 | -4.0 [-6.0, -2.0] | worse |" in text
    assert "Not measured yet" in "\n".join(when_to_use.render_regime(None))
