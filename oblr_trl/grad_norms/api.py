"""The public per-sequence gradient functions: the engine's pass (:func:`.engine.run_pass`), each after the coverage
check (:func:`.coverage.check_once`: every trainable parameter accounted for, a probe once per model)."""

from __future__ import annotations

import torch
from torch import nn

from . import engine
from .coverage import check_once, pass_plan
from .result import PerSequenceGradients


def per_sequence_grads(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       completion_mask: torch.Tensor, **kwargs) -> PerSequenceGradients:
    """:func:`.engine.run_pass` (see there for the arguments), once the model's coverage is checked, by the rules the
    coverage chose (:func:`.coverage.pass_plan`)."""
    view = check_once(model)  # the model resolved once (model.view_of), read by every room of the pass
    return engine.run_pass(view, input_ids, attention_mask, completion_mask, covering=pass_plan, **kwargs)


def per_sequence_grad_inner_products(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    group_size: int = 1,
    temperature: float = 1.0,
    model_inputs: dict | None = None,
) -> torch.Tensor:
    """Inner products ``<u_i, u_j>`` of ``u_i = grad_theta sum_t log pi(o_{i,t} | q, o_{i,<t})`` within groups.

    Rows ``i`` of one group are ``group_size`` consecutive rows of ``input_ids``. Returns a float32 tensor
    ``(B / group_size, group_size, group_size)``; with ``group_size=1`` its entries are ``||u_i||^2``. See
    :func:`per_sequence_grad_sq_norms` for the arguments.
    """
    if input_ids.shape[0] % group_size:
        raise ValueError(f"group_size={group_size} must divide the batch size {input_ids.shape[0]}.")
    grads = per_sequence_grads(
        model, input_ids, attention_mask, completion_mask, temperature=temperature, stream_group_size=group_size,
        model_inputs=model_inputs,
    )
    return grads.inner_products(group_size)


def per_sequence_grad_sq_norms(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    model_inputs: dict | None = None,
) -> torch.Tensor:
    """``||grad_theta sum_t log pi_theta(o_t | q, o_<t)||^2`` for each row: the weights ``w_i`` of Theorem 7.

    Exact, over the model's trainable parameters (LoRA adapters only, under PEFT), from the activations and output
    gradients of one forward and one backward of the batch; no per-sample gradient of a large matrix is materialized
    and the logits are never held whole. No ``.grad`` is left on any parameter.

    Args:
        model: a causal LM (``*ForCausalLM``), possibly wrapped by PEFT or DDP.
        input_ids: ``(B, L)`` prompt + completion token ids; prompts may be left-padded.
        attention_mask: ``(B, L)``.
        completion_mask: ``(B, C)``; the completion is the last ``C`` positions of ``input_ids`` (right-padded: the
            mask is 0 after the end). Only its tokens enter the sum.
        temperature: the sampling temperature the trainer scores log-probs with (logits are divided by it).
        model_inputs: further inputs of the backbone's forward, e.g. a VLM's images (see :func:`per_sequence_grads`).

    Returns:
        float32 tensor ``(B,)``.
    """
    products = per_sequence_grad_inner_products(
        model, input_ids, attention_mask, completion_mask, group_size=1, temperature=temperature,
        model_inputs=model_inputs,
    )
    return products.reshape(-1)
