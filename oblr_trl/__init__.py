"""oblr-trl: OBLR-PO (Optimal Baseline and Learning-Rate Policy Optimization, arXiv 2511.23310) for Hugging Face TRL.

Swap ``GRPOTrainer``/``GRPOConfig`` for :class:`OBLRPOTrainer`/:class:`OBLRPOConfig`.
"""

from .config import OBLRPOConfig
from .estimators import (
    BASELINES,
    GRAD_NORM_ESTIMATORS,
    clip_weights,
    gradient_signal_noise,
    gradient_snr,
    gradient_weighted_baseline,
    mean_baseline,
    register_baseline,
    register_weight_estimator,
    snr_lr_scale,
    step_scale_from_contributions,
)
from .grad_norms import (
    per_sequence_grad_inner_products,
    per_sequence_grad_sq_norms,
    register_grad_norm_rule,
    validate,
)
from .plotting import plot_training
from .step_size import SNR_ESTIMATORS, register_snr_estimator
from .reference_model import load_reference_model, resolve_model_path
from .tasks import evaluate_accuracy, extract_answer, make_dataset, make_reward_func
from .tiny import build_model, build_tokenizer, load_or_build_warm_model, warmup_sft
from .trainer import OBLRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "BASELINES",
    "GRAD_NORM_ESTIMATORS",
    "SNR_ESTIMATORS",
    "build_model",
    "build_tokenizer",
    "clip_weights",
    "evaluate_accuracy",
    "extract_answer",
    "load_or_build_warm_model",
    "load_reference_model",
    "make_dataset",
    "make_reward_func",
    "plot_training",
    "warmup_sft",
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
    "resolve_model_path",
    "snr_lr_scale",
    "step_scale_from_contributions",
    "validate",
]
