"""benchmarks/prompts_per_step.py (issue 58, stage 1): the re-sampling and statistics against brute force on explicit
group gradients, the decision rule, and the --quick path end to end on the tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import prompts_per_step as pps  # noqa: E402


def group_vectors(pool=12, dim=9, seed=0, signal=0.6):
    """Explicit group gradients H_q: a shared direction plus noise, a few exactly 0 (groups of equal rewards)."""
    g = torch.Generator().manual_seed(seed)
    h = signal * torch.ones(dim, dtype=torch.float64) + torch.randn(pool, dim, generator=g, dtype=torch.float64)
    h[[2, 7]] = 0.0
    return h


def brute_step(h: torch.Tensor, subset) -> tuple[float, float]:
    """(SNR, factor) of one step from its samples' vectors, written out (McCandlish et al. App. A; Theorem 4)."""
    rows = h[list(subset)]
    n = rows.shape[0]
    sum_sq, total = float((rows**2).sum()), float((rows.sum(0) ** 2).sum())
    signal, noise = n * (total - sum_sq) / (n - 1), n * (n * sum_sq - total) / (n - 1)
    if signal <= 0:
        return 0.0, 0.0
    snr = signal / noise
    return snr, n * snr / (1 + n * snr)


def test_subset_sums_match_the_vectors_with_and_without_repeats():
    h = group_vectors()
    gram = h @ h.T
    for subset in ([0, 3, 5, 11], [1, 1, 4, 4, 4, 9], list(range(12))):
        sum_sq, total = pps.subset_sums(gram, torch.tensor(subset))
        rows = h[subset]
        assert sum_sq == pytest.approx(float((rows**2).sum()), rel=1e-12)
        assert total == pytest.approx(float((rows.sum(0) ** 2).sum()), rel=1e-12)


def test_per_step_decisions_match_brute_force_and_the_package():
    from oblr_trl.snr_formulas import step_scale_from_contributions

    h = group_vectors()
    gram = h @ h.T
    subsets = pps.draw_subsets(12, 6, 40, seed=3)
    decisions = pps.step_decisions(gram, subsets)
    for subset, d in zip(subsets.tolist(), decisions):
        snr, factor = brute_step(h, subset)
        assert d.scale == pytest.approx(factor, abs=1e-12) and d.snr == pytest.approx(snr, abs=1e-12)
        rows = h[subset]
        assert d.scale == pytest.approx(float(step_scale_from_contributions(
            float((rows**2).sum()), float((rows.sum(0) ** 2).sum()), 6)), abs=1e-12)
    assert any(d.scale == 0.0 for d in decisions) and any(d.scale > 0.3 for d in decisions)  # both regimes occur


def test_default_estimator_chain_carries_the_state_as_the_trainer_does():
    from oblr_trl.snr_formulas import SNRState, snr_step_size

    h = group_vectors(seed=4)
    gram = h @ h.T
    chains = pps.draw_subsets(12, 4, 5 * 3, seed=9).reshape(5, 3, 4)
    got = pps.step_decisions(gram, chains, "ema_soft")
    for chain, d in zip(chains, got):
        state = SNRState()
        for batch in chain.tolist():
            rows = h[batch]
            ref, state = snr_step_size("ema_soft", float((rows**2).sum()), float((rows.sum(0) ** 2).sum()), 4, state)
        assert d.scale == pytest.approx(ref.scale, abs=1e-12)
    # a chain of one step is the per-step decision under "ema" (its first step); "ema_soft"'s first step lifts the
    # signal by its own samples' standard error (no history), so it is never below the per-step one
    one = pps.step_decisions(gram, chains[:, :1, :], "ema")
    per = pps.step_decisions(gram, chains[:, 0, :])
    assert [d.scale for d in one] == pytest.approx([d.scale for d in per], abs=1e-12)
    soft = pps.step_decisions(gram, chains[:, :1, :], "ema_soft")
    assert all(s.scale >= p.scale for s, p in zip(soft, per))


def test_draw_subsets():
    s = pps.draw_subsets(20, 7, 30, seed=1)
    assert s.shape == (30, 7) and all(len(set(row)) == 7 for row in s.tolist()) and int(s.max()) < 20
    assert torch.equal(s, pps.draw_subsets(20, 7, 30, seed=1)) and not torch.equal(s, pps.draw_subsets(20, 7, 30, 2))
    r = pps.draw_subsets(5, 9, 10, seed=1, replace=True)
    assert r.shape == (10, 9) and int(r.max()) < 5
    with pytest.raises(ValueError):
        pps.draw_subsets(5, 6, 2, seed=0)


def test_summary_matches_numpy():
    values = [0.3, 0.1, 0.9, 0.5, 0.5, 0.2, 0.8, float("nan")]
    s = pps.summary(values)
    v = np.array([x for x in values if x == x])
    assert s["n"] == 7 and s["mean"] == pytest.approx(v.mean()) and s["std"] == pytest.approx(v.std(ddof=1))
    for key, q in (("p5", 5), ("p50", 50), ("p95", 95)):
        assert s[key] == pytest.approx(np.percentile(v, q))
    assert math.isnan(pps.summary([])["mean"])


def test_n_row_against_brute_force_and_the_whole_pool():
    h = group_vectors(seed=5, signal=1.0)
    gram = h @ h.T
    row = pps.n_row(gram, 5, 60, seed=11, chain=4)
    factors = [brute_step(h, s)[1] for s in pps.draw_subsets(12, 5, 60, seed=11).tolist()]
    assert row["factor"]["mean"] == pytest.approx(np.mean(factors), abs=1e-12)
    assert row["below_half"] == pytest.approx(np.mean([f < 0.5 for f in factors]))
    snr_pool, _ = brute_step(h, range(12))
    assert row["factor_at_pool_snr"] == pytest.approx(5 * snr_pool / (1 + 5 * snr_pool))
    whole = pps.n_row(gram, 12, 10, seed=1, chain=3)  # every draw is the whole pool: no spread
    assert whole["factor"]["std"] == pytest.approx(0.0, abs=1e-12)
    assert whole["factor"]["mean"] == pytest.approx(whole["factor_at_pool_snr"], abs=1e-12)


def _rows(n, mean, p5, p95):
    return [dict(n=n, replace=False, factor=dict(mean=mean, p5=p5, p95=p95)),
            dict(n=n, replace=True, factor=dict(mean=0.0, p5=0.0, p95=1.0))]  # the bootstrap does not decide


def test_stage2_decision_rule():
    calm = {"start": _rows(64, 0.80, 0.75, 0.85), "step15": _rows(64, 0.70, 0.62, 0.78)}
    d = pps.stage2_decision(calm)
    assert not d["run_stage2"] and d["change"] == pytest.approx(0.10) and d["spreads"]["start"] == pytest.approx(0.1)
    wide = {"start": _rows(64, 0.80, 0.55, 0.95), "step15": _rows(64, 0.75, 0.7, 0.8)}
    assert pps.stage2_decision(wide)["run_stage2"]
    moved = {"start": _rows(64, 0.85, 0.8, 0.9), "step15": _rows(64, 0.6, 0.55, 0.65)}
    d = pps.stage2_decision(moved)
    assert d["run_stage2"] and "moves by 0.250" in d["why"]


def test_quick_end_to_end_and_render_from_records(tmp_path):
    rec, out = tmp_path / "rec", tmp_path / "res" / "pps"
    result = pps.main(["--quick", "--records", str(rec), "--out", str(out), "--work", str(tmp_path / "work")])
    start, later = (json.loads((rec / f"{c}.json").read_text()) for c in ("start", "step2"))
    assert (start["steps"], later["steps"]) == (0, 2) and len(start["gram"]) == 16
    for r in (start, later):
        assert r["diag_check_max_rel_err"] < 1e-4  # each H_q's squared norm is the trainer's own ||H_q||^2
        gram = np.array(r["gram"])
        assert np.allclose(gram, gram.T) and np.linalg.eigvalsh(gram).min() > -1e-6 * max(1e-30, gram.trace())
    text = out.with_suffix(".md").read_text()
    assert "| 16 |" in text and "(with repl.)" in text and "stage 2" in text
    assert result["decision"]["n"] == 8
    assert json.loads(out.with_suffix(".json").read_text())["rows"]["start"][0]["n"] == 2
    again = pps.main(["--render", "--quick", "--records", str(rec), "--out", str(tmp_path / "again")])
    assert again["rows"] == result["rows"]  # the table comes from the records alone
