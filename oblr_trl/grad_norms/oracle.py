"""The brute-force oracle for per-sequence gradients: one ``torch.autograd.grad`` per sequence, through the model's
own full logits (no fused head, no chunking, no hooks). The slow, obviously-correct way, kept once: the coverage
probe (:mod:`.coverage`) checks the engine against it at run time, and the tests, the support table and the
benchmarks' exactness checks use it too."""

from __future__ import annotations

import torch
from torch import nn


def completion_logprob_sums(model: nn.Module, input_ids, attention_mask, completion_mask,
                            temperature: float = 1.0) -> torch.Tensor:
    """``sum_t log pi(o_t | q, o_<t)`` per row, from the full logits; the last ``completion_mask.shape[1]`` positions
    of ``input_ids`` are the completion."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    c = completion_mask.shape[1]
    logits = logits[:, -c - 1 : -1].float() / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, -c:, None]).squeeze(-1)
    return (logps * completion_mask).sum(-1)


def per_row_grads(model: nn.Module, input_ids, attention_mask, completion_mask, temperature: float = 1.0,
                  params: list[nn.Parameter] | None = None) -> list[tuple[torch.Tensor | None, ...]]:
    """Per row, the gradient of its ``sum_t log pi`` with respect to ``params`` (default: every trainable parameter),
    each row through the model alone; ``None`` for a parameter the row does not reach."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    out = []
    with torch.enable_grad():
        for i in range(input_ids.shape[0]):
            total = completion_logprob_sums(model, input_ids[i : i + 1], attention_mask[i : i + 1],
                                            completion_mask[i : i + 1], temperature).sum()
            out.append(torch.autograd.grad(total, params, allow_unused=True))
    return out


def per_row_sq_norms(model: nn.Module, input_ids, attention_mask, completion_mask,
                     temperature: float = 1.0) -> torch.Tensor:
    """``||grad sum_t log pi(o_i)||^2`` per row over the trainable parameters, in float64."""
    rows = per_row_grads(model, input_ids, attention_mask, completion_mask, temperature)
    return torch.stack([sum((g.double().pow(2).sum() for g in row if g is not None),
                            torch.zeros((), dtype=torch.float64)) for row in rows])

