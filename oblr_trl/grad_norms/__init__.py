"""Exact per-sequence gradient norms: a floor of layer rules over a small core, read in the order a pass runs.

:mod:`.api` is the public entry (:func:`per_sequence_grads`), the coverage check first. :mod:`.coverage` says which
module takes which rule (its plan, resolved once per model), finds the parameters a module uses outside its own forward
and proves the whole by a probe against autograd (:func:`validate`). :mod:`.engine` runs one pass by that plan:
:mod:`.hooks` record each trainable module's input and output gradient (or its whole call), and the layer rules
(:mod:`.rules`: one module per family, side by side) turn each record into per-sequence gradients. The core under the
rules: :mod:`.factors` (the factor algebra), :mod:`.result` (:class:`PerSequenceGradients`, or the refusal),
:mod:`.head` (the LM head), :mod:`.model` (the model resolved once, and every per-model cache on its
:class:`~.model.ModelPlan`) and :mod:`.quantized` (a quantized base's backward kept true)."""

from .api import per_sequence_grad_inner_products, per_sequence_grad_sq_norms, per_sequence_grads
from .coverage import validate
from .model import unwrap_causal_lm
from .quantized import keep_differentiable
from .result import PerSequenceGradients
from .rules import GRAD_NORM_RULES, register_grad_norm_rule
from .result import Unsupported, UnsupportedModulesError

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
