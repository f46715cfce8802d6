"""Factored per-sample gradients and their Gram ("ghost norm") algebra.

A layer applied to the tokens of one sequence gives its weight the per-sample gradient ``sum_t L_t (x) R_t``
(``L_t``: the output-side factor, ``R_t``: the input-side factor of token ``t``). The inner product of two such
gradients never needs them materialized:

    <sum_t L_t (x) R_t, sum_s L'_s (x) R'_s> = sum_{t,s} <L_t, L'_s> <R_t, R'_s>

i.e. the elementwise product of two token-by-token Gram matrices (Goodfellow 2015; Li et al. 2022, "ghost norm").
A factor is one of the following, each implementing the small :class:`Factor` protocol (``ids``, ``dense``,
``operand``, ``rows``, ``gather_cols``, ...), so that the algebra below reads attributes instead of testing types:

* :class:`Dense`: a ``(B, T, n)`` tensor (activations, output gradients);
* :class:`OneHot`: token ids ``(B, T)`` standing for one-hot rows of width ``n`` (an embedding's input);
* :class:`SoftmaxDelta`: the LM head's output gradient ``alpha * (onehot(y_t) - softmax(z_t))``, computed on the fly
  in vocabulary chunks so that the ``(B, T, V)`` logits are never held.

``blocked(k)`` merges ``k`` consecutive rows into one, so the Grams of a block hold the cross terms between the
block's sequences: that is how inner products ``<u_i, u_j>`` between completions of one group are computed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

VOCAB_CHUNK = 8192
HALF = (torch.bfloat16, torch.float16)
# Devices where products take half-precision operands (tensor cores, float32 output). Elsewhere (the CPU, where bf16
# matmuls gain nothing) every product runs on float32 operands, as autocast's factors are upcast: the historical
# numbers exactly.
HALF_OPERAND_DEVICES = ("cuda",)
# Elements of one (blocks, k, n_L * n_R) float32 buffer of materialized per-sample gradients.
MATERIALIZE_BUDGET = 1 << 26
# On CUDA, the cost model's price of one byte moved through device memory, in multiply-adds (tensor-core rate over
# bandwidth: an H100's ~400 T bf16 multiply-adds/s over ~3 TB/s is ~130, an A100's 156 T over 1.5-2 TB/s ~80-100).
CUDA_MACS_PER_BYTE = 100
# Float32 elements of the (blocks, k T, slots) softmax columns the tied head gathers at its embedding's token ids.
GATHER_BUDGET = 1 << 25
# Products of per-sample gradients over their long axis (N = n_L n_R entries, ~3M for a Qwen3-0.6B MLP map) take it
# in pieces of about PIECE entries, the pieces' partial products summed by a reduction: one (k, N)(N, k) product
# accumulates each dot serially in float32, ~sqrt(N) eps, 2-4e-4 relative at N = 2-3M on a CPU (measured),
# where the exactness target is 1e-5; in pieces it is ~1e-7, and faster on a CPU and a GPU alike. Axes up to
# SPLIT_MIN entries are one piece (~4e-6 at most).
PIECE = 1024
SPLIT_MIN = 4096
# Float32 materialized gradients of at most this many elements (norm gains, biases, LoRA's per-sample gradients) are
# concatenated, SMALL_BATCH at a time, into one product by summed_self_products: a few operator calls instead of one
# per parameter, which on a GPU (a launch each) costs more than the copy. On a CPU copying costs more than a call (a
# small model's one_backward update spent 32 of 48 ms of its inner products copying its layers' per-sample gradients):
# there only norm gains and biases are concatenated.
SMALL_MATERIALIZED = 1 << 20
SMALL_MATERIALIZED_CPU = 1 << 14
# On a CPU, the multiply-adds one more matmul call costs in place (~50 us at ~40 G multiply-adds/s on one core): forming
# a layer's per-sample gradients row by row, each over its own tokens (:class:`TokenSpans`), takes a call per row
# instead of one batched call, and a read of the layer's output gradient at the padding; it is taken where the padding
# it skips saves more than that. A call alone costs ~8 us in a tight loop, but inside the pass (operands not in cache,
# the check) 2^19 made the small benchmark model's norms pass 3.5% slower than 2^21 at 64-token completions (60
# interleaved rounds), and no faster at 256.
CPU_MACS_PER_CALL = 1 << 21
# The share of a batch's tokens that must lie outside the rows' spans for the pass to look for them at all (each layer
# that would skip them reads its output gradient there first): less is not worth a check per layer. A batch with no
# padding leaves out only each row's last token, which predicts nothing.
MIN_PADDING_SHARE = 1 / 16
SMALL_BATCH = 64
# Float32 elements of a tied head's per-sample gradients, (B, V, d), that the streamed pass keeps from the head's own
# products (where they are formed) for the embedding's share of the tied weight: a small vocabulary's (a
# character-level model's), whose cross terms then take the embedding's gradients scattered whole and two products
# (no sort, no softmax gathered at the ids, a product fewer than by slots: the tied weight's share of the inner
# products 0.87 -> 0.37 ms a pass at 8 x 96 tokens, vocabulary 100, width 64, median of 30 in a scratch loop).
TIED_HEAD_KEPT = 1 << 20
# TRL's fused head holds (up to HEAD_TILE_TOKENS tokens) x vocab float32 logits at a time; the head's passes here take
# vocabulary chunks of at most 1 / HEAD_TILE_SHARE of that (tokens x chunk float32), VOCAB_CHUNK columns at least
# (4 chunks instead of 19 at 2,048 tokens, each some 40 operator calls, within GRPO's head memory)
HEAD_TILE_TOKENS = 4096
HEAD_TILE_SHARE = 4
_OUT_DTYPE = {"ok": True}  # whether torch.mm/bmm(..., out_dtype=torch.float32) works here (CUDA, torch >= 2.8)


def vocab_chunk(tokens: int, vocab: int) -> int:
    """Vocabulary columns per chunk of the head's passes over ``tokens`` scored tokens: equal chunks of at least
    ``VOCAB_CHUNK`` columns, each a ``(tokens, chunk)`` float32 buffer of at most ``1 / HEAD_TILE_SHARE`` of the
    logits tile TRL's fused head holds (``min(tokens, HEAD_TILE_TOKENS) x vocab``): fewer chunks (fewer operator
    calls) where the tokens are few, no more memory than GRPO's head holds."""
    budget = min(tokens, HEAD_TILE_TOKENS) * vocab // HEAD_TILE_SHARE
    chunk = max(VOCAB_CHUNK, budget // max(1, tokens))
    if chunk >= vocab:
        return max(1, vocab)
    chunks = -(-vocab // chunk)
    return -(-vocab // chunks)


def half_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The half-precision dtype among ``tensors`` (bf16 or fp16), or None: the operand dtype of their products (None
    off ``HALF_OPERAND_DEVICES``)."""
    for t in tensors:
        if t is not None and t.dtype in HALF and t.device.type in HALF_OPERAND_DEVICES:
            return t.dtype
    return None


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D, or batched 3-D; ``a`` 3-D with ``b`` 2-D is flattened) accumulated and returned in float32.

    Half-precision operands of one dtype are multiplied as they are, on CUDA on the tensor cores with a float32
    output (``out_dtype``): each product of two half-precision numbers is exact in float32, so this is the float32
    product of the same numbers, at the half-precision rate. Anything else, and any device without that kernel, runs
    in float32 on upcast operands: the same numbers, the same result up to the order of the sums.
    """
    if a.dim() == 3 and b.dim() == 2:
        return mm32(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[-1])
    product = torch.bmm if a.dim() == 3 else torch.mm  # matmul would add views and expands around the same kernel
    if a.is_cuda and a.dtype == b.dtype and a.dtype in HALF and _OUT_DTYPE["ok"]:
        try:
            return product(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE["ok"] = False  # this torch has no float32-output half kernel: float32 from now on
    return product(a.float(), b.float())


def as_operand(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as a matmul operand of ``dtype`` (a half-precision dtype), or float32 where ``dtype`` is None."""
    return t.float() if dtype is None else t.to(dtype)


def autocast_operands(u: "Usage", cache: dict | None = None) -> "Usage":
    """A factored usage whose output gradient is half precision while its input is float32 (a linear layer under
    bf16/fp16 autocast, whose input is cast for the matmul) with the input cast the same way: autograd's own weight
    gradient is the product of the cast input, so these are the per-sample gradients of what ran, and every
    product over them takes the half-precision (tensor-core) path of :func:`mm32`.

    ``cache`` (a dict owned by the caller, one pass long) keeps the last cast with its source, so that layers reading
    one input (q/k/v, gate/up projections) cast it once; holding the source keeps its memory from being reused."""
    if getattr(u, "dense_pair", False):
        dtype = half_dtype(u.left.t, u.right.t)
        if dtype is not None and (u.left.t.dtype != dtype or u.right.t.dtype != dtype):
            return Factored(Dense(cast_once(u.left.t, dtype, cache)), Dense(cast_once(u.right.t, dtype, cache)))
    return u


def cast_once(t: torch.Tensor, dtype: torch.dtype, cache: dict | None) -> torch.Tensor:
    """``t.to(dtype)``, the same tensor for the same source while ``cache`` (the caller's) holds it: the last cast
    is kept with its source, whose memory cannot be reused meanwhile."""
    if t.dtype == dtype:
        return t
    if cache is None:
        return t.to(dtype)
    src = cache.get("source")
    if (src is not None and src.data_ptr() == t.data_ptr() and src.shape == t.shape and src.stride() == t.stride()
            and src.dtype == t.dtype and cache["cast"].dtype == dtype):
        return cache["cast"]
    cache["source"], cache["cast"] = t, t.to(dtype)
    return cache["cast"]


def _block(x: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T, ...) -> (B/k, k*T, ...)."""
    if k == 1:
        return x  # a reshape to the same shape would still be an operator call
    return x.reshape(x.shape[0] // k, k * x.shape[1], *x.shape[2:])


def _update_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T, n) as the update's contraction over the tokens takes it: ``(B/k, kT, n)``, or for one block (``k = B``)
    ``(BT, n)``, whose product is the parameter's rows with no block axis to reshape away."""
    return x.reshape(-1, x.shape[-1]) if k == x.shape[0] else _block(x, k)


@dataclass(frozen=True)
class TokenSpans:
    """The tokens of each row that can carry a gradient, ``[starts[b], ends[b])`` of ``length``: in a causal LM no
    position after a row's last scored token, and no left padding, reaches the loss, so every layer's output gradient
    is zero there, and the per-sample gradient ``sum_t L_t (x) R_t`` needs no term from them. A layer's gradients
    formed row by row over these spans skip the batch's padding, which a batched weight gradient multiplies through.
    Nothing is assumed: :func:`trimmed` takes a usage's spans only after reading its factor zero outside them.

    ``outside``: the flat indices ``b * length + t`` of the tokens outside the spans."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    length: int
    outside: torch.Tensor

    @classmethod
    def of(cls, starts: list[int], ends: list[int], length: int, device) -> "TokenSpans | None":
        """The spans, or None where they leave out less than :data:`MIN_PADDING_SHARE` of the tokens."""
        ends = [max(s, e) for s, e in zip(starts, ends)]
        if sum(length - e + s for s, e in zip(starts, ends)) < MIN_PADDING_SHARE * len(starts) * length:
            return None
        out = [b * length + t for b, (s, e) in enumerate(zip(starts, ends)) for t in (*range(s), *range(e, length))]
        return cls(tuple(starts), tuple(ends), length, torch.tensor(out, dtype=torch.long, device=device))

    @property
    def kept_share(self) -> float:
        """The share of the ``(rows, length)`` tokens inside the spans."""
        return 1.0 - self.outside.numel() / (len(self.starts) * self.length)

    def zero_outside(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (``(rows, length, n)``) is exactly zero at every token outside the spans."""
        if tuple(t.shape[:2]) != (len(self.starts), self.length) or t.dim() != 3 or not t.is_contiguous():
            return False
        # the largest magnitude (a NaN stays one): a float tensor's any(), or an inf-norm, reads 3-20x slower on a CPU
        return not bool(t.view(-1, t.shape[-1]).index_select(0, self.outside).abs().amax())

    def products(self, a: torch.Tensor, b: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """``sum_t a_t (x) b_t`` of each row over its span, ``(rows, n_a, n_b)`` in float32, for the rows of ``a`` and
        ``b`` (``(rows, length, n)``) that start at row ``first_row`` of the spans: one product per row (:func:`mm32`'s,
        written in place for float32 operands)."""
        out = torch.empty(a.shape[0], a.shape[-1], b.shape[-1], dtype=torch.float32, device=a.device)
        in_place = a.dtype == b.dtype == torch.float32
        rows = len(out)  # each row's views from one unbind (fewer operator calls than indexing row by row)
        spans = zip(self.starts[first_row : first_row + rows], self.ends[first_row : first_row + rows])
        for x, y, o, (start, end) in zip(a.unbind(0), b.unbind(0), out.unbind(0), spans):
            if end > start and in_place:
                torch.mm(x[start:end].t(), y[start:end], out=o)
            elif end > start:
                o.copy_(mm32(x[start:end].t(), y[start:end]))
            else:
                o.zero_()  # no scored token: no gradient
        return out


class Factor(Protocol):
    """What the Gram algebra asks of a factor (:class:`Dense`, :class:`OneHot`, :class:`SoftmaxDelta`), so that no
    function here dispatches on its type:

    * ``width``: ``n``; ``blocked(k)``: ``k`` consecutive rows merged into one; ``rows(b0, b1)``: rows ``b0:b1``;
    * ``ids``: the token ids of a one-hot factor, else None; ``dense``: the ``(B, T, n)`` tensor of a factor held
      whole, else None; ``operand``: the tensor whose dtype and device its products take (None: enters none), and
      ``product_dtype``: that dtype;
    * ``gather_cols(idx)``: columns ``idx[b, q]`` of each row, ``(B, T, Tq)`` float32 (its Gram with a one-hot
      factor); ``cols(start, end)``: columns ``start:end`` (not of one-hot factors);
    * ``materialize_with(right)``: ``sum_t self_t (x) right_t`` per row, where it can be formed.
    """

    ids: torch.Tensor | None
    dense: torch.Tensor | None
    operand: torch.Tensor | None
    product_dtype: torch.dtype | None

    @property
    def width(self) -> int: ...

    def blocked(self, k: int) -> "Factor": ...

    def rows(self, b0: int, b1: int) -> "Factor": ...

    def gather_cols(self, idx: torch.Tensor) -> torch.Tensor: ...

    def materialize_with(self, right: "Dense") -> torch.Tensor: ...


@dataclass
class Dense:
    """A factor held whole: ``(B, T, n)`` activations or output gradients."""

    t: torch.Tensor  # (B, T, n)
    ids = None  # not one-hot

    @property
    def width(self) -> int:
        return self.t.shape[-1]

    @property
    def dense(self) -> torch.Tensor:
        return self.t

    @property
    def operand(self) -> torch.Tensor:
        return self.t

    @property
    def product_dtype(self) -> torch.dtype:
        return self.t.dtype

    def blocked(self, k: int) -> "Dense":
        return Dense(_block(self.t, k))

    def rows(self, b0: int, b1: int) -> "Dense":
        return Dense(self.t[b0:b1])

    def cols(self, start: int, end: int) -> torch.Tensor:
        return self.t[..., start:end].float()

    def gather_cols(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T, Tq): column ``idx[b, q]`` of row ``(b, t)``."""
        b, t, _ = self.t.shape
        return torch.gather(self.t.float(), 2, idx[:, None, :].expand(b, t, idx.shape[1]))

    def materialize_with(self, right: "Dense") -> torch.Tensor:
        dtype = half_dtype(self.t, right.t)
        return mm32(as_operand(self.t, dtype).transpose(1, 2), as_operand(right.t, dtype))


@dataclass
class OneHot:
    """Token ids standing for one-hot rows of width ``n`` (an embedding's input)."""

    idx: torch.Tensor  # (B, T) long
    n: int
    dense = None  # never held whole
    operand = None  # enters no product: its Grams and gradients are gathers and scatters
    product_dtype = None

    @property
    def width(self) -> int:
        return self.n

    @property
    def ids(self) -> torch.Tensor:
        return self.idx

    def blocked(self, k: int) -> "OneHot":
        return OneHot(_block(self.idx, k), self.n)

    def rows(self, b0: int, b1: int) -> "OneHot":
        return OneHot(self.idx[b0:b1], self.n)

    def gather_cols(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T, Tq): whether token ``t`` is token ``idx[b, q]``, the Gram of two one-hot factors."""
        return (self.idx[:, :, None] == idx[:, None, :]).float()

    def materialize_with(self, right: Dense) -> torch.Tensor:
        batch, tokens, d = right.t.shape
        rows = (self.idx + torch.arange(batch, device=self.idx.device)[:, None] * self.n).reshape(-1)  # (b, id)'s row
        out = right.t.new_zeros(batch * self.n, d, dtype=torch.float32)  # whole rows added: faster than a scatter_add_
        return out.index_add_(0, rows, right.t.reshape(-1, d).float()).view(batch, self.n, d)


def head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, alpha: float,
                softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The head's scored logits ``z = alpha * cap(h W^T + b)`` on the rows of ``weight`` given (a vocabulary chunk or
    gathered rows, ``(V_c, d)`` or ``(B, V_c, d)``), and ``dz/ds`` w.r.t. the raw logits ``s``: ``alpha``, times
    ``1 - tanh^2(s / softcap)`` under Gemma 2's ``final_logit_softcapping`` (``cap(s) = softcap * tanh(s / softcap)``).
    The one place the scored logits are written. Half-precision ``h`` and ``weight`` (the head under autocast) are
    multiplied as they are, with a float32 result (:func:`mm32`); the rest is float32."""
    dtype = half_dtype(h, weight) if h.dtype == weight.dtype else None
    w = as_operand(weight, dtype)
    s = mm32(as_operand(h, dtype), w.T if w.dim() == 2 else w.transpose(1, 2))
    if bias is not None:
        s += bias.float() if bias.dim() == 1 else bias.float()[:, None, :]
    if softcap is None:
        return (s if alpha == 1 else s.mul_(alpha)), alpha
    t = torch.tanh(s / softcap)
    return alpha * softcap * t, alpha * (1 - t * t)


@dataclass
class SoftmaxDelta:
    """``d log p(y_t) / d s_t`` of the LM head w.r.t. its raw logits ``s_t = h_t W^T + b``:
    ``mask_t * (onehot(y_t) - softmax(z_t)) * dz/ds`` with ``z`` from :func:`head_logits`."""

    h: torch.Tensor  # (B, T, d) hidden states entering the head
    weight: torch.Tensor  # (V, d)
    bias: torch.Tensor | None  # (V,)
    alpha: float  # logit scale / temperature
    lse: torch.Tensor  # (B, T) log-sum-exp of the scored logits
    labels: torch.Tensor  # (B, T) long
    mask: torch.Tensor  # (B, T) float
    softcap: float | None = None  # final_logit_softcapping
    _shared: dict | None = field(default=None, repr=False, compare=False)  # per-token terms, formed once (cols)
    ids = None  # not one-hot
    dense = None  # never held whole: its columns are formed chunk by chunk

    @property
    def width(self) -> int:
        return self.weight.shape[0]

    @property
    def operand(self) -> torch.Tensor:
        return self.h

    @property
    def product_dtype(self) -> torch.dtype | None:
        return self.operand_dtype

    def rows(self, b0: int, b1: int) -> "SoftmaxDelta":
        return SoftmaxDelta(self.h[b0:b1], self.weight, self.bias, self.alpha, self.lse[b0:b1], self.labels[b0:b1],
                            self.mask[b0:b1], self.softcap)

    def materialize_with(self, right: Dense) -> torch.Tensor:
        raise NotImplementedError("Materializing an LM-head or one-hot-input gradient is not supported.")

    @property
    def operand_dtype(self) -> torch.dtype | None:
        """The dtype its columns enter products in: the head's half-precision dtype under autocast, else float32."""
        return self.h.dtype if self.h.dtype in HALF and self.weight.dtype == self.h.dtype else None

    def blocked(self, k: int) -> "SoftmaxDelta":
        return SoftmaxDelta(
            _block(self.h, k), self.weight, self.bias, self.alpha, _block(self.lse, k), _block(self.labels, k),
            _block(self.mask, k), self.softcap,
        )

    def _delta(self, weight, bias, is_label: torch.Tensor) -> torch.Tensor:
        z, dz = head_logits(self.h, weight, bias, self.alpha, self.softcap)
        return (is_label.float() - torch.exp(z - self.lse[..., None])) * dz * self.mask[..., None]

    def _per_token(self) -> dict:
        """What every chunk's columns use, formed once: ``lse`` and the labels as columns, ``mask * dz/ds`` (for a
        constant ``dz/ds``) as a row weight and its negative as a column."""
        if self._shared is None:
            weight_row = self.mask if self.softcap is not None else self.mask * self.alpha
            self._shared = dict(lse=self.lse[..., None], labels=self.labels[..., None],
                                weight_row=weight_row[..., None], neg_weight=-weight_row[..., None])
        return self._shared

    def cols(self, start: int, end: int) -> torch.Tensor:
        """Columns ``start:end`` of the delta, ``(B, T, end - start)`` float32: one logits product and three in-place
        passes over the chunk (the label's ``+1`` is a scatter), the widest tensors of the whole pass."""
        shared = self._per_token()
        bias = None if self.bias is None else self.bias[start:end]
        z, dz = head_logits(self.h, self.weight[start:end], bias, self.alpha, self.softcap)
        p = z.sub_(shared["lse"]).exp_()  # softmax probabilities of the chunk
        local = shared["labels"] - start
        at = local.clamp(0, end - start - 1)  # equal to local where the label is in this chunk
        plus = shared["weight_row"] * (at == local)
        if torch.is_tensor(dz):  # softcapped: dz/ds per logit
            p.mul_(dz)
            plus = plus * dz.gather(-1, at)
        p.mul_(shared["neg_weight"])  # -(mask * dz) * softmax
        return p.scatter_add_(-1, at, plus)

    def gather_cols(self, idx: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[idx]
        return self._delta(self.weight[idx], bias, self.labels[:, :, None] == idx[:, None, :])



def _operand_dtype(*factors: Factor) -> torch.dtype | None:
    """The half-precision dtype the products of these factors take (under autocast), or None (float32)."""
    held = [f for f in factors if f.operand is not None]
    if not held or held[0].operand.device.type not in HALF_OPERAND_DEVICES:
        return None
    dtypes = {f.product_dtype for f in held}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return dtype if dtype in HALF else None


def gram(a: Factor, b: Factor) -> torch.Tensor:
    """Token-by-token Gram ``(B, Ta, Tb)`` of two factors of the same width, in float32."""
    if a.width != b.width:
        raise ValueError(f"Factor widths differ: {a.width} vs {b.width}.")
    if b.ids is not None:  # one-hot columns: gathered (two one-hot factors: where the ids agree)
        return a.gather_cols(b.ids)
    if a.ids is not None:
        return b.gather_cols(a.ids).transpose(1, 2)
    if a.dense is not None and b.dense is not None:
        dtype = half_dtype(a.t, b.t)
        return mm32(as_operand(a.t, dtype), as_operand(b.t, dtype).transpose(1, 2))
    dtype = _operand_dtype(a, b)
    out = None
    for start in range(0, a.width, VOCAB_CHUNK):
        end = min(start + VOCAB_CHUNK, a.width)
        cols_a = as_operand(a.cols(start, end), dtype)
        cols_b = cols_a if b is a else as_operand(b.cols(start, end), dtype)  # with itself: the chunk once
        part = mm32(cols_a, cols_b.transpose(1, 2))
        out = part if out is None else out + part
    return out


@dataclass
class Factored:
    """A per-sample weight gradient ``sum_t left_t (x) right_t`` (``left``: output side, ``right``: input side)."""

    left: Factor
    right: Factor
    # set by :func:`trimmed`: each row's tokens outside these spans are zero in a factor, and its per-sample gradients
    # are formed over the spans alone
    spans: TokenSpans | None = None
    concatenable = False  # see Materialized

    @property
    def dense_pair(self) -> bool:
        """Both factors held whole (a linear layer's)."""
        return self.left.dense is not None and self.right.dense is not None

    @property
    def shared_input(self) -> torch.Tensor | None:
        """The input-side tensor, which layers reading one input share (None: not held whole)."""
        return self.right.dense

    def blocked(self, k: int) -> "Factored":
        return Factored(self.left.blocked(k), self.right.blocked(k), self.spans)  # spans: of the rows, as before

    @property
    def kept_share(self) -> float:
        """The share of the tokens its per-sample gradients are formed over (below 1 with :attr:`spans`)."""
        return 1.0 if self.spans is None else self.spans.kept_share

    def materialize(self) -> torch.Tensor:
        if self.right.dense is None:
            raise NotImplementedError("Materializing an LM-head or one-hot-input gradient is not supported.")
        if self.spans is not None and tuple(self.left.t.shape[:2]) == (len(self.spans.starts), self.spans.length):
            return self.spans.products(self.left.t.float(), self.right.t.float())  # unblocked: row by row
        return self.left.materialize_with(self.right)

    def weighted_rows(self, scale: torch.Tensor, k: int, start: int, end: int, cache: dict | None = None):
        """:func:`block_weighted_rows` of a factored usage: one contraction over the tokens per block (a one-hot left
        factor's rows scattered), with the scaled input from ``cache`` where a layer reading it formed it."""
        if self.right.dense is None:
            raise NotImplementedError("A factored usage needs a dense right (input-side) factor.")
        nb = scale.shape[0] // k
        right = _scaled_right(self.right.t, scale, k, cache)  # (nb, kT, n_R); one block: (BT, n_R)
        left = self.left
        dtype = _operand_dtype(left, self.right)
        if left.ids is not None:  # each token's row added at its id, ids outside the slice to a spare row at each end
            width, ids = end - start, left.ids.reshape(-1)
            block = torch.arange(ids.shape[0], device=ids.device) // (ids.shape[0] // nb)  # each token's block
            rows = (ids - (start - 1)).clamp_(0, width + 1).add_(block * (width + 2))
            out = right.new_zeros(nb * (width + 2), right.shape[-1])
            out.index_add_(0, rows, right.reshape(-1, right.shape[-1]))
            return out[1:-1] if nb == 1 else out.view(nb, width + 2, -1)[:, 1:-1]
        if left.dense is not None:
            cols = left.dense if start == 0 and end == left.width else left.dense[..., start:end]
        else:
            cols = left.cols(start, end)
        return mm32(as_operand(_update_rows(cols, k), dtype).transpose(-2, -1), as_operand(right, dtype))

    def block_inner_products(self, v: "Usage", k: int) -> torch.Tensor:
        """:func:`block_inner_products` of two factored usages."""
        if not isinstance(v, Factored):
            raise TypeError("Mixed factored and materialized usages must be materialized first.")
        if _sparse_pair(self, v):
            return _sparse_rows_block_products([self] if v is self else [self, v], [(0, 0) if v is self else (0, 1)], k)
        if v is self and self.left.dense is None and self.left.ids is None and _head_materialize_cheaper(self, k):
            return _head_materialized_block_products(self, k)
        if _materialize_cheaper(self, v, k):
            return _materialized_block_products(self, v, k)
        prod = gram(self.left, v.left) * gram(self.right, v.right)  # (B/k, k*T1, k*T2)
        nb, kt1, kt2 = prod.shape
        return prod.reshape(nb, k, kt1 // k, k, kt2 // k).sum(dim=(2, 4))


@dataclass
class Materialized:
    """A per-sample gradient held explicitly, ``(B, *param.shape)``: for small parameters (norm weights, biases), and
    layers whose per-sample gradients take no more memory than their factors.

    ``block``: set by :meth:`blocked` (``k`` rows per block), which keeps ``g`` as it is: the products read it as
    ``(B/k, k, N)`` in the one view that cuts it into pieces (:func:`_row_products`), a reshape fewer. None: ``g`` is
    ``(B/k, k, N)`` already."""

    g: torch.Tensor
    block: int | None = None
    dense_pair = False
    shared_input = None

    @property
    def concatenable(self) -> bool:
        """Small and float32: :func:`summed_self_products` concatenates such gradients into one product (smaller ones
        on a CPU, where a copy costs more than an operator call)."""
        small = SMALL_MATERIALIZED_CPU if self.g.device.type == "cpu" else SMALL_MATERIALIZED
        return self.g.dtype == torch.float32 and self.g.numel() <= small

    def blocked(self, k: int) -> "Materialized":
        return Materialized(self.g, k)

    @property
    def flat(self) -> torch.Tensor:
        """``g`` as ``(B, N)`` (``block`` None: ``(B/k, k, N)``), for concatenation: a view where it has more axes."""
        lead = self.g.shape[:1] if self.block else self.g.shape[:2]
        return self.g if self.g.dim() == len(lead) + 1 else self.g.reshape(*lead, -1)

    def weighted_rows(self, scale: torch.Tensor, k: int, start: int, end: int, cache: dict | None = None):
        """:func:`block_weighted_rows`: ``(nb, 1, k) x (nb, k, rows * cols)``, a batched matmul, no scaled copy; one
        block, ``(1, B) x (B, rows * cols)`` with the scale's row from ``cache`` (formed once per weighted sum)."""
        batch = scale.shape[0]
        nb = batch // k
        rows = self.g.shape[1] if self.g.dim() > 1 else 1
        g = self.g if start == 0 and end == rows else self.g.reshape(batch, rows, -1)[:, start:end]  # this slice
        if nb == 1:
            row = scale.float().reshape(1, batch) if cache is None else cache.get("scale_row")
            if row is None:
                row = cache["scale_row"] = scale.float().reshape(1, batch)
            return torch.mm(row, g.reshape(batch, -1).float()).view(end - start, -1)
        out = torch.bmm(scale.float().reshape(nb, 1, k), g.reshape(nb, k, -1).float())
        return out.reshape(nb, end - start, -1)

    def block_inner_products(self, v: "Usage", k: int) -> torch.Tensor:
        """:func:`block_inner_products` of two materialized usages (blocked: ``(B/k, k, n)``)."""
        if not isinstance(v, Materialized):
            raise TypeError("Mixed factored and materialized usages must be materialized first.")
        # by _row_products: a squared norm (k = 1) a float32-accumulating reduction (a GPU would run each block's
        # (1 x N)(N x 1) product as a slow gemv: 0.6 ms at N = 1M on an H200), a long axis in pieces (exact to ~1e-7)
        dtype = self.g.dtype if self.g.dtype == v.g.dtype and self.g.dtype in HALF else None
        g = as_operand(self.g, dtype)
        return _row_products(g, g if v is self else as_operand(v.g, dtype), 0, self.block)


Usage = Factored | Materialized


def _scaled_right(t: torch.Tensor, scale: torch.Tensor, k: int, cache: dict | None) -> torch.Tensor:
    """``t`` (``(B, T, n)``) with each row times its ``scale``, float32, as :func:`_update_rows`; ``cache`` (the caller's,
    one weighted sum long, pruned by :func:`keep_scaled`) keeps them by source, for the layers that read one input
    and for the row slices of one parameter."""
    key = (_tensor_key(t), k)
    if cache is not None and key in cache:
        return cache[key][1]
    column = scale.float().view(-1, 1, 1) if cache is None else cache.get("scale")
    if column is None:
        column = cache["scale"] = scale.float().view(-1, 1, 1)
    right = _update_rows(t.float() * column, k)
    if cache is not None:  # the source is held so that its memory is not reused under the same key
        cache[key] = (t, right)
    return right


def keep_scaled(cache: dict, usages: list) -> None:
    """Drop from a :func:`_scaled_right` cache every scaled input that ``usages`` (the next parameter's) do not read."""
    wanted = {_tensor_key(t) for t in (getattr(u, "shared_input", None) for u in usages) if t is not None}
    for key in [key for key in cache if isinstance(key, tuple) and key[0] not in wanted]:  # not the scale's views
        del cache[key]


def block_weighted_rows(u: Usage, scale: torch.Tensor, k: int, start: int, end: int,
                        cache: dict | None = None) -> torch.Tensor:
    """``sum_{i in block} scale_i g_i[start:end]`` for each block of ``k`` consecutive rows of an (unblocked) usage,
    ``(B/k, end - start, n)`` in float32 (one block, ``k = B``: ``(end - start, n)``, the rows as the product leaves
    them, a reshape fewer): rows ``start:end`` of the gradient of ``sum_i scale_i sum_t log pi(o_i)`` that each block
    (a group of completions) contributes, formed once the per-sample coefficients are known.

    ``n`` is the parameter's size over its first axis. A factored usage costs what autograd's weight gradient costs
    (one contraction over the tokens, batched by block); the LM head's rows come from their vocabulary slice only.
    """
    if isinstance(u, (Factored, Materialized)):  # a scaled input, or the scale's row, shared through ``cache``
        return u.weighted_rows(scale, k, start, end, cache)
    return u.weighted_rows(scale, k, start, end)  # one that forms its own (an expert bank's)


def per_sample_dtype(u: Factored) -> torch.dtype:
    """The dtype a factored usage's per-sample gradients are held in: bfloat16 where a factor is bfloat16 (under bf16
    autocast, where autograd's own weight gradient is a bf16 matmul output too), float32 otherwise. They are formed,
    and every sum over them taken, in float32."""
    return torch.bfloat16 if torch.bfloat16 in (u.left.t.dtype, u.right.t.dtype) else torch.float32


def materializing_saves_memory(u: Usage) -> bool:
    """Whether a usage's per-sample gradients, ``(B, n_L, n_R)`` in :func:`per_sample_dtype`, take no more memory
    than the factors they are formed from, ``(B, T, n_L + n_R)``: then holding them costs nothing extra, and forming
    them costs one contraction (what the layer's weight gradient costs), after which every inner product and weighted
    sum is cheap.
    """
    if not getattr(u, "dense_pair", False):
        return False
    left, right = u.left.t, u.right.t
    factor_bytes = left.shape[1] * (left.shape[-1] * left.element_size() + right.shape[-1] * right.element_size())
    held_bytes = left.shape[-1] * right.shape[-1] * per_sample_dtype(u).itemsize
    return held_bytes <= factor_bytes


def _materialize_cheaper(u: Factored, v: Factored, k: int) -> bool:
    """Whether materializing the per-sample gradients beats the token Grams for this pair (fastDP's choice).

    In multiply-adds per block, Gram: ``(kT_u)(kT_v)(n_L + n_R)``; materialized: ``(kT_u + kT_v) n_L n_R + k^2 n_L
    n_R`` (``kT_u n_L n_R`` alone when ``u`` is ``v``: its gradients are formed once). On CUDA, where the matmuls run
    on the tensor cores, the float32 buffers each writes and reads are priced too (``CUDA_MACS_PER_BYTE``
    multiply-adds a byte): the two Grams and their product, ``(kT_u)(kT_v)`` elements of ~24 bytes, against the
    per-sample gradients, ``k n_L n_R`` elements of 8 bytes per usage formed. On the CPU (flops bound) the count
    alone, which picked the faster route at each of 32 shapes timed (8 rows, T from 96 to 544, widths 32 to 512);
    counting a usage's own gradients twice sent the MLPs of short sequences to the Grams, up to 1.65x slower.
    """
    if not (u.dense_pair and v.dense_pair):
        return False
    t_u, t_v = u.left.t.shape[1], v.left.t.shape[1]  # already blocked: k*T
    n_l, n_r = u.left.width, u.right.width
    if not u.left.t.is_cuda:  # formed over each row's span where a usage has them (trimmed)
        formed = t_u * u.kept_share + (0 if v is u else t_v * v.kept_share)
        return formed * n_l * n_r + k * k * n_l * n_r < t_u * t_v * (n_l + n_r)
    formed = 1 if v is u else 2
    gram = t_u * t_v * (n_l + n_r + 24 * CUDA_MACS_PER_BYTE)
    materialized = (t_u if v is u else t_u + t_v) * n_l * n_r + k * n_l * n_r * (k + 8 * formed * CUDA_MACS_PER_BYTE)
    return materialized < gram


def _piece(n: int, inner: int) -> int:
    """The length of the pieces :func:`_row_products` cuts an axis of ``n`` entries into: the whole axis up to
    :data:`SPLIT_MIN` entries; else whole rows of ``inner`` entries (the per-sample gradient's last axis), as many as
    make about :data:`PIECE`, where ``inner`` divides ``n``; else the longest divisor of ``n`` from ``PIECE / 2`` to
    ``PIECE``; else :data:`PIECE` (the axis zero-padded to a multiple)."""
    if n <= SPLIT_MIN:
        return n
    if inner > 0 and n % inner == 0:
        rows = n // inner
        return inner * next(m for m in range(min(rows, max(1, PIECE // inner)), 0, -1) if rows % m == 0)
    return next((p for p in range(PIECE, PIECE // 2, -1) if n % p == 0), PIECE)


def _in_pieces(t: torch.Tensor, lead: tuple[int, ...], n: int, piece: int) -> torch.Tensor:
    """Rows of ``n`` entries held in ``t`` (any shape, ``lead`` rows first) as ``(*lead, pieces, piece)``: one view (a
    copy where ``t`` is not contiguous), the axis zero-padded first where ``piece`` does not divide it."""
    if n % piece:
        t = torch.nn.functional.pad(t.reshape(-1, n), (0, piece - n % piece))
    return t.reshape(*lead, -1, piece)


def _row_products(a: torch.Tensor, b: torch.Tensor, inner: int, k: int | None = None) -> torch.Tensor:
    """``a @ b^T`` per block, ``(nb, k, k)`` in float32, between per-sample gradients of ``N`` entries (``b`` may be
    ``a``): ``a`` is ``(nb, k, N)``, or with ``k`` given, ``(nb * k, ...)`` in any shape (a materialized gradient as
    it was formed: read as blocks by the one view below, not reshaped first).

    The axis is cut into pieces (:func:`_piece`; ``inner``: the per-sample gradient's last axis, 0 if none): one
    float32 product over ``N`` accumulates ~sqrt(N) rounding errors (2-4e-4 at N = 3M, where the target is 1e-5); the
    pieces' partial products, summed by a reduction, are exact to ~1e-7. Every length takes the same route (a short
    axis is one piece), in a fixed number of operator calls:

    * a squared norm (``k = 1``, ``b`` is ``a``): each piece's float32-accumulating norm, squared, summed (view, norm,
      square, sum): no product (a GPU would run a ``(1 x N)(N x 1)`` product as a slow gemv);
    * ``k = 1`` otherwise: an elementwise product summed by a reduction (pairwise sums on every device);
    * ``k > 1``: the pieces become the batch of one matmul, summed over. One block (``nb = 1``) is read in that
      layout where it lies (``as_strided``: piece ``p`` of row ``i`` starts ``p * piece + i * N`` entries in): no
      copy, no reshape of the products; several blocks are copied into it (their rows interleave).
    """
    if k is None:
        nb, k = a.shape[:2]
    else:
        nb = a.shape[0] // k
    n = a.numel() // (nb * k)
    if k == 1 and b is not a:  # a reduction: pairwise sums on every device
        return (a.reshape(nb, 1, n).float() * b.reshape(nb, 1, n).float()).sum(-1, keepdim=True)
    piece = _piece(n, inner)
    if k == 1:  # (nb, 1, pieces, piece) -> (nb, 1, pieces) -> (nb, 1, 1)
        norms = torch.linalg.vector_norm(_in_pieces(a, (nb, 1), n, piece), dim=-1, dtype=torch.float32)
        return norms.square_().sum(-1, keepdim=True)
    pieces = -(-n // piece)

    def batch(t: torch.Tensor) -> torch.Tensor:
        """``(nb * pieces, k, piece)``: each block's pieces as the batch."""
        if nb == 1:  # contiguous rows (padded: a copy) that as_strided reads in place
            t = _in_pieces(t, (k,), n, piece) if n % piece else t.contiguous()
            return t.as_strided((pieces, k, piece), (piece, pieces * piece, 1))
        return _in_pieces(t, (nb, k), n, piece).transpose(1, 2).reshape(nb * pieces, k, piece)

    x = batch(a)
    products = mm32(x, (x if b is a else batch(b)).transpose(1, 2))  # (nb * pieces, k, k)
    return products.sum(0, keepdim=True) if nb == 1 else products.reshape(nb, pieces, k, k).sum(1)


def _materialized_block_products(u: Factored, v: Factored, k: int) -> torch.Tensor:
    """Materialize the ``k`` per-sample gradients of each usage, as many blocks at a time as
    ``MATERIALIZE_BUDGET`` float32 elements hold (each one batched contraction over the tokens, in half precision
    under autocast; row by row over each row's span where the usage has them, :class:`TokenSpans`), then their Gram.
    On a CPU they are formed transposed where that puts the shorter side first (``(n_R, n_L)``: the same products,
    up to 8% faster at 512 x 128), which no product between them can tell."""
    nb = u.left.t.shape[0]
    n = u.left.width * u.right.width
    step = max(1, MATERIALIZE_BUDGET // max(1, k * n * (1 if v is u else 2)))
    flip = not u.left.t.is_cuda and u.left.width > u.right.width
    out = []
    for start in range(0, nb, step):
        end = min(nb, start + step)

        def per_sample(f: Factored) -> torch.Tensor:
            dtype = half_dtype(f.left.t, f.right.t)
            left = as_operand(f.left.t[start:end], dtype).reshape((end - start) * k, -1, f.left.width)
            right = as_operand(f.right.t[start:end], dtype).reshape((end - start) * k, -1, f.right.width)
            a, b = (right, left) if flip else (left, right)
            if f.spans is not None:
                return f.spans.products(a, b, start * k)
            return mm32(a.transpose(1, 2), b)  # ((end - start) k, n_a, n_b): read as blocks in pieces

        grads_u = per_sample(u)
        grads_v = grads_u if v is u else per_sample(v)
        out.append(_row_products(grads_u, grads_v, u.left.width if flip else u.right.width, k))
    return out[0] if len(out) == 1 else torch.cat(out)


def trimmed(u: Usage, spans: TokenSpans | None, k: int, formed: bool = False) -> Usage:
    """``u`` with ``spans`` (:class:`TokenSpans`) where that pays: a layer's dense pair on a CPU, whose per-sample
    gradients are formed (``formed``: materialized now; else where its products take them, ``k`` rows to a block),
    whose padding outside the spans costs more multiply-adds than a matmul call per row (:data:`CPU_MACS_PER_CALL`),
    and one of whose factors is read exactly zero there (else ``u`` as it is: nothing is assumed of the model). On a
    GPU, where a call per row costs a launch each, unchanged."""
    if spans is None or not getattr(u, "dense_pair", False) or u.spans is not None or u.left.t.device.type != "cpu":
        return u
    n = u.left.width * u.right.width
    if spans.outside.numel() * n < len(spans.starts) * CPU_MACS_PER_CALL:
        return u
    candidate = Factored(u.left, u.right, spans)
    blocked = candidate.blocked(k)
    if not formed and not _materialize_cheaper(blocked, blocked, k):
        return u
    if not (spans.zero_outside(u.left.t) or spans.zero_outside(u.right.t)):
        return u
    return candidate


def _unique_slots(ids: torch.Tensor, vocab: int) -> dict:
    """Each block's slots for its token ids (``ids``: ``(nb, m)``, below ``vocab``): ``rank``, the slot of each id;
    ``rows``, the id in each slot; ``valid``, the slots that hold an id; ``m``, the slots a block has. Where the
    vocabulary is no larger than the block's tokens, every id has its own slot (no sort: ``rank`` is the id itself);
    else each block's unique ids, found by a sort, in token order, then padding (masked)."""
    m = ids.shape[1]
    if vocab <= m:  # every id a slot: fewer slots than unique-id padding would take
        rows = torch.arange(vocab, device=ids.device).expand(ids.shape[0], vocab)
        return dict(rank=ids, rows=rows, valid=torch.ones_like(rows, dtype=torch.bool), m=vocab)
    sorted_ids, order = ids.sort(dim=1)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    rank_sorted = first.long().cumsum(1) - 1  # the slot of each sorted id among the block's unique ids
    rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)  # ... of each id in token order
    rows = torch.zeros_like(ids).scatter_(1, rank_sorted, sorted_ids)  # (nb, m): unique ids, then padding
    valid = torch.arange(m, device=ids.device)[None, :] <= rank_sorted[:, -1:]  # (nb, m): not padding
    return dict(rank=rank, rows=rows, valid=valid, m=m)


def _sparse_per_sample(f: Factored, slots: dict, b0: int, b1: int, c0: int, c1: int, k: int,
                       scattered: dict[int, torch.Tensor]) -> torch.Tensor:
    """Block rows b0:b1's per-sample gradients on unique-id slots c0:c1, ``(n, k, (c1 - c0) * d)``: an embedding's
    scattered (every slot at once, kept in ``scattered`` for the next chunks), any other gathered at the ids."""
    right = f.right.t[b0:b1]  # (n, kT, d)
    n, kt = right.shape[:2]
    m = slots["m"]
    if f.left.ids is not None:
        if id(f) not in scattered:  # every slot at once (the scatter is cheap), sliced per chunk below
            offset = slots["offsets"][id(f)]
            slot = slots["rank"][b0:b1, offset : offset + kt]  # (n, kT)
            # each token's row of the (n k m, d) gradients: its sequence's (n k of them) m slots, then its slot. An
            # index_add_ of whole rows, 3x faster on a CPU than a scatter_add_ along an axis (8 x 96 tokens of 128)
            sample = torch.arange(n * k, device=slot.device).repeat_interleave(kt // k).view(n, kt)
            grads = right.new_zeros(n * k * m, right.shape[-1], dtype=torch.float32)
            grads.index_add_(0, (sample * m + slot).reshape(-1), right.reshape(-1, right.shape[-1]).float())
            scattered[id(f)] = grads.view(n, k, m, -1)
        return scattered[id(f)][:, :, c0:c1].reshape(n, k, -1)
    left = f.left.rows(b0, b1).gather_cols(slots["rows"][b0:b1, c0:c1]) * slots["valid"][b0:b1, None, c0:c1]
    dtype = _operand_dtype(f.left, f.right)
    grads = mm32(as_operand(left, dtype).reshape(n * k, kt // k, c1 - c0).transpose(1, 2),
                 as_operand(right, dtype).reshape(n * k, kt // k, right.shape[-1]))
    return grads.reshape(n, k, -1)


def _sparse_pair(u: Usage, v: Usage) -> bool:
    """Whether a pair's products take :func:`_sparse_rows_block_products`: factored, one of them an embedding's
    (one-hot left factor), both inputs held whole."""
    return (isinstance(u, Factored) and isinstance(v, Factored) and (u.left.ids is not None or v.left.ids is not None)
            and u.right.dense is not None and v.right.dense is not None)


def _sparse_rows_block_products(usages: list[Factored], pairs: list[tuple[int, int]], k: int,
                                symmetric: bool = False) -> torch.Tensor:
    """Pairs with an embedding (one-hot left factor): only the rows of the tokens it saw enter the inner product.
    Returns ``sum <u_a, u_b>`` over the ``pairs`` of ``usages`` (``symmetric``: each ``a != b`` pair with its
    transpose too, the pair's two cross terms), all from one set of slots, each usage's rows formed once (a tied
    embedding's and head's three products in one call).

    Per block, the per-sample gradients are formed on the ``U`` unique token ids of the one-hot side(s), ``(k, U, d)``
    (on every id where the vocabulary is no larger than the block's tokens, :func:`_unique_slots`): an embedding's by
    adding its output gradients' rows, any other (the tied LM head's) from its left factor's columns at those ids.
    ``k T U d`` work at most, against the ``(kT)^2 (U + d)`` of the token Grams. All blocks at once (as many as
    ``MATERIALIZE_BUDGET`` holds): each block's unique ids are found by a sort, padded to the block's token count and
    masked, so nothing waits on the device (no ``torch.unique``, whose size the host must read).
    """
    sides = sorted({i for pair in pairs for i in pair})
    ids = torch.cat([usages[i].left.ids for i in sides if usages[i].left.ids is not None], dim=1)  # (nb, tokens)
    nb = ids.shape[0]
    slots = _unique_slots(ids, min(usages[i].left.width for i in sides))
    m = slots["m"]
    slots["offsets"], offset = {}, 0
    for i in sides:
        if usages[i].left.ids is not None:
            slots["offsets"][id(usages[i])] = offset
            offset += usages[i].left.ids.shape[1]
    first = usages[sides[0]]
    d = first.right.width
    step = max(1, MATERIALIZE_BUDGET // max(1, k * m * d * len(sides)))
    gathered = any(usages[i].left.ids is None for i in sides)
    out = []
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        scattered: dict[int, torch.Tensor] = {}
        # a gathered side's (n, kT, slots) softmax columns are bounded by GATHER_BUDGET: slots in chunks
        chunk = max(1, GATHER_BUDGET // max(1, (b1 - b0) * first.right.t.shape[1])) if gathered else m
        part = None
        for c0 in range(0, m, chunk):
            c1 = min(m, c0 + chunk)
            grads = {i: _sparse_per_sample(usages[i], slots, b0, b1, c0, c1, k, scattered) for i in sides}
            for a, b in pairs:
                prod = _row_products(grads[a], grads[b], d)
                if symmetric and a != b:
                    prod = prod + prod.transpose(1, 2)
                part = prod if part is None else part + prod
        out.append(part)
    return out[0] if len(out) == 1 else torch.cat(out)


def slot_products(usages: list[Usage], pairs: list[tuple[int, int]], k: int) -> torch.Tensor:
    """``sum <u_a, u_b>`` over the ``pairs`` (``a <= b``) of one parameter's blocked usages, each ``a != b`` pair with
    its transpose (its two cross terms), ``(B/k, k, k)``: the pairs with an embedding's side all from one set of slots
    (:func:`_sparse_rows_block_products`), the rest one by one (:func:`block_inner_products`)."""
    sparse = [(a, b) for a, b in pairs if _sparse_pair(usages[a], usages[b])]
    total = _sparse_rows_block_products(usages, sparse, k, symmetric=True) if sparse else None
    for a, b in pairs:
        if (a, b) in sparse:
            continue
        prod = block_inner_products(usages[a], usages[b], k)
        prod = prod if a == b else prod + prod.transpose(1, 2)
        total = prod if total is None else total + prod
    return total


def _head_materialize_cheaper(u: Factored, k: int) -> bool:
    """LM head (softmax-delta left factor) with itself: Grams cost ``(kT)^2 (V + d)``, chunked per-sample gradients
    ``kT V d + k^2 V d`` per block; the second wins once ``kT`` exceeds about ``d``."""
    kt, d, vocab = u.right.t.shape[1], u.right.width, u.left.width
    return kt * vocab * d + k * k * vocab * d < kt * kt * (vocab + d)


def head_columns(u: Factored, chunk: int = VOCAB_CHUNK):
    """``(start, end, columns)`` of a blocked head usage's delta, vocabulary chunk by chunk, in its operand dtype."""
    dtype = _operand_dtype(u.left, u.right)
    for start in range(0, u.left.width, chunk):
        end = min(start + chunk, u.left.width)
        yield start, end, as_operand(u.left.cols(start, end), dtype)


def _head_materialized_block_products(u: Factored, k: int, columns=None, kept: list | None = None) -> torch.Tensor:
    """The head's per-sample gradients ``delta^T h``, one vocabulary chunk at a time (never ``(k, V, d)`` whole).

    ``columns``: the delta's ``(start, end, columns)`` chunks (:func:`head_columns`) when the caller computes them
    anyway (the engine's pass that forms the head's output gradient), so that they are not computed twice.
    ``kept``: a list the chunks' per-sample gradients, ``(B, chunk, d)``, are appended to (a small vocabulary's, kept
    whole by the caller)."""
    nb, kt, d = u.right.t.shape
    dtype = _operand_dtype(u.left, u.right)
    h = as_operand(u.right.t, dtype).reshape(nb * k, kt // k, d)
    sub = max(1, (1 << 25) // max(1, nb * k * d))  # bound the (nb, k, chunk, d) buffer
    out = torch.zeros(nb, k, k, device=h.device)
    for _, _, cols in head_columns(u, min(VOCAB_CHUNK, sub)) if columns is None else columns:
        for first in range(0, cols.shape[-1], sub):
            delta = cols[..., first : first + sub]
            grads = mm32(delta.reshape(nb * k, kt // k, -1).transpose(1, 2), h)  # (nb k, chunk, d)
            out += _row_products(grads, grads, d, k)
            if kept is not None:
                kept.append(grads)
    return out


def _head_gram_block_products(u: Factored, k: int, columns=None) -> torch.Tensor:
    """The head's self inner products by token Grams: ``sum_chunks delta_c delta_c^T`` times ``h h^T``."""
    nb, kt, _ = u.right.t.shape
    g = None
    for _, _, cols in head_columns(u) if columns is None else columns:
        part = mm32(cols, cols.transpose(1, 2))
        g = part if g is None else g.add_(part)
    prod = g.mul_(gram(u.right, u.right))
    return prod.reshape(nb, k, kt // k, k, kt // k).sum(dim=(2, 4))


def head_self_products(u: Factored, k: int, columns=None, kept: list | None = None) -> torch.Tensor:
    """A blocked head usage's ``(B/k, k, k)`` self inner products by the cheaper strategy, from ``columns`` if given;
    ``kept``: where the per-sample gradients are formed (:func:`_head_materialized_block_products`), they are appended
    to it, chunk by chunk (the token Grams form none)."""
    if _head_materialize_cheaper(u, k):
        return _head_materialized_block_products(u, k, columns, kept)
    return _head_gram_block_products(u, k, columns)


def _tensor_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the same operand: storage, shape, strides and dtype (the layers that read one input,
    q/k/v or gate/up, are handed views of one tensor)."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


def _block_sums(prod: torch.Tensor, k: int) -> torch.Tensor:
    """``(B/k, kT1, kT2)`` products of token pairs -> ``(B/k, k, k)``: summed over each pair of sequences' tokens."""
    if k == 1:
        return prod.sum(dim=(1, 2), keepdim=True)
    nb, kt1, kt2 = prod.shape
    return prod.reshape(nb, k, kt1 // k, k, kt2 // k).sum(dim=(2, 4))


def _summed_left_grams(group: list[Factored]) -> torch.Tensor:
    """``sum_u gram(u.left, u.left)`` over dense usages: one Gram of their factors concatenated along the features
    (the sum of their Grams: one batched product instead of one per usage) where they share a dtype and
    shape; else float32 Grams accumulated in place by ``baddbmm``."""
    lefts = [u.left.t for u in group]
    if len(lefts) > 1 and len({(t.dtype, t.shape[:-1]) for t in lefts}) == 1:
        joined = Dense(torch.cat(lefts, dim=-1))
        return gram(joined, joined)
    total = None
    for u in group:
        if total is not None and half_dtype(u.left.t) is None:
            x = u.left.t.float()
            total.baddbmm_(x, x.transpose(1, 2))
        else:
            g = gram(u.left, u.left)
            total = g if total is None else total.add_(g)
    return total


def summed_self_products(usages: list[Usage], k: int) -> torch.Tensor | None:
    """``sum_u <u_i, u_j>`` within blocks of ``k`` rows, ``(B/k, k, k)``, over blocked usages each with itself (None
    if ``usages`` is empty): what :func:`block_inner_products` gives each, summed, in fewer operator calls.

    * Dense usages that take the token Grams and share their input (q/k/v and gate/up projections read one tensor)
      share its Gram: ``sum_u G(L_u) * G(R) = (sum_u G(L_u)) * G(R)``, one Gram of the input and one product.
    * Small float32 materialized gradients (norm gains, biases) are concatenated into one product.
    * The rest, one by one.
    """
    by_input: dict[tuple, list[Factored]] = {}
    small: list[torch.Tensor] = []
    parts: list[torch.Tensor] = []
    for u in usages:
        if getattr(u, "dense_pair", False) and not _materialize_cheaper(u, u, k):
            by_input.setdefault(_tensor_key(u.right.t), []).append(u)
        elif getattr(u, "concatenable", False):
            small.append(u.flat)
        else:
            parts.append(block_inner_products(u, u, k))
    for group in by_input.values():
        parts.append(_block_sums(_summed_left_grams(group).mul_(gram(group[0].right, group[0].right)), k))
    for start in range(0, len(small), SMALL_BATCH):
        g = small[start] if len(small) == start + 1 else torch.cat(small[start : start + SMALL_BATCH], dim=-1)
        parts.append(_row_products(g, g, 0, k if g.dim() == 2 else None))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def self_products(u: Usage, k: int, cache: dict) -> torch.Tensor:
    """``block_inner_products(u.blocked(k), u.blocked(k), k)`` of an unblocked usage, one layer at a time as the
    streamed pass takes them: a dense pair that takes the token Grams takes its input's Gram from ``cache`` (the
    caller's, one pass long) where the last such layer read the same input tensor (the gate and up projections read
    one): one batched product fewer. Only the last input's Gram is kept, by a weak reference to the input (a freed
    input is never matched)."""
    blocked = u.blocked(k)
    if not getattr(u, "dense_pair", False) or _materialize_cheaper(blocked, blocked, k):
        return block_inner_products(blocked, blocked, k)
    source = cache.get("input")
    if source is None or source() is not u.right.t or cache["k"] != k:
        cache["input"], cache["k"], cache["gram"] = weakref.ref(u.right.t), k, gram(blocked.right, blocked.right)
    return _block_sums(gram(blocked.left, blocked.left).mul_(cache["gram"]), k)


def block_inner_products(u: Usage, v: Usage, k: int) -> torch.Tensor:
    """``(B/k, k, k)`` inner products between the per-sample gradients of two usages, within blocks of ``k`` rows.

    ``u`` and ``v`` must already be blocked with :meth:`blocked`. Each pair takes the cheaper of the ghost-norm Grams
    and the (block-by-block) materialized per-sample gradients.
    """
    return u.block_inner_products(v, k)  # each usage kind pairs itself (an expert bank's too, :mod:`.rules.experts`)
