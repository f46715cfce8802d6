"""Exact per-sequence gradient norms: hooks (:mod:`.engine`), one rule per module type (:mod:`.rules`), and the
ghost-norm algebra (:mod:`.factors`)."""

from .engine import (
    PerSequenceGradients,
    per_sequence_grad_inner_products,
    per_sequence_grad_sq_norms,
    per_sequence_grads,
    unwrap_causal_lm,
)
from .rules import GRAD_NORM_RULES, register_grad_norm_rule

__all__ = [
    "GRAD_NORM_RULES",
    "PerSequenceGradients",
    "per_sequence_grad_inner_products",
    "per_sequence_grad_sq_norms",
    "per_sequence_grads",
    "register_grad_norm_rule",
    "unwrap_causal_lm",
]
