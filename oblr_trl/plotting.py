"""Training curves from a `transformers` Trainer `state.log_history`."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

# (panel title, [(log key, legend label), ...]); a panel whose keys never appear is drawn empty with a note.
PANELS = [
    ("Reward", [("reward", "reward")]),
    ("OBLR-PO step-size scale", [("oblr/lr_scale", "lr scale")]),
    ("Gradient SNR", [("oblr/snr", "SNR")]),
    ("Baseline vs reward", [("oblr/baseline_mean", "baseline mean"), ("oblr/reward_mean", "reward mean")]),
]


def _series(log_history: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for every log entry that has `key`."""
    points = [(entry.get("step", i), entry[key]) for i, entry in enumerate(log_history) if key in entry]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (shorter at the start)."""
    return [sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def plot_training(log_history: list[dict], out_dir: str | os.PathLike) -> list[str]:
    """Write `training_curves.png` (reward, lr scale, SNR, baseline vs reward) into `out_dir`; return its path(s).

    Missing keys are skipped: their panel says "not logged" instead of failing.
    """
    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
        drawn = False
        for key, label in keys:
            steps, values = _series(log_history, key)
            if len(values) >= 20:  # noisy per-step values: faint raw curve plus a trailing moving average
                (line,) = ax.plot(steps, values, alpha=0.3, linewidth=0.8)
                window = max(2, len(values) // 10)
                ax.plot(steps, _moving_average(values, window), color=line.get_color(), label=f"{label} (avg {window})")
                drawn = True
            elif values:
                ax.plot(steps, values, marker="o", markersize=3, label=label)
                drawn = True
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    path = os.path.join(out_dir, "training_curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
