"""Exact per-sequence gradient norms, read in the order a pass runs: :mod:`.hooks` record each trainable module's
input and output gradient (or its whole call); :mod:`.rules` (one per module type; :mod:`.recognise` finds one by what
a layer computes), :mod:`.experts` and :mod:`.routers` (MoE, by routed tokens and logits) and :mod:`.generic` (the
exact per-row path) turn records into per-sequence gradients, factored by :mod:`.factors`; :mod:`.ledger` and
:mod:`.support` say which module covers which parameter (each module's rule resolved once per model, kept with every
per-model cache on the model's :class:`~.plan.ModelPlan`), :mod:`.coverage` proves it (the probe, :func:`validate`; :mod:`.quantized` keeps a quantized base's backward true);
:mod:`.head` handles the LM head; :mod:`.engine` wires one pass together into a :class:`PerSequenceGradients`
(:mod:`.result`); :mod:`.api` is the public entry, the coverage check first."""

from .api import per_sequence_grad_inner_products, per_sequence_grad_sq_norms, per_sequence_grads
from .coverage import validate
from .model import unwrap_causal_lm
from .quantized import keep_differentiable
from .result import PerSequenceGradients
from .rules import GRAD_NORM_RULES, register_grad_norm_rule
from .support import Unsupported, UnsupportedModulesError

__all__ = [
    "GRAD_NORM_RULES",
    "keep_differentiable",
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
