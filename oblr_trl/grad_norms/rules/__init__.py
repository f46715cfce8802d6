"""The layer rules, one module per family, side by side: each turns one module's record of a pass into per-sequence
gradients (``{parameter name: usage}``, factored by :mod:`..factors`). :mod:`.registry` keeps the tables a rule
registers in; the families register on import."""

from . import linear, embeddings, norms  # noqa: F401 (each family's rules register on import, in this order)
from . import experts, lora_experts, routers  # noqa: F401
from .registry import GRAD_NORM_RULES, CallRule, Rule, register_grad_norm_rule, switched_off

__all__ = ["CallRule", "GRAD_NORM_RULES", "Rule", "register_grad_norm_rule", "switched_off"]
