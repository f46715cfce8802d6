"""benchmarks/paper_n.py on synthetic records (no training): the lr grid's centres, the launch order (GRPO and
OBLR-PO first, seeds only once a grid is complete), the generated tables and "When to use" sentence, and the quoted
result in the docs against its record."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from harness.stats import paired_difference  # noqa: E402
from studies import paper_n as pn  # noqa: E402


@pytest.fixture(scope="module")
def script():
    return importlib.import_module("paper_n")


def write_record(records: Path, arm: str, lr: float, seed: int, greedy: float, sampled: float = 0.2) -> None:
    records.mkdir(parents=True, exist_ok=True)
    rec = dict(arm=arm, lr=lr, seed=seed, long=False, accuracy_after=greedy, sampled_accuracy_after=sampled,
               mean_applied_lr=lr / 10, mean_lr_scale=0.1 if arm != "GRPO" else None, seconds_per_step=10.0,
               peak_rss_gb=2.5, history=[])
    (records / f"{arm}_lr{lr:.3g}_seed{seed}.json").write_text(json.dumps(rec))


def write_pilots(records: Path) -> None:
    for model, arm, n, s in [("tiny", "GRPO", 128, 12.0), ("tiny", "OBLR-PO", 128, 15.0), ("smollm2", "OBLR-PO", 64, 360.0)]:
        rec = dict(name=f"{model}_{arm}", model=model, arm=arm, prompts=n, group_size=8, steps=1, micro_batch=32,
                   torch_threads=1, seconds_per_step=s, model_seconds=30.0, eval_seconds=60.0, seconds=s + 90,
                   peak_rss_gb=9.5 if model == "smollm2" else 2.5, mean_lr_scale=0.5, command="c", host="h", when="w")
        (records / f"pilot_{model}_{arm}_N{n}.json").write_text(json.dumps(rec))


def test_the_snr_arms_centre_applies_grpo_s_lr_at_the_measured_factor_and_a_bad_factor_is_refused():
    assert pn.centre("GRPO", 1e-4, 0.25) == pytest.approx(1e-4)
    assert pn.centre("baseline-only", 1e-4, 0.25) == pytest.approx(1e-4)
    assert pn.centre("OBLR-PO", 1e-4, 0.25) == pytest.approx(4e-4)  # 0.25 x 4e-4 = GRPO's lr at the first steps
    assert pn.grid("SNR-only", 1e-4, 0.25) == pytest.approx([1.33e-4, 4e-4, 1.2e-3])
    with pytest.raises(ValueError, match="studies.paper_n.centre"):
        pn.centre("OBLR-PO", 1e-4, 0.0)


def test_jobs_run_grpo_and_oblr_po_grids_first_and_an_arm_s_seeds_only_once_its_grid_is_complete(script, tmp_path):
    args = script.build_parser().parse_args(["--factor", "0.5", "--records", str(tmp_path / "r")])
    jobs = script.jobs(args, [])
    assert [a for a, _, _ in jobs[:6]] == ["GRPO"] * 3 + ["OBLR-PO"] * 3 and {s for _, _, s in jobs} == {0}
    assert [a for a, _, _ in jobs[6:]] == ["SNR-only"] * 3 + ["baseline-only"] * 3  # no seeds before a grid's end
    for lr, acc in zip(pn.grid("GRPO", 1e-4, 0.5), [0.30, 0.40, 0.35]):
        write_record(tmp_path / "r", "GRPO", lr, 0, acc)
    runs = script.load_runs(tmp_path / "r")
    jobs = script.jobs(args, runs)
    seeds = [(a, lr, s) for a, lr, s in jobs if s != 0]
    assert seeds == [("GRPO", pytest.approx(1e-4), s) for s in (1, 2, 3, 4)]  # at its grid's best
    assert jobs.index(seeds[0]) < [a for a, _, _ in jobs].index("SNR-only")  # before the halves


def test_the_tables_and_the_when_sentence_come_from_the_records(script, tmp_path):
    records = tmp_path / "r"
    grpo = {s: g for s, g in enumerate([0.30, 0.32, 0.31, 0.29, 0.33])}
    oblr = {s: g + d for (s, g), d in zip(grpo.items(), [0.05, 0.06, 0.04, 0.05, 0.07])}  # +5 pts, every seed
    for lr in pn.grid("GRPO", 1e-4, 0.5):
        write_record(records, "GRPO", lr, 0, grpo[0] - (0.05 if lr != pytest.approx(1e-4) else 0))
    for lr in pn.grid("OBLR-PO", 1e-4, 0.5):
        write_record(records, "OBLR-PO", lr, 0, oblr[0] - (0.05 if lr != pytest.approx(2e-4) else 0))
    for s in range(1, 5):
        write_record(records, "GRPO", 1e-4, s, grpo[s])
        write_record(records, "OBLR-PO", 2e-4, s, oblr[s])
    write_pilots(records)
    out = tmp_path / "res" / "paper_n"
    out.parent.mkdir()
    script.main(["--no_run", "--factor", "0.5", "--records", str(records), "--out", str(out), "--run_dir",
                 str(tmp_path / "runs"), "--arms", "GRPO", "OBLR-PO"])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["best"] == {"GRPO": pytest.approx(1e-4), "OBLR-PO": pytest.approx(2e-4)}
    d = paired_difference({s: 100 * v for s, v in oblr.items()}, {s: 100 * v for s, v in grpo.items()})
    c = saved["contrasts"][0]
    assert c["greedy"]["mean"] == pytest.approx(d["mean"]) and c["greedy"]["ci"] == pytest.approx(list(d["ci"]))
    assert c["greedy"]["verdict"] == "better" and c["greedy"]["n"] == 5
    text, when = out.with_suffix(".md").read_text(), out.with_name("paper_n_when.md").read_text()
    quoted = f"{d['mean']:+.1f} pts [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}], better"
    assert quoted in text and quoted in when and "An interval excludes 0" in when
    assert "Not run: SNR-only vs GRPO" not in when  # arms outside the design are not "not run"
    assert "edge" not in when and "Mean applied lr at the best lrs: GRPO 1e-05, OBLR-PO 2e-05." in when
    assert "about 8.1 CPU-hours" in when  # 4 x (20 x 360 + 60 + 30) s from the SmolLM2 pilot


def test_a_null_result_is_said_with_its_power_and_changes_no_default(script, tmp_path):
    records = tmp_path / "r"
    for lr in pn.grid("GRPO", 1e-4, 0.5):
        write_record(records, "GRPO", lr, 0, 0.30)
    for lr in pn.grid("OBLR-PO", 1e-4, 0.5):
        write_record(records, "OBLR-PO", lr, 0, 0.30)
    best_g, best_o = pn.grid("GRPO", 1e-4, 0.5)[0], pn.grid("OBLR-PO", 1e-4, 0.5)[0]  # ties: the first of the grid
    for s, (a, b) in enumerate([(0.31, 0.33), (0.29, 0.28), (0.33, 0.30), (0.30, 0.31)], start=1):
        write_record(records, "GRPO", best_g, s, a)
        write_record(records, "OBLR-PO", best_o, s, b)
    out = tmp_path / "paper_n"
    script.main(["--no_run", "--factor", "0.5", "--records", str(records), "--out", str(out), "--run_dir",
                 str(tmp_path / "runs")])
    when = out.with_name("paper_n_when.md").read_text()
    assert "no difference detected" in when and "power" in when and "no default changes" in when
    assert "Not run: SNR-only vs GRPO, baseline-only vs GRPO" in when
    assert "SmolLM2 at N = 64 was not piloted" in when
    assert "The best lr of GRPO, OBLR-PO lay at the edge of their grid" in when  # ties: the grid's first
    assert "**At the grid's edge: GRPO, OBLR-PO.**" in out.with_suffix(".md").read_text()


def test_the_docs_quote_the_committed_result():
    """The evidence page's block is the generated sentence (test_docs checks every block is current); the README's
    one line on the paper's N says what the committed record's OBLR-PO contrast says."""
    saved = ROOT / "benchmarks" / "results" / "paper_n.json"
    if not saved.exists():
        pytest.skip("the study has no tables yet")
    result = json.loads(saved.read_text())
    evidence = (ROOT / "docs" / "evidence.md").read_text()
    assert "<!-- results:paper_n_when:begin -->" in evidence
    readme = (ROOT / "README.md").read_text().split("## When to use it\n")[1].split("\n## ")[0]
    oblr = next((c for c in result["contrasts"] if c["name"] == "OBLR-PO vs GRPO"), None)
    if oblr is None:
        assert "128" not in readme or "untrained" in readme
        return
    verdict = oblr["greedy"]["verdict"]
    words = {"better": "beat GRPO", "worse": "trailed GRPO", "no difference detected": "no difference detected"}
    assert words.get(verdict, verdict) in re.sub(r"\s+", " ", readme)
