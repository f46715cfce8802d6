"""One per-sample gradient rule per module type (in the manner of Opacus' ``grad_sample/``).

A rule maps ``(module, activation, output_grad)`` of one call of the module, both shaped ``(B, ..., features)``, to
``{parameter_name: usage}``: each usage is the per-sample gradient of that parameter from this call, either
:class:`~oblr_trl.grad_norms.factors.Factored` (never materialized; its norms come from token Grams) or
:class:`~oblr_trl.grad_norms.factors.Materialized` (small parameters). Rules know nothing about hooks.
"""

from __future__ import annotations

from typing import Callable

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from . import per_row as generic
from ..factors import Dense, Factored, Materialized, OneHot, Usage

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, Usage]]
GRAD_NORM_RULES: dict[type, Rule] = {}
_NAME_RULES: dict[str, Rule] = {}


def register_grad_norm_rule(*module_types: type | str) -> Callable[[Rule], Rule]:
    """Register a rule for exact module types, or for class names (for model-specific classes that share a formula
    without sharing a base class). Registering a second rule for a type (or name) raises: a rule is replaced only by
    removing the first from :data:`GRAD_NORM_RULES` explicitly."""

    def decorator(rule: Rule) -> Rule:
        for module_type in module_types:
            table = _NAME_RULES if isinstance(module_type, str) else GRAD_NORM_RULES
            if module_type in table:
                raise ValueError(f"A grad-norm rule is already registered for {module_type!r}: {table[module_type]}.")
            table[module_type] = rule
        return rule

    return decorator


def _original_class(cls: type) -> type:
    """The class under FSDP2's wrapper: ``fully_shard`` swaps a module's class for ``FSDP<Cls>(FSDPModule, Cls)``."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


@dataclass(frozen=True)
class CallRule:
    """A rule for a module whose whole call is recorded (its arguments and outputs; see :mod:`.hooks`):
    ``recognise(module, memo)`` says whether it takes a module (each verifies that on a probe, remembered in ``memo``,
    the model's :attr:`~.plan.ModelPlan.memo`, or None), ``usages(module, call, output_grads, batch, handoff)`` forms
    the module's per-sequence gradients, ``{parameter name: usage}`` (``handoff``: what the pass's forward kept for
    its backward, :class:`~.experts.RoutedCaptures`, or None). ``borrows``: its usages also cover the trainable
    parameters of descendants the module uses functionally (LoRA's factors on an expert bank, :mod:`.lora_experts`),
    by their dotted names; the others take such a module on the per-row path."""

    name: str
    recognise: Callable[[nn.Module], bool]
    usages: Callable[..., dict[str, Usage]]
    borrows: bool = False


CALL_RULES: dict[str, CallRule] = {}  # in the order they are tried
# the rules switched off in this thread/task (switched_off); a context variable, so no other thread sees them
_SWITCHED_OFF: ContextVar[frozenset[str]] = ContextVar("switched_off_rules", default=frozenset())


def register_call_rule(name: str, recognise: Callable[[nn.Module], bool], borrows: bool = False):
    """Register ``usages`` (the decorated function) as the call rule ``name``; a name is taken once (``borrows``:
    see :class:`CallRule`)."""

    def decorator(usages):
        if name in CALL_RULES:
            raise ValueError(f"A call rule named {name!r} is already registered: {CALL_RULES[name]}.")
        CALL_RULES[name] = CallRule(name, recognise, usages, borrows)
        return usages

    return decorator


@contextmanager
def switched_off(*names: str):
    """Inside, the rules named (call rules by name, tensor rules by function name, e.g. ``"linear_rule"``) are not
    used: their modules fall back to what comes next (a recognised rule, the per-row path, or a refusal). Held in a
    context variable (this thread or task only); a model's plan is resolved again under another set
    (:func:`~.support.coverage_plan`)."""
    unknown = set(names) - set(CALL_RULES) - {rule.__name__ for rule in _all_tensor_rules()}
    if unknown:
        raise ValueError(f"No rule named {sorted(unknown)}; call rules: {list(CALL_RULES)}.")
    token = _SWITCHED_OFF.set(_SWITCHED_OFF.get() | frozenset(names))
    try:
        yield
    finally:
        _SWITCHED_OFF.reset(token)


def switched_off_now() -> frozenset[str]:
    """The names of the rules switched off here (:func:`switched_off`)."""
    return _SWITCHED_OFF.get()


def registered() -> tuple:
    """What is registered now (every type, name and call rule, and its rule): a plan resolved under other
    registrations is resolved again (:func:`~.support.coverage_plan`), so a rule registered later is used."""
    return tuple(GRAD_NORM_RULES.items()), tuple(_NAME_RULES.items()), tuple(CALL_RULES.items())


def is_on(rule) -> bool:
    return getattr(rule, "name", getattr(rule, "__name__", None)) not in _SWITCHED_OFF.get()


def _all_tensor_rules() -> list[Rule]:
    return list(GRAD_NORM_RULES.values()) + list(_NAME_RULES.values()) + [centred_norm_rule]


def find_call_rule(module: nn.Module, memo: dict | None = None, borrows: bool = False) -> CallRule | None:
    """The first registered call rule (switched on) that takes ``module``, or None (``memo``: see :class:`CallRule`;
    ``borrows``: only the rules that cover borrowed parameters too)."""
    return next((rule for rule in CALL_RULES.values()
                 if is_on(rule) and (rule.borrows or not borrows) and rule.recognise(module, memo)), None)


def call_usages(module: nn.Module, call, output_grads: list, batch: int, handoff=None) -> dict[str, Usage]:
    """The usages of a module whose whole call was recorded, its call rule looked up now (one module alone; a
    model's pass runs the rule its plan chose): the call rule's (an expert bank by its routed tokens, :mod:`.experts`;
    a router by its logits, :mod:`.routers`), else the exact per-row path's (:mod:`.generic`)."""
    rule = find_call_rule(module)
    if rule is not None:
        return rule.usages(module, call, output_grads, batch, handoff)
    return generic.per_row_usages(module, call, output_grads, batch)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, ..., n) -> (B, T, n): every position between the batch and the feature axis is a token."""
    if x.dim() == 3:
        return x  # already: a reshape to the same shape would still be an operator call
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _sum_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, ..., n) -> (B, n): summed over every position between the batch and the feature axis, in place of a
    :func:`_tokens` reshape and a sum (q/k norms' (B, T, heads, d) output gradients are not contiguous: that reshape
    would be a copy)."""
    return x if x.dim() == 2 else x.sum(dim=tuple(range(1, x.dim() - 1)))


@register_grad_norm_rule(nn.Linear, "FalconLinear")
def linear_rule(layer: nn.Linear, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Usage]:
    """``y = x W^T + b``: per-sample ``dW = sum_t g_t (x) x_t`` (factored), ``db = sum_t g_t``."""
    g, x = _tokens(output_grad), _tokens(activation)
    return _affine_usages(layer, g, x, g)


def _affine_usages(layer: nn.Module, left: torch.Tensor, right: torch.Tensor, g: torch.Tensor) -> dict[str, Usage]:
    """An affine layer's per-sample gradients: ``weight`` as ``sum_t left_t (x) right_t``, ``bias`` as ``sum_t g_t``."""
    usages: dict[str, Usage] = {}
    if layer.weight.requires_grad:
        usages["weight"] = Factored(Dense(left), Dense(right))
    if layer.bias is not None and layer.bias.requires_grad:
        usages["bias"] = Materialized(g.float().sum(1))
    return usages


def _embed_scale(layer: nn.Module) -> float | None:
    scale = getattr(layer, "embed_scale", None)
    if scale is None:
        return None
    return float(scale)


@register_grad_norm_rule(nn.Embedding)
def embedding_rule(layer: nn.Embedding, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Usage]:
    """``y_t = W[x_t]``: per-sample ``dW = sum_t onehot(x_t) (x) g_t``; the ``padding_idx`` row gets no gradient."""
    if not layer.weight.requires_grad:
        return {}
    ids = activation.reshape(activation.shape[0], -1)
    g = _tokens(output_grad)
    scale = _embed_scale(layer)
    if scale is not None:  # Gemma's *ScaledWordEmbedding: y = W[x] * embed_scale
        g = g * scale
    if layer.padding_idx is not None:
        g = g * (ids != layer.padding_idx)[..., None].to(g.dtype)
    return {"weight": Factored(OneHot(ids, layer.num_embeddings), Dense(g))}


def _rms_normalized(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(layer, "variance_epsilon", getattr(layer, "eps", None))
    if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = torch.finfo(x.dtype).eps
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@register_grad_norm_rule(nn.RMSNorm)
def rms_norm_rule(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Usage]:
    """``y = w * x / rms(x)`` (Llama/Qwen form) or ``y = (1 + w) * x / rms(x)`` (Gemma's): per-sample
    ``dw = sum_t g_t * xhat_t`` either way (materialized, d values)."""
    if not layer.weight.requires_grad:
        return {}
    xhat = _rms_normalized(layer, activation)
    return {"weight": Materialized(_sum_tokens(output_grad.float() * xhat.float()))}


@register_grad_norm_rule(nn.LayerNorm)
def layer_norm_rule(layer: nn.LayerNorm, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Usage]:
    """``y = w * (x - mean) / std + b``: per-sample ``dw = sum_t g_t * xhat_t``, ``db = sum_t g_t``."""
    if len(layer.normalized_shape) != 1:
        raise NotImplementedError("LayerNorm over more than one trailing dimension has no per-sample rule.")
    g = output_grad.float()
    usages: dict[str, Usage] = {}
    if layer.weight is not None and layer.weight.requires_grad:
        xhat = nn.functional.layer_norm(activation.float(), layer.normalized_shape, eps=layer.eps)
        usages["weight"] = Materialized(_sum_tokens(g * xhat))
    if layer.bias is not None and layer.bias.requires_grad:
        usages["bias"] = Materialized(_sum_tokens(g))
    return usages


def centred_norm_rule(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Usage]:
    """``y = w * (x - mean) / std`` with no bias (Cohere's LayerNorm): per-sample ``dw = sum_t g_t * xhat_t``."""
    if not layer.weight.requires_grad:
        return {}
    eps = getattr(layer, "variance_epsilon", getattr(layer, "eps", 1e-5))
    xhat = nn.functional.layer_norm(activation.float(), activation.shape[-1:], eps=eps)
    return {"weight": Materialized(_sum_tokens(output_grad.float() * xhat))}


@register_grad_norm_rule("Conv1D")
def conv1d_rule(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Usage]:
    """GPT-2's ``Conv1D``, ``y = x W + b`` with ``W`` stored ``(in, out)``: per-sample ``dW = sum_t x_t (x) g_t``."""
    g, x = _tokens(output_grad), _tokens(activation)
    return _affine_usages(layer, x, g, g)
