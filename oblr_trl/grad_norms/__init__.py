"""Exact per-sequence gradient norms: hooks and the LM head (:mod:`.engine`), one rule per module type
(:mod:`.rules`), rules recognised by what a layer computes (:mod:`.recognise`), the exact per-row path for small
parameters no rule covers (:mod:`.generic`), the ghost-norm algebra (:mod:`.factors`), and :func:`validate`
(:mod:`.support`)."""

from .engine import (
    PerSequenceGradients,
    per_sequence_grad_inner_products,
    per_sequence_grad_sq_norms,
    per_sequence_grads,
    unwrap_causal_lm,
)
from .rules import GRAD_NORM_RULES, register_grad_norm_rule
from .coverage import validate
from .support import Unsupported, UnsupportedModulesError

__all__ = [
    "GRAD_NORM_RULES",
    "PerSequenceGradients",
    "per_sequence_grad_inner_products",
    "per_sequence_grad_sq_norms",
    "per_sequence_grads",
    "register_grad_norm_rule",
    "Unsupported",
    "UnsupportedModulesError",
    "validate",
    "unwrap_causal_lm",
]
