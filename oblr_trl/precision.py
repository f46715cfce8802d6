"""Does a learning rate still move low-precision weights? A pure check, used to warn before a run silently stalls.

An Adam-family step changes each weight by about the learning rate (its update is normalized). A bf16 weight ``w``
keeps 8 significant bits, so a change smaller than half the spacing of bf16 numbers around ``w`` (``~|w| 2^-8``)
rounds away: at lr 1e-6 and weights of size ~1e-2 almost no bf16 weight moves. The SNR step size multiplies the
lr by a factor below 1, which makes this likelier. Keeping fp32 master weights (load the model in float32 and train
under ``bf16=True`` autocast) avoids it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def frozen_fraction(parameters: Iterable[torch.Tensor], lr: float) -> float:
    """The fraction of low-precision trainable elements for which an update of size ``lr`` rounds away.

    Returns 0.0 when no trainable parameter is in a low-precision dtype.
    """
    frozen = total = 0
    for p in parameters:
        if not p.requires_grad or p.dtype not in LOW_PRECISION:
            continue
        w = p.detach().abs()
        spacing = torch.nextafter(w, torch.full_like(w, float("inf"))) - w  # in the parameter's own dtype
        frozen += int((lr < spacing.float() / 2).sum())
        total += w.numel()
    return frozen / total if total else 0.0
