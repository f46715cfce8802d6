"""The demo's model cards: what the example scripts write into a model folder, shown on its card.

`examples/evaluate.py` writes the card's results file, `eval_results.json` (`oblr_trl.card.HELD_OUT_FILE`; its shape
is in `oblr_trl.card`), with `write_held_out_results`, which also refreshes the card's "Held-out results" block in
place. `examples/demo.py` writes `summary.json` (`accuracy_before`/`_after`, `sampled_accuracy_*`, `mean_score_*`,
`sampled_mean_score_*`, `num_eval`, `task`), shown as before/after rows by `summary_rows`, and a whole card with
`write_model_card` (the saved model's, replacing PEFT's blank template).

The trainer's card (`oblr_trl.card`: the OBLR-PO section, TRL's card put right, the paper) knows none of the demo's
files.
"""

from __future__ import annotations

import json
import os

from ..card import (HELD_OUT_FILE, PAPER, SECTION_END, SECTION_START, as_number, held_out_file_rows, json_in,
                    oblr_card_section)

DEMO_SUMMARY_FILE = "summary.json"
METRIC_NOTE = ("Accuracy: the share of exact answers (the verifier's full credit for the reply's final number, "
               "`oblr_trl.demo.tasks.extract_answer`). Mean score: the verifier's mean score, partial credit included.")


def summary_rows(output_dir: str | os.PathLike) -> list[str]:
    """Markdown lines of the demo's `summary.json` in `output_dir` (before and after RL), or []."""
    data = json_in(output_dir, DEMO_SUMMARY_FILE)
    if data is None:
        return []
    pairs = [("accuracy (exact answers), greedy", "accuracy", "{:.1%}"),
             ("accuracy, sampled at temperature 1", "sampled_accuracy", "{:.1%}"),
             ("mean score, greedy", "mean_score", "{:.3f}"),
             ("mean score, sampled at temperature 1", "sampled_mean_score", "{:.3f}")]
    rows = [f"| {label} | {fmt.format(float(data[k + '_before']))} | {fmt.format(float(data[k + '_after']))} |"
            for label, k, fmt in pairs
            if as_number(data.get(k + "_before")) is not None and as_number(data.get(k + "_after")) is not None]
    if not rows:
        return []
    what = f"{data.get('num_eval', '?')} held-out {data.get('task', '')} problems".replace("  ", " ")
    return [f"From `{DEMO_SUMMARY_FILE}` ({what}):", "", "| metric | before RL | after RL |", "|---|---|---|",
            *rows, "", METRIC_NOTE, ""]


def load_held_out_results(output_dir: str | os.PathLike) -> list[str]:
    """Markdown lines of the held-out results found in `output_dir`: `eval_results.json`, then `summary.json`."""
    return held_out_file_rows(output_dir) + summary_rows(output_dir)


def has_oblr_section(folder: str | os.PathLike) -> bool:
    """Whether `folder`/README.md exists and holds the OBLR-PO section (what `write_held_out_results` updates)."""
    path = os.path.join(folder, "README.md")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        card = f.read()
    return SECTION_START in card and SECTION_END in card


def write_held_out_results(output_dir: str | os.PathLike, results: dict) -> str:
    """Write `results` (the `eval_results.json` shape above) into `output_dir` and show them on its card.

    The card's OBLR-PO section, if present, gets its "Held-out results" block added or replaced in place; a card
    without the section (or no card) is left alone. Returns the JSON file's path.
    """
    path = os.path.join(output_dir, HELD_OUT_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    readme = os.path.join(output_dir, "README.md")
    if os.path.isfile(readme):
        with open(readme, encoding="utf-8") as f:
            card = f.read()
        start, end = card.find(SECTION_START), card.find(SECTION_END)
        if start != -1 and end > start:
            section = card[start:end]
            block_start = section.find("\n### Held-out results\n")
            if block_start != -1:
                block_end = section.find("\n### ", block_start + 1)
                section = section[:block_start] + (section[block_end:] if block_end != -1 else "\n")
            held_out = "\n".join(["", "### Held-out results", "", *load_held_out_results(output_dir)])
            plots = section.find("\n### Training curves\n")
            if plots != -1:
                section = section[:plots] + held_out + section[plots:]
            else:
                section = section.rstrip("\n") + "\n" + held_out + "\n"
            card = card[:start] + section + card[end:]
            with open(readme, "w", encoding="utf-8") as f:
                f.write(card)
    return path


def write_model_card(folder: str | os.PathLike, config, log_history: list[dict], base_model: str, title: str,
                     description: str = "", library: str = "transformers", plot_paths: list[str] | None = None) -> str:
    """Write `folder`/README.md as this package's card, replacing any template there (PEFT's `save_pretrained` writes
    a blank one): front matter naming `base_model` (a Hub id), `title`, `description`, how to load it, the OBLR-PO
    section (settings, metrics over the run, held-out results of `folder`, plots) and the paper's citation.
    Returns the README's path; `write_held_out_results` later refreshes its held-out block."""
    tags = ["oblr-po", "trl", "reinforcement-learning"] + (["lora", "peft"] if library == "peft" else [])
    on_hub = "/" in base_model and not os.path.exists(base_model)  # an `owner/name` Hub id, not a local path
    header = [
        "---",
        *([f"base_model: {base_model}"] if on_hub else []),
        f"library_name: {library}",
        "tags:",
        *[f"- {tag}" for tag in tags],
        "---",
        "",
        f"# {title}",
        "",
        f"Fine-tuned from {f'[{base_model}](https://huggingface.co/{base_model})' if on_hub else base_model} with "
        "[OBLR-PO](https://arxiv.org/abs/2511.23310) (oblr-trl's `OBLRPOTrainer`, a TRL `GRPOTrainer` subclass).",
        "",
    ]
    if description:
        header += [description.strip(), ""]
    load = ("from peft import AutoPeftModelForCausalLM\n\nmodel = AutoPeftModelForCausalLM.from_pretrained(FOLDER)"
            if library == "peft" else
            "from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained(FOLDER)")
    header += ["## Use", "", "```python", load.replace("FOLDER", json.dumps(os.fspath(folder))), "```", "", ""]
    section = oblr_card_section(config, log_history, plot_paths, output_dir=folder, held_out=summary_rows(folder))
    citation = ["", "## Citation", "", "```bibtex", PAPER["citation"], "```", ""]
    path = os.path.join(folder, "README.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(header) + section + "\n".join(citation))
    return path
