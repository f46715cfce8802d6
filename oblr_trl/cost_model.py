"""The update's cost from shapes alone: FLOPs and peak live bytes of GRPO's update and of OBLR-PO's modes. Pure: no
model, no device, no decision; :mod:`.path_choice` describes the model and batch as a :class:`Shape`
(:func:`.path_choice.describe`) and chooses the path by these predictions, and ``benchmarks/cost_counts.py`` prints
them beside its counts, so the table verifies the function training runs.

* :func:`flops`: matmul and attention FLOPs (the floor the modes aim at; matches the counts within 4%).
* :func:`peak_bytes`: peak live bytes of operator outputs, weights not included: per layer (the checkpointed inputs
  or, without checkpointing, the saved activations; ``one_backward`` also keeps each trainable weight's factors, the
  smaller of its input and output gradient and its per-sample gradients) plus the head and the rest. The per-layer
  activation size and the head's transients are fitted to the counted Qwen3 rows (``benchmarks/results/
  cost_counts*.md`` prints model and count side by side).

Modes (:data:`MODES`): ``grpo``, ``one_backward`` (factors kept), ``two_passes`` and ``replay``. Why not one backward
with GRPO's bytes: each advantage needs every layer's norm, known only when the backward ends, so the update needs each
layer's per-row gradient after its backward: kept (at least ``min(T (in + out), in out)`` elements per row and layer,
:func:`kept_per_row`: 1.6-2.7x GRPO's peak for full fine-tuning under checkpointing) or formed again (a second
backward, recomputing each layer: about 1.5-1.7x GRPO's FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("grpo", "one_backward", "two_passes", "replay")
HEAD_TILE = 4096  # tokens per tile of TRL's fused LM head (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE)
ACTIVATION = 1.4  # elements a layer saves per token without checkpointing, per element of its linear maps' in + out
# the head and the rest, fitted to the counted rows: logits-sized tiles, head-weight gradients, hidden-sized tensors
GRPO_REST = dict(tiles=1.9, head_grad=0.55, hidden=5.0, hidden_ckpt=10.0)
# one_backward's: refitted (the head's larger vocabulary chunks, factors.vocab_chunk, and both untied head
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
