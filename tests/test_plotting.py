"""oblr_trl.plotting: no import-time side effects, None-safe series, labelled axes, held-out accuracy marked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oblr_trl.plotting import PANELS, _series, plot_training


def _history(n=6):
    history = [
        {"step": s, "reward": 0.1 * s, "oblr/lr_scale": 0.0 if s % 3 == 0 else 0.5, "oblr/lr": 1e-3 * (s % 3 != 0),
         "learning_rate": 1e-3, "oblr/snr": 0.05, "oblr/baseline_mean": 0.1, "oblr/reward_mean": 0.1 * s,
         "completions/mean_length": 7.0}
        for s in range(1, n + 1)
    ]
    history[2]["reward"] = None  # TRL logs this when every reward of the step is None
    return history


def test_importing_oblr_trl_leaves_matplotlib_alone():
    # (reasoning-gym's dependencies import pyplot, which is harmless; switching the backend is not)
    for code in (
        "import matplotlib; matplotlib.use('svg'); import oblr_trl; import matplotlib.pyplot as plt; "
        "print(plt.get_backend())",
        "import matplotlib; before = dict.__getitem__(matplotlib.rcParams, 'backend'); import oblr_trl; "
        "print(before == dict.__getitem__(matplotlib.rcParams, 'backend'))",
    ):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() in ("svg", "True"), proc.stdout


def test_plotting_does_not_touch_pyplot_state():
    plt = pytest.importorskip("matplotlib.pyplot")
    backend, open_figures = plt.get_backend(), plt.get_fignums()
    # (drawn in a temporary folder by the next test too; here only the global state matters)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        plot_training(_history(), out)
    assert plt.get_backend() == backend and plt.get_fignums() == open_figures


def test_series_skips_none_and_non_finite():
    history = [{"step": 1, "reward": 0.5}, {"step": 2, "reward": None}, {"step": 3}, {"step": 4, "reward": float("nan")},
               {"step": 5, "reward": "0.25"}]
    assert _series(history, "reward") == ([1, 5], [0.5, 0.25])


def test_plot_with_none_rewards_accuracy_and_labels(tmp_path):
    from matplotlib.figure import Figure

    captured = []
    original = Figure.savefig

    def spy(self, *args, **kwargs):
        captured.append(self)
        return original(self, *args, **kwargs)

    Figure.savefig = spy
    try:
        paths = plot_training(_history(), tmp_path, accuracy={"greedy": (0.07, 0.41), "sampled": (0.02, 0.30)})
    finally:
        Figure.savefig = original
    assert paths == [str(tmp_path / "training_curves.png")] and (tmp_path / "training_curves.png").stat().st_size > 0
    axes = captured[0].axes
    assert [ax.get_title() for ax in axes] == [p[0] for p in PANELS]
    assert all(ax.get_xlabel() == "optimizer step" and ax.get_ylabel() for ax in axes)
    reward_legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert "held-out greedy: 7% -> 41%" in reward_legend and "held-out sampled: 2% -> 30%" in reward_legend
    held_out = [line for line in axes[0].get_lines() if line.get_label().startswith("held-out greedy")][0]
    assert list(held_out.get_xdata()) == [0, 6] and list(held_out.get_ydata()) == [0.07, 0.41]
    # steps 3 and 6 have scale 0: 2 of 6
    assert any("scale 0 (update skipped) on 33% of 6 steps" == t.get_text() for t in axes[1].texts)
    applied = [line for line in axes[2].get_lines() if line.get_label().startswith("applied lr")][0]
    assert list(applied.get_ydata()) == [1e-3, 1e-3, 0.0, 1e-3, 1e-3, 0.0]


def test_plot_empty_history(tmp_path):
    assert plot_training([], tmp_path) == [str(tmp_path / "training_curves.png")]


def _demo_like_history():
    """15 steps as the SmolLM2 demo logs them: steps 9 and 13 with every group's rewards equal (scale 0), every
    completion cut at the 8-token cap from step 6."""
    return [{"step": s, "reward": 0.3 + 0.03 * s, "frac_reward_zero_std": 1.0 if s in (9, 13) else 0.5,
             "oblr/lr_scale": 0.0 if s in (9, 13) else 0.2, "oblr/lr": 0.0 if s in (9, 13) else 2e-4,
             "learning_rate": 1e-3, "oblr/snr": 0.03, "oblr/baseline_mean": 0.3, "oblr/reward_mean": 0.3 + 0.03 * s,
             "completions/mean_length": 8.0 if s >= 6 else 7.8, "completions/max_length": 8.0,
             "completions/clipped_ratio": 1.0 if s >= 6 else 0.7} for s in range(1, 16)]


def _drawn_axes(history, tmp_path, **kw):
    from matplotlib.figure import Figure

    captured, original = [], Figure.savefig

    def spy(self, *args, **kwargs):
        captured.append(self)
        return original(self, *args, **kwargs)

    Figure.savefig = spy
    try:
        plot_training(history, tmp_path, **kw)
    finally:
        Figure.savefig = original
    return captured[0].axes


def test_skipped_steps_and_the_length_cap_are_read_from_the_log():
    from oblr_trl.plotting import length_cap, skipped_steps

    history = _demo_like_history()
    assert skipped_steps(history) == ([9, 13], [])
    assert length_cap(history) == (8.0, 6)
    history[-1]["completions/clipped_ratio"] = 0.5  # the last step's completions not all cut: no "from step"
    assert length_cap(history) == (8.0, None)
    assert skipped_steps([{"step": 1, "oblr/lr_scale": 0.0}]) == ([], [1])  # scale 0 for another reason
    assert length_cap([{"step": 1, "completions/mean_length": 5.0}]) == (None, None)


def test_the_figure_labels_skipped_steps_and_the_cap_and_keeps_legends_off_the_curves(tmp_path):
    axes = _drawn_axes(_demo_like_history(), tmp_path, accuracy={"greedy": (0.5, 0.69)}, max_completion_length=8)
    reward, scale, length = axes[0], axes[1], axes[5]
    for ax in (reward, scale):  # the steps with no signal, shaded and labelled
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "update skipped:\nevery group's rewards equal" in labels
        assert len(ax.patches) == 2  # steps 9 and 13
    cap = [line for line in length.get_lines() if line.get_label().startswith("cap: max_completion_length = 8")]
    assert cap and list(cap[0].get_ydata()) == [8, 8]
    assert any("from step 6 every completion" in t.get_text() and "not the policy" in t.get_text() for t in length.texts)
    for ax in axes:  # every legend lies below its panel, so none covers a curve
        legend = ax.get_legend()
        if legend is not None:
            anchor = legend.get_bbox_to_anchor().transformed(ax.transAxes.inverted())
            assert anchor.y0 < 0, ax.get_title()
