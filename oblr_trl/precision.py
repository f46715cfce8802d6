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


FROZEN_WARNING = 0.5  # warn when an update of the applied lr rounds away for this fraction of low-precision weights


class PrecisionWatch:
    """Checks, each time the applied lr halves, whether updates of it round away for most low-precision trainable
    weights. :meth:`check` returns the :data:`.advice.WARNINGS` key and its fields once that happens, else None."""

    def __init__(self):
        self.checked_lr = float("inf")
        self.warned = False

    def check(self, parameters: Iterable[torch.Tensor], lr: float) -> tuple[str, dict] | None:
        if self.warned or not 0 < lr < self.checked_lr / 2:
            return None
        self.checked_lr = lr
        frozen = frozen_fraction(parameters, lr)
        if frozen <= FROZEN_WARNING:
            return None
        self.warned = True
        return "precision", dict(lr=lr, frozen=frozen)
