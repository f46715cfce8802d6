"""The TRL user's path end to end: the script trains a step and writes a pushable folder with its card, evaluation
scores it. (Recipes and --help: test_recipes.py; the card: test_card.py; evaluate.py's own: test_evaluate.py.)"""

import json
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


@pytest.mark.slow
def test_script_trains_a_step_and_writes_a_pushable_folder(trained_dir):
    out, _ = trained_dir
    files = {p.name for p in out.iterdir()}
    # What `push_to_hub` uploads (upload_folder of output_dir): weights, config, tokenizer, card, plots.
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "training_curves.png"} <= files, files
    assert (out / "training_curves.png").stat().st_size > 10_000


@pytest.mark.slow
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


@pytest.mark.slow
def test_evaluate_scores_the_saved_checkpoint(trained_dir, tmp_path):
    out, _ = trained_dir
    table = tmp_path / "eval.md"
    stdout = run([str(EXAMPLES / "evaluate.py"), "--model", str(out), "--num_examples", "32", "--benchmarks",
                  "gsm8k", "--output", str(table)], timeout=600)
    text = table.read_text()
    row = re.search(r"\| reasoning-gym chain_sum \(seed 1\) \| (\d+\.\d)% \| (\d\.\d{3}) \| 32 \|", text)
    assert row and 0.0 <= float(row.group(1)) <= 100.0
    assert "| gsm8k | skipped:" in text  # offline: reported, not failed
    assert "skipped" in stdout
    card = (out / "README.md").read_text()  # the results join the model card (eval_results.json in the folder)
    assert "### Held-out results" in card and f"| reasoning-gym chain_sum (seed 1) | {row.group(1)}% | {row.group(2)} | 32 |" in card


def test_prompt_template_with_a_hub_dataset_is_refused_before_any_loading(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_oblrpo", EXAMPLES / "oblrpo.py")
    SCRIPT = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(SCRIPT)
    argv = ["--dataset_name", "oblr-trl-tests/no-such-dataset", "--reward_funcs", "accuracy_reward", "--prompt_template",
            "chain_sum", "--use_cpu", "true", "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="--prompt_template .* cannot apply to --dataset_name: drop it"):
        SCRIPT.main(*SCRIPT.make_parser().parse_args_and_config(argv))
    # the advice: without --prompt_template the same command gets past that check, to loading the dataset
    with pytest.raises(Exception) as error:
        SCRIPT.main(*SCRIPT.make_parser().parse_args_and_config(argv[:4] + argv[6:]))
    assert "no-such-dataset" in str(error.value) and "--prompt_template" not in str(error.value)


# ------------------------------------------------------------------ the script's default model: SmolLM2, offline
@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(os.environ.get("OBLR_TRL_REAL_MODEL_TEST") == "0",
                    reason="OBLR_TRL_REAL_MODEL_TEST=0: skips the real SmolLM2-135M-Instruct load (and its download)")
def test_script_trains_smollm2_by_default_and_saves_the_adapter_with_its_card(tmp_path):
    """smollm2_cpu.yaml without its `model_name_or_path` line (so the script's default model), one step of 16
    completions and an evaluation on 2 held-out problems (16 completions): a LoRA adapter on the resolved SmolLM2
    folder, with its card."""
    from oblr_trl.demo.reference_model import resolve_model_path

    recipe = (EXAMPLES / "recipes" / "smollm2_cpu.yaml").read_text()
    assert "\nmodel_name_or_path: smollm2\n" in recipe
    config = tmp_path / "default_model.yaml"
    config.write_text(recipe.replace("\nmodel_name_or_path: smollm2\n", "\n"))
    out = tmp_path / "smollm2"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "oblrpo.py"), "--config", str(config), "--max_steps", "1",
         "--per_device_train_batch_size", "16", "--num_train_examples", "64", "--num_eval_examples", "2",
         "--eval_steps", "1", "--per_device_eval_batch_size", "16", "--output_dir", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]

    files = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md",
            "training_curves.png"} <= files, files
    assert "model.safetensors" not in files  # the adapter only, not a copy of the 135M base weights
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == resolve_model_path("smollm2")  # the converted, offline SmolLM2
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(adapter["target_modules"])
    card = (out / "README.md").read_text()
    assert "oblr-po" in yaml.safe_load(card.split("---")[1])["tags"]
    assert card.count(SECTION_START) == 1 and "| `one_backward` | `True` |" in card
    assert "![training_curves.png](training_curves.png)" in card
    # both reward functions scored the training step, and the held-out problems were evaluated (TRL's logs)
    assert "'rewards/chain_sum_accuracy/mean'" in output, output[-3000:]  # the verifier alone (format_reward: 0)
    assert "'rewards/bare_number_format/mean'" not in output
    assert "'eval_rewards/chain_sum_accuracy/mean'" in output, output[-3000:]
