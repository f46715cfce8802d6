"""Token embeddings, ``y_t = W[x_t]`` (Gemma's ``*ScaledWordEmbedding``: times ``embed_scale``): per-sample
``dW = sum_t onehot(x_t) (x) g_t``, factored with a one-hot left factor."""

from __future__ import annotations

import torch
from torch import nn

from ..factors import Dense, Factored, OneHot, Usage
from .registry import _tokens, register_grad_norm_rule


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
