"""The model card of an OBLR-PO run: TRL's card made right for local models, plus an OBLR-PO section.

`trainer.create_model_card()` (TRL) writes the card's front matter (tags, base model), usage snippet and the paper's
BibTeX from `OBLRPOTrainer._tag_names/_name/_paper`. `append_oblr_section` then

* fixes what TRL's template writes for a model that is not on the Hub: no "fine-tuned version of [None](...)", no
  `pipeline(model="None")`, no "Model Card for None" (the local folder is named instead), and cites the paper with its
  authors (`PAPER`);
* adds what only OBLR-PO knows: a table of the OBLR-PO options and the GRPO options its theory constrains; the metrics
  over the run (reward, the mean lr scale, the fraction of steps at lr scale 0, the applied lr's mean, the SNR),
  never failing on a metric logged as None (TRL logs `reward: None` when every reward of a step is None); links to the
  training plots; and held-out results: the card's own results file in the output folder, `eval_results.json`, shaped
  as ``{"model": str, "decoding": str, "results": [{"benchmark": str, "accuracy": float, "mean_score": float
  (optional), "problems": int} or {"benchmark": str, "skipped": str}, ...]}`` (accuracy: the exact-answer rate; mean
  score: the mean verifier score), so that a later checkpoint's card keeps them, plus any lines a caller passes.

Who writes that file, and what the demo's own outputs (`summary.json`) show, is the demo's business:
`oblr_trl.demo.card` (`write_held_out_results`, `write_model_card`). This module knows no example script's files.

The section sits between two HTML comments, so appending again (a later checkpoint, a push that rewrote the card)
replaces it instead of stacking copies.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import numbers
import os
import re
import textwrap

from trl import GRPOConfig

from .metrics import key as metric_key, labelled
from .plotting import plot_training

logger = logging.getLogger(__name__)

SECTION_START = "<!-- oblr-po:start -->"
SECTION_END = "<!-- oblr-po:end -->"
HELD_OUT_FILE = "eval_results.json"

# The paper, for TRL's card generation (`OBLRPOTrainer._paper`). Authors as listed for arXiv 2511.23310 (v2).
PAPER = {
    "title": "OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning",
    "id": "2511.23310",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @misc{huang2025oblrpo,
            title         = {{OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning}},
            author        = {Zixun Huang and Jiayi Sheng and Zeyu Zheng},
            year          = 2025,
            eprint        = {2511.23310},
            archivePrefix = {arXiv},
            primaryClass  = {stat.ML},
            url           = {https://arxiv.org/abs/2511.23310},
        }"""),
}

# GRPOConfig options whose values the paper's theory fixes or that define a step's sample (shown with OBLR-PO's own).
CONSTRAINED_GRPO_OPTIONS = (
    "scale_rewards",
    "loss_type",
    "beta",
    "num_iterations",
    "num_generations",
    "learning_rate",
    "lr_scheduler_type",
    "max_grad_norm",
)

# (log key, label) of the metrics over the run: TRL's reward, then OBLR-PO's, labelled as the catalogue
# (.metrics) labels them.
RUN_METRICS = (("reward", "reward"),
               *labelled(("snr_factor", "lr_scale", "lr", "eta_max", "snr", "num_samples", "baseline_mean")))
WINDOW = 10  # steps in the "first" and "last" columns



def oblr_option_names(config) -> list[str]:
    """Options `OBLRPOConfig` adds to `GRPOConfig` (from the dataclass fields), then the constrained GRPO ones."""
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = [f.name for f in dataclasses.fields(config) if f.name not in grpo]
    return own + [name for name in CONSTRAINED_GRPO_OPTIONS if hasattr(config, name)]


def _fmt(value) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}"
    return f"`{value}`"


def as_number(value) -> float | None:
    """`value` as a float, or None for what is not a number (None, strings): a log entry may hold `reward: None`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def metric_values(log_history: list[dict], key: str) -> list[float]:
    """The numeric values logged under `key`, in order; entries without it, or holding None, are skipped."""
    values = (as_number(entry.get(key)) for entry in log_history if key in entry)
    return [v for v in values if v is not None]


def _mean_finite(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def numeric_history(log_history: list[dict]) -> list[dict]:
    """`log_history` without the entries' None values (what the plots can draw)."""
    return [{k: v for k, v in entry.items() if v is not None} for entry in log_history]


def run_metrics_rows(log_history: list[dict]) -> list[str]:
    """Markdown rows: each metric's mean over the run, over its first and last `WINDOW` logged steps, and its count."""
    rows = []
    for key, label in RUN_METRICS:
        values = metric_values(log_history, key)
        if values:
            rows.append(
                f"| {label} (`{key}`) | {_fmt(_mean_finite(values))} | {_fmt(_mean_finite(values[:WINDOW]))} "
                f"| {_fmt(_mean_finite(values[-WINDOW:]))} | {len(values)} |"
            )
    return rows


def step_size_summary(log_history: list[dict], config) -> list[str]:
    """Lines on the step size over the run: mean lr scale, steps at scale 0, the applied lr against learning_rate."""
    scales = [v for v in metric_values(log_history, metric_key("lr_scale")) if math.isfinite(v)]
    if not scales:
        return []
    zero = sum(v == 0 for v in scales)
    lines = [
        f"- mean lr scale over the run: {_fmt(sum(scales) / len(scales))} ({len(scales)} steps)",
        f"- steps at lr scale 0 (no update: no signal, or an SNR estimate of 0): {zero} of {len(scales)} "
        f"({zero / len(scales):.0%})",
    ]
    applied = [v for v in metric_values(log_history, metric_key("lr")) if math.isfinite(v)]
    if applied:
        lines.append(
            f"- mean applied lr: {_fmt(sum(applied) / len(applied))} (`learning_rate`: "
            f"{_fmt(float(getattr(config, 'learning_rate', float('nan'))))}, snr_lr_mode="
            f"{getattr(config, 'snr_lr_mode', 'eta_max')!r})"
        )
    return lines


def json_in(output_dir: str | os.PathLike, name: str) -> dict | None:
    """The JSON file `name` in `output_dir`, read; None where there is none."""
    path = os.path.join(output_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def held_out_file_rows(output_dir: str | os.PathLike) -> list[str]:
    """Markdown lines of `output_dir`/`HELD_OUT_FILE` (the shape in the module docstring), or [] without the file."""
    data = json_in(output_dir, HELD_OUT_FILE)
    if data is None:
        return []
    lines = [f"From `{HELD_OUT_FILE}` ({data.get('decoding', 'decoding not recorded')}):", ""]
    lines += ["| benchmark | accuracy (exact answers) | mean score | problems |", "|---|---|---|---|"]
    for row in data.get("results", []):
        if "skipped" in row:
            lines.append(f"| {row['benchmark']} | {row['skipped']} |  | 0 |")
        else:
            score = as_number(row.get("mean_score"))
            lines.append(f"| {row['benchmark']} | {float(row['accuracy']):.1%} | "
                         f"{'' if score is None else f'{score:.3f}'} | {int(row['problems'])} |")
    return lines + [""]


def oblr_card_section(
    config, log_history: list[dict], plot_paths: list[str] | None = None, output_dir: str | os.PathLike | None = None,
    held_out: list[str] | None = None,
) -> str:
    """Markdown for the card: OBLR-PO settings, metrics over the run, plot links, and held-out results: those of
    `output_dir`'s `HELD_OUT_FILE`, then `held_out` (markdown lines a caller adds, e.g. the demo's summary).

    `plot_paths` are shown by file name, i.e. relative to the card (the plots lie next to README.md in output_dir).
    """
    lines = [SECTION_START, "", "## OBLR-PO training", ""]
    lines += [
        "Trained with [OBLR-PO](https://arxiv.org/abs/2511.23310): the gradient-weighted baseline (Theorem 7) and "
        "the SNR-governed step size `lr_t = eta_max · N·SNR_t / (1 + N·SNR_t)` (Theorem 4).",
        "",
        "### Settings",
        "",
        "| option | value |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_fmt(getattr(config, name))} |" for name in oblr_option_names(config)]

    lines += ["", "### Metrics over the run", ""]
    rows = run_metrics_rows(log_history)
    if rows:
        lines += step_size_summary(log_history, config)
        lines += [
            "",
            f"| metric | mean | first {WINDOW} steps | last {WINDOW} steps | logged steps |",
            "|---|---|---|---|---|",
            *rows,
        ]
    else:
        lines.append("No metrics were logged.")

    held_out = (held_out_file_rows(output_dir) if output_dir is not None else []) + (held_out or [])
    if held_out:
        lines += ["", "### Held-out results", "", *held_out]
    if plot_paths:
        lines += ["", "### Training curves", ""]
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plot_paths]
    lines += ["", SECTION_END, ""]
    return "\n".join(lines)


def fix_trl_card(card: str, output_dir: str | os.PathLike) -> str:
    """TRL's card text with what its template writes for a model that is not on the Hub put right.

    A locally built base model (no Hub id) and an unpushed model (no `hub_model_id`) render in TRL's template as
    "fine-tuned version of [None](https://huggingface.co/None)", `pipeline(model="None")` and "Model Card for None";
    the local folder is named instead. The paper's BibTeX is replaced by `PAPER["citation"]` (with its authors).
    """
    folder = os.fspath(output_dir)
    card = card.replace(
        "a fine-tuned version of [None](https://huggingface.co/None)", "fine-tuned from a local model (not on the Hub)"
    )
    card = card.replace('model="None"', f"model={json.dumps(folder)}")
    card = card.replace("# Model Card for None\n", f"# Model Card for {os.path.basename(os.path.normpath(folder))}\n")
    card = re.sub(
        r"(Cite OBLR-PO as:\s*```bibtex\n).*?(\n```)",
        lambda m: m.group(1) + PAPER["citation"] + m.group(2),
        card,
        count=1,
        flags=re.DOTALL,
    )
    return card


def append_oblr_section(
    output_dir: str | os.PathLike, config, log_history: list[dict], plot_paths: list[str] | None = None
) -> str:
    """Add (or replace) the OBLR-PO section of `output_dir`/README.md and fix TRL's part (`fix_trl_card`).

    Call it after `trainer.create_model_card()`; if no README.md exists yet, one holding only the section is written.
    `plot_paths` defaults to drawing the training plots into `output_dir` with `plot_training` (none if nothing was
    logged). Returns the README's path. Metrics logged as None are skipped, never an error.
    """
    if plot_paths is None:
        history = numeric_history(log_history)
        try:
            plot_paths = plot_training(history, output_dir) if history else []
        except ImportError as e:  # no matplotlib (the trainer alone, without the demo extra): a card without plots
            logger.info(f"Model card without training plots: {e}")
            plot_paths = []
    section = oblr_card_section(config, log_history, plot_paths, output_dir=output_dir)
    path = os.path.join(output_dir, "README.md")
    card = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            card = fix_trl_card(f.read(), output_dir)
    start, end = card.find(SECTION_START), card.find(SECTION_END)
    if start != -1 and end > start:
        card = card[:start] + section + card[end + len(SECTION_END) :].lstrip("\n")
    else:
        card = card.rstrip("\n") + ("\n\n" if card else "") + section
    with open(path, "w", encoding="utf-8") as f:
        f.write(card)
    return path
