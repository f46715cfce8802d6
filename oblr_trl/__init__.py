"""oblr-trl: OBLR-PO (Optimal Baseline and Learning-Rate Policy Optimization, arXiv 2511.23310) for Hugging Face TRL.

Swap ``GRPOTrainer``/``GRPOConfig`` for :class:`OBLRPOTrainer`/:class:`OBLRPOConfig`.

This package is the trainer: the config, the estimators and their registries, the norms API and ``validate``. The
demo's helpers (the tiny model, the reasoning-gym tasks, the reference model, the demo's cards) live in their own room,
:mod:`oblr_trl.demo`, which this package never imports; ``oblr_trl.load_reference_model`` forwards there on first use.
"""

import importlib

from .config import OBLRPOConfig
from .estimators import (
    BASELINES,
    GRAD_NORM_ESTIMATORS,
    clip_weights,
    gradient_weighted_baseline,
    mean_baseline,
    register_baseline,
    register_weight_estimator,
)
from .grad_norms import (
    per_sequence_grad_inner_products,
    per_sequence_grad_sq_norms,
    register_grad_norm_rule,
    validate,
)
from .snr_formulas import (
    SNR_ESTIMATORS,
    gradient_signal_noise,
    gradient_snr,
    register_snr_estimator,
    snr_lr_scale,
    step_scale_from_contributions,
)
from .trainer import OBLRPOTrainer

__version__ = "0.1.0"

# Names that moved to the demo's room -> their module. `load_reference_model` still forwards (the README
# and users name it); the others say where they went.
_FORWARDED = {"load_reference_model": "oblr_trl.demo"}
_MOVED = {
    **{name: "oblr_trl.demo" for name in ("build_model", "build_tokenizer", "evaluate_accuracy", "extract_answer",
                                          "load_or_build_warm_model", "make_dataset", "make_reward_func",
                                          "resolve_model_path", "warmup_sft")},
    "plot_training": "oblr_trl.plotting",
}


def __getattr__(name: str):
    """``load_reference_model`` from the demo's room, imported on first use; a moved name says where it went."""
    if name in _FORWARDED:
        return getattr(importlib.import_module(_FORWARDED[name]), name)
    if name in _MOVED:
        raise AttributeError(f"oblr_trl.{name} moved to {_MOVED[name]} (the demo in its own room): "
                             f"from {_MOVED[name]} import {name}")
    raise AttributeError(f"module 'oblr_trl' has no attribute {name!r}")


__all__ = [
    "BASELINES",
    "GRAD_NORM_ESTIMATORS",
    "SNR_ESTIMATORS",
    "clip_weights",
    "OBLRPOConfig",
    "OBLRPOTrainer",
    "gradient_signal_noise",
    "gradient_snr",
    "gradient_weighted_baseline",
    "mean_baseline",
    "per_sequence_grad_inner_products",
    "per_sequence_grad_sq_norms",
    "register_baseline",
    "register_grad_norm_rule",
    "register_snr_estimator",
    "register_weight_estimator",
    "snr_lr_scale",
    "step_scale_from_contributions",
    "validate",
]
