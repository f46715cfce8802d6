"""The one lr rule (docs/how-it-works.md, "Choosing the learning rate"): set `learning_rate` to the lr you would give
GRPO; by default (`snr_lr_mode="calibrated"`) the first steps apply it on average, each step `learning_rate x
min(f / f_ref, 2)`. Its constants come from the code (`CALIBRATION_STEPS`, `MAX_LR_MULTIPLE`) and its figures from the
results files (the prompts-per-step pools, the lr window's 20-step runs of the paper's reading); the docs' section,
`learning_rate`'s help, the config's docstring, the default, the README, Quick start and the recipes must say the same.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from trl import GRPOConfig

from oblr_trl import OBLRPOConfig
from oblr_trl.snr_formulas import CALIBRATION_STEPS, MAX_LR_MULTIPLE

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SECTION = "## Choosing the learning rate"
POOLS = {"one-digit sums": "prompts_per_step", "sums with two-digit terms": "prompts_per_step_two_digit"}


def lr(value: float) -> str:
    """1.5e-4, 3.33e-3: an lr as the docs write it."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def factor(n: int, noise_scale: float) -> float:
    return n / (n + noise_scale)


def pool_noise_scales() -> dict[tuple[str, str], float]:
    """(task, checkpoint) -> B = 1 / SNR of the pool's 128 groups (prompts)."""
    out = {}
    for task, name in POOLS.items():
        for checkpoint, pool in json.loads((RESULTS / f"{name}.json").read_text())["pools"].items():
            out[task, checkpoint] = 1 / pool["snr"]
    return out


def rule_figures() -> dict[str, str]:
    """The figures the rule quotes, formatted as the docs write them, each computed from the results files."""
    window = json.loads((RESULTS / "lr_window.json").read_text())["summaries"]
    grpo, oblr = window["GRPO"], window["OBLR-PO"]
    runs = [json.loads(p.read_text()) for p in sorted((RESULTS / "ablation_runs").glob("OBLR-PO_lr*_seed*.json"))]
    best = [r for r in runs if r["lr"] == oblr["best_lr"] and r["steps"] == 20]
    f_best = sum(r["mean_lr_scale"] for r in best) / len(best)
    scales = pool_noise_scales().values()
    at = {n: [factor(n, b) for b in scales] for n in (8, 128)}
    grpo_default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}["learning_rate"]
    default = {f.name: f.default for f in dataclasses.fields(OBLRPOConfig)}["learning_rate"]
    return {
        "grpo_best": lr(grpo["best_lr"]), "grpo_window": f"{lr(grpo['lo'])} to {lr(grpo['hi'])}",
        "oblr_best": lr(oblr["best_lr"]), "oblr_window": f"{lr(oblr['lo'])} to {lr(oblr['hi'])}",
        "ratio": f"{oblr['best_lr'] / grpo['best_lr']:.0f}x", "seeds": f"{len(best)} seeds",
        "f_best": f"{f_best:.3f}", "applied": lr(round(oblr["best_lr"] * f_best, 5)),
        "predicted": f"{lr(round(grpo['lo'] / f_best, 4))} to {lr(round(grpo['hi'] / f_best, 4))}",
        "f_at_8": f"{min(at[8]):.2f}-{max(at[8]):.2f}", "f_at_128": f"{min(at[128]):.2f}-{max(at[128]):.2f}",
        "eta_at_128": f"{1 / max(at[128]):.1f}-{1 / min(at[128]):.0f}x",
        "default": lr(default), "grpo_default": lr(grpo_default),
        "steps": f"first {CALIBRATION_STEPS} steps", "cap": f"{MAX_LR_MULTIPLE:g}",
    }


def table_rows() -> list[str]:
    """The section's table: per pool, B and f = N / (N + B) at 8, 64 and 128 prompts per step."""
    names = {"start": "start", "step15": "after 15 steps"}
    return [f"| {task}, {names[checkpoint]} | {b:.0f} | " + " | ".join(f"{factor(n, b):.2f}" for n in (8, 64, 128)) + " |"
            for (task, checkpoint), b in pool_noise_scales().items()]


def section() -> str:
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    assert f"\n{SECTION}\n" in text, f"docs/how-it-works.md lost its heading {SECTION!r} (pages link to its anchor)"
    return text.split(f"\n{SECTION}\n")[1].split("\n## ")[0]


def help_text() -> str:
    return {f.name: f for f in dataclasses.fields(OBLRPOConfig)}["learning_rate"].metadata["help"]


def docstring() -> str:
    return " ".join(OBLRPOConfig.__doc__.split("Parameters:")[0].split())


def test_the_rule_s_figures_come_from_the_results_files():
    figures = rule_figures()
    assert figures["grpo_best"] == "1.5e-4" and figures["oblr_best"] == "3.33e-3" and figures["ratio"] == "22x"
    f_best = float(figures["f_best"])
    assert 0 < f_best < 1  # the best eta_max applied a fraction of itself ...
    applied = float(figures["applied"])
    lo, hi = (float(x) for x in figures["grpo_window"].split(" to "))
    assert lo <= applied <= hi  # ... which landed inside GRPO's window: the rule's premise, measured


RULE = "the lr you would give GRPO"


@pytest.mark.parametrize("where", ["docs", "help", "docstring"])
def test_the_docs_the_help_and_the_docstring_quote_the_rule_s_figures(where):
    text = {"docs": section, "help": help_text, "docstring": docstring}[where]()
    flat = " ".join(text.split())
    figures = rule_figures()
    needed = {"docs": [k for k in figures if k not in ("default",)],
              "help": ["grpo_default", "steps", "cap"], "docstring": ["grpo_default", "steps"]}[where]
    missing = {k: figures[k] for k in needed if figures[k] not in flat}
    assert not missing, f"{where} does not quote {missing}"
    assert RULE in flat and "oblr/lr_mean" in flat and "oblr/eta_max" in flat
    assert "calibrated" in flat and "eta_max" in flat  # the mode, and the paper's reading one option away
    if where == "docs":
        assert "Set `learning_rate` to the lr you would give GRPO." in text
        assert f"\\min\\left(\\frac{{f_t}}{{f_{{\\mathrm{{ref}}}}}}, {figures['cap']}\\right)" in flat  # typeset
        assert "oblr/noise_scale" in flat
        missing_rows = [row for row in table_rows() if row not in text]
        assert not missing_rows, f"the section's table differs from the results files: {missing_rows}"
        assert "What it keeps of Theorem 4" in flat and "gives up the absolute level" in flat
    assert "a few times" not in flat and "1e-3 on two tasks" not in flat and "5e-6" not in flat  # the old rules


def test_the_default_is_grpo_s_default_and_the_calibrated_mode():
    fields = {f.name: f.default for f in dataclasses.fields(OBLRPOConfig)}
    grpo_default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}["learning_rate"]
    assert fields["learning_rate"] == grpo_default and fields["snr_lr_mode"] == "calibrated"
    assert f"default {lr(grpo_default)}, GRPO's default" in " ".join(help_text().split())


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_the_front_pages_say_the_rule_in_one_sentence_and_set_grpo_s_lr(page):
    text = (ROOT / page).read_text()
    flat = " ".join(text.split())
    assert "the lr you would give GRPO" in flat and "5e-6" not in flat and "η_max = GRPO's lr" not in flat
    assert re.search(r"learning_rate=1e-6, +# the lr you would give GRPO", text), page


def test_the_gpu_recipes_set_the_grpo_lr_their_comment_names():
    """Each GPU recipe (128 prompts per step) sets learning_rate to the lr its comment says one would give GRPO, in the
    calibrated mode (the default), and names oblr/lr_mean as the check."""
    import yaml

    recipes = sorted((ROOT / "examples" / "recipes").glob("qwen3_*.yaml"))
    assert recipes
    for path in recipes:
        text = path.read_text()
        config = yaml.safe_load(text)
        prompts = (config["per_device_train_batch_size"] * config["gradient_accumulation_steps"]
                   * int(re.search(r"Prompts per step: (\d+) training GPU", text).group(1)) // config["num_generations"])
        assert prompts == 128, path.name
        grpo_lr = float(re.search(r"the lr you would give GRPO \(([\d.e-]+)", text).group(1))
        assert float(config["learning_rate"]) == grpo_lr, path.name
        assert config.get("snr_lr_mode", "calibrated") == "calibrated", path.name
        assert "oblr/lr_mean" in text and "Choosing the learning rate" in text


# ---------------------------------------------------------------- the calibrated mode's measurements, one source each
def applied_figures() -> dict[str, str]:
    """The figures How it works quotes from the applied-lr table (benchmarks/results/applied_lr.json)."""
    rows = [r for r in json.loads((RESULTS / "applied_lr.json").read_text())["rows"] if "tiny" in r["model"]]
    capped = [r for r in rows if r["later"] == pytest.approx(MAX_LR_MULTIPLE)]
    out = {"f_first": f"{min(r['f_first'] for r in rows):.3f}-{max(r['f_first'] for r in rows):.3f}"}
    if capped:
        r = capped[0]
        out["capped"] = f"at {r['prompts_per_step']} prompts per step"
        out["rise"] = f"{r['f_first']:.3f} to {r['f_later']:.3f}"
    return out


def test_how_it_works_quotes_the_applied_lr_table():
    """Every tiny-policy run's first 10 steps applied learning_rate (the calibration's design, measured), and the
    section quotes the table's factors and where the cap was reached."""
    rows = json.loads((RESULTS / "applied_lr.json").read_text())["rows"]
    assert rows and all(r["within"] for r in rows if "tiny" in r["model"])
    flat = " ".join(section().split())
    missing = {k: v for k, v in applied_figures().items() if v not in flat}
    assert not missing, f"How it works does not quote {missing}"
    assert f"ran at the cap, {MAX_LR_MULTIPLE:g}x `learning_rate`" in flat


def test_the_demo_presets_and_their_pages_use_grpo_s_lr():
    """The demo's OBLR-PO presets are the lr GRPO gets in the same setting (`--trainer grpo` runs the same preset), in
    the calibrated mode; docs/demos.md says so with the same figures."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    page = " ".join((ROOT / "docs" / "demos.md").read_text().split())
    smollm2, tiny = demo.PRESETS["smollm2"]["learning_rate"], demo.PRESETS["tiny"]["learning_rate"]
    assert f"`learning_rate` = {lr(smollm2)} (constant), the lr GRPO gets in the same setting" in page
    assert f"`learning_rate={lr(tiny)}` (the lr GRPO gets on this policy" in page
    assert "snr_lr_mode" not in str(demo.PRESETS)  # the default mode: calibrated
    assert "--trainer grpo   # TRL's GRPO, same setting, the same learning rate" in demo.__doc__
