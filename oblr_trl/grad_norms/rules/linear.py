"""Linear maps: ``nn.Linear`` (and Falcon's ``FalconLinear``) and GPT-2's ``Conv1D``, ``y = x W^T + b``: per-sample
``dW = sum_t g_t (x) x_t``, factored (never materialized; its norms come from token Grams)."""

from __future__ import annotations

import torch
from torch import nn

from ..factors import Dense, Factored, Materialized, Usage
from .registry import _tokens, full_shape, register_grad_norm_rule


def _plain_weight(layer: nn.Module) -> torch.Tensor | None:
    """The layer's 2-D weight (its whole shape, under ZeRO-3 too), or None."""
    weight = getattr(layer, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and len(full_shape(weight)) == 2 else None


def linear_cost(layer: nn.Module) -> tuple[int, int, bool] | None:
    """``(in_features, out_features)``: the map each token is multiplied by, and whether it trains."""
    weight = _plain_weight(layer)
    return None if weight is None else (layer.in_features, layer.out_features, weight.requires_grad)


def conv1d_cost(layer: nn.Module) -> tuple[int, int, bool] | None:
    """GPT-2's ``Conv1D`` stores its weight ``(in, out)``."""
    weight = _plain_weight(layer)
    return None if weight is None else (*full_shape(weight), weight.requires_grad)


@register_grad_norm_rule(nn.Linear, "FalconLinear", cost=linear_cost)
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


@register_grad_norm_rule("Conv1D", cost=conv1d_cost)
def conv1d_rule(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Usage]:
    """GPT-2's ``Conv1D``, ``y = x W + b`` with ``W`` stored ``(in, out)``: per-sample ``dW = sum_t x_t (x) g_t``."""
    g, x = _tokens(output_grad), _tokens(activation)
    return _affine_usages(layer, x, g, g)
