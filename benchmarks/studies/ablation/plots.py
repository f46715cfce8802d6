"""The ablation's plots: step size, reward, held-out accuracy and the paired differences; the long runs."""

from __future__ import annotations

import statistics
from pathlib import Path

from .design import ARMS, PRIMARY, TITLES


def plot(curves: dict, contrasts: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 10), layout="constrained")  # 2 x 2: each panel readable at a page's width
    axes = fig.subplots(2, 2).ravel()
    palette = dict(zip(ARMS, ("tab:red", "tab:gray", "tab:green", "tab:orange", "tab:blue", "tab:purple", "tab:cyan")))
    for arm, c in curves.items():
        if c["lr_scale"]:
            axes[0].plot(list(c["lr_scale"]), list(c["lr_scale"].values()), color=palette[arm], label=arm)
        axes[1].plot(list(c["reward"]), list(c["reward"].values()), color=palette[arm], label=arm)
        axes[2].plot(list(c["greedy"]), list(c["greedy"].values()), marker="o", color=palette[arm], label=arm)
    axes[0].set(xlabel="optimizer step", ylabel="lr scale (SNR factor), seed mean", title="step size")
    axes[1].set(xlabel="optimizer step", ylabel="training reward, seed mean", title="reward")
    axes[2].set(xlabel="optimizer step", ylabel="held-out greedy accuracy (%), seed mean", title="held-out")
    metric = PRIMARY if any(c[PRIMARY]["n"] for c in contrasts) else "greedy"
    shown = [c for c in contrasts if c[metric]["n"]]
    for i, c in enumerate(shown):
        d = c[metric]
        axes[3].scatter(d["diffs"], [i] * len(d["diffs"]), color=palette[c["a"]], alpha=0.6)
        if d["ci"]:
            axes[3].errorbar([d["mean"]], [i], xerr=[[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]],
                             color="black", capsize=4, marker="|")
    axes[3].axvline(0, color="gray", linestyle="--")
    axes[3].set_yticks(range(len(shown)), [f"{c['a']} ({c['lr_a']:.2g}) - {c['b']} ({c['lr_b']:.2g})" for c in shown],
                       fontsize=9)
    axes[3].set(xlabel=f"{TITLES[metric]} difference, same seed (pts)", title="paired differences, 95% CI")
    for ax in axes[:3]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    axes[3].grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def plot_long(runs: list[dict], path: Path, title: str) -> None:
    """The long runs: applied lr, training reward (10-step running mean) and held-out accuracy against the step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    palette = dict(zip(ARMS, ("tab:red", "tab:gray", "tab:green", "tab:orange", "tab:blue", "tab:purple", "tab:cyan")))
    for r in sorted(runs, key=lambda r: (r["seed"], r["arm"])):
        label, color = f"{r['arm']} seed {r['seed']}", palette[r["arm"]]
        steps = [e["step"] for e in r["history"]]
        applied = [r["lr"] * (e.get("oblr/lr_scale") if e.get("oblr/lr_scale") is not None else 1.0)
                   for e in r["history"]]
        reward = [e.get("reward") or 0.0 for e in r["history"]]
        smooth = [statistics.mean(reward[max(0, i - 9):i + 1]) for i in range(len(reward))]
        axes[0].plot(steps, applied, color=color, label=label)
        axes[1].plot(steps, smooth, color=color, label=label)
        curve = r.get("curve", [])
        axes[2].plot([c["step"] for c in curve], [100 * c["accuracy"] for c in curve], marker="o", color=color,
                     label=f"{label}, greedy")
        axes[2].plot([c["step"] for c in curve], [100 * c["sampled_accuracy"] for c in curve], marker="x",
                     linestyle="--", color=color, label=f"{label}, sampled")
    axes[0].set(xlabel="optimizer step", ylabel="applied lr (eta_max x SNR factor)", yscale="log", title="step size")
    axes[1].set(xlabel="optimizer step", ylabel="training reward (10-step running mean)", title="reward")
    axes[2].set(xlabel="optimizer step", ylabel="held-out accuracy, 100 problems (%)", title="held-out")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
