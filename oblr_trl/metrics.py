"""The ``oblr/`` metrics OBLR-PO logs, each in one place: its name, what it is, what a healthy run shows, and the
labels the model card and the training plots give it.

Everything that names a metric reads :data:`CATALOGUE`: the trainer logs a name only through :func:`key`, which
refuses one missing here; the model card's table of the run (``card.RUN_METRICS``) and the plots
(``plotting.PANELS``) choose metrics by name and take their labels from here; the Logged metrics page's table
(``docs/metrics.md``) is generated from it (``python docs/generate.py``). The producers form them:
:meth:`.step_sizer.StepSizer.size` once per optimizer step, :func:`.estimators.baseline_metrics` once per generation
batch; TRL averages each over ``logging_steps``. Meanings and healthy ranges are Markdown, with links relative to
``docs/``.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "oblr/"


@dataclass(frozen=True)
class Metric:
    """One logged metric: ``name`` (logged as ``oblr/<name>``), ``meaning`` (what it is) and ``healthy`` (what a
    healthy run shows), as the Logged metrics page gives them; ``label``, its label in the model card's table of the
    run, and ``legend``, its label in the training plots (empty: the card or the plots do not show it)."""

    name: str
    meaning: str
    healthy: str
    label: str = ""
    legend: str = ""

    @property
    def key(self) -> str:
        """The log key, ``oblr/<name>``."""
        return PREFIX + self.name


CATALOGUE: tuple[Metric, ...] = (
    Metric("snr_factor",
           "The [SNR factor](glossary.md#snr-factor) `f = N·SNR / (1 + N·SNR)` of Theorem 4 for this optimizer "
           "step, from the step's SNR estimate (before `lr_scale_min`). Not logged for a step without an estimate "
           "(fewer than 2 samples, a zero or non-finite gradient).",
           "Between 0 and 1, rarely exactly 0 with the default `snr_estimator=\"ema_soft\"`. Measured at 8 prompts "
           "per step: 0.07-0.12 on the tiny demo, 0.13-0.37 on SmolLM2-135M with LoRA; it falls as training goes on "
           "(0.12 → 0.02 over 120 steps on SmolLM2).",
           label="SNR factor f = N·SNR/(1+N·SNR)", legend="SNR factor f"),
    Metric("lr_scale",
           "The applied lr over the scheduled `learning_rate`: `min(f / f_ref, 2)` by default "
           "(`snr_lr_mode=\"calibrated\"`, f_ref the mean factor of the first 10 steps, which apply 1), `f` itself "
           "with `snr_lr_mode=\"eta_max\"`; at least `lr_scale_min`.",
           "Calibrated: exactly 1 over the first 10 steps (0 where the factor is 0), then around 1, falling below "
           "it as the signal fades, never above 2. Below 0.01 for 10 steps in a row warns "
           "([`stalled`](troubleshooting.md#stalled)).",
           label="applied lr / scheduled lr", legend="lr scale"),
    Metric("eta_max",
           "[η_max](glossary.md#eta_max), the lr a step with factor 1 would apply: the scheduled `learning_rate` / "
           "f_ref (`snr_lr_mode=\"calibrated\"`; not logged before the first step with a factor above 0), the "
           "scheduled `learning_rate` itself with `\"eta_max\"`.",
           "Calibrated: 1/f_ref times `learning_rate`, several times it at 8 prompts per step (where f is "
           "0.06-0.43) and close to it at 128 (f 0.49-0.92); settled after the first 10 steps, then it follows the "
           "schedule. A value far above what the model tolerates for a clean step means noisy first steps (a small "
           "f_ref); the cap still holds each step to 2x `learning_rate`.",
           label="eta_max", legend="eta_max"),
    Metric("snr",
           "The step's gradient signal-to-noise ratio $\\lVert \\nabla J \\rVert^2 / \\operatorname{tr} \\Sigma$ "
           "per sample, as `snr_estimator` estimates it. Not logged for a step where it is undefined (fewer than 2 "
           "samples, a non-finite gradient).",
           "Small and positive: a mean of 0.03-0.06 on the SmolLM2 demo (N = 8). `N·SNR` near 1 means the step runs "
           "at about half of [η_max](glossary.md#eta_max). Exactly 0 under `\"per_step\"`, `\"ema\"` or "
           "`\"window\"` is a skipped step ([`zero_snr`](troubleshooting.md#zero_snr)).",
           label="gradient SNR", legend="SNR"),
    Metric("noise_scale",
           "The [gradient noise scale](glossary.md#noise-scale) $B = \\operatorname{tr} \\Sigma / \\lVert \\nabla J "
           "\\rVert^2 = 1 / \\mathrm{SNR}$, in samples: prompts where a sample is a group (`snr_sample_unit`, by "
           "default wherever a step holds at least 2 prompts). It is McCandlish et al.'s (2018) critical batch "
           "size, the prompts per step at which a step's noise equals its signal; the step's factor `oblr/lr_scale` "
           "is `N / (N + B)`, N = `oblr/num_samples`. Not logged for a step whose signal estimate is ≤ 0 (B "
           "unbounded: [`zero_snr`](troubleshooting.md#zero_snr), warned) or whose SNR is undefined: never inf or "
           "NaN.",
           "Read it against your prompts per step N. **N well below B** (N < B/3: factor under 0.25): steps are "
           "noise-dominated, the factor shrinks the lr; more prompts per step make each step count. **N near B**: "
           "the factor is about 0.5. **N well above B** (N > 3B: factor over 0.75): diminishing returns, extra "
           "prompts mostly cost time. It grows as the groups' rewards saturate: on SmolLM2-135M with LoRA, about 11 "
           "prompts at the start of the demo's one-digit sums and 131 after 15 steps; 39 and 82 on sums with "
           "two-digit terms. What to set from it: [Choosing the learning "
           "rate](how-it-works.md#choosing-the-learning-rate)."),
    Metric("lr",
           "The learning rate this optimizer step applied: the scheduled `learning_rate` × `oblr/lr_scale`.",
           "Calibrated: near `learning_rate` at the start, falling as the signal fades. If it sits far below what "
           "you would give GRPO, see [Choosing the learning rate](how-it-works.md#choosing-the-learning-rate).",
           label="applied lr", legend="applied lr"),
    Metric("lr_mean",
           "The mean applied lr over every step since the start of training (carried through a resume by the "
           "checkpoint's `oblr_state.json`).",
           "The number to compare with GRPO's lr. Calibrated: `learning_rate` itself over the first 10 steps (they "
           "apply it as scheduled; less only where a factor was 0), lower later as the signal fades. With "
           "`snr_lr_mode=\"eta_max\"`: f times `learning_rate` ([Choosing the learning "
           "rate](how-it-works.md#choosing-the-learning-rate))."),
    Metric("lr_scale_mean",
           "The mean of `oblr/lr_scale` since the start of training.",
           "With `snr_lr_mode=\"eta_max\"` (where it is the mean factor): 0.19-0.31 over the SmolLM2 demo's 3 seeds "
           "(15 steps), 0.05-0.10 over the tiny demo's (300 steps) (`benchmarks/results/demo_seeds_smollm2.md`, "
           "`demo_seeds.md`, 2026-11-24, 2-core CPU); a value near 0 says most steps barely moved "
           "([`stalled`](troubleshooting.md#stalled))."),
    Metric("skipped_fraction",
           "The fraction of optimizer steps since the start of training whose scale was exactly 0 (they did not "
           "move the model).",
           "About 0 with [`\"ema_soft\"`](glossary.md#ema_soft) (0.2% on the tiny demo); about 45% with the paper's "
           "`\"per_step\"` at 8 prompts per step. Steps of a batch whose rewards are all identical count here too "
           "([`zero_gradient`](troubleshooting.md#zero_gradient))."),
    Metric("num_samples",
           "N, the samples the step's SNR is estimated from: prompts per optimizer step "
           "(`snr_sample_unit=\"group\"`), or completions.",
           "Constant over the run, at least 2: the prompts per optimizer step. Fewer than 2 warns "
           "([`few_samples`](troubleshooting.md#few_samples)).",
           label="samples per step N"),
    Metric("baseline_mean",
           "The mean baseline `b_i` over the batch's scorable completions "
           "([leave-one-out](glossary.md#leave-one-out): each completion's own baseline).",
           "Close to `oblr/reward_mean`: a baseline is a weighted mean of its group's rewards. A persistent gap "
           "means the weights favour completions whose rewards differ from the rest.",
           label="baseline mean", legend="baseline mean"),
    Metric("reward_mean",
           "The mean reward over the batch's scorable completions (`None`, NaN and ±inf left out).",
           "Rising over training. Flat at 0 or 1 means no signal within groups "
           "([`zero_gradient`](troubleshooting.md#zero_gradient)).",
           legend="reward mean"),
    Metric("weight_spread",
           "The coefficient of variation (std / mean) of the baseline weights `w_i` over the batch's scorable "
           "completions.",
           "Of order 1. Far above it, a few completions carry the baseline; a group whose largest weight is 100x "
           "its median warns ([`weight_spread`](troubleshooting.md#weight_spread)) and `weight_clip` bounds it."),
    Metric("fallback_samples",
           "Completions whose baseline fell back to the plain mean of the rewards because their weights summed to 0.",
           "0, or a small count ([`fallback`](troubleshooting.md#fallback))."),
    Metric("clipped_weights",
           "Baseline weights capped at `weight_clip` x their group's median.",
           "0 without `weight_clip`; with it, a few per batch (many means the cap is doing the work: lower it with "
           "care)."),
    Metric("unscorable",
           "Completions without a usable reward (`None`, NaN or ±inf) or with a non-finite gradient norm: advantage "
           "0, in no baseline.",
           "0, or the share your verifier means to leave unscored ([`unscorable`](troubleshooting.md#unscorable))."),
)
_BY_NAME = {m.name: m for m in CATALOGUE}


def metric(name: str) -> Metric:
    """The catalogue's entry ``name`` (without the ``oblr/`` prefix); a name missing from it raises, naming the
    catalogue: a metric is logged, shown or documented only once it has its meaning and healthy range here."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"oblr_trl.metrics: no metric {name!r} in CATALOGUE (known: {sorted(_BY_NAME)}); add its "
                       "meaning and healthy range there, then run python docs/generate.py.") from None


def key(name: str) -> str:
    """``oblr/<name>`` for a metric of the catalogue (:func:`metric` refuses another)."""
    return metric(name).key


def labelled(names: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """``(log key, label)`` of the metrics ``names``, in that order: the model card's rows (``card.RUN_METRICS``)."""
    return [(metric(name).key, metric(name).label) for name in names]


def legend(name: str) -> tuple[str, str]:
    """``(log key, legend)`` of the metric ``name``: a curve of the training plots (``plotting.PANELS``)."""
    return metric(name).key, metric(name).legend
