"""The update's cost from shapes alone: FLOPs and peak live bytes of GRPO's update and of OBLR-PO's modes, and the
default's choice between them. Pure: no model, no device; the trainer describes its model and batch as a
:class:`Shape` (:func:`.one_backward.describe`), and ``benchmarks/cost_counts.py`` prints these predictions beside its
counts, so the table verifies the function training runs.

* :func:`flops`: matmul and attention FLOPs (the floor the modes aim at; matches the counts within 4%).
* :func:`peak_bytes`: peak live bytes of operator outputs, weights not included: per layer (the checkpointed inputs
  or, without checkpointing, the saved activations; ``one_backward`` also keeps each trainable weight's factors, the
  smaller of its input and output gradient and its per-sample gradients) plus the head and the rest. The per-layer
  activation size and the head's transients are fitted to the counted Qwen3 rows (``benchmarks/results/
  cost_counts*.md`` prints model and count side by side).
* :func:`choose`: ``one_backward`` and its chunk where its predicted peak stays within the memory target and its
  FLOPs within the FLOP target of GRPO's; else, under gradient checkpointing, ``one_backward`` replayed (``replay``:
  no factors kept, the update from a second backward of the pass's graph; GRPO's bytes, two passes' FLOPs less a
  forward); two passes otherwise (:func:`norms_chunk`: their norms pass's chunk).

Modes (:data:`MODES`): ``grpo``, ``one_backward`` (factors kept), ``two_passes`` and ``replay``. Why not one backward
with GRPO's bytes: each advantage needs every layer's norm, known only when the backward ends, so the update needs each
layer's per-row gradient after its backward: kept (at least ``min(T (in + out), in out)`` elements per row and layer,
:func:`kept_per_row`: 1.6-2.7x GRPO's peak for full fine-tuning under checkpointing) or formed again (a second
backward, recomputing each layer: about 1.5-1.7x GRPO's FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

FLOPS_TARGET = 1.3  # one_backward's FLOPs at most this times GRPO's
BYTES_TARGET = 1.1  # its peak bytes at most this times GRPO's, under gradient checkpointing
BYTES_TARGET_NO_CKPT = 1.2  # and without
MODES = ("grpo", "one_backward", "two_passes", "replay")
HEAD_TILE = 4096  # tokens per tile of TRL's fused LM head (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE)
ACTIVATION = 1.4  # elements a layer saves per token without checkpointing, per element of its linear maps' in + out
# the head and the rest, fitted to the counted rows: logits-sized tiles, head-weight gradients, hidden-sized tensors
GRPO_REST = dict(tiles=1.9, head_grad=0.55, hidden=5.0, hidden_ckpt=10.0)
# one_backward's: refitted for issue 56 (the head's larger vocabulary chunks, factors.vocab_chunk, and both untied head
# gradients held at the update's end): at or above the counted peaks of benchmarks/results/cost_counts.md
ONE_BACKWARD_REST = dict(tiles=1.0, head_grad=1.0, hidden=20.0, hidden_ckpt=30.0)
REPLAY_HIDDEN = 25.0  # hidden-sized tensors per token that one_backward replayed holds beside the checkpointed inputs


@dataclass(frozen=True)
class Shape:
    """A decoder's and a micro-batch's shapes.

    ``linears``: one layer's linear maps as ``(in, out, trainable)``; ``adapters``: its LoRA adapters' maps ``(in, r)``,
    ``(r, out)``, all trainable (their activations are small: not counted); ``head_trainable``: the LM head's weight
    is trained (tied: counted once);
    ``rows`` x (``prompt`` + ``completion``) tokens; ``itemsize``: the activations' bytes per element; ``group``:
    completions per prompt (``one_backward`` chunks hold whole groups)."""

    layers: int
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    linears: tuple[tuple[int, int, bool], ...]
    adapters: tuple[tuple[int, int], ...]
    head_trainable: bool
    tied: bool
    rows: int
    prompt: int
    completion: int
    itemsize: int
    checkpointing: bool
    group: int

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion

    @property
    def maps(self) -> list[tuple[int, int, bool]]:
        """Every linear map of a layer, the adapters' included, as ``(in, out, trainable)``."""
        return [*self.linears, *((i, o, True) for i, o in self.adapters)]


def _attention_flops(s: Shape, rows: int) -> tuple[float, float]:
    """Scaled dot-product attention's forward and backward FLOPs (both products, all T x T positions)."""
    forward = 4 * rows * s.heads * s.tokens ** 2 * s.head_dim
    return forward, 2.5 * forward


def flops(s: Shape, mode: str) -> float:
    """Matmul and attention FLOPs of one micro-batch's update, ``mode`` one of ``grpo``, ``one_backward``,
    ``two_passes``, ``replay``.

    GRPO: per layer each linear map's forward and input gradient (``4 N in out``) and, where trained, its weight
    gradient (``2 N in out``), attention forward and backward, and the forward again under checkpointing; the fused
    head 4 logits products over all ``T - 1`` scored positions (3 with a frozen head). ``one_backward`` adds each
    trainable map's per-sequence norm at the cheaper of ghost (``2 T^2 (in + out)``) and instantiation
    (``2 T in out``), the head's likewise over the ``C`` completion positions, and runs its head over ``C`` positions:
    5 logits products (3 with a frozen head). Two passes: GRPO plus a norms pass (forward, input gradients, norms;
    head 3 products). Replayed: two passes less the loss pass's forward, the head's update over the ``C``
    positions (its logits again and the weight gradient: 5 products in all, 2 with a frozen head)."""
    B, T, C, d, V = s.rows, s.tokens, s.completion, s.hidden, s.vocab
    N = B * T
    fwd = sum(2 * N * i * o for i, o, _ in s.maps)
    wgrad = sum(2 * N * i * o for i, o, t in s.maps if t)
    att_f, att_b = _attention_flops(s, B)
    recompute = fwd + att_f if s.checkpointing else 0
    layer = 2 * fwd + wgrad + att_f + att_b + recompute
    logits = lambda n: 2 * n * d * V  # noqa: E731
    head = (4 if s.head_trainable else 3) * logits(B * (T - 1))
    if mode == "grpo":
        return s.layers * layer + head
    norms = sum(B * min(2 * T * T * (i + o), 2 * T * i * o) for i, o, t in s.maps if t)
    head_norm = B * min(2 * C * C * (d + V), 2 * C * d * V) if s.head_trainable else 0
    if mode == "one_backward":
        return s.layers * (layer + norms) + (5 if s.head_trainable else 3) * logits(B * C) + head_norm
    norm_pass = 2 * fwd + att_f + att_b + norms + recompute
    if mode == "two_passes":
        return s.layers * (layer + norm_pass) + head + 3 * logits(B * C) + head_norm
    if mode == "replay":  # the norms pass, then GRPO's backward of its kept graph: no second forward
        return s.layers * (layer + norm_pass - fwd - att_f) + (5 if s.head_trainable else 2) * logits(B * C) \
            + head_norm
    raise ValueError(f"mode={mode!r}: one of {MODES}")


def kept_per_row(s: Shape) -> int:
    """Elements ``one_backward`` keeps per row and layer for the update: each trainable map's smaller of its factors
    (``T (in + out)``) and its per-sample gradient (``in out``)."""
    return sum(min(s.tokens * (i + o), i * o) for i, o, t in s.maps if t)


def peak_bytes(s: Shape, mode: str, chunk: int = 0) -> float:
    """Peak live bytes of operator outputs (weights not included) of one micro-batch's update; ``one_backward`` runs
    in chunks of ``chunk`` rows (0: all), as does the two-pass path's norms pass. The layers' part is exact under
    checkpointing (their inputs; ``one_backward``'s factors, :func:`kept_per_row`; the norms pass also holds each
    layer's output gradient) and fitted without (:data:`ACTIVATION`); the head's and the rest's part is fitted
    (:data:`GRPO_REST`, :data:`ONE_BACKWARD_REST`). Two passes: the larger of GRPO's loss pass and the norms pass.
    Replayed: :func:`_replay_peak` (what GRPO's backward holds, less TRL's logits-sized tiles)."""
    if mode == "grpo":
        return _peak(s, s.rows, False)
    if mode == "one_backward":
        return _peak(s, chunk or s.rows, True)
    if mode == "two_passes":
        if not s.checkpointing:
            return _peak(s, s.rows, False)
        return max(_peak(s, s.rows, False), _norms_pass_peak(s, chunk or s.rows))
    if mode == "replay":
        return _replay_peak(s, chunk or s.rows)
    raise ValueError(f"mode={mode!r}: one of {MODES}")


def _replay_peak(s: Shape, rows: int) -> float:
    """``one_backward`` replayed over ``rows`` rows: the weight gradients (the layers' and the head's, float32), each
    layer's checkpointed input and :data:`REPLAY_HIDDEN` hidden-sized tensors (fitted: 0.90-1.04x the counted peak,
    Qwen3-0.6B at 8 x 256, 8 x 512 and 64 x 512). No logits-sized tiles: the pass's head works in vocabulary chunks."""
    weights = s.layers * sum(i * o for i, o, t in s.maps if t) + (s.vocab * s.hidden if s.head_trainable else 0)
    return 4 * weights + (s.layers + REPLAY_HIDDEN) * rows * s.tokens * s.hidden * s.itemsize


def _norms_pass_peak(s: Shape, rows: int) -> float:
    """The norms pass over ``rows`` rows: GRPO's peak at those rows, plus each layer's input gradient (the pass's
    backward returns them all at its end), except under LoRA (the adapters' inputs)."""
    extra = 0 if s.adapters else s.layers * rows * s.tokens * s.hidden * s.itemsize
    return _peak(s, rows, False) + extra


def _peak(s: Shape, rows: int, one_backward: bool) -> float:
    d, V, T = s.hidden, s.vocab, s.tokens
    act = ACTIVATION * sum(i + o for i, o, _ in s.linears)
    head_grads = V * d * (1 if s.tied else 2) * 4 if s.head_trainable else 0
    n = rows * T
    if one_backward:
        k, tiles = ONE_BACKWARD_REST, min(rows * s.completion, HEAD_TILE)
        layer = (n * d + rows * kept_per_row(s) if s.checkpointing else n * act) * s.itemsize
    else:
        k, tiles = GRPO_REST, min(rows * (T - 1), HEAD_TILE)
        layer = n * (d if s.checkpointing else act) * s.itemsize
    hidden = k["hidden_ckpt" if s.checkpointing else "hidden"] * n * d * s.itemsize
    return s.layers * layer + k["tiles"] * tiles * V * 4 + k["head_grad"] * head_grads + hidden


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
        return chunk, peak / peak_bytes(s, "grpo")
    return _fitting(s, "one_backward")


def replay_chunk(s: Shape) -> tuple[int, float]:
    """:func:`fitting_chunk` for ``one_backward`` replayed."""
    return _fitting(s, "replay")


def _fitting(s: Shape, mode: str) -> tuple[int, float]:
    limit = BYTES_TARGET if s.checkpointing else BYTES_TARGET_NO_CKPT
    grpo = peak_bytes(s, "grpo")
    ratio = float("inf")
    for size in chunk_sizes(s.rows, s.group):
        ratio = peak_bytes(s, mode, size) / grpo
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
    grpo = peak_bytes(s, "grpo")
    return next((size for size in sizes if peak_bytes(s, "two_passes", size) <= limit * grpo), sizes[-1])


def choose(s: Shape, replay: bool = True) -> Choice:
    """The default: ``one_backward`` in the largest chunk within the memory target where its FLOPs are within the
    FLOP target of GRPO's; else, under gradient checkpointing (``replay``: allowed), ``one_backward`` replayed (no
    factors kept: the norms pass's backward, then GRPO's backward of the same graph) in the largest chunk within the
    memory target, where it costs fewer FLOPs than two passes; two passes otherwise."""
    grpo = flops(s, "grpo")
    flops_ratio = flops(s, "one_backward") / grpo
    chunk, bytes_ratio = fitting_chunk(s)
    if chunk > 0 and flops_ratio <= FLOPS_TARGET:
        return Choice(True, chunk, flops_ratio, bytes_ratio)
    if replay and s.checkpointing and flops(s, "replay") < flops(s, "two_passes"):
        chunk, ratio = replay_chunk(s)
        if chunk:
            return Choice(True, chunk, flops(s, "replay") / grpo, ratio, replay=True)
    return Choice(False, 0, flops_ratio, bytes_ratio)


# ---- issue 56: the memory-aware default ----
# The byte model is fitted (0.8-1.4x the counted peaks, benchmarks/results/cost_counts*.md): a prediction is weighed at
# MEMORY_SAFETY times itself against the room the device has left, less a margin (MARGIN_FRACTION of the device, at
# least MARGIN_MIN bytes) for the allocator's fragmentation and what the model leaves out.
MEMORY_SAFETY = 1.25
MARGIN_FRACTION = 0.05
MARGIN_MIN = 1 << 30


@dataclass(frozen=True)
class Budget:
    """What the memory-aware default may spend: ``room``, the bytes the update's peak (operator outputs and gradients,
    as :func:`peak_bytes` predicts) may take on the device (``inf``: no device figure, a CPU); ``cap``, the most bytes
    it may add to GRPO's predicted peak (``OBLRPOConfig.max_extra_memory_gib``; None: no cap); ``host``: the room is
    the CPU's host memory (:func:`choose_on_host` decides), not a GPU's."""

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
    (:func:`.one_backward.host_memory` reads them)."""
    free = available if limit is None else min(available, max(0.0, limit - used))
    return free / max(1, processes)


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
    grpo, peak = peak_bytes(s, "grpo"), float("inf")
    for size in chunk_sizes(s.rows, s.group):
        peak = peak_bytes(s, mode, size)
        if fits(peak, grpo, budget):
            return size, peak
    return 0, peak


def choose_within(s: Shape, budget: Budget, replay: bool = True) -> Choice:
    """The memory-aware default: ``one_backward`` (whole, else in the largest chunk of whole groups) where its FLOPs are
    within :data:`FLOPS_TARGET` of GRPO's and its predicted peak fits ``budget``; else, under gradient checkpointing
    (``replay`` allowed), ``one_backward`` replayed in the largest chunk that fits; else two passes. The
    :class:`Choice` says why (``reason``) with the predicted peak (``peak``) and room."""
    grpo_f, grpo_b = flops(s, "grpo"), peak_bytes(s, "grpo")
    ratio = flops(s, "one_backward") / grpo_f
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
    if replay and s.checkpointing and flops(s, "replay") < flops(s, "two_passes"):
        size, replayed = _largest_fitting(s, "replay", budget)
        if size:
            return Choice(True, size, flops(s, "replay") / grpo_f, replayed / grpo_b, replay=True,
                          reason=why + f"; replayed ({gib(replayed)}) fits", peak=replayed)
    two = peak_bytes(s, "two_passes", norms_chunk(s, budget))
    return Choice(False, 0, ratio, peak / grpo_b, reason=why + "; two passes", peak=two)


def choose_on_host(s: Shape, budget: Budget, replay: bool = True) -> Choice:
    """The CPU's default. Host memory is shared with the rest of the machine, and on a CPU a chunk costs little time
    (no kernel launches to amortise: one group at a time measured 1.03x GRPO's step), while the replayed update is a
    second backward (1.53x). So: ``one_backward`` in the largest chunk of whole groups within the ratio target of
    GRPO's peak (:func:`_fitting`) that also fits ``budget`` (:func:`_largest_fitting`; peaks fall with the chunk, so
    that is the smaller of the two); else one group at a time where that fits; else as :func:`choose_within`."""
    ratio = flops(s, "one_backward") / flops(s, "grpo")
    within, fitting = _fitting(s, "one_backward")[0], _largest_fitting(s, "one_backward", budget)[0]
    if ratio > FLOPS_TARGET or not fitting:
        return choose_within(s, budget, replay)
    size = min(within, fitting) if within else chunk_sizes(s.rows, s.group)[-1]
    grpo, peak = peak_bytes(s, "grpo"), peak_bytes(s, "one_backward", size)
    limit = BYTES_TARGET if s.checkpointing else BYTES_TARGET_NO_CKPT
    why = (f"one_backward's predicted peak {readable_bytes(peak)} is within {limit}x GRPO's {readable_bytes(grpo)}"
           if within else f"no chunk keeps one_backward's peak within {limit}x GRPO's {readable_bytes(grpo)}; one "
           f"group at a time ({readable_bytes(peak)}) fits the host's room {readable_bytes(budget.room)}")
    return Choice(True, size, ratio, peak / grpo, reason=why + " (on a CPU a chunk costs little time, the replayed "
                  "update a second backward)", peak=peak)
