"""What one pass gives: the per-sequence gradients (:class:`PerSequenceGradients`), their inner products (the weights
of Theorem 7 and the SNR terms) and their weighted sum (the policy gradient, ``one_backward``'s update); or the
refusal (:class:`UnsupportedModulesError`), naming every module the pass cannot cover, with advice that works."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .factors import (
    vocab_chunk,
    Factored,
    Materialized,
    SoftmaxDelta,
    Usage,
    block_weighted_rows,
    keep_scaled,
    slot_products,
    summed_self_products,
)

ADVICE = (
    "Either freeze them (module.requires_grad_(False) for each), or train without exact norms: "
    "OBLRPOConfig(grad_norm_estimator='length', snr_lr=False) (a completion-length proxy for the baseline weights; "
    "the SNR step size needs the exact norms, so it must be off too), or register a rule with "
    "oblr_trl.grad_norms.register_grad_norm_rule."
)


@dataclass(frozen=True)
class Unsupported:
    name: str  # the module's qualified name ('' for the model itself)
    type: str  # its class name
    reason: str

    def __str__(self) -> str:
        return f"'{self.name}' ({self.type}): {self.reason}"


class UnsupportedModulesError(NotImplementedError):
    """Raised by :func:`~.coverage.validate` and by a pass; ``.modules`` lists every unsupported trainable module."""

    def __init__(self, modules: list[Unsupported], advice: str = ADVICE):
        self.modules = modules
        lines = "\n".join(f"  - {m}" for m in modules)
        super().__init__(
            f"Exact per-sequence gradient norms do not cover {len(modules)} trainable module(s) of this model:\n"
            f"{lines}\n{advice}"
        )


Slot = tuple[nn.Module, str]  # a parameter, as (owning module, attribute name)


def _reduce_scatter_like(grad: torch.Tensor, param) -> torch.Tensor:
    """A full-size gradient from this rank's samples -> the sum over ranks, sharded like the DTensor ``param``."""
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(grad, param.device_mesh, [Partial()] * param.device_mesh.ndim, run_check=False)
    return partial.redistribute(param.device_mesh, param.placements)


def _fp32(device: torch.device):
    """Autocast off: the Grams, the head's softmax terms and the weighted sums are accumulated in float32 even when
    the forward runs under bf16/fp16 autocast (which would otherwise run these matmuls in half precision). Where
    autocast is off already, nothing is entered (an autocast region's exit may also clear its cast cache)."""
    if not torch.is_autocast_enabled(device.type):
        return nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


class Replay(NamedTuple):
    """What a pass with ``keep_graph=True`` keeps for the update: the backbone's last hidden state (its graph kept;
    ``None`` where nothing in the backbone is trained), its output gradient ``(B, T, d)``, one row per sequence, and
    the LM head's usages by slot (the head runs outside that graph)."""

    hidden: torch.Tensor | None
    grad: torch.Tensor | None
    head_usages: dict


class PerSequenceGradients:
    """The per-sequence gradients ``u_i`` of one forward/backward, held per parameter: factored, or materialized
    where that takes no more memory (``materialize=True``; never for a large matrix over short sequences).

    Their inner products give the weights of Theorem 7 and the SNR terms (:meth:`inner_products`); their weighted
    sum ``sum_i s_i u_i`` is the policy gradient once the advantages are known (:meth:`accumulate_grad`), which is how
    ``OBLRPOConfig(one_backward=True)`` gets the norms and the update from a single backward.
    """

    def __init__(self, usages: dict[Slot, list[Usage]], batch: int, device, streamed: torch.Tensor | None = None,
                 slots: list[Slot] = (), self_done: set[int] = frozenset(), presummed: torch.Tensor | None = None):
        self.usages, self.batch, self.device = usages, batch, device
        # ids of usages whose products with themselves are already in ``streamed`` or ``presummed`` (the LM head's,
        # formed with its output gradient)
        self.self_done = set(self_done)
        # without streaming: those products, ``(B/k, k, k)``, used by inner_products(k) (other k form them again)
        self.presummed = presummed
        # inner products already summed during the backward (layers whose factors were consumed as they arrived)
        self.streamed = streamed
        self.slots = list(slots) or list(usages)  # every trainable parameter, in module order
        self.replay: Replay | None = None  # set by a pass with keep_graph=True

    @property
    def params(self) -> dict[Slot, nn.Parameter]:
        """The parameters with per-sample gradients, as registered now (FSDP2 swaps the objects as it (un)shards)."""
        return {slot: getattr(*slot) for slot in self.usages}

    def inner_products(self, group_size: int = 1) -> torch.Tensor:
        """``<u_i, u_j>`` within blocks of ``group_size`` consecutive rows: ``(B / group_size, k, k)``, float32."""
        if self.batch % group_size:
            raise ValueError(f"group_size={group_size} must divide the batch size {self.batch}.")
        if self.streamed is not None and self.streamed.shape[1] != group_size:
            raise ValueError(f"These gradients were streamed for group_size={self.streamed.shape[1]}.")
        out = torch.zeros(self.batch // group_size, group_size, group_size, device=self.device)
        if self.streamed is not None:
            out += self.streamed
        presummed = self.presummed is not None and self.presummed.shape[1] == group_size
        if presummed:
            out += self.presummed
        with _fp32(self.device):
            self._add_inner_products(out, group_size, self.self_done if presummed or self.streamed is not None
                                     else set())
        return out

    def _add_inner_products(self, out: torch.Tensor, group_size: int, done: set[int]) -> None:
        alone = []  # parameters with one usage: their self products, batched (summed_self_products)
        for param_usages in self.usages.values():
            if len(param_usages) == 1:
                if id(param_usages[0]) not in done:
                    alone.append(param_usages[0].blocked(group_size))
                continue
            if any(isinstance(u, Materialized) for u in param_usages):
                param_usages = [
                    u if isinstance(u, Materialized) else Materialized(u.materialize().flatten(1)) for u in param_usages
                ]
            blocked = [u.blocked(group_size) for u in param_usages]
            pairs = [(a, b) for a in range(len(blocked)) for b in range(a, len(blocked))
                     if a != b or id(param_usages[a]) not in done]  # each cross term, and each self not done
            if pairs:
                out += slot_products(blocked, pairs, group_size)
        summed = summed_self_products(alone, group_size)
        if summed is not None:
            out += summed

    # float32 elements of one (blocks, rows, columns) buffer of accumulate_grad (256 MiB: each slice of rows costs some
    # 10 operator calls; at 2^24 a Qwen3-1.7B layer took ~23 slices over 8 blocks)
    ROW_BUDGET = 1 << 26
    # float32 elements of the LM head's (B, T, rows) softmax slice in accumulate_grad: at most what the head pass's own
    # vocabulary chunks hold at 8,192 tokens (each slice costs some 30 operator calls)
    HEAD_BUDGET = 1 << 26
    head_rows = None  # rows of the head's weight formed at a time in the update (None: factors.vocab_chunk's)

    @torch.no_grad()
    def accumulate_grad(self, scale: torch.Tensor, group_size: int | None = None) -> torch.Tensor | None:
        """Add ``sum_i scale_i u_i`` to each trainable parameter's ``.grad`` (created if absent), as a backward of
        ``sum_i scale_i sum_t log pi(o_{i,t})`` would. An FSDP2-sharded parameter gets its shard of the gradient
        summed over ranks (a reduce-scatter, as FSDP2's own backward does; every rank must call this).

        With ``group_size=k``, also returns ``||sum_{i in q} scale_i u_i||^2`` for each block ``q`` of ``k``
        consecutive rows, ``(B / k,)``: a group's gradient ``H_q``, whose squared norm is one sample of the SNR's noise
        estimate. It comes nearly free: each block's part of a weight gradient is formed anyway (a parameter's rows
        are formed in slices of at most ``ROW_BUDGET`` elements over all blocks). Summed in float64 (float32 on MPS,
        which has no float64): the SNR subtracts the sum of these from a close number.
        """
        if scale.shape != (self.batch,):
            raise ValueError(f"scale must have shape ({self.batch},), got {tuple(scale.shape)}.")
        if self.streamed is not None:
            raise ValueError("Streamed gradients kept no factors to form a weighted sum from (stream_group_size).")
        k = self.batch if group_size is None else group_size
        if self.batch % k:
            raise ValueError(f"group_size={k} must divide the batch size {self.batch}.")
        nb = self.batch // k
        sq_dtype = torch.float32 if torch.device(self.device).type == "mps" else torch.float64
        sq_parts = [] if group_size is not None else None
        cache: dict = {}  # the scaled input shared by the layers that read one tensor (q/k/v, gate/up)
        for slot in self.slots:
            param, param_usages = getattr(*slot), self.usages.get(slot, [])
            sharded = hasattr(param, "device_mesh")  # an FSDP2 DTensor: every rank reduces every parameter, in order
            if not param_usages and not sharded:
                continue
            keep_scaled(cache, param_usages)
            with _fp32(self.device):
                grad = self._weighted_sum(param, param_usages, scale, k, sq_parts, sq_dtype, cache)
            if grad.shape != param.shape:
                grad = grad.reshape(param.shape)
            grad = grad.to(param.dtype)
            if sharded:  # this rank's full gradient: summed over ranks and sharded as the parameter is
                grad = _reduce_scatter_like(grad, param)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
        if sq_parts is None:
            return None
        if not sq_parts:
            return torch.zeros(nb, device=self.device, dtype=sq_dtype)
        total = sq_parts[0] if len(sq_parts) == 1 else torch.stack(sq_parts).sum(0)
        return total if nb > 1 else total.reshape(nb)  # one block's: a scalar each

    def _weighted_sum(self, param, param_usages: list[Usage], scale: torch.Tensor, k: int, sq_parts: list | None,
                      sq_dtype: torch.dtype, cache: dict) -> torch.Tensor:
        """One parameter's ``sum_i scale_i u_i``, ``(rows, cols)`` float32, formed in slices of rows of at most
        ``ROW_BUDGET`` elements over all blocks; each slice's per-block sums of squares appended to ``sq_parts``."""
        nb = self.batch // k
        rows = param.shape[0] if param.dim() else 1
        cols = param.numel() // max(rows, 1)
        step = max(1, min(rows, self.ROW_BUDGET // max(1, nb * cols)))
        for u in param_usages:  # the LM head's (B, T, rows) softmax slice is a buffer too
            if isinstance(u, Factored) and isinstance(u.left, SoftmaxDelta):
                # the head pass's chunks (factors.vocab_chunk: few where the tokens are few), or ``head_rows``
                # (the replayed update's VOCAB_CHUNK: it runs beside the weight gradients, at GRPO's peak)
                rows_at_once = self.head_rows or vocab_chunk(self.batch * u.right.t.shape[1], rows)
                step = min(step, rows_at_once, max(1, self.HEAD_BUDGET // (self.batch * u.right.t.shape[1])))
        if not param_usages:
            return torch.zeros(rows, cols, device=self.device)
        grad = None if step >= rows else torch.zeros(rows, cols, device=self.device)
        for start in range(0, rows, step):
            end = min(start + step, rows)
            parts = [block_weighted_rows(u, scale, k, start, end, cache) for u in param_usages]
            part = parts[0] if len(parts) == 1 else parts[0] + parts[1]
            for more in parts[2:]:
                part.add_(more)
            if sq_parts is not None:  # one block's rows have no block axis (factors.block_weighted_rows)
                sq_parts.append(part.pow(2).sum(dim=(1, 2), dtype=sq_dtype) if nb > 1 else
                                part.pow(2).sum(dtype=sq_dtype))
            if grad is None:  # one block: its rows as they are (the caller reshapes; no copy, one call fewer)
                return part.sum(0) if nb > 1 else part
            if nb > 1:
                torch.sum(part, 0, out=grad[start:end])  # into its rows: one call fewer than a sum and a copy
            else:
                grad[start:end] = part
        return grad

