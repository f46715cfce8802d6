"""The two-pass path's forward-side passes over a generated batch, before the loss: each completion's gradient
inner products within its SNR unit (exact norms, one backward), or the logit proxy's weights (one forward)."""

from __future__ import annotations

import torch

from . import multimodal
from .estimators import logit_proxy_weights, mask_nonfinite_products, token_log_sum_sq_probs
from .grad_norms import per_sequence_grad_inner_products
from .trl_seam import sequence_inputs


def norm_products(model, batch: dict, *, unit: int, chunk: int, temperature: float, autocast) -> tuple[
        torch.Tensor, torch.Tensor]:
    """The within-unit inner products ``<u_i, u_j>``, ``(n / unit, unit, unit)``, in chunks of ``chunk`` rows (a
    multiple of ``unit``), with those of completions whose norm is not finite zeroed; and the mask of those
    completions. ``autocast``: the accelerator's autocast context factory."""
    input_ids, attention_mask, mask = sequence_inputs(batch)
    with torch.enable_grad(), autocast():
        products = torch.cat([
            per_sequence_grad_inner_products(
                model, input_ids[s : s + chunk], attention_mask[s : s + chunk], mask[s : s + chunk],
                group_size=unit, temperature=temperature,
                model_inputs=multimodal.row_inputs(batch, s, s + chunk),  # a VLM's images, if any
            )
            for s in range(0, input_ids.shape[0], chunk)
        ])
    return mask_nonfinite_products(products)


@torch.no_grad()
def logit_proxy(model, batch: dict, *, chunk: int, temperature: float, autocast) -> torch.Tensor:
    """``grad_norm_estimator="logit"``: each completion's proxy weight from one forward without backward."""
    input_ids, attention_mask, mask = sequence_inputs(batch)
    length = batch["completion_ids"].shape[1]
    parts = []
    with autocast():
        for s in range(0, input_ids.shape[0], chunk):
            logits = model(input_ids=input_ids[s : s + chunk], attention_mask=attention_mask[s : s + chunk],
                           logits_to_keep=length + 1, **multimodal.row_inputs(batch, s, s + chunk),
                           ).logits[:, :-1].float() / temperature
            token_logps = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][s : s + chunk, :, None])
            parts.append(logit_proxy_weights(token_logps[..., 0], token_log_sum_sq_probs(logits), mask[s : s + chunk]))
    return torch.cat(parts)
