"""The model card: TRL's part right for local models, the OBLR-PO section (None-safe metrics, step size over the run,
held-out results), and TRL's all-None-rewards warning shown once."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.card import (
    PAPER,
    SECTION_END,
    SECTION_START,
    append_oblr_section,
    oblr_card_section,
)
from oblr_trl.demo import build_model, build_tokenizer, make_dataset
from oblr_trl.demo.card import write_held_out_results, write_model_card
from oblr_trl.trl_logs import ALL_NONE_MESSAGE, NOTE, install_all_none_reward_filter

HISTORY = [
    {"step": 1, "reward": 0.25, "oblr/lr_scale": 0.5, "oblr/lr": 5e-4, "oblr/snr": 0.125, "oblr/num_samples": 8.0},
    {"step": 2, "reward": 0.75, "oblr/lr_scale": 0.0, "oblr/lr": 0.0, "oblr/snr": float("nan"),
     "oblr/num_samples": 8.0},
    {"step": 2, "train_runtime": 1.0},
]


def config(tmp_path, **kwargs):
    return OBLRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, learning_rate=1e-3, **kwargs)


# ------------------------------------------------------------------ the OBLR-PO section
def test_section_lists_every_oblr_option(tmp_path):
    section = oblr_card_section(config(tmp_path, lr_scale_min=0.05), HISTORY, ["/somewhere/training_curves.png"])
    for name in ("baseline", "leave_one_out", "grad_norm_estimator", "snr_lr", "snr_sample_unit", "lr_scale_min",
                 "snr_ema", "scale_rewards", "beta", "num_iterations"):
        assert f"| `{name}` |" in section, name
    assert "| `lr_scale_min` | 0.05 |" in section
    assert "![training_curves.png](training_curves.png)" in section  # relative to the card


def test_section_shows_the_step_size_over_the_run_not_the_last_step(tmp_path):
    section = oblr_card_section(config(tmp_path), HISTORY)
    assert "mean lr scale over the run: 0.25 (2 steps)" in section
    assert "steps at lr scale 0 (no update: no signal, or an SNR estimate of 0): 1 of 2 (50%)" in section
    assert "mean applied lr: 0.00025 (`learning_rate`: 0.001, snr_lr_mode='calibrated')" in section
    # mean over the run, first and last steps (non-finite values skipped), count
    assert "| reward (`reward`) | 0.5 | 0.5 | 0.5 | 2 |" in section
    assert "(`oblr/snr`) | 0.125 | 0.125 | 0.125 | 2 |" in section
    assert "| last |" not in section


def test_section_and_plots_survive_metrics_logged_as_none(tmp_path):
    """TRL logs `reward: None` when every reward of a step is None; the card must not call float(None)."""
    history = [{"step": 1, "reward": None, "oblr/lr_scale": None, "loss": 0.0},
               {"step": 2, "reward": 0.5, "oblr/lr_scale": 1.0, "oblr/lr": 1e-3}, {"step": 3, "reward": None}]
    path = append_oblr_section(tmp_path, config(tmp_path), history)
    card = Path(path).read_text()
    assert "| reward (`reward`) | 0.5 | 0.5 | 0.5 | 1 |" in card
    assert (tmp_path / "training_curves.png").exists()
    everything_none = [{"step": 1, "reward": None}]
    assert "No metrics were logged." in oblr_card_section(config(tmp_path), everything_none)


def test_append_replaces_the_section_instead_of_stacking(tmp_path):
    (tmp_path / "README.md").write_text("---\ntags: [oblr-po]\n---\n\n# TRL's card\n")
    append_oblr_section(tmp_path, config(tmp_path), HISTORY)
    path = append_oblr_section(tmp_path, config(tmp_path), HISTORY[:1])
    card = Path(path).read_text()
    assert card.startswith("---\ntags: [oblr-po]") and "# TRL's card" in card
    assert card.count(SECTION_START) == 1 and "| 0.25 | 0.25 | 0.25 | 1 |" in card
    assert (tmp_path / "training_curves.png").exists()


# ------------------------------------------------------------------ held-out results
EVAL = {"model": "outputs/x", "decoding": "greedy, max_new_tokens=8",
        "results": [{"benchmark": "reasoning-gym chain_sum (seed 1)", "accuracy": 0.375, "problems": 200},
                    {"benchmark": "gsm8k", "skipped": "skipped: offline"}]}


def test_held_out_results_join_the_card_and_are_replaced_not_stacked(tmp_path):
    append_oblr_section(tmp_path, config(tmp_path), HISTORY)
    assert "Held-out results" not in (tmp_path / "README.md").read_text()
    write_held_out_results(tmp_path, EVAL)
    write_held_out_results(tmp_path, {**EVAL, "results": EVAL["results"][:1]})
    card = (tmp_path / "README.md").read_text()
    assert card.count("### Held-out results") == 1
    assert "| reasoning-gym chain_sum (seed 1) | 37.5% |  | 200 |" in card and "gsm8k" not in card
    assert card.index("### Held-out results") < card.index("### Training curves") < card.index(SECTION_END)
    # a later checkpoint's card keeps them: the section reads eval_results.json
    append_oblr_section(tmp_path, config(tmp_path), HISTORY)
    assert "| reasoning-gym chain_sum (seed 1) | 37.5% |  | 200 |" in (tmp_path / "README.md").read_text()
    assert json.loads((tmp_path / "eval_results.json").read_text())["results"][0]["problems"] == 200


def test_demo_summary_is_shown_as_before_and_after(tmp_path):
    summary = {"task": "chain_sum", "num_eval": 1000, "accuracy_before": 0.342, "accuracy_after": 0.445,
               "sampled_accuracy_before": 0.194, "sampled_accuracy_after": 0.266, "mean_score_before": 0.4,
               "mean_score_after": 0.5}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    # the demo's file is the demo's business (issue 48): its card shows it, the trainer's card section does not
    trainer_card = Path(append_oblr_section(tmp_path, config(tmp_path), HISTORY)).read_text()
    assert "summary.json" not in trainer_card and "Held-out results" not in trainer_card
    card = Path(write_model_card(tmp_path, config(tmp_path), HISTORY, base_model=str(tmp_path), title="t")).read_text()
    assert "1000 held-out chain_sum problems" in card and "`oblr_trl.demo.tasks.extract_answer`" in card
    assert "| accuracy (exact answers), greedy | 34.2% | 44.5% |" in card
    assert "| accuracy, sampled at temperature 1 | 19.4% | 26.6% |" in card
    assert "| mean score, greedy | 0.400 | 0.500 |" in card and "mean score, sampled" not in card  # not recorded


def test_write_model_card_replaces_a_template_and_names_the_hub_base_model(tmp_path):
    from oblr_trl.demo.card import has_oblr_section

    (tmp_path / "README.md").write_text("# Model Card for Model ID\n[More Information Needed]\n")  # PEFT's template
    assert not has_oblr_section(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"task": "chain_sum", "num_eval": 100, "accuracy_before": 0.5,
                                                        "accuracy_after": 0.6}))
    write_model_card(tmp_path, config(tmp_path), HISTORY, base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                     title="SmolLM2 + OBLR-PO", library="peft")
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\nlibrary_name: peft\n")
    assert "More Information Needed" not in card and "Model ID" not in card
    assert has_oblr_section(tmp_path) and "| accuracy (exact answers), greedy | 50.0% | 60.0% |" in card
    assert "AutoPeftModelForCausalLM" in card and PAPER["citation"] in card
    # re-scoring updates it
    write_held_out_results(tmp_path, {**EVAL, "results": [{**EVAL["results"][0], "mean_score": 0.4}]})
    assert "| reasoning-gym chain_sum (seed 1) | 37.5% | 0.400 | 200 |" in (tmp_path / "README.md").read_text()
    # a local path is not a Hub id: no base_model entry
    write_model_card(tmp_path, config(tmp_path), HISTORY, base_model=str(tmp_path), title="local")
    assert "base_model:" not in (tmp_path / "README.md").read_text()


# ------------------------------------------------------------------ TRL's card of a local model, and a run with None
@pytest.fixture(scope="module")
def all_none_run(tmp_path_factory):
    """Two OBLR-PO steps of the tiny model whose reward is None for every completion, a checkpoint each step."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("local_model")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    args = OBLRPOConfig(output_dir=str(out), use_cpu=True, report_to="none", max_steps=2, save_strategy="steps",
                        save_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
                        logging_steps=1, disable_tqdm=True)
    trainer = OBLRPOTrainer(model=model, processing_class=tokenizer, args=args,
                            reward_funcs=[lambda completions, **kwargs: [None] * len(completions)],
                            train_dataset=make_dataset("chain_sum", size=16, seed=0))
    filter_ = install_all_none_reward_filter()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("trl.trainer.grpo_trainer").addHandler(handler)
    try:
        trainer.train()  # before the fix: float(None) in the checkpoint's card killed training here
    finally:
        logging.getLogger("trl.trainer.grpo_trainer").removeHandler(handler)
    card_at_checkpoint = (out / "README.md").read_text()  # TRL writes the card into output_dir at each checkpoint
    trainer.save_model(str(out))
    trainer.create_model_card()
    return out, trainer, records, filter_, card_at_checkpoint


def test_training_with_every_reward_none_survives_its_checkpoint_cards(all_none_run):
    out, trainer, _, _, card_at_checkpoint = all_none_run
    assert trainer.state.global_step == 2 and (out / "checkpoint-2").is_dir()
    assert [entry["reward"] for entry in trainer.state.log_history if "reward" in entry] == [None, None]
    assert SECTION_START in card_at_checkpoint and "No metrics were logged." not in card_at_checkpoint


def test_card_of_a_local_model_names_no_none_and_cites_the_authors(all_none_run):
    out, _, _, _, _ = all_none_run
    card = (out / "README.md").read_text()
    assert "[None](https://huggingface.co/None)" not in card and 'model="None"' not in card
    assert "Model Card for None" not in card and f"# Model Card for {out.name}" in card
    assert f'model="{out}"' in card  # the pipeline snippet loads the folder
    assert "fine-tuned from a local model (not on the Hub)" in card
    assert "author        = {Zixun Huang and Jiayi Sheng and Zeyu Zheng}" in card
    assert PAPER["citation"] in card and "@misc{oblrpo2025" not in card
    front_matter = yaml.safe_load(card.split("---")[1])
    assert "oblr-po" in front_matter["tags"] and "base_model" not in front_matter
    assert re.search(r"@misc\{.*?eprint\s*=\s*\{2511\.23310\}", card, re.DOTALL)


def test_all_none_rewards_warning_is_shown_once_with_what_oblr_po_does(all_none_run):
    _, _, records, filter_, _ = all_none_run
    warned = [r for r in records if ALL_NONE_MESSAGE in r.getMessage()]
    assert len(warned) == 1 and NOTE.strip() in warned[0].getMessage()
    assert filter_.dropped >= 1  # TRL warned again on the second step: dropped


def test_filter_installs_once_and_rearms():
    first, second = install_all_none_reward_filter(), install_all_none_reward_filter()
    assert first is second and not second.shown
    logger = logging.getLogger("trl.trainer.grpo_trainer")
    assert sum(f is first for f in logger.filters) == 1
    record = logging.LogRecord("trl.trainer.grpo_trainer", logging.WARNING, "", 0, "other warning", (), None)
    assert first.filter(record) and record.msg == "other warning"
