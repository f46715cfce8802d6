"""The OBLR-PO section of a model card: settings, final metrics and training plots, appended to TRL's README.md.

`trainer.create_model_card()` (TRL) writes the card's front matter (tags, base model), usage snippet and the paper's
BibTeX from `OBLRPOTrainer._tag_names/_name/_paper`. This module adds what only OBLR-PO knows:

* a table of the OBLR-PO options and the GRPO options its theory constrains, with their values;
* the final metrics (reward, step-size scale, gradient SNR), last value and mean of the last logged steps;
* links to the training plots, relative to the card so they render on the Hub once the folder is pushed.

The section sits between two HTML comments, so appending again (a later checkpoint, a push that rewrote the card)
replaces it instead of stacking copies.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os

from trl import GRPOConfig

from .plotting import plot_training

SECTION_START = "<!-- oblr-po:start -->"
SECTION_END = "<!-- oblr-po:end -->"

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

# (log key, label) of the final metrics.
FINAL_METRICS = (
    ("reward", "reward"),
    ("oblr/lr_scale", "step-size scale N·SNR/(1+N·SNR)"),
    ("oblr/snr", "gradient SNR"),
    ("oblr/num_samples", "samples per step N"),
    ("oblr/baseline_mean", "baseline mean"),
)


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


def _final_metric(log_history: list[dict], key: str, window: int = 10) -> tuple[float, float, int] | None:
    """(last value, mean of the last `window` finite values, number of logged values) or None if never logged."""
    values = [float(entry[key]) for entry in log_history if key in entry]
    if not values:
        return None
    finite = [v for v in values[-window:] if math.isfinite(v)]
    return values[-1], (sum(finite) / len(finite) if finite else float("nan")), len(values)


def oblr_card_section(config, log_history: list[dict], plot_paths: list[str] | None = None) -> str:
    """Markdown for the card: OBLR-PO settings, final metrics and plot links.

    `plot_paths` are shown by file name, i.e. relative to the card (the plots lie next to README.md in output_dir).
    """
    lines = [SECTION_START, "", "## OBLR-PO training", ""]
    lines += [
        "Trained with [OBLR-PO](https://arxiv.org/abs/2511.23310): the gradient-weighted baseline (Theorem 7) and "
        "the SNR-governed step size `lr_t = lr_max · N·SNR_t / (1 + N·SNR_t)` (Theorem 4).",
        "",
        "### Settings",
        "",
        "| option | value |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_fmt(getattr(config, name))} |" for name in oblr_option_names(config)]

    lines += ["", "### Final metrics", ""]
    rows = []
    for key, label in FINAL_METRICS:
        final = _final_metric(log_history, key)
        if final is not None:
            last, mean, count = final
            rows.append(f"| {label} (`{key}`) | {_fmt(last)} | {_fmt(mean)} | {count} |")
    if rows:
        lines += ["| metric | last | mean of last 10 | logged steps |", "|---|---|---|---|", *rows]
    else:
        lines.append("No metrics were logged.")

    if plot_paths:
        lines += ["", "### Training curves", ""]
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plot_paths]
    lines += ["", SECTION_END, ""]
    return "\n".join(lines)


def append_oblr_section(
    output_dir: str | os.PathLike, config, log_history: list[dict], plot_paths: list[str] | None = None
) -> str:
    """Add (or replace) the OBLR-PO section of `output_dir`/README.md; return the README's path.

    Call it after `trainer.create_model_card()`; if no README.md exists yet, one holding only the section is written.
    `plot_paths` defaults to drawing the training plots into `output_dir` with `plot_training` (none if nothing was
    logged).
    """
    if plot_paths is None:
        plot_paths = plot_training(log_history, output_dir) if log_history else []
    section = oblr_card_section(config, log_history, plot_paths)
    path = os.path.join(output_dir, "README.md")
    card = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            card = f.read()
    start, end = card.find(SECTION_START), card.find(SECTION_END)
    if start != -1 and end > start:
        card = card[:start] + section + card[end + len(SECTION_END) :].lstrip("\n")
    else:
        card = card.rstrip("\n") + ("\n\n" if card else "") + section
    with open(path, "w", encoding="utf-8") as f:
        f.write(card)
    return path
