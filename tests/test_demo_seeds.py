"""benchmarks/demo_seeds.py's bookkeeping: a run's summary (which names its own seed) loads, and --resume reuses it."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("demo_seeds", ROOT / "benchmarks" / "demo_seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUMMARY = {"seed": 0, "accuracy_before": 0.5, "accuracy_after": 0.69, "sampled_accuracy_before": 0.13,
           "sampled_accuracy_after": 0.69, "mean_score_before": 0.5, "mean_score_after": 0.69, "seconds": 10.0}


def test_a_summary_naming_its_seed_loads_and_resume_reuses_it(tmp_path, monkeypatch):
    demo_seeds = load_script()
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "summary.json").write_text(json.dumps(SUMMARY))
    assert demo_seeds.load_seed(0, tmp_path)["accuracy_after"] == 0.69  # (a TypeError: 'seed' given twice, before)

    def no_run(*args, **kwargs):
        raise AssertionError("--resume ran a seed whose summary.json exists")

    monkeypatch.setattr(demo_seeds.subprocess, "run", no_run)
    assert demo_seeds.run_seed(0, tmp_path, [], resume=True)["seed"] == 0
