"""The LM head, handled as TRL's fused head handles it: the ``(B, T, V)`` logits are never held; the log-sum-exp and
the head's output gradient are formed in vocabulary chunks, with the model's logit scale, softcap and offset as
observed (:mod:`.head_transform`)."""

from __future__ import annotations

import torch
from torch import nn

from . import factors
from .factors import Dense, Factored, SoftmaxDelta, as_operand, head_logits, mm32


@torch.no_grad()
def lm_head_terms(h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, weight, bias, alpha: float,
                   softcap: float | None = None, self_products: int | None = None):
    """Log-sum-exp of the scored logits and ``d sum_t log p / d h`` of the head, in vocabulary chunks. ``h`` and
    ``weight`` in half precision (the head under autocast) are multiplied as they are, into float32 (:func:`mm32`).

    With ``self_products=k``, also the head weight's own ``(B/k, k, k)`` per-sample inner products, from the same
    chunks of the softmax delta as the output gradient (:func:`~.factors.head_self_products`), else None: the widest
    tensors of the pass are then formed twice (log-sum-exp, then delta) instead of three times."""
    lse = torch.full(h.shape[:-1], -float("inf"), device=h.device)
    size = factors.vocab_chunk(h.shape[0] * h.shape[1], weight.shape[0])  # VOCAB_CHUNK columns at least
    chunks = [(start, min(start + size, weight.shape[0])) for start in range(0, weight.shape[0], size)]
    for start, end in chunks:
        z, _ = head_logits(h, weight[start:end], None if bias is None else bias[start:end], alpha, softcap)
        lse = torch.logaddexp(lse, torch.logsumexp(z, dim=-1))
    delta = SoftmaxDelta(h, weight, bias, alpha, lse, labels, mask, softcap)
    grad_h = torch.zeros_like(h, dtype=torch.float32)
    dtype = delta.operand_dtype
    k = self_products or 1

    def columns():
        for start, end in chunks:
            cols = as_operand(delta.cols(start, end), dtype)
            grad_h.add_(mm32(cols, as_operand(weight[start:end], dtype)))
            yield start, end, cols.reshape(h.shape[0] // k, k * h.shape[1], end - start)  # blocked by k

    if self_products is None:
        for _ in columns():
            pass
        return lse, grad_h, None
    usage = Factored(delta, Dense(h)).blocked(k)
    return lse, grad_h, factors.head_self_products(usage, k, columns())
