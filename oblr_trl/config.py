"""`OBLRPOConfig`: `trl.GRPOConfig` plus the options of OBLR-PO (arXiv 2511.23310)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .estimators import BASELINES, GRAD_NORM_ESTIMATORS, weights_need
from .loss_terms import LOSS_TYPES, terms_beyond_ratio_one
from .snr_formulas import CALIBRATION_STEPS, MAX_LR_MULTIPLE, SNR_ESTIMATORS, check_estimator

SUPPORTED_LOSS_TYPES = LOSS_TYPES  # every TRL 1.16 loss type
SNR_SAMPLE_UNITS = ("auto", "group", "completion")
SNR_LR_MODES = ("calibrated", "eta_max")


def snr_samples_per_step(per_device_train_batch_size: int, gradient_accumulation_steps: int, num_processes: int,
                         num_generations: int, unit: str) -> int:
    """N, the samples an optimizer step gives the SNR estimate: its completions (`per_device_train_batch_size x
    gradient_accumulation_steps x num_processes`), divided by `num_generations` when a sample is a whole group
    (`unit="group"`: one prompt and its completions)."""
    completions = per_device_train_batch_size * gradient_accumulation_steps * num_processes
    return completions // num_generations if unit == "group" else completions


def resolve_snr_sample_unit(unit: str, prompts_per_step: int) -> str:
    """`"auto"` as `"group"` where an optimizer step holds at least 2 prompts (the paper's per-prompt estimate), else
    `"completion"` (one prompt: its completions are the only samples there are); other units unchanged."""
    if unit != "auto":
        return unit
    return "group" if prompts_per_step >= 2 else "completion"



def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"OBLRPOConfig.{name}={value!r} is not allowed; allowed values: {list(allowed)}.")


def _check_registered(registry, value) -> None:
    """``value`` against the names in ``registry`` (:class:`oblr_trl.registry.Registry`) at the time of the call, so
    a name a user registered is accepted; the error names the option and the allowed values."""
    try:
        registry.check(value)
    except ValueError as e:
        raise ValueError(f"OBLRPOConfig.{e}") from None


# OBLR-PO's own options and the type each must have: a string such as "false" is truthy, so it would act as True
_OPTION_TYPES = {"leave_one_out": "bool", "snr_lr": "bool", "one_backward": "bool or None", "snr_window": "int",
                 "lr_scale_min": "number", "snr_ema": "number", "weight_clip": "number or None",
                 "max_extra_memory_gib": "number or None"}


def _check_types(config) -> None:
    """Refuse a value of the wrong type for OBLR-PO's options (a string ``"false"`` for a bool, ``"10"`` for an int),
    naming the option, the value and what to pass instead."""
    for name, kind in _OPTION_TYPES.items():
        value = getattr(config, name)
        if value is None and kind.endswith("or None"):
            continue
        if kind.startswith("bool"):
            ok = isinstance(value, bool)
        else:
            ok = not isinstance(value, bool) and isinstance(value, int if kind == "int" else (int, float))
        if not ok:
            hint = f" (pass {name}={str(value).strip().lower() in ('true', '1', 'yes', 'y', 'on')}, not a string)" \
                if kind.startswith("bool") and isinstance(value, str) else ""
            raise ValueError(f"OBLRPOConfig.{name}={value!r} must be {_a(kind)}, not {_a(type(value).__name__)}{hint}.")


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


@dataclass
class OBLRPOConfig(GRPOConfig):
    r"""
    Configuration for [`OBLRPOTrainer`]: every option of `trl.GRPOConfig`, plus OBLR-PO's.

    OBLR-PO replaces GRPO's heuristics with two results of its theory:

    - the variance-optimal **gradient-weighted baseline** (Theorem 7), `b(q) = sum_i w_i r_i / sum_i w_i` with
      `w_i = ||grad log pi(o_i|q)||^2`, here in its leave-one-out form, without division by the reward std;
    - the **SNR-governed step size** (Theorem 4), `lr_t = eta_max * N SNR_t / (1 + N SNR_t)`, where `SNR_t` is
      estimated from the step's own samples.

    `learning_rate` is the lr you would give GRPO (default 1e-6, GRPO's default). With `snr_lr_mode="calibrated"`
    (the default) the run's first 10 steps apply `learning_rate` as scheduled while `f_ref`, the mean of their SNR
    factors `f = N SNR / (1 + N SNR)`, is measured; after them each step applies `learning_rate x f / f_ref`, at most
    2x `learning_rate` (eta_max = `learning_rate / f_ref`, logged as `oblr/eta_max`). Noisy steps are shorter than
    clean ones, and the step still shrinks when the signal fades later.
    `snr_lr_mode="eta_max"` is the paper's literal reading: `learning_rate` is eta_max and each step applies
    `learning_rate x f`. Check `oblr/lr_mean`, the mean applied lr. The rule and its measurements: docs, How it
    works, "Choosing the learning rate".

    Defaults differ from `GRPOConfig` where the paper's theory requires it: `scale_rewards="none"` (std scaling biases
    the gradient), `beta=0.0` and `num_iterations=1` (on-policy, unbiased updates).

    Parameters:
        baseline (`str`, defaults to `"gradient_weighted"`):
            `"gradient_weighted"` (Theorem 7) or `"mean"` (GRPO's group mean; RLOO's with `leave_one_out=True`).
        leave_one_out (`bool`, defaults to `True`):
            Leave each completion out of its own baseline, so the baseline does not depend on the sample it is
            subtracted from and the gradient estimate stays unbiased (Assumption 1).
        grad_norm_estimator (`str`, defaults to `"exact"`):
            Source of the weights `w_i`: `"exact"` computes `||grad log pi(o_i|q)||^2` from one extra forward and
            backward; `"logit"` uses verl's optimal-token-baseline proxy `sum_t (1 - 2 pi_t + sum_v pi_v^2)` from one
            extra forward without backward; `"length"` uses verl OPO's proxy `w_i = |o_i|` (no extra pass). With
            `snr_lr=True` the exact per-sequence gradients are computed anyway (the SNR needs them): the proxies
            then change the baseline only, and save work only with `snr_lr=False`.
        snr_lr (`bool`, defaults to `True`):
            Scale each optimizer step's learning rate by its SNR factor `N SNR / (1 + N SNR)` (Theorem 4), as
            `snr_lr_mode` says.
        snr_lr_mode (`str`, defaults to `"calibrated"`):
            What `learning_rate` means. `"calibrated"`: the lr you would give GRPO. The run's first 10 steps (from the
            first step with a factor above 0) apply it as scheduled while `f_ref`, their mean factor, is measured;
            after them each step applies `learning_rate x min(f / f_ref, 2)`. eta_max is `learning_rate / f_ref`,
            logged as `oblr/eta_max`. `"eta_max"`: the paper's reading; `learning_rate` is eta_max and each step
            applies `learning_rate x f`.
        snr_sample_unit (`str`, defaults to `"auto"`):
            What counts as one i.i.d. sample in the SNR estimate: `"group"` (a prompt with its completions, which share
            a leave-one-out baseline and are therefore correlated; `N` = number of prompts per optimizer step, which
            must be >= 2: a config with fewer is refused at construction) or `"completion"` (`N` = number of
            completions; misestimates the noise when completions are correlated). `"auto"` is resolved at
            construction (the field then holds the result): `"group"` where an optimizer step holds >= 2 prompts,
            else `"completion"` with a warning naming the options that give more prompts. TRL's defaults
            (`per_device_train_batch_size=8`, `num_generations=8`: one prompt per step) thus keep a sized step.
        lr_scale_min (`float`, defaults to `0.0`):
            Floor of the step-size factor, a guard against the step collapsing when the SNR is ~0 for many steps. The
            paper has no floor (0.0).
        weight_clip (`float` or `None`, defaults to `None`):
            Cap each baseline weight at this multiple of its group's median weight: a guard against the baseline
            following one or two completions when gradient norms vary wildly. `None` (no cap) is the paper's baseline.
        snr_estimator (`str`, defaults to `"ema_soft"`):
            How the SNR of each step is estimated (see `oblr_trl.snr_formulas`). `"ema"`: bias-corrected exponential
            moving averages of the signal and of the noise estimates, divided only then (McCandlish et al.);
            `"ema_soft"`: the same, with the averaged signal's clipping at 0 replaced by its expected positive part
            given its standard error (a small step instead of none where the signal is indistinguishable from 0);
            `"window"`: their mean over the last `snr_window` steps; `"per_step"`: this step's samples only, as in
            the paper, whose signal estimate is below 0 (scale 0: the step is skipped) on about half the steps when
            a step has few prompts.
        snr_ema (`float`, defaults to `0.9`):
            Smoothing factor of `snr_estimator="ema"` and `"ema_soft"` (an effective window of
            `(1 + snr_ema) / (1 - snr_ema)` steps); ignored by the other estimators.
        snr_window (`int`, defaults to `10`):
            Steps pooled by `snr_estimator="window"`; ignored by the other estimators.
        one_backward (`bool` or `None`, defaults to `None`):
            Take the per-sequence norms and the policy update from a single forward and backward instead of a norms
            pass and then TRL's loss pass (same result, tested; about one pass less). `None` (default): automatic,
            by counted cost, the choice logged once with its reason; `True`: used wherever valid (a warning says why
            where it is not); `False`: never. Valid where each completion's per-token loss coefficient is constant
            (on-policy: `num_iterations=1`, `beta=0`, no vLLM importance-sampling correction, no token masks, no
            entropy bonus or router auxiliary loss), on one process, DDP or FSDP2 (not FSDP1); with gradient
            accumulation `steps_per_generation` must divide `gradient_accumulation_steps`, and where a generation spans
            several micro-batches `per_device_train_batch_size` must be a multiple of `num_generations`
            (micro-batches are then re-split into whole groups). Memory: it keeps each layer's input and output
            gradient (or, where smaller, its per-sample gradients) until the update is formed, as a backward without
            gradient checkpointing does, so under checkpointing it may run a micro-batch in chunks of whole groups
            (same result, tested). The automatic choice is made once, at the first generation, on any device, from
            the FLOPs and peak bytes `oblr_trl/cost_model.py` predicts for each path and the memory the device has
            free, and logged with its reason and predicted cost. Its rule lives in one module,
            `oblr_trl/path_choice.py`: summarised in
            [How it works](how-it-works.md#one_backward-norms-and-update-from-one-backward), in full in the
            [API reference](api.md#the-path-each-step-takes). `True` takes the rule's chunk, or one group at a time
            where none fits.
        max_extra_memory_gib (`float` or `None`, defaults to `None`):
            The most memory (GiB) the automatic choice may add to GRPO's predicted peak to take `one_backward`.
            `None`: what the device (a GPU, or the CPU's host memory) has free decides; `0`: never more than GRPO's
            peak. Must be `None` or >= 0.
    """

    baseline: str = field(
        default="gradient_weighted",
        metadata={
            "help": "Baseline subtracted from the rewards: 'gradient_weighted' (default; the variance-optimal "
            "baseline of Theorem 7, weighted by ||grad log pi||^2) or 'mean' (GRPO's group mean, RLOO's with "
            "leave_one_out).",
            "choices": BASELINES,  # the registry itself: entries registered later are allowed too
        },
    )
    leave_one_out: bool = field(
        default=True,
        metadata={
            "help": "Leave each completion out of its own baseline (default True): the baseline then does not depend "
            "on the sample, which keeps the policy gradient unbiased (Assumption 1)."
        },
    )
    grad_norm_estimator: str = field(
        default="exact",
        metadata={
            "help": "Source of the baseline weights w_i: 'exact' (default; ||grad log pi(o_i|q)||^2 from one extra "
            "forward/backward, per-sample norms by ghost-norm rules), 'logit' (verl's optimal-token-baseline proxy "
            "sum_t (1 - 2 pi_t + sum pi^2), one forward without backward) or 'length' (verl OPO's proxy w_i = |o_i|).",
            "choices": GRAD_NORM_ESTIMATORS,  # live, as above
        },
    )
    snr_lr: bool = field(
        default=True,
        metadata={
            "help": "Scale each step's learning rate by its SNR factor N*SNR/(1+N*SNR) (Theorem 4; default True), as "
            "snr_lr_mode says."
        },
    )
    snr_lr_mode: str = field(
        default="calibrated",
        metadata={
            "help": f"What learning_rate means under snr_lr=True: 'calibrated' (default; the lr you would give GRPO: "
            f"the first {CALIBRATION_STEPS} steps apply it while f_ref, their mean SNR factor, is measured, then each "
            f"step applies learning_rate x f/f_ref, at most {MAX_LR_MULTIPLE:g}x learning_rate; eta_max = "
            "learning_rate/f_ref is logged as oblr/eta_max) or 'eta_max' (the paper's reading: learning_rate is "
            "eta_max, each step applies learning_rate x f).",
            "choices": list(SNR_LR_MODES),
        },
    )
    snr_sample_unit: str = field(
        default="auto",
        metadata={
            "help": "What the SNR estimate counts as one independent sample: 'group' (a prompt and its completions, "
            "the paper's N = number of prompts; needs >= 2 prompts per optimizer step), 'completion' (misestimates "
            "correlated noise) or 'auto' (default; resolved at construction: 'group' with >= 2 prompts per step, else "
            "'completion', e.g. TRL's defaults of 8 completions, 8 per prompt).",
            "choices": list(SNR_SAMPLE_UNITS),
        },
    )
    lr_scale_min: float = field(
        default=0.0,
        metadata={
            "help": "Floor of the step-size factor in [0, 1] (default 0.0, as in the paper). Set e.g. 0.05 to keep "
            "learning when the SNR is ~0 for long stretches (the 'step collapse' failure mode)."
        },
    )
    snr_estimator: str = field(
        default="ema_soft",
        metadata={
            "help": "SNR estimate behind the step size: 'ema' (bias-corrected moving averages of the signal and noise "
            "estimates, divided only then), 'ema_soft' (default; the same, with the signal's clipping at 0 replaced "
            "by its expected positive part: no skipped steps), 'window' (their mean over the last snr_window steps) or "
            "'per_step' (the paper's: this step only; with few prompts per step it skips about half the steps).",
            "choices": SNR_ESTIMATORS,  # live, as above
        },
    )
    snr_ema: float = field(
        default=0.9,
        metadata={
            "help": "Smoothing factor in [0, 1) of snr_estimator='ema'/'ema_soft' (default 0.9: an effective window "
            "of 19 steps). Ignored by the other estimators."
        },
    )
    snr_window: int = field(
        default=10,
        metadata={"help": "Steps pooled by snr_estimator='window' (default 10). Ignored by the other estimators."},
    )
    one_backward: bool | None = field(
        default=None,
        metadata={
            "help": "Norms and update from one forward/backward instead of a norms pass then TRL's loss pass (same "
            "result, one pass less). Default None: automatic, chosen once at the first generation by the rule of "
            "oblr_trl/path_choice.py from the predicted cost and the device's free memory, and logged with its reason. "
            "True: wherever valid; False: never."
        },
    )
    max_extra_memory_gib: float | None = field(
        default=None,
        metadata={
            "help": "The most device memory (GiB) OBLR-PO's automatic choice (one_backward=None) may add to GRPO's "
            "predicted peak to take one_backward. Default None: the memory the device (a GPU, or the CPU's host "
            "memory) has free decides, by the rule of oblr_trl/path_choice.py (see one_backward); 0: never more than "
            "GRPO's peak. The choice, its reason, predicted time and bytes are logged once."
        },
    )

    weight_clip: float | None = field(
        default=None,
        metadata={
            "help": "Cap each baseline weight w_i at weight_clip x the median weight of its group (default None: no "
            "cap, as in the paper). A guard for the 'baseline explosion' failure mode, where wildly varying gradient "
            "norms make the baseline follow one or two completions; e.g. 10."
        },
    )

    learning_rate: float = field(
        default=1e-6,
        metadata={
            "help": "Set it to the lr you would give GRPO (default 1e-6, GRPO's default). With snr_lr_mode='calibrated' "
            f"(default) the first {CALIBRATION_STEPS} steps apply it as scheduled while f_ref, the mean of their SNR "
            "factors f = N*SNR/(1+N*SNR), is measured; after them each step applies learning_rate x f/f_ref, at most "
            f"{MAX_LR_MULTIPLE:g}x learning_rate (oblr/lr_mean is the mean applied lr, oblr/eta_max = "
            "learning_rate/f_ref). With snr_lr_mode='eta_max' it is eta_max, the largest step, and each step applies "
            "learning_rate x f."
        },
    )

    # Paper defaults that differ from GRPOConfig's.
    scale_rewards: str = field(
        default="none",
        metadata={
            "help": "Reward scaling. OBLR-PO default 'none': dividing by the group's reward std biases the gradient. "
            "'group'/'batch' are accepted only with baseline='mean', leave_one_out=False (plain GRPO, for ablations)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        _check_types(self)
        _check_registered(BASELINES, self.baseline)
        _check_registered(GRAD_NORM_ESTIMATORS, self.grad_norm_estimator)
        _check_choice("snr_sample_unit", self.snr_sample_unit, SNR_SAMPLE_UNITS)
        _check_choice("snr_lr_mode", self.snr_lr_mode, SNR_LR_MODES)
        if not self.learning_rate >= 0:
            raise ValueError(f"OBLRPOConfig.learning_rate={self.learning_rate} must be >= 0.")
        self._resolve_snr_sample_unit()
        _check_choice("loss_type", self.loss_type, SUPPORTED_LOSS_TYPES)
        if not 0.0 <= self.lr_scale_min <= 1.0:
            raise ValueError(f"OBLRPOConfig.lr_scale_min={self.lr_scale_min} must lie in [0, 1].")
        if self.torch_compile and needs_norms(self):
            raise ValueError(
                "OBLRPOConfig.torch_compile=True is not supported while OBLR-PO computes per-sequence gradient norms "
                "(snr_lr=True, or grad_norm_estimator='exact' with a weighted baseline): their pass hooks every "
                "layer's input and output gradient and calls the backbone and head itself, which a compiled model's "
                "graph would bypass or break. Allowed values: torch_compile=False (the default); or snr_lr=False with "
                "grad_norm_estimator='logit' or 'length' (no norms).")
        if self.max_extra_memory_gib is not None and not self.max_extra_memory_gib >= 0:
            raise ValueError(f"OBLRPOConfig.max_extra_memory_gib={self.max_extra_memory_gib} is not allowed; allowed "
                             "values: None (the device's free memory decides) or a number of GiB >= 0.")
        if self.weight_clip is not None and not self.weight_clip >= 1.0:
            raise ValueError(f"OBLRPOConfig.weight_clip={self.weight_clip} must be None or >= 1.")
        if not 0.0 <= self.snr_ema < 1.0:
            raise ValueError(f"OBLRPOConfig.snr_ema={self.snr_ema} must lie in [0, 1).")
        try:
            check_estimator(self.snr_estimator, self.snr_ema, self.snr_window)
        except ValueError as e:
            raise ValueError(f"OBLRPOConfig.{e}") from None
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "OBLRPOConfig.multi_objective_aggregation must be 'sum_then_normalize': 'normalize_then_sum' "
                "standardizes each reward per group, which the OBLR-PO baseline does not cover."
            )
        if self.scale_rewards != "none" and (self.baseline != "mean" or self.leave_one_out):
            raise ValueError(
                f"OBLRPOConfig.scale_rewards={self.scale_rewards!r} is only allowed with baseline='mean' and "
                "leave_one_out=False (plain GRPO); OBLR-PO's theory uses unscaled advantages: set scale_rewards='none'."
            )
        self._warn_where_approximate()

    def _warn_where_approximate(self) -> None:
        """Options TRL allows whose gradient the SNR estimate or the baseline weights do not fully cover
        (:func:`.loss_terms.terms_beyond_ratio_one`, and a generation spanning optimizer steps): warned."""
        messages = {
            "num_iterations": f"OBLRPOConfig.num_iterations={self.num_iterations} > 1: updates after the first are "
            "off-policy (importance ratio != 1, clipping); the SNR uses on-policy per-sample norms and is approximate "
            "there.",
            "beta": f"OBLRPOConfig.beta={self.beta}: the KL term's gradient is not part of the SNR estimate (the "
            "paper's theory has no KL term).",
            "token_masks": "top_entropy_quantile < 1 or off_policy_mask_threshold masks tokens out of the loss; the "
            "baseline weights and the SNR use every completion token.",
            "entropy": "OBLRPOConfig: an entropy bonus (entropy_coef / use_adaptive_entropy) adds a term to the "
            "gradient that the SNR estimate does not include (the paper's theory has none); the step size is "
            "approximate.",
        }
        for key in terms_beyond_ratio_one(self):
            warnings.warn(messages[key], stacklevel=3)
        if self.steps_per_generation > self.gradient_accumulation_steps:
            warnings.warn(
                f"OBLRPOConfig.steps_per_generation={self.steps_per_generation} > gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}: one generation spans several optimizer steps, so later steps "
                "use completions sampled before the last update (importance ratio != 1); the baseline weights and "
                "per-sample SNR terms come from generation time and are approximate there.",
                stacklevel=3,
            )

    def _resolve_snr_sample_unit(self) -> None:
        """Resolve `snr_sample_unit="auto"`, and refuse a step the SNR cannot size (fewer than 2 samples)."""
        if not self.snr_lr:
            return
        shape = (self.per_device_train_batch_size, self.gradient_accumulation_steps, self.world_size,
                 self.num_generations)
        prompts = snr_samples_per_step(*shape, "group")
        how = (f"per_device_train_batch_size={shape[0]} x gradient_accumulation_steps={shape[1]} x {shape[2]} "
               f"process(es) / num_generations={shape[3]}")
        more = "raise per_device_train_batch_size or gradient_accumulation_steps, or lower num_generations"
        unit = resolve_snr_sample_unit(self.snr_sample_unit, prompts)
        if unit == "group" and prompts < 2:
            raise ValueError(
                f"OBLRPOConfig.snr_sample_unit='group' needs >= 2 prompts per optimizer step, got {prompts} ({how}): "
                f"the SNR step size (snr_lr=True) cannot be sized. To size it, {more}; or set "
                f"snr_sample_unit='completion' or 'auto' (allowed values: {list(SNR_SAMPLE_UNITS)}); or snr_lr=False."
            )
        if self.snr_sample_unit == "auto" and unit == "completion":
            warnings.warn(
                f"OBLRPOConfig: {prompts} prompt(s) per optimizer step ({how}), so the SNR step size counts each of its "
                f"{snr_samples_per_step(*shape, 'completion')} completions as a sample (snr_sample_unit='auto' -> "
                f"'completion'). For the paper's per-prompt estimate give each step >= 2 prompts: {more}.",
                stacklevel=3,
            )
        self.snr_sample_unit = unit


def upgrade_config(args: GRPOConfig) -> OBLRPOConfig:
    """An ``OBLRPOConfig`` with every option of a ``GRPOConfig`` (what a drop-in ``OBLRPOTrainer`` is handed).

    OBLR-PO's options take their defaults; ``learning_rate`` is kept as it is: under the default
    ``snr_lr_mode="calibrated"`` it means what it means to GRPO (the run's first steps apply it). One GRPO
    option conflicts with the theory and is replaced, with a warning:
    ``scale_rewards`` (GRPO's default ``"group"``) becomes ``"none"`` (dividing by the group's reward std biases the
    gradient). ``multi_objective_aggregation="normalize_then_sum"`` is refused (the baseline does not cover it).
    """
    if isinstance(args, OBLRPOConfig):
        return args
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    values["generation_batch_size"] = None  # derived again from steps_per_generation (both set is an error)
    if values.get("scale_rewards") not in ("none", False):
        warnings.warn(
            f"OBLRPOTrainer got a GRPOConfig with scale_rewards={values['scale_rewards']!r}: OBLR-PO uses unscaled "
            "advantages (std scaling biases the gradient), so scale_rewards='none'. For plain GRPO as an ablation pass "
            "OBLRPOConfig(baseline='mean', leave_one_out=False, snr_lr=False, scale_rewards='group').",
            stacklevel=3,
        )
        values["scale_rewards"] = "none"
    return OBLRPOConfig(**values)


def config_for(args: GRPOConfig | None, model) -> OBLRPOConfig:
    """The trainer's config: ``args`` upgraded (:func:`upgrade_config`), or, with none, the defaults with the output
    directory ``<model name>-OBLR-PO`` (as TRL names its own)."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        args = OBLRPOConfig(f"{name.rstrip('/').split('/')[-1]}-OBLR-PO")
    return upgrade_config(args)


def needs_norms(args: OBLRPOConfig) -> bool:
    """Whether the run needs per-sequence gradient norms: for the SNR step, or for gradient-weighted baseline weights
    formed from the norms."""
    return args.snr_lr or weights_need(args.baseline, args.grad_norm_estimator) == "norms"  # as the entries declare
