"""The catalogue of ``oblr/`` metrics (oblr_trl/metrics.py) is the one home of each metric: every metric the trainer
logs is in it (a tiny training step, and the code's producers read statically), every entry says what it is and what
a healthy run shows, the trainer, the model card and the plots take names and labels from it, and a name missing from
it is refused naming the catalogue."""

import importlib.util
from pathlib import Path

import pytest

from oblr_trl import metrics
from oblr_trl.metrics import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
generate = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(generate)


def test_every_entry_has_a_unique_name_a_meaning_and_a_healthy_range():
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names)) and len(names) >= 14
    for m in CATALOGUE:
        assert m.key == f"oblr/{m.name}" and generate.METRIC.fullmatch(m.key), m.name
        assert len(m.meaning) > 20 and len(m.healthy) > 20, m.name
        assert "|" not in m.meaning + m.healthy, m.name  # a cell of the generated Markdown table


def test_the_catalogue_holds_exactly_the_metrics_the_code_forms():
    """The producers' names, read from the code (docs/generate.py's finder: the step sizer's and the baseline's
    metric dicts), against the catalogue: none without an entry, no entry for a metric no longer formed."""
    formed = generate.logged_metrics()
    assert {"lr_scale", "snr", "lr", "lr_mean", "baseline_mean", "unscorable"} <= formed  # the finder finds them
    assert formed == {m.name for m in CATALOGUE}


def test_a_name_missing_from_the_catalogue_is_refused_naming_it():
    assert metrics.key("snr") == "oblr/snr" and metrics.metric("snr") is CATALOGUE[[m.name for m in CATALOGUE].index(
        "snr")]
    with pytest.raises(KeyError, match=r"oblr_trl\.metrics: no metric 'snr_typo' in CATALOGUE .*python docs/generate"):
        metrics.key("snr_typo")


def test_the_card_and_the_plots_take_their_metrics_and_labels_from_the_catalogue():
    from oblr_trl.card import RUN_METRICS
    from oblr_trl.plotting import PANELS

    by_key = {m.key: m for m in CATALOGUE}
    card = [(k, label) for k, label in RUN_METRICS if k.startswith("oblr/")]
    plotted = [(k, legend) for _, _, keys in PANELS for k, legend in keys if k.startswith("oblr/")]
    assert card and plotted
    assert all(label and by_key[k].label == label for k, label in card), card
    assert all(legend and by_key[k].legend == legend for k, legend in plotted), plotted
    assert {m.key for m in CATALOGUE if m.label} == {k for k, _ in card}  # a label nobody shows is not kept
    assert {m.key for m in CATALOGUE if m.legend} == {k for k, _ in plotted}


def test_the_metrics_page_s_table_is_the_catalogue():
    table = generate.metrics_table().splitlines()
    assert table[2:] == [f"| `{m.key}` | {m.meaning} | {m.healthy} |" for m in CATALOGUE]
    assert "\n".join(table) in (ROOT / "docs" / "metrics.md").read_text()  # committed as generated


def test_the_trainer_s_docstring_points_to_the_catalogue():
    from oblr_trl import OBLRPOTrainer

    assert "oblr_trl.metrics" in OBLRPOTrainer.__doc__


@pytest.mark.slow
def test_every_metric_a_tiny_training_step_logs_is_in_the_catalogue():
    """One optimizer step on the tiny model, with the options that log the most (the SNR step, a weight clip): each
    ``oblr/`` key in the log is a catalogue entry; an unknown name logged by the trainer raises, naming it."""
    from helpers import common_args, train

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1, weight_clip=10.0)))
    keys = {k for h in trainer.state.log_history for k in h if k.startswith("oblr/")}
    assert {"oblr/lr_scale", "oblr/lr", "oblr/baseline_mean", "oblr/clipped_weights"} <= keys
    assert keys <= {m.key for m in CATALOGUE}, keys - {m.key for m in CATALOGUE}
    with pytest.raises(KeyError, match="oblr_trl.metrics: no metric 'not_catalogued'"):
        trainer._log({"not_catalogued": 1.0})
