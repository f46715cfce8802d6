"""The TRL user's path end to end: the script trains a step and writes a pushable folder with its card, evaluation
scores it. (Recipes and --help: test_recipes.py; the card: test_card.py; evaluate.py's own: test_evaluate.py.)"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oblr_trl.card import SECTION_END, SECTION_START

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def run(args, timeout=600):
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


# ------------------------------------------------------------------ the script (recipes and --help: test_recipes.py)
@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """One OBLR-PO step of the tiny CPU recipe, saved with its model card and plots."""
    out = tmp_path_factory.mktemp("tiny_cpu")
    stdout = run([str(EXAMPLES / "oblrpo.py"), "--config", "examples/recipes/tiny_cpu.yaml", "--max_steps", "1",
                  "--output_dir", str(out)])
    return out, stdout


def test_script_trains_a_step_and_writes_a_pushable_folder(trained_dir):
    out, _ = trained_dir
    files = {p.name for p in out.iterdir()}
    # What `push_to_hub` uploads (upload_folder of output_dir): weights, config, tokenizer, card, plots.
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "training_curves.png"} <= files, files
    assert (out / "training_curves.png").stat().st_size > 10_000


def test_model_card_names_oblr_po_cites_the_paper_and_shows_the_run(trained_dir):
    out, _ = trained_dir
    card = (out / "README.md").read_text()
    front_matter = yaml.safe_load(card.split("---")[1])
    assert "oblr-po" in front_matter["tags"] and "trl" in front_matter["tags"]
    assert "OBLR-PO" in card and "https://huggingface.co/papers/2511.23310" in card
    assert re.search(r"@misc\{.*?eprint\s*=\s*\{2511\.23310\}", card, re.DOTALL)
    # The OBLR-PO section: settings, final metrics, the plot.
    assert card.count(SECTION_START) == 1 and card.count(SECTION_END) == 1
    assert "| `baseline` | `gradient_weighted` |" in card and "| `snr_lr` | `True` |" in card
    assert "(`oblr/lr_scale`)" in card and "(`oblr/snr`)" in card and "(`reward`)" in card
    assert "![training_curves.png](training_curves.png)" in card


def test_evaluate_scores_the_saved_checkpoint(trained_dir, tmp_path):
    out, _ = trained_dir
    table = tmp_path / "eval.md"
    stdout = run([str(EXAMPLES / "evaluate.py"), "--model", str(out), "--num_examples", "32", "--benchmarks",
                  "gsm8k", "--output", str(table)], timeout=600)
    text = table.read_text()
    row = re.search(r"\| reasoning-gym chain_sum \(seed 1\) \| (\d+\.\d)% \| 32 \|", text)
    assert row and 0.0 <= float(row.group(1)) <= 100.0
    assert "| gsm8k | skipped:" in text  # offline: reported, not failed
    assert "skipped" in stdout
    card = (out / "README.md").read_text()  # the results join the model card (eval_results.json in the folder)
    assert "### Held-out results" in card and f"| reasoning-gym chain_sum (seed 1) | {row.group(1)}% | 32 |" in card
