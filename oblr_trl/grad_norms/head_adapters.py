"""The LM head under a PEFT adapter: LoRA on ``lm_head`` (tied or untied embeddings) and ``trainable_token_indices``
(trained rows of a tied head), as the head's raw output ``s`` the engine's vocabulary chunks compute.

* LoRA: ``s = h W^T + b + c (x A^T) B^T`` with ``x`` the head's input after the adapter's dropout and ``c`` its
  scaling. The head's operands are widened: ``[h, c x A^T]`` against ``[W, B]``, so the softmax delta ``d/ds`` (and
  its log-sum-exp) come from the same chunks as a plain head's. Then ``B``'s per-sequence gradient is
  ``sum_t delta_t (x) c A x_t`` (the delta against the widened columns) and ``A``'s ``sum_t c (B^T delta_t) (x) x_t``
  (``B^T delta`` is the widened columns' output gradient); the head's input gradient adds ``c (B^T delta) A`` through
  the dropout. The widened weight is a copy of the head's, held for the pass (one more head's worth of memory).
* Trainable tokens: ``s = h W'^T + b`` with ``W'`` the weight with the trained rows put in (PEFT's ``index_copy``);
  the trained rows' per-sequence gradient is ``sum_t delta_t[idx] (x) h_t``. On tied embeddings the rows are one
  parameter with the embedding's (one slot in the ledger, :func:`~.engine._slots`).

Anything else on the head (DoRA and other LoRA variants, a LoRA bias, several active adapters, the base weight
trained beside trained token rows) is refused naming the head, with advice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .factors import Dense, Factored
from .support import Unsupported, UnsupportedModulesError

HEAD_ADVICE = ("exact instead: the head trained whole (modules_to_save=['lm_head']), or LoRA on it with one active "
               "adapter, no DoRA and no lora_bias")


@dataclass(eq=False)
class HeadAdapter:
    """The head as the engine computes it: ``linear`` (the ``nn.Linear`` whose weight and bias ``s`` starts from),
    and LoRA's ``(A, B, dropout, scaling)`` or the trained tokens' ``(ParameterDict, adapter name, row indices)``."""
    linear: nn.Linear
    lora: tuple | None = None
    tokens: tuple | None = None

    @property
    def plain(self) -> bool:
        return self.lora is None and self.tokens is None

    @property
    def modules(self) -> list[nn.Module]:
        """The modules that own the adapter's parameters (their slots in the ledger)."""
        if self.lora is not None:
            return [self.lora[0], self.lora[1]]
        return [self.tokens[0]] if self.tokens is not None else []

    def raw_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """``s`` in float64, without dropout (the head's observation, :mod:`.head_transform`, runs in eval mode)."""
        weight = self.linear.weight.detach().double()
        if self.tokens is not None:
            deltas, name, idx = self.tokens
            weight = weight.index_copy(0, idx.to(weight.device), deltas[name].detach().double())
        s = hidden.double() @ weight.T
        if self.linear.bias is not None:
            s = s + self.linear.bias.detach().double()
        if self.lora is not None:
            a, b, _, scaling = self.lora
            s = s + scaling * (hidden.double() @ a.weight.detach().double().T) @ b.weight.detach().double().T
        return s


def _refused(head: nn.Module, reason: str) -> UnsupportedModulesError:
    return UnsupportedModulesError([Unsupported("lm_head", type(head).__name__, f"{reason}; {HEAD_ADVICE}")])


def _one_active(head: nn.Module, names) -> str | None:
    active = [a for a in (getattr(head, "active_adapters", None) or []) if a in names]
    if len(active) > 1:
        raise _refused(head, f"{len(active)} adapters are active on the LM head ({active}); the per-sequence pass "
                             "forms one")
    return active[0] if active else None


def _lora(head: nn.Module) -> HeadAdapter:
    base = head.get_base_layer()
    if not isinstance(base, nn.Linear):
        raise _refused(head, f"LoRA on an LM head whose base layer is a {type(base).__name__}, not an nn.Linear")
    name = None if head.disable_adapters or head.merged else _one_active(head, head.lora_A.keys())
    if name is None:  # adapters off, or merged into the base weight: the base layer is the head
        return HeadAdapter(base)
    if name in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(name):
        raise _refused(head, "a LoRA variant (such as DoRA) on the LM head; the per-sequence pass forms plain LoRA")
    a, b = head.lora_A[name], head.lora_B[name]
    if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)) or a.bias is not None or b.bias is not None:
        raise _refused(head, "LoRA on the LM head with a bias (lora_bias=True) or non-Linear factors")
    return HeadAdapter(base, lora=(a, b, head.lora_dropout[name], float(head.scaling[name])))


def _tokens(head: nn.Module, layer: nn.Module) -> HeadAdapter:
    base = layer.base_layer
    if not isinstance(base, nn.Linear):
        raise _refused(head, f"trainable tokens on an LM head whose base layer is a {type(base).__name__}, not an "
                             "nn.Linear")
    name = None if layer.disable_adapters or layer.merged else _one_active(layer, layer.trainable_tokens_delta.keys())
    if name is None:
        return HeadAdapter(base)
    if base.weight.requires_grad:
        raise _refused(head, "the head's weight is trained beside trained token rows that replace some of its rows")
    idx = torch.as_tensor(layer.token_indices[name], dtype=torch.long)
    if idx.unique().numel() != idx.numel():
        raise _refused(head, "trainable_token_indices lists a token twice")
    return HeadAdapter(base, tokens=(layer.trainable_tokens_delta, name, idx))


def adapter_of(head: nn.Module | None) -> HeadAdapter:
    """The head as the engine computes it (:class:`HeadAdapter`); raises :class:`~.support.UnsupportedModulesError`
    naming the head where it is none of an ``nn.Linear``, LoRA on one, or trainable tokens on one."""
    if isinstance(head, nn.Linear):
        return HeadAdapter(head)
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    except ImportError:  # pragma: no cover - PEFT not installed: no PEFT head either
        LoraLayer = TrainableTokensLayer = ()
    if isinstance(head, LoraLayer):
        return _lora(head)
    layer = getattr(head, "token_adapter", head)  # PEFT's TrainableTokensWrapper, or the layer itself
    if isinstance(layer, TrainableTokensLayer):
        return _tokens(head, layer)
    raise _refused(head, "the LM head must be an nn.Linear (or one under PEFT's LoRA or trainable tokens)")


def refusal(head: nn.Module | None) -> list[Unsupported]:
    """:func:`adapter_of`'s refusal as entries (empty where the head is supported)."""
    try:
        adapter_of(head)
    except UnsupportedModulesError as error:
        return list(error.modules)
    return []


class HeadPass:
    """One pass's head under its adapter: the widened operands, the input gradient through the adapter, and the
    adapter's usages. ``read(param)``: the parameter as a plain tensor (gathered under ZeRO-3 or FSDP2)."""

    def __init__(self, adapter: HeadAdapter, read):
        self.adapter, self.read = adapter, read
        self.h = None  # the head's input rows, as the base weight's usage needs them
        self.x_in = self.x = self.u = self.a = None
        self.grad_u = None

    def operands(self, h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor):
        """``(h, W)`` widened for the adapter (``rows``: the head's input rows, with their graph cut)."""
        self.h = h
        adapter = self.adapter
        if adapter.tokens is not None:
            deltas, name, idx = adapter.tokens
            rows_in = self.read(deltas[name]).to(weight.dtype)
            return h, weight.index_copy(0, idx.to(weight.device), rows_in)
        if adapter.lora is None:
            return h, weight
        a, b, dropout, scaling = adapter.lora
        self.a = self.read(a.weight).float()
        self.x_in = rows.detach().float().requires_grad_(True)
        with torch.enable_grad():
            self.x = dropout(self.x_in)
        self.u = scaling * (self.x.detach() @ self.a.T)
        b_weight = self.read(b.weight).to(weight.dtype)
        return torch.cat([h, self.u.to(h.dtype)], -1), torch.cat([weight, b_weight], -1)

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The head's input gradient from the widened operands' ``grad``."""
        if self.adapter.lora is None:
            return grad
        width = self.h.shape[-1]
        scaling = self.adapter.lora[3]
        self.grad_u = grad[..., width:]
        through = torch.autograd.grad(self.x, self.x_in, scaling * self.grad_u @ self.a)[0]
        self.x_in = None
        return grad[..., :width] + through

    def usages(self, delta) -> list[tuple[nn.Module, str, Factored]]:
        """The adapter's ``(module, parameter name, usage)`` (``delta``: the head's softmax delta on the widened
        operands)."""
        adapter, found = self.adapter, []
        if adapter.lora is not None:
            a, b, _, scaling = adapter.lora
            if b.weight.requires_grad:
                found.append((b, "weight", Factored(delta, Dense(self.u))))
            if a.weight.requires_grad:
                found.append((a, "weight", Factored(Dense(scaling * self.grad_u), Dense(self.x.detach()))))
        elif adapter.tokens is not None:
            deltas, name, idx = adapter.tokens
            if deltas[name].requires_grad:
                idx = idx.to(self.h.device)
                cols = delta.gather_cols(idx.expand(self.h.shape[0], -1))
                found.append((deltas, name, Factored(Dense(cols), Dense(self.h))))
        return found
