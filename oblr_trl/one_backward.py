"""The machinery of ``one_backward``: norms, advantages and the policy update from one forward and one backward.

No trainer state: the trainer calls these with what it holds, and they return what they found. Data flows one way:
the trainer takes each chunk's norms, forms its advantages as the two-pass path does, and hands back ``a_i = c_i A_i``.

* :class:`Plan`: whether it runs, and in chunks of how many rows (decided at construction or the first generation).
* :func:`chunk_norms`: one micro-batch's norms, chunk by chunk (a :class:`ChunkNorms` each); from them the caller
  forms the advantages, and :meth:`ChunkNorms.update` the chunk's gradient and SNR terms (a :class:`ChunkUpdate`)
  from the same backward (or, ``replay_unit``, from a second backward of the pass's graph: :func:`replayed_update`).

* :func:`blockers`: why a configuration cannot use it (then the two-pass path runs, and says why).
* :func:`whole_group_micro_batches`: TRL's shuffled micro-batches re-split so each holds whole groups.
* :func:`all_reduce_grads`: what DDP's backward hooks would have done, once per optimizer step.
* :func:`describe`: the model's and the batch's shapes, from which :mod:`.cost_model` predicts the cost of each path
  and the default chooses (``one_backward`` and its chunks where they stay within the cost targets against GRPO's).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from trl.trainer.utils import split_tensor_dict

from . import cost_model
from .estimators import mask_nonfinite_products
from .grad_norms import per_sequence_grads
from .grad_norms.lm import output_head, unwrap_causal_lm
from .loss_terms import terms_beyond_ratio_one
from .trl_seam import sequence_inputs

ALL_REDUCE_BUCKET = 1 << 25  # elements per all-reduce (DDP's default bucket is 25 MiB)


def blockers(args, *, fsdp1: bool = False, aux_loss: bool = False, deepspeed: bool = False) -> list[str]:
    """Why ``one_backward`` cannot be used with ``args`` (an ``OBLRPOConfig``); empty: it can.

    ``one_backward`` forms the gradient of the policy term at ratio 1 only, so anything else TRL's loss would add
    (a KL term, an entropy bonus, an MoE router's auxiliary loss, token masks, importance weights) blocks it.
    """
    a, reasons = args, list(terms_beyond_ratio_one(args).values())
    if a.gradient_accumulation_steps % a.steps_per_generation:
        reasons.append(
            f"steps_per_generation={a.steps_per_generation} does not divide gradient_accumulation_steps="
            f"{a.gradient_accumulation_steps} (a generation's later micro-batches would be off-policy)"
        )
    elif a.steps_per_generation > 1 and a.per_device_train_batch_size % a.num_generations:
        reasons.append(
            f"per_device_train_batch_size={a.per_device_train_batch_size} is not a multiple of num_generations="
            f"{a.num_generations} with steps_per_generation={a.steps_per_generation} (each micro-batch must hold "
            "whole groups: a group's baseline needs all its norms)"
        )
    if a.use_vllm and getattr(a, "vllm_importance_sampling_correction", False):
        reasons.append("vllm_importance_sampling_correction=True (per-token importance weights)")
    if a.use_liger_kernel:
        reasons.append("use_liger_kernel=True (Liger computes the loss)")
    if a.fp16:
        reasons.append("fp16=True (the loss scaler would unscale gradients it never scaled; use bf16)")
    if aux_loss:
        reasons.append("the model's router auxiliary loss (router_aux_loss_coef != 0)")
    if fsdp1:
        reasons.append("FSDP1 (use FSDP2: fsdp_version 2)")
    if deepspeed:
        reasons.append("DeepSpeed (ZeRO owns the gradient buffers and reduces them in its backward hooks; "
                       "one_backward writes .grad outside autograd, which ZeRO would never see)")
    return reasons


def initial_choice(requested: bool | None, reasons: list[str]) -> tuple[bool | None, str]:
    """``one_backward``'s path at construction, and why: ``True``, ``False``, or ``None`` (the automatic choice,
    decided at the first generation from the model's and the batch's shapes by :func:`.cost_model.choose`).

    ``requested``: ``OBLRPOConfig.one_backward``; ``reasons``: :func:`blockers`."""
    if reasons:
        why = "; ".join(reasons)
        if requested:
            return False, f"one_backward=True falls back to two passes (norms pass, then the loss pass): {why}."
        return False, f"OBLR-PO takes the two-pass path (norms pass, then the loss pass): {why}."
    if requested:
        return True, "OBLR-PO takes norms and update from one forward/backward (one_backward)."
    return None, ""


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


def _full_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """A weight's whole shape, also where DeepSpeed ZeRO-3 holds only this rank's flat shard (its ``ds_shape``)."""
    return tuple(getattr(weight, "ds_shape", None) or weight.shape)


def describe(model: torch.nn.Module, rows: int, prompt: int, completion: int, itemsize: int,
             checkpointing: bool, group: int) -> cost_model.Shape:
    """``model``'s and a micro-batch's shapes for :mod:`.cost_model`: its decoder layers (those gradient checkpointing
    wraps; their count, the first one's linear maps (``nn.Linear``, GPT-2's ``Conv1D``) and LoRA adapters), hidden
    width, attention heads and LM head. Other weights (experts' banks, convolutions) are not in the model."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    lm = unwrap_causal_lm(model)
    head = output_head(lm)
    config = getattr(lm, "config", None)
    config = config.get_text_config() if config is not None else None
    linears, adapters = [], []
    for name, m in (layers[0] if layers else model).named_modules():
        if m is head or not isinstance(getattr(m, "weight", None), torch.Tensor) or len(_full_shape(m.weight)) != 2 \
                or not isinstance(m, torch.nn.Linear) and type(m).__name__ != "Conv1D":
            continue
        n_in, n_out = (m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else _full_shape(m.weight)
        if "lora_" in name:
            if m.weight.requires_grad:
                adapters.append((n_in, n_out))
        else:
            linears.append((n_in, n_out, m.weight.requires_grad))
    vocab, hidden = _full_shape(head.weight) if head is not None else (0, getattr(config, "hidden_size", 0))
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    embeddings = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    return cost_model.Shape(
        layers=max(1, len(layers)), hidden=hidden, vocab=vocab, heads=heads, head_dim=head_dim,
        linears=tuple(linears), adapters=tuple(adapters),
        head_trainable=head is not None and head.weight.requires_grad,
        tied=head is not None and embeddings is not None and head.weight is embeddings.weight, rows=rows,
        prompt=prompt, completion=completion, itemsize=itemsize, checkpointing=checkpointing, group=group)


class Plan:
    """Whether ``one_backward`` runs, and in chunks of how many rows (0: the whole micro-batch).

    Set at construction from :func:`initial_choice`; the automatic choice (and, under gradient checkpointing, the
    chunks of ``one_backward=True``) is decided at the first generation by :meth:`decide`, from the shapes."""

    def __init__(self, enabled: bool | None, gradient_checkpointing: bool, needs_norms: bool = True):
        self.enabled = enabled  # None: the automatic choice, until decide()
        self.chunk_rows = 0
        self.replay = False  # the update by a second backward of the norms pass's graph (no factors kept)
        self.norms_chunk = 0  # rows per chunk of the two-pass path's norms pass (0: the micro-batch's)
        self.decided = not needs_norms or (enabled is not None and not gradient_checkpointing)

    @classmethod
    def for_trainer(cls, args, *, needs_norms: bool, fsdp1: bool, aux_loss: bool,
                    deepspeed: bool) -> tuple["Plan", str, bool]:
        """The plan at construction, the message saying why (``""``: nothing to say) and whether it is a warning
        (asked for, or under DeepSpeed, and refused)."""
        if args.one_backward is False or not needs_norms:
            plan, why, loud = cls(False, args.gradient_checkpointing, needs_norms), "", False
        else:
            reasons = blockers(args, fsdp1=fsdp1, aux_loss=aux_loss, deepspeed=deepspeed)
            enabled, why = initial_choice(args.one_backward, reasons)
            plan, loud = cls(enabled, args.gradient_checkpointing), bool(reasons and (args.one_backward or deepspeed))
        # Under DeepSpeed the norms pass keeps TRL's micro-batches (no cost-model chunks): ZeRO-3 fetches and releases
        # parameters per forward/backward, and back-to-back norms passes over smaller chunks left a gathered
        # parameter active ("Cannot free a ZeRO-3 parameter while it is still active in submodules")
        plan.decided = plan.decided or deepspeed
        return plan, why, loud

    @property
    def on(self) -> bool:
        return bool(self.enabled)

    def switch_off(self) -> None:
        self.enabled, self.chunk_rows, self.replay, self.decided = False, 0, False, True

    def decide(self, model, batch: dict, args, group_size: int, max_completion_length: int, device,
               gather, optimizer=None, budget: cost_model.Budget | None = None) -> str:
        """The automatic choice (:func:`.cost_model.choose`: ``one_backward`` in the largest chunk of whole groups
        whose predicted peak bytes and FLOPs stay within the targets against GRPO's, else two passes), or, for
        ``one_backward=True``, that chunk (one group where none fits); and the two-pass path's norms-pass chunk
        (:func:`.cost_model.norms_chunk`). The same on every rank (``gather``: the accelerator's, whose result's
        elementwise minimum over ranks is taken). With a budget (``budget``, else :func:`device_budget`: a GPU's
        free memory or the host's available memory, less the state ``optimizer`` has yet to allocate, or
        ``args.max_extra_memory_gib``) the choice is the memory-aware one: on a GPU
        :func:`.cost_model.choose_within` (``one_backward`` wherever its predicted peak fits), on the CPU
        :func:`.cost_model.choose_on_host` (chunks within the ratio target first). Returns the message to log."""
        if budget is None:
            budget = device_budget(device, getattr(args, "max_extra_memory_gib", None),
                                   optimizer_state_pending(model, optimizer))
        rows = min(batch["prompt_ids"].shape[0], args.per_device_train_batch_size)
        shape = describe(model, rows, batch["prompt_ids"].shape[1], max_completion_length,
                         2 if (args.bf16 or args.fp16) else 4, args.gradient_checkpointing, group_size)
        # replayed only in one process: its second backward runs outside DDP's and FSDP's forward (untested there)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        within = {} if budget is None else {"budget": budget}  # no budget: the ratio targets, as before
        host = budget is not None and budget.host  # the CPU's host rule, else a GPU's memory-aware choice
        choose = (cost_model.choose if budget is None else
                  cost_model.choose_on_host if host else cost_model.choose_within)
        choice = choose(shape, **within, replay=not distributed)
        if self.enabled is None:
            chunk = choice.chunk
        elif host:  # one_backward=True on a CPU: the host rule's chunk, else (below) one group at a time
            chunk = choice.chunk if choice.one_backward and not choice.replay else 0
        else:
            chunk = cost_model.fitting_chunk(shape, **within)[0]
        chunks = [chunk, cost_model.norms_chunk(shape, **within)]
        if distributed:  # the same on every rank: the smallest
            chunks = gather(torch.tensor(chunks, device=device)[None]).min(0).values.tolist()
        chunk, self.norms_chunk = (int(c) for c in chunks)
        if self.enabled is False:
            self.decided = True
            return f"OBLR-PO (two passes, gradient checkpointing on): norms pass in chunks of {self.norms_chunk} rows."
        if self.enabled is None:
            self.enabled, self.replay = chunk > 0, chunk > 0 and choice.replay
        elif chunk == 0:  # one_backward=True: as little at a time as whole groups allow
            chunk = cost_model.chunk_sizes(rows, group_size)[-1]
        self.chunk_rows, self.decided = (chunk if self.enabled else 0), True
        if self.enabled:
            how = ("one forward/backward per micro-batch" if chunk >= rows else
                   f"one forward/backward per chunk of {chunk} rows ({chunk // group_size} groups)")
            how += (", the update replayed by a second backward of its graph (no per-layer factors kept)."
                    if self.replay else ".")
        else:
            how = "two passes (norms pass, then the loss pass)."
        if budget is not None:
            grpo_f, grpo_b = cost_model.flops(shape, "grpo"), cost_model.peak_bytes(shape, "grpo")
            ran = "replay" if self.replay else "one_backward" if self.enabled else "two_passes"
            peak = cost_model.peak_bytes(shape, ran, self.chunk_rows or self.norms_chunk)
            return (f"OBLR-PO (one_backward={args.one_backward}, gradient checkpointing "
                    f"{'on' if args.gradient_checkpointing else 'off'}, memory-aware): for {rows} x {shape.tokens} "
                    f"tokens it takes {how[:-1]}: {choice.reason}. Predicted: time (FLOPs) "
                    f"{cost_model.flops(shape, ran) / grpo_f:.2f}x GRPO's, peak {cost_model.readable_bytes(peak)} "
                    f"against GRPO's {cost_model.readable_bytes(grpo_b)} (oblr_trl/cost_model.py; "
                    "OBLRPOConfig.max_extra_memory_gib "
                    "caps what it may add).")
        limit = cost_model.BYTES_TARGET if args.gradient_checkpointing else cost_model.BYTES_TARGET_NO_CKPT
        return (f"OBLR-PO (one_backward={args.one_backward}, gradient checkpointing "
                f"{'on' if args.gradient_checkpointing else 'off'}): for {rows} x {shape.tokens} tokens, "
                f"one_backward{' (replayed)' if self.replay else ''}'s predicted cost against GRPO's is "
                f"{choice.flops_ratio:.2f}x the FLOPs (target "
                f"<= {cost_model.FLOPS_TARGET}x) and {choice.bytes_ratio:.2f}x the peak bytes (target <= {limit}x; "
                "oblr_trl/cost_model.py, verified by benchmarks/cost_counts.py): " + how)


def device_budget(device, max_extra_gib: float | None, pending: float = 0.0) -> cost_model.Budget | None:
    """What the memory-aware default may spend on ``device``: on a GPU, the room :func:`.cost_model.memory_room`
    finds from ``torch.cuda.mem_get_info``, the allocator's counters and its per-process memory fraction; on the CPU,
    the host's available memory (:func:`host_memory`: within a container's limit, shared by this machine's
    processes); either less a margin (:func:`.cost_model.margin_bytes`) and ``pending`` bytes still to come (the
    optimizer's state). With ``max_extra_gib`` (``OBLRPOConfig.max_extra_memory_gib``), at most that many GiB beyond
    GRPO's predicted peak. ``None`` on a device with no free-memory figure (MPS, XPU, ...) and no cap: the ratio
    targets of :func:`.cost_model.choose` then."""
    cap = None if max_extra_gib is None else float(max_extra_gib) * 2**30
    device = torch.device(device)
    if device.type == "cpu":
        free, total = host_memory()
        if free is not None:
            room = cost_model.memory_room(free, total, 0.0, 0.0, 1.0, cost_model.margin_bytes(total), pending)
            return cost_model.Budget(room, cap, host=True)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None if cap is None else cost_model.Budget(float("inf"), cap)
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = getter(index) if getter is not None else 1.0
    room = cost_model.memory_room(free, total, torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index),
                                  fraction, cost_model.margin_bytes(total), pending)
    return cost_model.Budget(room, cap)


CGROUP = "/sys/fs/cgroup"  # cgroup v2's files (memory.max, memory.current, memory.stat); v1's under memory/


def _read_cgroup(name: str) -> str | None:
    try:
        with open(f"{CGROUP}/{name}") as f:
            return f.read()
    except OSError:
        return None


def _cgroup_memory() -> tuple[float | None, float]:
    """A container's memory limit (None: none) and what it uses less its reclaimable page cache (``inactive_file``),
    from cgroup v2, else v1."""
    for limit_file, used_file, stat_file, key in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                                  ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                                   "memory/memory.stat", "total_inactive_file")):
        limit = _read_cgroup(limit_file)
        if limit is None:
            continue
        limit = limit.strip()
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes ~2^63 for no limit
            return None, 0.0
        stat = dict(line.split() for line in (_read_cgroup(stat_file) or "").splitlines() if len(line.split()) == 2)
        used = float((_read_cgroup(used_file) or "0").strip() or 0) - float(stat.get(key, 0))
        return float(limit), max(0.0, used)
    return None, 0.0


def host_memory() -> tuple[float | None, float]:
    """The host memory this process may count on for a step (:func:`.cost_model.host_free`: psutil's available
    bytes, within a container's limit, shared by ``LOCAL_WORLD_SIZE`` processes) and the total it is part of;
    ``(None, 0)`` where psutil is missing."""
    try:
        import psutil  # accelerate's dependency
    except ImportError:
        return None, 0.0
    memory = psutil.virtual_memory()
    limit, used = _cgroup_memory()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    total = memory.total if limit is None else min(memory.total, limit)
    return cost_model.host_free(memory.available, limit, used, processes), float(total)


def optimizer_state_pending(model, optimizer) -> float:
    """Bytes the optimizer's state will take at its first step where it holds none yet: two float32 values per
    trainable element (Adam's moments; an over-estimate for lighter optimizers), else 0."""
    if optimizer is not None and getattr(optimizer, "state", None):
        return 0.0
    return 8.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)


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
    checkpointed inputs is held); the head's from its usages (:meth:`.PerSequenceGradients.accumulate_grad`).
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
