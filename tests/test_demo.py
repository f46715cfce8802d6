"""examples/demo.py end to end on the embedded tiny model (the real model's run is benchmarks/demo_seeds.py's job):
one progress bar instead of printed log dicts, the summary table, the saved model, and a re-score command that works."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_tiny_quick_output_and_rescore(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OBLR_TRL_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "examples/demo.py", "--model", "tiny", "--quick", "--warmup_steps", "5", "--output_dir",
         str(out), "--prompt_template", "{question}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "{'loss'" not in console and "'reward':" not in console, "a log dict was printed"
    assert re.search(r"OBLR-PO: 100%.*3/3.*reward=[\d.]+, lr scale=[\d.e-]+, SNR=[\d.e-]+", console)
    assert re.search(r"greedy accuracy\s+[\d.]+%\s+[\d.]+%", proc.stdout)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["model"] == "embedded tiny Qwen3"
    assert (out / "training_curves.png").exists() and (out / "model" / "config.json").exists()
    assert json.loads((out / "model" / "oblr_task.json").read_text())["task"] == "chain_sum"

    # the printed command re-scores the saved model on the same held-out problems, with the same greedy accuracy
    command = proc.stdout.split("Re-score it:\n", 1)[1].splitlines()[0].strip()
    argv = shlex.split(command)
    assert argv[:2] == ["python", "examples/evaluate.py"]
    assert argv[argv.index("--prompt_template") + 1] == "{question}"  # asked in the demo's wording
    rescore = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    assert rescore.returncode == 0, rescore.stdout[-3000:] + rescore.stderr[-3000:]
    assert f"| {summary['accuracy_after']:.1%} | {summary['num_eval']} |" in rescore.stdout
