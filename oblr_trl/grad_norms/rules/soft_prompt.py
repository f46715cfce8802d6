"""Soft prompts: PEFT's prompt tuning and P-tuning, which GRPOTrainer trains (the ``PeftModel``'s forward puts
``num_virtual_tokens`` learned embeddings before every sequence), taken on by the per-sequence pass as the
``PeftModel`` runs them.

The virtual tokens come from the adapter's prompt encoder, called on ``(B, n)`` token indices (the same indices in
every row): an ``nn.Embedding`` (prompt tuning), then an MLP or LSTM (P-tuning). Each row's own copy of the prompt
carries that row's gradient, so the encoder's layers take the usual rules (an embedding, linear layers) on rows that
are the batch's sequences. The pass builds ``inputs_embeds`` and the attention mask as
``PeftModelForCausalLM.forward`` does and runs the backbone on them; the completion's positions, counted from the
end, are unchanged. Prefix tuning (a past key-value cache, which GRPOTrainer itself fails on) is refused by
:func:`~..coverage.outside_modules`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model import _config, unwrap_distributed


def kind(model: nn.Module) -> str | None:
    """The active adapter's PEFT type (``'PREFIX_TUNING'``...) where it is a prompt-learning one; else None."""
    config = _config(unwrap_distributed(model))
    if config is None or not getattr(config, "is_prompt_learning", False):
        return None
    return str(getattr(config.peft_type, "value", config.peft_type))


def encoder_modules(outer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The active prompt encoder's modules with trainable parameters of their own, by their name in ``outer``."""
    encoder = outer.prompt_encoder[outer.active_adapter]
    prefix = next(n for n, m in outer.named_modules() if m is encoder)
    return [(f"{prefix}.{n}" if n else prefix, m) for n, m in encoder.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))]


def prompted_inputs(outer: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs_embeds`` and ``attention_mask`` with the virtual tokens first, as ``PeftModelForCausalLM.forward``
    forms them, except that the encoder runs on all ``B`` rows of prompt-token indices (PEFT's ``get_prompt`` runs it
    on one row and repeats the result, which sums the rows' gradients before any hook could see them apart): the same
    values, with one prompt per sequence for the hooks."""
    adapter = outer.active_adapter
    encoder = outer.prompt_encoder[adapter]
    tokens = outer.prompt_tokens[adapter].unsqueeze(0).expand(input_ids.shape[0], -1).to(input_ids.device)
    embeds = outer.word_embeddings(input_ids)
    prompts = encoder(tokens).to(embeds.dtype)
    ones = torch.ones(input_ids.shape[0], prompts.shape[1], dtype=attention_mask.dtype, device=attention_mask.device)
    return torch.cat((prompts, embeds), dim=1), torch.cat((ones, attention_mask), dim=1)
