"""The machinery of ``one_backward``: norms, advantages and the policy update from one forward and one backward.

No trainer state and no decision: :mod:`.path_choice` decides whether it runs and in what chunks (a
:class:`.path_choice.Route`); the trainer calls these with what it holds, and they return what they found. Data flows
one way: the trainer takes each chunk's norms, forms its advantages as the two-pass path does, and hands back
``a_i = c_i A_i``.

* :func:`chunk_norms`: one micro-batch's norms, chunk by chunk (a :class:`ChunkNorms` each); from them the caller
  forms the advantages, and :meth:`ChunkNorms.update` the chunk's gradient and SNR terms (a :class:`ChunkUpdate`)
  from the same backward (or, ``replay_unit``, from a second backward of the pass's graph: :func:`replayed_update`).
* :func:`whole_group_micro_batches`: TRL's shuffled micro-batches re-split so each holds whole groups.
* :func:`all_reduce_grads`: what DDP's backward hooks would have done, once per optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from trl.trainer.utils import split_tensor_dict

from .estimators import mask_nonfinite_products
from .grad_norms import per_sequence_grads
from .trl_seam import sequence_inputs

ALL_REDUCE_BUCKET = 1 << 25  # elements per all-reduce (DDP's default bucket is 25 MiB)


def whole_group_micro_batches(micro_batches: list[dict], group_size: int) -> list[dict]:
    """TRL's (shuffled) micro-batches of one generation batch, re-split so that each holds whole groups.

    Groups go in the order of their first row in TRL's shuffle (as random, and no random numbers drawn), each group's
    rows in row order. Rows are identified by ``oblr_row`` (consecutive within a group).
    """
    merged = {}
    for key, first in micro_batches[0].items():
        parts = [mb[key] for mb in micro_batches]
        if isinstance(first, list):
            merged[key] = [x for part in parts for x in part]
        elif torch.is_tensor(first) and first.dim() > 0:
            merged[key] = torch.cat(parts)
        else:  # None, or a scalar every micro-batch shares (num_items_in_batch)
            merged[key] = first
    index = merged["oblr_row"] - merged["oblr_row"].min()
    n, group = index.shape[0], index // group_size
    first = torch.full((n // group_size,), n, device=index.device)
    first.scatter_reduce_(0, group, torch.arange(n, device=index.device), "amin")
    rows = torch.argsort(first[group] * n + index)
    for key, value in merged.items():
        if torch.is_tensor(value) and value.dim() > 0:
            merged[key] = value[rows]
        elif isinstance(value, list):
            merged[key] = [value[i] for i in rows.tolist()]
    return split_tensor_dict(merged, len(micro_batches))


def all_reduce_grads(parameters, bucket_elements: int = ALL_REDUCE_BUCKET) -> None:
    """Sum the trainable parameters' ``.grad`` over ranks, in buckets, in the same order on every rank."""
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:  # e.g. a rank whose batch never reached a parameter: it still takes part
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:  # consecutive parameters of one gradient dtype, up to bucket_elements each
        if not buckets or size + p.numel() > bucket_elements or p.grad.dtype != buckets[-1][0].grad.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        torch.distributed.all_reduce(flat)
        for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(part.view_as(p))


def rows_of(batch: dict, index, n: int) -> dict:
    """The batch's per-row tensors (first dimension ``n``) at ``index``, the rest as they are."""
    return {k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v for k, v in batch.items()}


@dataclass(frozen=True)
class ChunkUpdate:
    """What one chunk's update leaves besides ``.grad``: ``loss``, the value of TRL's loss at ratio 1 over the chunk
    (no graph); ``units`` and ``unit_sq``, the SNR units' ids and their ``||H_q||^2`` (``None`` without the SNR)."""

    loss: torch.Tensor
    units: torch.Tensor | None
    unit_sq: torch.Tensor | None


class ChunkNorms:
    """One chunk of ``one_backward`` after its forward and backward: ``rows`` (its slice of the micro-batch) and
    ``batch`` (those rows), each row's ``sq_norms`` ``||u_i||^2`` (0 where not finite), the ``unscorable`` rows (norm
    not finite) and the ``warnings`` found. It holds the backward's factors (or, replayed, its graph) until
    :meth:`update` uses and frees them: the advantages (formed by the caller from these norms) come between the
    backward and the update. ``unit``: rows per block of the inner products taken (a replayed pass streams them by
    SNR unit, since its update keeps no factors to form ``||H_q||^2`` from)."""

    def __init__(self, rows: slice, batch: dict, grads, unit: int = 1):
        self.rows, self.batch, self._grads = rows, batch, grads
        products, self.unscorable = mask_nonfinite_products(grads.inner_products(unit))
        self._products = products if grads.replay is not None else None
        self.sq_norms = torch.diagonal(products, dim1=1, dim2=2).reshape(-1)
        self.found = {"nonfinite_norms": self.unscorable.any()}  # read with the step's other checks (advantages.raised)

    @property
    def pending(self) -> bool:
        """Whether :meth:`update` has yet to run (the factors are still held)."""
        return self._grads is not None

    def update(self, a: torch.Tensor, *, snr_unit: int | None) -> ChunkUpdate:
        """Adds ``-sum_i a_i u_i`` to each weight's ``.grad``, ``a_i = c_i A_i`` (the gradient of TRL's loss at
        importance ratio 1), and with ``snr_unit`` (rows per SNR unit; ``None``: no SNR) each unit's
        ``||H_q||^2 = ||sum_{i in q} a_i u_i||^2``. Once per chunk: the factors are freed here, before the next
        chunk's forward."""
        if not self.pending:
            raise RuntimeError("ChunkNorms.update: this chunk's update has run already (its factors are freed).")
        grads, self._grads, unit = self._grads, None, snr_unit or 0
        dtype = torch.float32 if a.device.type == "mps" else torch.float64
        if self._products is not None:  # replayed: a second backward of the kept graph; ||H_q||^2 = a_q^T P_q a_q
            replayed_update(grads, -a, self.unscorable)
            q = a.to(dtype).reshape(-1, self._products.shape[-1])
            unit_sq = torch.einsum("qi,qij,qj->q", q, self._products.to(dtype), q) if unit else None
            self._products = None
        else:
            unit_sq = grads.accumulate_grad(-a, group_size=unit if unit > 1 else None)
            if unit == 1:  # a unit of one row needs no block of its own: a_i^2 ||u_i||^2, from the norms
                unit_sq = a.to(dtype).pow(2) * self.sq_norms.to(dtype)
        del grads
        units = None if unit_sq is None else self.batch["oblr_row"][::unit] // unit
        return ChunkUpdate((-(a * sequence_inputs(self.batch)[2].sum(-1))).sum(), units, unit_sq)


def chunk_norms(model, batch: dict, *, chunk: int, temperature: float, autocast,
                replay_unit: int | None = None) -> Iterator[ChunkNorms]:
    """``one_backward``'s norms of one micro-batch, one chunk of ``chunk`` rows (whole units, rows in generation
    order) at a time: a forward and a backward that reach every layer's output and keep the factors of each row's
    gradient ``u_i``. The caller forms the chunk's advantages from its norms and calls :meth:`ChunkNorms.update`
    before asking for the next chunk (refused otherwise: its update would be lost).

    ``replay_unit`` (replayed, under gradient checkpointing where the kept factors would not fit; rows per SNR unit):
    each chunk's backward streams the units' inner products and keeps its graph but no factors, and the update is a
    second backward of that graph (:func:`replayed_update`)."""
    n = batch["oblr_row"].shape[0]
    for s in range(0, n, chunk):
        part = batch if s == 0 and chunk >= n else rows_of(batch, slice(s, s + chunk), n)  # whole: no slicing calls
        input_ids, attention_mask, mask = sequence_inputs(part)
        with torch.enable_grad(), autocast():
            grads = per_sequence_grads(model, input_ids, attention_mask, mask, temperature=temperature,
                                       materialize=replay_unit is None, stream_group_size=replay_unit,
                                       keep_graph=replay_unit is not None)
            norms = ChunkNorms(slice(s, s + chunk), part, grads, replay_unit or 1)
        del grads
        yield norms
        if norms.pending:
            raise RuntimeError(f"one_backward: the update of rows {s}..{s + chunk} was not applied "
                               "(ChunkNorms.update) before the next chunk was asked for.")


def replayed_update(grads, a: torch.Tensor, bad: torch.Tensor) -> None:
    """``sum_i a_i u_i`` added to ``.grad`` from a pass with ``keep_graph=True``: the backbone's part by a second
    backward of its kept graph, the last hidden state's per-row gradient scaled by ``a_i`` (under non-reentrant
    checkpointing each layer is recomputed again: the layers' cost is GRPO's backward, and nothing beyond the
    checkpointed inputs is held); the head's from its usages (:meth:`.grad_norms.PerSequenceGradients.accumulate_grad`).
    Rows ``bad`` (a norm that was not finite) add nothing."""
    from .grad_norms import PerSequenceGradients
    from .grad_norms.factors import VOCAB_CHUNK

    hidden, grad, head_usages = grads.replay
    scale = torch.where(bad, torch.zeros_like(a), a)
    if hidden is not None:
        row_grad = grad * scale.to(grad.dtype)[:, None, None]
        torch.autograd.backward(hidden, torch.where(bad[:, None, None], torch.zeros_like(row_grad), row_grad))
    if head_usages:
        head = PerSequenceGradients(head_usages, a.shape[0], a.device, slots=list(head_usages))
        head.head_rows = VOCAB_CHUNK  # small slices: this runs beside every weight gradient, where GRPO peaks
        head.accumulate_grad(scale)
