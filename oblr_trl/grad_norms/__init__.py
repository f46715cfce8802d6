"""Exact per-sequence gradient norms: hooks (:mod:`.engine`), one rule per module type (:mod:`.rules`), and the
ghost-norm algebra (:mod:`.factors`)."""

from .engine import per_sequence_grad_inner_products, per_sequence_grad_sq_norms, unwrap_causal_lm
from .rules import GRAD_NORM_RULES, register_grad_norm_rule

__all__ = [
    "GRAD_NORM_RULES",
    "per_sequence_grad_inner_products",
    "per_sequence_grad_sq_norms",
    "register_grad_norm_rule",
    "unwrap_causal_lm",
]
