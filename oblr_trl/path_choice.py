"""The path each training step takes, and why: the one place the default's rule lives.

OBLR-PO forms its norms, advantages and update on one of four paths: ``one_backward`` whole (one forward and one
backward per micro-batch, each layer's factors kept until the advantages are known), ``one_backward`` in chunks of
whole groups, ``one_backward`` replayed (no factors kept: the update from a second backward of the pass's graph, under
gradient checkpointing, one process), or two passes (a norms pass, then TRL's loss pass; its norms pass in chunks
too). This module decides which, once, at the first generation; :mod:`.one_backward` runs the chosen path and
:mod:`.cost_model` predicts each path's FLOPs and peak bytes from the model's and the batch's shapes (:func:`describe`).

* **Blockers** (:func:`blockers`): settings under which ``one_backward`` would not compute TRL's loss (anything at an
  importance ratio other than 1, token masks, fp16's loss scaler, Liger, FSDP1, DeepSpeed): two passes, said once.
* **Memory readers** (:func:`device_budget`): a GPU's room from ``torch.cuda.mem_get_info``, the allocator's cache and
  the per-process memory fraction (:func:`memory_room`); the CPU's from the host's available memory within a
  container's cgroup limit, shared by ``LOCAL_WORLD_SIZE`` processes (:func:`host_memory`, :func:`host_free`); either
  less a margin (:func:`margin_bytes`: 5% of the device, at least 1 GiB) and the optimizer's state still to come
  (:func:`optimizer_state_pending`); at most ``OBLRPOConfig.max_extra_memory_gib`` beyond GRPO's predicted peak.
* **The rules**, one per kind of budget (:func:`rule_for` picks it):

  - a GPU's, :func:`choose_within`: ``one_backward``, whole or in the largest chunk of whole groups, wherever its
    FLOPs are at most :data:`FLOPS_TARGET` (1.3x) GRPO's and its predicted peak, times :data:`MEMORY_SAFETY` (1.25),
    fits the room, or is no more than GRPO's own predicted peak (:func:`fits`); else, under checkpointing,
    ``one_backward`` replayed in the largest chunk that fits; else two passes.
  - the CPU's, :func:`choose_on_host`: ``one_backward`` in the largest chunk whose predicted peak is within
    :data:`BYTES_TARGET` (1.1x) GRPO's under checkpointing (:data:`BYTES_TARGET_NO_CKPT`, 1.2x, without) and fits the
    host's room; else one group at a time where that fits (on a CPU a chunk costs little time); else as on a GPU.
  - the ratio rule, :func:`choose`, on a device with no free-memory figure (MPS, XPU) and no cap: the largest chunk
    within those byte ratios where the FLOPs are within the FLOP target; else replayed, where that costs fewer FLOPs
    than two passes; else two passes.

  ``one_backward=True`` takes the rule's chunk (one group at a time where none fits); ``False`` two passes, whose
  norms pass runs in the largest chunk that fits (:func:`norms_chunk`).
* **The decision** (:class:`Route`): made at construction where the settings decide it (:func:`initial_choice`),
  else at the first generation (:meth:`Route.at_generation`, asked by the trainer each generation: image inputs switch
  the automatic choice to two passes), the same on every rank, and logged once with its reason and the predicted time
  and bytes against GRPO's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import cost_model, multimodal
from .grad_norms.hooks import runs_reentrant
from .grad_norms.model import output_head, unwrap_causal_lm
from .grad_norms.rules.registry import declared_cost, full_shape
from .loss_terms import terms_beyond_ratio_one

# ---------------------------------------------------------------------------------------------- the targets
FLOPS_TARGET = 1.3  # one_backward's FLOPs at most this times GRPO's
BYTES_TARGET = 1.1  # its peak bytes at most this times GRPO's, under gradient checkpointing
BYTES_TARGET_NO_CKPT = 1.2  # and without
# The byte model is fitted (0.8-1.4x the counted peaks, benchmarks/results/cost_counts*.md): a prediction is weighed at
# MEMORY_SAFETY times itself against the room the device has left, less a margin (MARGIN_FRACTION of the device, at
# least MARGIN_MIN bytes) for the allocator's fragmentation and what the model leaves out.
MEMORY_SAFETY = 1.25
MARGIN_FRACTION = 0.05
MARGIN_MIN = 1 << 30


# ---------------------------------------------------------------------------------------------- the blockers
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
    decided at the first generation from the model's and the batch's shapes by :func:`choose`).

    ``requested``: ``OBLRPOConfig.one_backward``; ``reasons``: :func:`blockers`."""
    if reasons:
        why = "; ".join(reasons)
        if requested:
            return False, f"one_backward=True falls back to two passes (norms pass, then the loss pass): {why}."
        return False, f"OBLR-PO takes the two-pass path (norms pass, then the loss pass): {why}."
    if requested:
        return True, "OBLR-PO takes norms and update from one forward/backward (one_backward)."
    return None, ""


# ---------------------------------------------------------------------------------------------- the shapes
def describe(model: torch.nn.Module, rows: int, prompt: int, completion: int, itemsize: int,
             checkpointing: bool, group: int) -> cost_model.Shape:
    """``model``'s and a micro-batch's shapes for :mod:`.cost_model`: its decoder layers (those gradient checkpointing
    wraps; their count, the first one's linear maps (each as its grad-norm rule declares it,
    :func:`~.grad_norms.rules.registry.declared_cost`: ``nn.Linear``, GPT-2's ``Conv1D``) and LoRA adapters), hidden
    width, attention heads and LM head. Other weights (experts' banks, convolutions) are not in the model."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    lm = unwrap_causal_lm(model)
    head = output_head(lm)
    config = getattr(lm, "config", None)
    config = config.get_text_config() if config is not None else None
    linears, adapters = [], []
    for name, m in (layers[0] if layers else model).named_modules():
        shape = None if m is head else declared_cost(m)  # as the layer's grad-norm rule declares it
        if shape is None:
            continue
        n_in, n_out, trainable = shape
        if "lora_" in name:
            if trainable:
                adapters.append((n_in, n_out))
        else:
            linears.append((n_in, n_out, trainable))
    vocab, hidden = full_shape(head.weight) if head is not None else (0, getattr(config, "hidden_size", 0))
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    embeddings = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    return cost_model.Shape(
        layers=max(1, len(layers)), hidden=hidden, vocab=vocab, heads=heads, head_dim=head_dim,
        linears=tuple(linears), adapters=tuple(adapters),
        head_trainable=head is not None and head.weight.requires_grad,
        tied=head is not None and embeddings is not None and head.weight is embeddings.weight, rows=rows,
        prompt=prompt, completion=completion, itemsize=itemsize, checkpointing=checkpointing, group=group)


def chunk_sizes(rows: int, group: int) -> list[int]:
    """``one_backward``'s possible chunks, largest first: all ``rows``, then whole groups in as few chunks of equal
    size (as far as they divide) as give each size; only ``rows`` where the rows are not whole groups."""
    if rows % group:
        return [rows]
    groups, sizes = rows // group, []
    for chunks in range(1, groups + 1):
        size = -(-groups // chunks) * group
        if size not in sizes:
            sizes.append(size)
    return sizes


# ---------------------------------------------------------------------------------------------- the memory readers
@dataclass(frozen=True)
class Budget:
    """What the memory-aware default may spend: ``room``, the bytes the update's peak (operator outputs and gradients,
    as :func:`.cost_model.peak_bytes` predicts) may take on the device (``inf``: no device figure, a CPU); ``cap``,
    the most bytes it may add to GRPO's predicted peak (``OBLRPOConfig.max_extra_memory_gib``; None: no cap);
    ``host``: the room is the CPU's host memory (:func:`choose_on_host` decides), not a GPU's."""

    room: float
    cap: float | None = None
    host: bool = False


def readable_bytes(b: float) -> str:
    """``b`` bytes in GiB (MiB below 1 GiB)."""
    return f"{b / 2**30:.2f} GiB" if abs(b) >= 2**30 or b == float("inf") else f"{b / 2**20:.1f} MiB"


def margin_bytes(total: float) -> float:
    """The margin kept free on a device of ``total`` bytes: :data:`MARGIN_FRACTION` of it, at least
    :data:`MARGIN_MIN`."""
    return max(MARGIN_MIN, MARGIN_FRACTION * total)


def memory_room(free: float, total: float, allocated: float, reserved: float, fraction: float, margin: float,
                pending: float = 0.0) -> float:
    """The bytes a step's peak may still take: what the process can allocate (the device's ``free`` bytes plus the
    allocator's cached ``reserved - allocated``, at most ``fraction * total - allocated``, the per-process memory
    fraction's limit), less ``margin`` and ``pending`` (allocations still to come outside the update, such as the
    optimizer's state before its first step). Pure: every figure is handed in (``torch.cuda.mem_get_info`` and the
    allocator's counters on a GPU)."""
    can = min(free + max(0.0, reserved - allocated), fraction * total - allocated)
    return max(0.0, can - margin - pending)


def host_free(available: float, limit: float | None = None, used: float = 0.0, processes: int = 1) -> float:
    """The host memory one process may count on for a step on the CPU: the system's ``available`` bytes (psutil's
    figure: free memory plus what the kernel can reclaim), within a container's memory ``limit`` less what it has
    ``used`` (cgroup; reclaimable page cache not counted), shared evenly by the ``processes`` of this machine that
    each make this choice (``torchrun --nproc_per_node``). Pure: every figure is handed in
    (:func:`host_memory` reads them)."""
    free = available if limit is None else min(available, max(0.0, limit - used))
    return free / max(1, processes)


def device_budget(device, max_extra_gib: float | None, pending: float = 0.0) -> Budget | None:
    """What the memory-aware default may spend on ``device``: on a GPU, the room :func:`memory_room`
    finds from ``torch.cuda.mem_get_info``, the allocator's counters and its per-process memory fraction; on the CPU,
    the host's available memory (:func:`host_memory`: within a container's limit, shared by this machine's
    processes); either less a margin (:func:`margin_bytes`) and ``pending`` bytes still to come (the
    optimizer's state). With ``max_extra_gib`` (``OBLRPOConfig.max_extra_memory_gib``), at most that many GiB beyond
    GRPO's predicted peak. ``None`` on a device with no free-memory figure (MPS, XPU, ...) and no cap: the ratio
    targets of :func:`choose` then."""
    cap = None if max_extra_gib is None else float(max_extra_gib) * 2**30
    device = torch.device(device)
    if device.type == "cpu":
        free, total = host_memory()
        if free is not None:
            room = memory_room(free, total, 0.0, 0.0, 1.0, margin_bytes(total), pending)
            return Budget(room, cap, host=True)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None if cap is None else Budget(float("inf"), cap)
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = getter(index) if getter is not None else 1.0
    room = memory_room(free, total, torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index),
                                  fraction, margin_bytes(total), pending)
    return Budget(room, cap)


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
    """The host memory this process may count on for a step (:func:`host_free`: psutil's available
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
    return host_free(memory.available, limit, used, processes), float(total)


def optimizer_state_pending(model, optimizer) -> float:
    """Bytes the optimizer's state will take at its first step where it holds none yet: two float32 values per
    trainable element (Adam's moments; an over-estimate for lighter optimizers), else 0."""
    if optimizer is not None and getattr(optimizer, "state", None):
        return 0.0
    return 8.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------- the rules
@dataclass(frozen=True)
class Choice:
    one_backward: bool
    chunk: int  # rows per chunk (the micro-batch's rows where it runs whole); 0 on the two-pass path
    flops_ratio: float  # the chosen one_backward path's predicted FLOPs / GRPO's (kept factors' where neither runs)
    bytes_ratio: float  # its predicted peak bytes (at ``chunk``, or at the smallest chunk) / GRPO's
    replay: bool = False  # one_backward's update replayed by a second backward (no factors kept), not from factors
    reason: str = ""  # why, where the memory-aware default (:func:`choose_within`) chose
    peak: float = 0.0  # the chosen path's predicted peak bytes (memory-aware default)


def fitting_chunk(s: Shape, budget: "Budget | None" = None) -> tuple[int, float]:
    """The largest chunk whose predicted peak is within the memory target of GRPO's (with ``budget``: fits it; 0:
    none), and its ratio (the smallest chunk's where none fits)."""
    if budget is not None:
        chunk, peak = _largest_fitting(s, "one_backward", budget)
        return chunk, peak / cost_model.peak_bytes(s, "grpo")
    return _fitting(s, "one_backward")


def replay_chunk(s: Shape) -> tuple[int, float]:
    """:func:`fitting_chunk` for ``one_backward`` replayed."""
    return _fitting(s, "replay")


def _fitting(s: Shape, mode: str) -> tuple[int, float]:
    limit = BYTES_TARGET if s.checkpointing else BYTES_TARGET_NO_CKPT
    grpo = cost_model.peak_bytes(s, "grpo")
    ratio = float("inf")
    for size in chunk_sizes(s.rows, s.group):
        ratio = cost_model.peak_bytes(s, mode, size) / grpo
        if ratio <= limit:
            return size, ratio
    return 0, ratio


def norms_chunk(s: Shape, budget: "Budget | None" = None) -> int:
    """Rows per chunk of the two-pass path's norms pass: the largest (whole groups) whose predicted peak stays within
    the memory target of GRPO's (with ``budget``: fits it); the smallest where none does."""
    if budget is not None:
        return _largest_fitting(s, "two_passes", budget)[0] or chunk_sizes(s.rows, s.group)[-1]
    limit = BYTES_TARGET if s.checkpointing else BYTES_TARGET_NO_CKPT
    sizes = chunk_sizes(s.rows, s.group)
    grpo = cost_model.peak_bytes(s, "grpo")
    return next((size for size in sizes if cost_model.peak_bytes(s, "two_passes", size) <= limit * grpo), sizes[-1])


def choose(s: Shape, replay: bool = True) -> Choice:
    """The default: ``one_backward`` in the largest chunk within the memory target where its FLOPs are within the
    FLOP target of GRPO's; else, under gradient checkpointing (``replay``: allowed), ``one_backward`` replayed (no
    factors kept: the norms pass's backward, then GRPO's backward of the same graph) in the largest chunk within the
    memory target, where it costs fewer FLOPs than two passes; two passes otherwise."""
    grpo = cost_model.flops(s, "grpo")
    flops_ratio = cost_model.flops(s, "one_backward") / grpo
    chunk, bytes_ratio = fitting_chunk(s)
    if chunk > 0 and flops_ratio <= FLOPS_TARGET:
        return Choice(True, chunk, flops_ratio, bytes_ratio)
    if replay and s.checkpointing and cost_model.flops(s, "replay") < cost_model.flops(s, "two_passes"):
        chunk, ratio = replay_chunk(s)
        if chunk:
            return Choice(True, chunk, cost_model.flops(s, "replay") / grpo, ratio, replay=True)
    return Choice(False, 0, flops_ratio, bytes_ratio)


def fits(predicted: float, grpo: float, budget: Budget) -> bool:
    """Whether a path predicted to peak at ``predicted`` bytes (GRPO's update: ``grpo``) fits ``budget``:
    :data:`MEMORY_SAFETY` times the prediction within its room, or no more than GRPO's own peak (it then runs wherever
    GRPO's update runs: the safety factor is for what a path adds, and a large batch whose GRPO peak nearly fills the
    device must not be pushed into chunks that cost operator calls and host syncs); and what it adds to GRPO's within
    its cap."""
    within_room = MEMORY_SAFETY * predicted <= budget.room or predicted <= grpo
    return within_room and (budget.cap is None or predicted - grpo <= budget.cap)


def _largest_fitting(s: Shape, mode: str, budget: Budget) -> tuple[int, float]:
    """The largest chunk (:func:`chunk_sizes`) whose ``mode`` peak fits ``budget`` (0: none), and its peak (the
    smallest chunk's where none fits)."""
    grpo, peak = cost_model.peak_bytes(s, "grpo"), float("inf")
    for size in chunk_sizes(s.rows, s.group):
        peak = cost_model.peak_bytes(s, mode, size)
        if fits(peak, grpo, budget):
            return size, peak
    return 0, peak


def choose_within(s: Shape, budget: Budget, replay: bool = True) -> Choice:
    """The memory-aware default: ``one_backward`` (whole, else in the largest chunk of whole groups) where its FLOPs are
    within :data:`FLOPS_TARGET` of GRPO's and its predicted peak fits ``budget``; else, under gradient checkpointing
    (``replay`` allowed), ``one_backward`` replayed in the largest chunk that fits; else two passes. The
    :class:`Choice` says why (``reason``) with the predicted peak (``peak``) and room."""
    grpo_f, grpo_b = cost_model.flops(s, "grpo"), cost_model.peak_bytes(s, "grpo")
    ratio = cost_model.flops(s, "one_backward") / grpo_f
    gib = readable_bytes
    room = "no device limit" if budget.room == float("inf") else f"room {gib(budget.room)} (after the margin)"
    cap = "" if budget.cap is None else f", cap {gib(budget.cap)} beyond GRPO's"
    chunk, peak = _largest_fitting(s, "one_backward", budget)
    if chunk and ratio <= FLOPS_TARGET:
        why = (f"one_backward's predicted peak {gib(peak)} (x{MEMORY_SAFETY} safety) fits: {room}{cap}; GRPO's "
               f"{gib(grpo_b)}")
        return Choice(True, chunk, ratio, peak / grpo_b, reason=why, peak=peak)
    why = (f"one_backward's FLOPs {ratio:.2f}x GRPO's exceed {FLOPS_TARGET}x" if chunk else
           f"one_backward's predicted peak ({gib(peak)} in its smallest chunk, x{MEMORY_SAFETY} safety) does not fit: "
           f"{room}{cap}")
    if replay and s.checkpointing and cost_model.flops(s, "replay") < cost_model.flops(s, "two_passes"):
        size, replayed = _largest_fitting(s, "replay", budget)
        if size:
            return Choice(True, size, cost_model.flops(s, "replay") / grpo_f, replayed / grpo_b, replay=True,
                          reason=why + f"; replayed ({gib(replayed)}) fits", peak=replayed)
    two = cost_model.peak_bytes(s, "two_passes", norms_chunk(s, budget))
    return Choice(False, 0, ratio, peak / grpo_b, reason=why + "; two passes", peak=two)


def choose_on_host(s: Shape, budget: Budget, replay: bool = True) -> Choice:
    """The CPU's default. Host memory is shared with the rest of the machine, and on a CPU a chunk costs little time
    (no kernel launches to amortise: one group at a time measured 1.03x GRPO's step), while the replayed update is a
    second backward (1.53x). So: ``one_backward`` in the largest chunk of whole groups within the ratio target of
    GRPO's peak (:func:`_fitting`) that also fits ``budget`` (:func:`_largest_fitting`; peaks fall with the chunk, so
    that is the smaller of the two); else one group at a time where that fits; else as :func:`choose_within`."""
    ratio = cost_model.flops(s, "one_backward") / cost_model.flops(s, "grpo")
    within, fitting = _fitting(s, "one_backward")[0], _largest_fitting(s, "one_backward", budget)[0]
    if ratio > FLOPS_TARGET or not fitting:
        return choose_within(s, budget, replay)
    size = min(within, fitting) if within else chunk_sizes(s.rows, s.group)[-1]
    grpo, peak = cost_model.peak_bytes(s, "grpo"), cost_model.peak_bytes(s, "one_backward", size)
    limit = BYTES_TARGET if s.checkpointing else BYTES_TARGET_NO_CKPT
    why = (f"one_backward's predicted peak {readable_bytes(peak)} is within {limit}x GRPO's {readable_bytes(grpo)}"
           if within else f"no chunk keeps one_backward's peak within {limit}x GRPO's {readable_bytes(grpo)}; one "
           f"group at a time ({readable_bytes(peak)}) fits the host's room {readable_bytes(budget.room)}")
    return Choice(True, size, ratio, peak / grpo, reason=why + " (on a CPU a chunk costs little time, the replayed "
                  "update a second backward)", peak=peak)


def rule_for(budget: Budget | None):
    """The rule that decides with ``budget``: :func:`choose` (the ratio targets) without one (no free-memory figure,
    no cap), :func:`choose_on_host` for the CPU's host memory, :func:`choose_within` for a GPU's (or a cap alone)."""
    return choose if budget is None else choose_on_host if budget.host else choose_within


# ---------------------------------------------------------------------------------------------- the decision
class Route:
    """The path of a run's steps: whether ``one_backward`` runs (``enabled``; ``on``), in chunks of how many rows
    (``chunk_rows``; 0: the whole micro-batch), replayed (``replay``), and the two-pass path's norms-pass chunk
    (``norms_chunk``; 0: the micro-batch's).

    Set at construction (:meth:`for_trainer`, from :func:`initial_choice`); the automatic choice (and, under gradient
    checkpointing, the chunks of ``one_backward=True``) is made at the first generation (:meth:`at_generation`, which
    the trainer asks every generation, and :meth:`decide`), from the shapes."""

    def __init__(self, enabled: bool | None, gradient_checkpointing: bool, needs_norms: bool = True):
        self.enabled = enabled  # None: the automatic choice, until decide()
        self.chunk_rows = 0
        self.replay = False  # the update by a second backward of the norms pass's graph (no factors kept)
        self.norms_chunk = 0  # rows per chunk of the two-pass path's norms pass (0: the micro-batch's)
        self.decided = not needs_norms or (enabled is not None and not gradient_checkpointing)

    @classmethod
    def for_trainer(cls, args, *, needs_norms: bool, fsdp1: bool, aux_loss: bool,
                    deepspeed: bool) -> tuple["Route", str, bool]:
        """The route at construction, the message saying why (``""``: nothing to say) and whether it is a warning
        (asked for, or under DeepSpeed, and refused)."""
        if args.one_backward is False or not needs_norms:
            route, why, loud = cls(False, args.gradient_checkpointing, needs_norms), "", False
        else:
            reasons = blockers(args, fsdp1=fsdp1, aux_loss=aux_loss, deepspeed=deepspeed)
            enabled, why = initial_choice(args.one_backward, reasons)
            route, loud = cls(enabled, args.gradient_checkpointing), bool(reasons and (args.one_backward or deepspeed))
        # Under DeepSpeed the norms pass keeps TRL's micro-batches (no cost-model chunks): ZeRO-3 fetches and releases
        # parameters per forward/backward, and back-to-back norms passes over smaller chunks left a gathered
        # parameter active ("Cannot free a ZeRO-3 parameter while it is still active in submodules")
        route.decided = route.decided or deepspeed
        return route, why, loud

    @property
    def on(self) -> bool:
        return bool(self.enabled)

    def switch_off(self) -> None:
        self.enabled, self.chunk_rows, self.replay, self.decided = False, 0, False, True

    def at_generation(self, model, batch: dict, args, group_size: int, max_completion_length: int, device, gather,
                      optimizer=None) -> str:
        """Asked once per generation batch (``batch``, TRL's): image inputs switch the automatic choice to two passes
        (``one_backward`` reorders rows, and a VLM's patch rows are not rows of the batch; ``one_backward=True`` is
        refused); the first batch makes the choice (:meth:`decide`). Returns the message to log (``""``: none)."""
        if multimodal.has_images(batch) and self.enabled is not False:
            if self.enabled:
                raise NotImplementedError("one_backward=True does not take image inputs: set one_backward=False.")
            self.switch_off()
        if self.decided:
            return ""
        return self.decide(model, batch, args, group_size, max_completion_length, device, gather, optimizer)

    def norms_rows(self, unit: int, micro_batch: int) -> int:
        """Rows per chunk of the two-pass path's norms pass: :attr:`norms_chunk` (else the ``micro_batch``'s rows)
        rounded up to whole SNR units of ``unit`` rows."""
        return max(unit, -(-(self.norms_chunk or micro_batch) // unit) * unit)

    def decide(self, model, batch: dict, args, group_size: int, max_completion_length: int, device,
               gather, optimizer=None, budget: Budget | None = None) -> str:
        """The automatic choice (the rule for the budget, :func:`rule_for`), or, for
        ``one_backward=True``, that chunk (one group where none fits); and the two-pass path's norms-pass chunk
        (:func:`norms_chunk`). The same on every rank (``gather``: the accelerator's, whose result's elementwise
        minimum over ranks is taken). The budget: ``budget``, else :func:`device_budget` (a GPU's free memory or
        the host's available memory, less the state ``optimizer`` has yet to allocate, or
        ``args.max_extra_memory_gib``). Returns the message to log."""
        if budget is None:
            budget = device_budget(device, getattr(args, "max_extra_memory_gib", None),
                                   optimizer_state_pending(model, optimizer))
        rows = min(batch["prompt_ids"].shape[0], args.per_device_train_batch_size)
        shape = describe(model, rows, batch["prompt_ids"].shape[1], max_completion_length,
                         2 if (args.bf16 or args.fp16) else 4, args.gradient_checkpointing, group_size)
        # replayed only in one process: its second backward runs outside DDP's and FSDP's forward (untested there);
        # and only under non-reentrant checkpointing: the norms pass runs a reentrant layer under its own checkpoint
        # (grad_norms/hooks.py), whose graph a second backward cannot take the update from
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        reentrant = runs_reentrant(model)
        within = {} if budget is None else {"budget": budget}  # no budget: the ratio targets
        choice = rule_for(budget)(shape, **within, replay=not distributed and not reentrant)
        chunk = self._asked_chunk(choice, shape, budget)
        chunks = [chunk, norms_chunk(shape, **within)]
        if distributed:  # the same on every rank: the smallest
            chunks = gather(torch.tensor(chunks, device=device)[None]).min(0).values.tolist()
        chunk, self.norms_chunk = (int(c) for c in chunks)
        if self.enabled is False:
            self.decided = True
            return f"OBLR-PO (two passes, gradient checkpointing on): norms pass in chunks of {self.norms_chunk} rows."
        automatic = self.enabled is None
        if automatic:
            self.enabled, self.replay = chunk > 0, chunk > 0 and choice.replay
        elif chunk == 0:  # one_backward=True: as little at a time as whole groups allow
            chunk = chunk_sizes(rows, group_size)[-1]
        self.chunk_rows, self.decided = (chunk if self.enabled else 0), True
        said = self.describe_choice(choice, shape, budget, args, rows)
        if reentrant and automatic and shape.checkpointing:
            said += (" Under reentrant gradient checkpointing one_backward is never replayed (no second backward of "
                     "the norms pass's graph).")
        return said

    def _asked_chunk(self, choice: Choice, shape: cost_model.Shape, budget: Budget | None) -> int:
        """The chunk the rule's ``choice`` gives this route: the choice's own for the automatic choice; for
        ``one_backward=True`` on the host the rule's chunk where it runs ``one_backward`` unreplayed, elsewhere the
        largest that fits (:func:`fitting_chunk`); 0: none (then one group at a time)."""
        if self.enabled is None:
            return choice.chunk
        if budget is not None and budget.host:
            return choice.chunk if choice.one_backward and not choice.replay else 0
        return fitting_chunk(shape, **({} if budget is None else {"budget": budget}))[0]

    def describe_choice(self, choice: Choice, shape: cost_model.Shape, budget: Budget | None, args,
                        rows: int) -> str:
        """The decided route in words: the path, its chunks, why, and its predicted time and bytes against GRPO's."""
        chunk = self.chunk_rows
        if self.enabled:
            how = ("one forward/backward per micro-batch" if chunk >= rows else
                   f"one forward/backward per chunk of {chunk} rows ({chunk // shape.group} groups)")
            how += (", the update replayed by a second backward of its graph (no per-layer factors kept)."
                    if self.replay else ".")
        else:
            how = "two passes (norms pass, then the loss pass)."
        checkpointing = "on" if args.gradient_checkpointing else "off"
        if budget is not None:
            grpo_f, grpo_b = cost_model.flops(shape, "grpo"), cost_model.peak_bytes(shape, "grpo")
            ran = "replay" if self.replay else "one_backward" if self.enabled else "two_passes"
            peak = cost_model.peak_bytes(shape, ran, self.chunk_rows or self.norms_chunk)
            return (f"OBLR-PO (one_backward={args.one_backward}, gradient checkpointing {checkpointing}, "
                    f"memory-aware): for {rows} x {shape.tokens} tokens it takes {how[:-1]}: {choice.reason}. "
                    f"Predicted: time (FLOPs) {cost_model.flops(shape, ran) / grpo_f:.2f}x GRPO's, peak "
                    f"{readable_bytes(peak)} against GRPO's {readable_bytes(grpo_b)} (oblr_trl/cost_model.py; "
                    "OBLRPOConfig.max_extra_memory_gib caps what it may add).")
        limit = BYTES_TARGET if args.gradient_checkpointing else BYTES_TARGET_NO_CKPT
        return (f"OBLR-PO (one_backward={args.one_backward}, gradient checkpointing {checkpointing}): for {rows} x "
                f"{shape.tokens} tokens, one_backward{' (replayed)' if self.replay else ''}'s predicted cost against "
                f"GRPO's is {choice.flops_ratio:.2f}x the FLOPs (target <= {FLOPS_TARGET}x) and "
                f"{choice.bytes_ratio:.2f}x the peak bytes (target <= {limit}x; oblr_trl/cost_model.py, verified by "
                "benchmarks/cost_counts.py): " + how)
