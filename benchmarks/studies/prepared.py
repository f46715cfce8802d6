"""The update without generation, for ``cost_counts.py`` (counted) and ``bench_gpu.py`` (timed): a fixed batch of
completions standing in for what TRL's ``GRPOTrainer._generate_and_score_completions`` returns."""

from __future__ import annotations

import torch


def prepared_batch(batch: int, completion: int, vocab: int, prompt: int, group: int,
                   device: str | torch.device = "cpu") -> tuple[dict, torch.Tensor]:
    """What ``_generate_and_score_completions`` returns for ``batch`` completions of ``completion`` tokens after
    ``prompt`` prompt tokens (no padding), and the rewards it computed (with spread inside each group of ``group``)."""
    g = torch.Generator().manual_seed(0)
    out = dict(prompt_ids=torch.randint(3, vocab, (batch, prompt), generator=g),
               prompt_mask=torch.ones(batch, prompt, dtype=torch.long),
               completion_ids=torch.randint(3, vocab, (batch, completion), generator=g),
               completion_mask=torch.ones(batch, completion, dtype=torch.long),
               num_items_in_batch=torch.tensor(batch * completion))
    rewards = torch.rand(batch, 1, generator=g)
    out["advantages"] = rewards[:, 0] - rewards[:, 0].reshape(-1, group).mean(1).repeat_interleave(group)
    return {k: v.to(device) for k, v in out.items()}, rewards.to(device)
