"""Training curves from a `transformers` Trainer `state.log_history`.

No import-time side effects: matplotlib is imported inside `plot_training`, which draws on a `matplotlib.figure.Figure`
(never `pyplot`), so importing `oblr_trl` leaves the user's backend and open figures alone.
"""

from __future__ import annotations

import math
import os

from .extras import require
from .metrics import key as metric_key, legend


def _series(log_history: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for every log entry whose `key` holds a number.

    Entries without the key, or with `None` there (TRL logs `reward: None` for a step whose every reward is None) or a
    non-finite value, are skipped: a gap in the curve, never an error.
    """
    steps, values = [], []
    for i, entry in enumerate(log_history):
        value = entry.get(key)
        if value is None:
            continue
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            steps.append(entry.get("step", i))
            values.append(value)
    return steps, values


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (shorter at the start)."""
    return [sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def _draw(ax, steps: list[float], values: list[float], label: str) -> None:
    if len(values) >= 20:  # noisy per-step values: faint raw curve plus a trailing moving average
        (line,) = ax.plot(steps, values, alpha=0.3, linewidth=0.8)
        window = max(2, len(values) // 10)
        ax.plot(steps, _moving_average(values, window), color=line.get_color(), label=f"{label} (avg of {window})")
    else:
        ax.plot(steps, values, marker="o", markersize=3, label=label)


# (panel title, y label, [(log key, legend label), ...]): OBLR-PO's curves from the catalogue (.metrics.legend);
# a panel whose keys never appear is drawn empty with a note.
PANELS = [
    ("Reward", "mean reward of the step's completions", [("reward", "training reward")]),
    ("OBLR-PO step-size scale", "applied lr / scheduled lr", [legend("lr_scale"), legend("snr_factor")]),
    ("Applied learning rate", "learning rate", [legend("lr"), ("learning_rate", "learning_rate (schedule)"),
                                               legend("eta_max")]),
    ("Gradient SNR", "SNR", [legend("snr")]),
    ("Baseline vs reward", "reward", [legend("baseline_mean"), legend("reward_mean")]),
    ("Completion length", "tokens", [("completions/mean_length", "mean length")]),
]


def skipped_steps(log_history: list[dict]) -> tuple[list[float], list[float]]:
    """The steps that did not update the model: ``(equal, zero)``. ``equal``: every group's rewards were equal (TRL's
    ``frac_reward_zero_std`` is 1), so no completion had an advantage; ``zero``: the other steps at lr scale 0."""
    equal = [step for step, frac in zip(*_series(log_history, "frac_reward_zero_std")) if frac >= 1.0]
    scales = zip(*_series(log_history, metric_key("lr_scale")))
    zero = [step for step, scale in scales if scale == 0.0 and step not in equal]
    return equal, zero


def length_cap(log_history: list[dict]) -> tuple[float | None, float | None]:
    """``(cap, from_step)``: the completion-length cap seen in the log (the longest completion of a step where some
    were cut, ``completions/clipped_ratio`` > 0), and the first step from which every logged step's completions were
    all cut at it (None where the last step's were not)."""
    clipped = dict(zip(*_series(log_history, "completions/clipped_ratio")))
    longest = dict(zip(*_series(log_history, "completions/max_length")))
    cap = max((longest[s] for s, ratio in clipped.items() if ratio > 0 and s in longest), default=None)
    from_step = None
    for step, ratio in clipped.items():
        from_step = (from_step if from_step is not None else step) if ratio >= 1.0 else None
    return cap, from_step


def _mark_skipped(ax, log_history: list[dict]) -> bool:
    """Shade the steps that did not update the model, each kind with its legend label; whether any was shaded."""
    equal, zero = skipped_steps(log_history)
    for steps, label, shade in ((equal, "update skipped:\nevery group's rewards equal", "0.8"),
                                (zero, "update skipped: lr scale 0", "0.9")):
        for i, step in enumerate(steps):
            ax.axvspan(step - 0.5, step + 0.5, color=shade, zorder=0, label=label if i == 0 else None)
    return bool(equal or zero)


def _mark_cap(ax, log_history: list[dict], cap: float | None) -> bool:
    """Draw the length cap as a labelled line, and say from which step every completion sits at it."""
    seen, from_step = length_cap(log_history)
    cap = cap if cap is not None else seen
    if cap is None:
        return False
    ax.axhline(cap, color="tab:red", linestyle="--", linewidth=1, label=f"cap: max_completion_length = {cap:g}")
    ax.set_ylim(0, cap * 1.25)
    if from_step is not None:
        ax.text(0.02, 0.04, f"from step {from_step:g} every completion\nis cut at the cap: the length\nshows the cap, "
                "not the policy", transform=ax.transAxes, va="bottom", fontsize="small", color="tab:red")
    return True


def _panel(ax, panel: str, keys, log_history: list[dict], accuracy, last_step, cap) -> None:
    drawn = False
    for key, label in keys:
        steps, values = _series(log_history, key)
        if values:
            _draw(ax, steps, values, label)
            drawn = True
    if panel == "Reward" and accuracy:
        for (name, (before, after)), marker in zip(accuracy.items(), "sD^v", strict=False):
            ax.plot([0, last_step], [before, after], linestyle="--", marker=marker, markersize=7,
                    label=f"held-out {name}: {before:.0%} -> {after:.0%}")
        drawn = True
    if panel in ("Reward", "OBLR-PO step-size scale"):
        drawn = _mark_skipped(ax, log_history) or drawn
    if panel == "OBLR-PO step-size scale":
        _, scales = _series(log_history, metric_key("lr_scale"))
        if scales:
            zero = sum(s == 0 for s in scales) / len(scales)
            ax.text(0.02, 0.97, f"scale 0 (update skipped) on {zero:.0%} of {len(scales)} steps",
                    transform=ax.transAxes, va="top", fontsize="small")
            ax.set_ylim(-0.05, 1.1)
    if panel == "Completion length":
        drawn = _mark_cap(ax, log_history, cap) or drawn
    if drawn:  # below the axes: a legend inside would cover the curves
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title(panel)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel_of(panel))
    ax.grid(alpha=0.3)


def ylabel_of(panel: str) -> str:
    return next(ylabel for name, ylabel, _ in PANELS if name == panel)


def plot_training(
    log_history: list[dict],
    out_dir: str | os.PathLike,
    accuracy: dict[str, tuple[float, float]] | None = None,
    title: str | None = None,
    max_completion_length: int | None = None,
) -> list[str]:
    """Write `training_curves.png` into `out_dir`; return its path(s).

    Panels: reward, OBLR-PO's lr scale (with the fraction of steps it was 0, i.e. skipped), the applied learning rate,
    the gradient SNR, baseline vs reward, completion length; x axis: optimizer step. `accuracy` maps a label to a
    held-out accuracy `(before, after)` in [0, 1] (e.g. `{"greedy": (0.07, 0.41)}`): marked on the reward panel at
    the first and last step, so training reward and held-out accuracy share the axis. Missing keys are skipped (the
    panel says "not logged"); `None` or non-finite values are gaps.

    The steps that did not update the model are shaded on the reward and scale panels, labelled "update skipped"
    (every group's rewards equal, from TRL's `frac_reward_zero_std`, or lr scale 0). The length panel draws the cap
    (`max_completion_length`, else the one seen in the log where completions were cut) and says from which step every
    completion is cut at it: there the length shows the cap, not the policy. Legends sit below the panels.
    """
    Figure = require("matplotlib.figure", "matplotlib", "oblr_trl.plotting.plot_training").Figure

    os.makedirs(out_dir, exist_ok=True)
    fig = Figure(figsize=(14, 10), layout="constrained")
    axes = fig.subplots(2, 3)
    last_step = max([entry.get("step", 0) for entry in log_history] or [0])
    for ax, (panel, _, keys) in zip(axes.flat, PANELS, strict=True):
        _panel(ax, panel, keys, log_history, accuracy, last_step, max_completion_length)
    if title:
        fig.suptitle(title)
    path = os.path.join(out_dir, "training_curves.png")
    fig.savefig(path, dpi=100)
    return [path]
