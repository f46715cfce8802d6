"""The one piece of TRL's internals that training reproduces outside the trainer: how ``GRPOTrainer._compute_loss``
forms a batch's model inputs and loss mask (:func:`sequence_inputs`, used by the norms passes and ``one_backward``).

Every TRL method OBLR-PO overrides or reproduces is listed, with why, what to re-check and a hash of its source, in
``tests/seam_table.py``; ``tests/test_trl_seam.py`` fails on a TRL that changes one.
"""

from __future__ import annotations

import torch


def sequence_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and the mask of completion tokens that enter the loss, from a batch of
    ``GRPOTrainer._generate_and_score_completions`` (as its ``_compute_loss`` forms them)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
    return input_ids, attention_mask, mask
