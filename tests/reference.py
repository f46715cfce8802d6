"""Brute-force oracles for the tests: one ``torch.autograd.grad`` per sequence (the slow, obviously-correct way)."""

import torch


def completion_logprob_sums(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """``sum_t log pi(o_t | q, o_<t)`` per row, from the full logits (no fused head, no chunking)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    c = completion_mask.shape[1]
    logits = logits[:, -c - 1 : -1].float() / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, -c:, None]).squeeze(-1)
    return (logps * completion_mask).sum(-1)


def per_sample_grads(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """List of per-row flattened gradients of ``sum_t log pi`` over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(input_ids.shape[0]):
        total = completion_logprob_sums(
            model, input_ids[i : i + 1], attention_mask[i : i + 1], completion_mask[i : i + 1], temperature
        ).sum()
        g = torch.autograd.grad(total, params, allow_unused=True)
        grads.append(torch.cat([(gi if gi is not None else torch.zeros_like(p)).flatten() for gi, p in zip(g, params)]))
    return grads


def per_sample_sq_norms(*args, **kwargs):
    return torch.stack([g.double().pow(2).sum() for g in per_sample_grads(*args, **kwargs)])


def within_group_products(grads, group_size):
    """``(B / k, k, k)`` inner products ``<g_i, g_j>`` of per-sample gradients within consecutive groups of ``k``."""
    blocks = torch.stack([g.double() for g in grads]).reshape(len(grads) // group_size, group_size, -1)
    return blocks @ blocks.transpose(1, 2)
