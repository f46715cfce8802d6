"""Where the layer rules register (in the manner of Opacus' ``grad_sample/``: one rule per module type; the rules
themselves live beside this module, one module per family).

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

from . import per_row
from ..factors import Usage

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, Usage]]
GRAD_NORM_RULES: dict[type, Rule] = {}
_NAME_RULES: dict[str, Rule] = {}
UNREGISTERED_RULES: list[Rule] = []  # rules that recognition alone hands out (no type or name of their own)


RULE_COSTS: dict[Rule, Callable[[nn.Module], tuple[int, int, bool] | None]] = {}  # a rule's declared cost (cost=)


def register_grad_norm_rule(*module_types: type | str,
                            cost: Callable[[nn.Module], tuple[int, int, bool] | None] | None = None
                            ) -> Callable[[Rule], Rule]:
    """Register a rule for exact module types, or for class names (for model-specific classes that share a formula
    without sharing a base class). Registering a second rule for a type (or name) raises: a rule is replaced only by
    removing the first from :data:`GRAD_NORM_RULES` explicitly.

    ``cost(module)``: the linear map one call of such a module multiplies each token by, ``(inputs, outputs,
    trainable)`` (whether that map's matrix trains; None where it multiplies by none), which the path choice's cost
    model counts (:func:`declared_cost`); a rule without one is not counted there."""

    def decorator(rule: Rule) -> Rule:
        for module_type in module_types:
            table = _NAME_RULES if isinstance(module_type, str) else GRAD_NORM_RULES
            if module_type in table:
                raise ValueError(f"A grad-norm rule is already registered for {module_type!r}: {table[module_type]}.")
            table[module_type] = rule
        if cost is not None:
            RULE_COSTS[rule] = cost
        return rule

    return decorator


def full_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """A weight's whole shape, also where DeepSpeed ZeRO-3 holds only this rank's flat shard (its ``ds_shape``)."""
    return tuple(getattr(weight, "ds_shape", None) or weight.shape)


def declared_cost(module: nn.Module) -> tuple[int, int, bool] | None:
    """The linear map ``(inputs, outputs, trainable)`` one call of ``module`` multiplies each token by, as the rule registered
    for its class name, or for its class or a base class, declares it (``cost=`` of :func:`register_grad_norm_rule`);
    None where that rule declares none, or no rule is registered."""
    rule = _NAME_RULES.get(type(module).__name__)
    if rule is None:
        rule = next((GRAD_NORM_RULES[c] for c in type(module).__mro__ if c in GRAD_NORM_RULES), None)
    cost = RULE_COSTS.get(rule)
    return None if cost is None else cost(module)


def _original_class(cls: type) -> type:
    """The class under FSDP2's wrapper: ``fully_shard`` swaps a module's class for ``FSDP<Cls>(FSDPModule, Cls)``."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


@dataclass(frozen=True)
class CallRule:
    """A rule for a module whose whole call is recorded (its arguments and outputs; see :mod:`..hooks`):
    ``recognise(module, memo)`` says whether it takes a module (each verifies that on a probe, remembered in ``memo``,
    the model's :attr:`~..model.ModelPlan.memo`, or None), ``usages(module, call, output_grads, batch, handoff)`` forms
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
    (:func:`~..coverage.coverage_plan`)."""
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
    registrations is resolved again (:func:`~..coverage.coverage_plan`), so a rule registered later is used."""
    return tuple(GRAD_NORM_RULES.items()), tuple(_NAME_RULES.items()), tuple(CALL_RULES.items())


def is_on(rule) -> bool:
    return getattr(rule, "name", getattr(rule, "__name__", None)) not in _SWITCHED_OFF.get()


def _all_tensor_rules() -> list[Rule]:
    return list(GRAD_NORM_RULES.values()) + list(_NAME_RULES.values()) + UNREGISTERED_RULES


def find_call_rule(module: nn.Module, memo: dict | None = None, borrows: bool = False) -> CallRule | None:
    """The first registered call rule (switched on) that takes ``module``, or None (``memo``: see :class:`CallRule`;
    ``borrows``: only the rules that cover borrowed parameters too)."""
    return next((rule for rule in CALL_RULES.values()
                 if is_on(rule) and (rule.borrows or not borrows) and rule.recognise(module, memo)), None)


def call_usages(module: nn.Module, call, output_grads: list, batch: int, handoff=None) -> dict[str, Usage]:
    """The usages of a module whose whole call was recorded, its call rule looked up now (one module alone; a
    model's pass runs the rule its plan chose): the call rule's (an expert bank by its routed tokens, :mod:`.experts`;
    a router by its logits, :mod:`.routers`), else the exact per-row path's (:mod:`.per_row`)."""
    rule = find_call_rule(module)
    if rule is not None:
        return rule.usages(module, call, output_grads, batch, handoff)
    return per_row.per_row_usages(module, call, output_grads, batch)


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
