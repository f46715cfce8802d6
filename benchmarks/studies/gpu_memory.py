"""The memory-tight row of ``benchmarks/bench_gpu.py`` (issue 56): the per-process memory fraction that makes the
default's ``one_backward`` not fit while GRPO's measured peak still does, from the cost model's shape of a row."""

from __future__ import annotations

import torch


def tight_fraction(trainer, cfg: dict, need_gib: float, prompt: int, group: int) -> tuple[float | None, str]:
    """The per-process memory fraction for the memory-tight row: what is allocated now, the default's margin, the
    optimizer's state to come and 0.9x what ``one_backward``'s smallest chunk would need (its predicted peak times
    the default's safety factor), so that it cannot fit; ``None`` and why where that would not hold ``need_gib``
    (GRPO's measured peak from the build, plus 5%), since GRPO must still run."""
    from oblr_trl import cost_model, one_backward

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    shape = one_backward_shape(trainer, cfg, prompt, group)
    smallest = min(cost_model.peak_bytes(shape, "one_backward", c) for c in cost_model.chunk_sizes(cfg["batch"], group))
    limit = (torch.cuda.memory_allocated() + cost_model.margin_bytes(total)
             + one_backward.optimizer_state_pending(trainer.model, trainer.optimizer)
             + 0.9 * cost_model.MEMORY_SAFETY * smallest)
    if limit < 1.05 * need_gib * 2**30:
        return None, (f"a fraction that refuses one_backward ({limit / 2**30:.1f} GiB) would not hold GRPO's measured "
                      f"peak ({need_gib:.1f} GiB): not forced")
    return min(1.0, limit / total), f"fraction {limit / total:.3f} ({limit / 2**30:.1f} GiB of {total / 2**30:.0f})"


def one_backward_shape(trainer, cfg: dict, prompt: int, group: int):
    """The cost model's shape of ``trainer``'s model and a ``cfg`` micro-batch, in bf16 (the GPU's autocast)."""
    from oblr_trl import one_backward

    return one_backward.describe(trainer.model, cfg["batch"], prompt, cfg["completion"], 2, cfg["ckpt"], group)
