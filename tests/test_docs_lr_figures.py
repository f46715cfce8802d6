"""Every learning-rate figure the user is shown for OBLR-PO follows one rule (`learning_rate` = the lr you would give
GRPO, in the default calibrated mode) and comes from one source: the demo's presets (`examples/demo.py`'s `PRESETS`,
what `make demo` runs) for the CPU recipes, their pages and the notebook. The quantity the SNR step scales has one
name, eta_max. (The front pages, the GPU recipes, How it works and the config's help: tests/test_lr_rule.py.)"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_SOURCE = ROOT / "notebooks" / "oblrpo_walkthrough.py"


def presets() -> dict:
    spec = importlib.util.spec_from_file_location("demo_presets", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo.PRESETS


def lr(value: float) -> str:
    """5.5e-4: an lr as the pages write it."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def test_lr_formats_as_the_pages_write_it():
    assert [lr(x) for x in (5.5e-4, 3e-4, 1e-6, 1.5e-05)] == ["5.5e-4", "3e-4", "1e-6", "1.5e-5"]


@pytest.mark.parametrize("recipe, preset", [("smollm2_cpu.yaml", "smollm2"), ("tiny_cpu.yaml", "tiny"),
                                            ("tiny_cpu_zero2.yaml", "tiny")])
def test_the_cpu_recipes_set_their_demos_lr_in_the_calibrated_mode(recipe, preset):
    text = (ROOT / "examples" / "recipes" / recipe).read_text()
    config = yaml.safe_load(text)
    assert float(config["learning_rate"]) == presets()[preset]["learning_rate"], recipe
    assert config.get("snr_lr_mode", "calibrated") == "calibrated", recipe
    line = next(line for line in text.splitlines() if line.startswith("learning_rate:"))
    assert "the lr you would give GRPO" in line, line


def test_the_recipes_page_quotes_the_demos_lr():
    page = " ".join((ROOT / "examples" / "recipes" / "README.md").read_text().split())
    assert f"`learning_rate` {lr(presets()['smollm2']['learning_rate'])} constant (the lr GRPO gets there)" in page


def notebook_code() -> str:
    return "\n".join(line for line in NOTEBOOK_SOURCE.read_text().splitlines() if not line.startswith("#"))


def test_the_notebook_gives_both_trainers_the_demos_lr_in_the_calibrated_mode():
    """Both trainers are built from one `settings` dict whose learning_rate is the demo's; OBLR-PO in the default
    (calibrated) mode, so its first steps apply the same lr as GRPO's."""
    code, text = notebook_code(), NOTEBOOK_SOURCE.read_text()
    value = presets()["smollm2"]["learning_rate"]
    rates = re.findall(r"learning_rate=([0-9.e-]+)", code)
    assert rates and all(float(x) == value for x in rates), rates
    for trainer in ("OBLRPOConfig", " GRPOConfig"):  # each call, up to the blank line after it, takes **settings
        assert re.search(trainer + r"\((?:(?!\n\n).)*\*\*settings\)", code, re.S), trainer
    assert "snr_lr_mode=" not in code  # the default mode
    assert f"`learning_rate` is {lr(value)}, constant: the lr GRPO gets in this setting" in " ".join(text.split())


def test_the_notebooks_verdict_is_computed_from_its_run():
    """The verdict is printed from the run's own figures, not typed into a markdown cell beforehand."""
    code = notebook_code()
    assert 'print(f"verdict: OBLR-PO - GRPO' in code
    assert "What the committed run shows" not in NOTEBOOK_SOURCE.read_text()


USER_FACING = ["README.md", "CHANGELOG.md", "docs/**/*.md", "examples/**/*", "notebooks/*", "oblr_trl/**/*.py",
               "benchmarks/*.md", "benchmarks/results/*.md"]


def test_the_quantity_has_one_name_eta_max():
    found = []
    for pattern in USER_FACING:
        for path in ROOT.glob(pattern):
            if path.is_file() and path.suffix in (".md", ".py", ".yaml", ".ipynb", ".json", ""):
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if re.search(r"lr[ _-]?max\b", line, re.I):
                        found.append(f"{path.relative_to(ROOT)}:{number}")
    assert not found, f"write eta_max (η_max in prose), not lr_max: {found}"


def test_the_committed_notebook_runs_the_same_lr():
    """The executed notebook (its code cells) carries the same figure as its source."""
    cells = json.loads((ROOT / "notebooks" / "oblrpo_walkthrough.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    rates = re.findall(r"learning_rate=([0-9.e-]+)", code)
    assert rates and all(float(x) == presets()["smollm2"]["learning_rate"] for x in rates), rates


def test_how_it_works_says_what_the_smollm2_rows_of_the_applied_lr_table_show():
    """The SmolLM2 rows (the lr window's calibrated runs) exist and each is within +-25%, as How it works says."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "applied_lr.json").read_text())["rows"]
    smollm2 = [r for r in rows if r["model"].startswith("SmolLM2")]
    assert smollm2 and all(r["within"] and r["prompts_per_step"] == 8 for r in smollm2)
    page = " ".join((ROOT / "docs" / "how-it-works.md").read_text().split())
    assert ("On SmolLM2 at 8 prompts per step (the lr window's runs, the same table) the first 10 steps applied "
            "`learning_rate` within ±25% too.") in page


def test_how_it_works_reads_the_smollm2_lr_window_from_its_table():
    """The figures of "The SmolLM2 lr window, read" are the calibrated window's (lr_window_calibrated.json) and the
    applied-lr table's: both best lrs with their points, their ratio, the shared window, the cells where OBLR-PO
    loses and the collapse at 1.5e-3."""
    result = json.loads((ROOT / "benchmarks" / "results" / "lr_window_calibrated.json").read_text())
    g, c = result["summaries"]["GRPO"], result["summaries"]["OBLR-PO-calibrated"]
    page = " ".join((ROOT / "docs" / "how-it-works.md").read_text().split())
    ratio = max(g["best_lr"], c["best_lr"]) / min(g["best_lr"], c["best_lr"])
    assert ratio > 2
    assert (f"The two best lrs are not within 2x: GRPO's is {lr(g['best_lr'])} ({g['best_mean']:.0f} points), "
            f"OBLR-PO's `learning_rate` {lr(c['best_lr'])} ({c['best_mean']:.0f} points), {ratio:.3g}x apart.") in page
    assert g["in_window_lrs"] == c["in_window_lrs"]
    evidence = " ".join((ROOT / "docs" / "evidence.md").read_text().split())
    assert (f"OBLR-PO's window was GRPO's, and its best `learning_rate` sat {ratio:.3g}x "
            f"{'above' if c['best_lr'] > g['best_lr'] else 'below'} GRPO's best") in evidence
    assert f"are the same three lrs, {lr(g['lo'])} to {lr(g['hi'])}." in page
    cell = {(r["arm"], r["lr"]): r["mean"] for r in result["rows"] if r["n"]}
    losses = [x for (arm, x), v in cell.items() if arm == "OBLR-PO-calibrated" and v < cell[("GRPO", x)]]
    assert losses == [1.5e-4, 2.74e-4]
    assert (f"OBLR-PO loses at GRPO's best lr ({cell[('OBLR-PO-calibrated', 1.5e-4)]:.0f} against "
            f"{cell[('GRPO', 1.5e-4)]:.0f}) and at 2.74e-4 ({cell[('OBLR-PO-calibrated', 2.74e-4)]:.0f} against "
            f"{cell[('GRPO', 2.74e-4)]:.0f}).") in page
    assert (f"At 1.5e-3 GRPO collapsed to {cell[('GRPO', 1.5e-3)]:.0f} points and OBLR-PO kept "
            f"{cell[('OBLR-PO-calibrated', 1.5e-3)]:.0f}.") in page
    rows = json.loads((ROOT / "benchmarks" / "results" / "applied_lr.json").read_text())["rows"]
    late = sorted(r["later"] for r in rows if r["model"].startswith("SmolLM2") and r["learning_rate"] >= 1.5e-4)
    assert len(late) == 4 and late[-1] < 1
    assert f"from 1.5e-4 up steps 11-20 applied {late[0]:.2f}-{late[-1]:.2f}x `learning_rate`" in page
