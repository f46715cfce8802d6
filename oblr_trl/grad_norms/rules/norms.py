"""Normalisation layers: RMSNorm (Llama's ``w * xhat``, Gemma's ``(1 + w) * xhat``), LayerNorm, and a bias-free
centred norm (Cohere's, found by recognition): per-sample ``dw = sum_t g_t * xhat_t``, materialized (d values)."""

from __future__ import annotations

import torch
from torch import nn

from ..factors import Materialized, Usage
from .registry import UNREGISTERED_RULES, _sum_tokens, register_grad_norm_rule


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


UNREGISTERED_RULES.append(centred_norm_rule)
