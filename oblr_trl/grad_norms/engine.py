"""One pass of exact per-sequence gradient norms of ``sum_t log pi(o_t | q, o_<t)``: one forward and one backward.

It reads hook -> record -> rule -> ledger -> head: :mod:`.hooks` record each trainable module's input activation and
output gradient (or whole call); the rules (:mod:`.rules`, :mod:`.experts`, :mod:`.routers`, :mod:`.generic`) turn
each record into per-sequence gradients, factored (:mod:`.factors`); the ledger (:mod:`.ledger`, :mod:`.support`)
says which module accounts for which parameter (a slot each, a tied weight shared); :mod:`.head` forms the LM head's
terms in vocabulary chunks, never holding the ``(B, T, V)`` logits. No coverage check here: the public functions of
:mod:`.api` run :func:`.coverage.check_once` first.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from contextlib import contextmanager

import torch
from torch import nn

from .factors import (
    Dense,
    Factored,
    Materialized,
    SoftmaxDelta,
    Usage,
    autocast_operands,
    block_inner_products,
    materializing_saves_memory,
    per_sample_dtype,
)
from . import factors, generic, hooks
from .head import lm_head_terms, logit_scale
from .hooks import Record, capture, checkpointed_layers
from .result import PerSequenceGradients, Slot, _fp32
from .experts import call_usages, routed_forwards
from .recognise import find_rule
from .ledger import functional_owners
from .lm import output_head, text_config as _text_config, unwrap_causal_lm
from .support import UnsupportedModulesError, coverage_plan, refuse_outside_decoder




def _hooked_modules(lm: nn.Module) -> tuple[list[nn.Module], set[nn.Module], dict[nn.Module, tuple[str, ...]]]:
    """The trainable modules of ``lm``'s backbone to hook, those of them whose whole call is recorded (per-row and
    routed paths), and the parameters each borrows from descendants that use them functionally (dotted names). Refuses,
    listing every unsupported module at once."""
    covered, unsupported = coverage_plan(lm, functional_owners(lm))
    if unsupported:
        raise UnsupportedModulesError(unsupported)
    modules = [c.module for c in covered]
    whole_call = {c.module for c in covered if c.how in ("per-row", "routed")}
    return modules, whole_call, {c.module: c.borrowed for c in covered if c.borrowed}


def _slot(module: nn.Module, name: str) -> Slot:
    """A parameter's slot from its name relative to ``module`` (dotted for a descendant's)."""
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


def _plain(param: torch.Tensor, lm: nn.Module) -> torch.Tensor:
    """A detached plain tensor of ``param``: gathered if it is a DTensor, copied if FSDP2 frees it on reshard."""
    value = param.detach()
    if hasattr(value, "full_tensor"):  # DTensor
        return value.full_tensor()
    return value.clone() if hasattr(lm, "reshard") else value


@contextmanager
def _fsdp_root_unsharded(lm: nn.Module):
    """Under FSDP2 the root's own parameters (embeddings, final norm, LM head) are gathered by the root's forward hook,
    which this pass bypasses (it calls the backbone and the head directly): gather them here. The layers' own hooks
    gather theirs. Every rank must run this pass, in the same order: it is a collective."""
    if not hasattr(lm, "unshard") or not hasattr(lm, "reshard"):  # not an FSDPModule
        yield
        return
    state = lm._get_fsdp_state() if hasattr(lm, "_get_fsdp_state") else None
    if state is not None and hasattr(state, "_lazy_init"):
        state._lazy_init()  # as the root's first forward would: the layers below must not become roots themselves
    lm.unshard()
    try:
        yield
    finally:
        lm.reshard()


def per_sequence_grads(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    stream_group_size: int | None = None,
    materialize: bool = False,
    model_inputs: dict | None = None,
) -> PerSequenceGradients:
    """Forward and backward of ``sum_t log pi(o_{i,t})`` for every row, captured as factored per-sequence gradients.

    The backward goes to the hooked modules' inputs only: no parameter's ``.grad`` is touched. With
    ``stream_group_size=k``, each layer whose parameters have one usage (called once, not tied) adds its within-block
    inner products as its output gradient arrives and drops its factors, so the pass holds no more than autograd does
    (only :meth:`PerSequenceGradients.inner_products` with that ``k`` can be taken then).

    With ``materialize=True`` (what ``OBLRPOConfig(one_backward=True)`` uses), each layer whose per-sample gradients
    take no more memory than its factors (:func:`~.factors.materializing_saves_memory`: long sequences through narrow
    layers) forms them as its output gradient arrives, one contraction over the tokens (the cost of its weight
    gradient), and keeps them instead of the factors (in bf16 under bf16 autocast, as autograd's own weight gradients
    are there; sums over them in fp32). Its inner products and its weighted sum are then nearly free, where the
    factors would cost a token Gram or a materialization now and a contraction again for the update.
    See :func:`per_sequence_grad_sq_norms` for the other arguments.
    """
    batch, length = input_ids.shape
    completion_length = completion_mask.shape[1]
    if completion_length >= length:
        raise ValueError("completion_mask must cover fewer positions than input_ids (a prompt token is needed).")
    lm = unwrap_causal_lm(model)
    usages: dict[Slot, list[Usage]] = defaultdict(list)
    if batch == 0 or not any(p.requires_grad for p in lm.parameters()):
        return PerSequenceGradients(usages, batch, input_ids.device)
    head = output_head(lm)
    if not isinstance(head, nn.Linear):
        raise NotImplementedError(f"The LM head must be an nn.Linear, got {type(head).__name__}.")
    backbone = lm.base_model
    alpha = logit_scale(lm) / temperature
    # The head's products run in the autocast dtype when the pass runs under autocast, as the fused head's do.
    device_type = input_ids.device.type
    half = torch.is_autocast_enabled(device_type) and device_type in factors.HALF_OPERAND_DEVICES
    head_dtype = torch.get_autocast_dtype(device_type) if half else None
    softcap = getattr(_text_config(lm), "final_logit_softcapping", None)
    hooked, per_row, borrowed = _hooked_modules(lm)
    if model_inputs:  # images: the modules that see them (a vision tower) have rows that are not the sequences
        refuse_outside_decoder(lm, hooked, model_inputs)
    checkpointed = checkpointed_layers(backbone)
    # Each trainable parameter's slot, (module, name) of its first owner: found now, by the parameters' identity, and
    # kept as modules, because FSDP2 swaps the parameter objects when it unshards them inside the pass. A tied
    # embedding and head share one slot.
    slot_of: dict[Slot, Slot] = {}
    first_owner: dict[int, Slot] = {}
    own = [(m, n) for m in hooked + [head] for n, p in m.named_parameters(recurse=False) if p.requires_grad]
    for slot in own + [_slot(m, n) for m, names in borrowed.items() for n in names]:
        slot_of[slot] = first_owner.setdefault(id(getattr(*slot)), slot)
    owners = Counter(slot_of.values())
    sharing = {module for (module, _), slot in slot_of.items() if owners[slot] > 1}
    streamed, self_done = None, set()
    streamed_parts: list[torch.Tensor] = []  # each streamed layer's products, summed once at the end (fewer launches)
    cast_cache: dict = {}  # the last half-precision cast of a layer input, for the layers that share it
    if stream_group_size is not None:
        if batch % stream_group_size:
            raise ValueError(f"group_size={stream_group_size} must divide the batch size {batch}.")
        streamed = torch.zeros(batch // stream_group_size, stream_group_size, stream_group_size, device=input_ids.device)

    def keep(record: Record, materialize_now: bool) -> None:
        """The record's per-sample gradients, by parameter: factored, or materialized where that saves memory."""
        for name, usage in find_rule(record.module)(record.module, record.activation, record.output_grad).items():
            usage = autocast_operands(usage, cast_cache)
            if materialize_now and materializing_saves_memory(usage):
                with _fp32(input_ids.device):
                    usage = Materialized(usage.materialize().to(per_sample_dtype(usage)))
            usages[slot_of[(record.module, name)]].append(usage)

    def on_grad(record: Record, calls: dict) -> None:
        module = record.module
        if streamed is not None and calls[module] == 1 and module not in sharing:
            k = stream_group_size
            with _fp32(input_ids.device):
                for usage in find_rule(module)(module, record.activation, record.output_grad).values():
                    blocked = autocast_operands(usage, cast_cache).blocked(k)
                    streamed_parts.append(block_inner_products(blocked, blocked, k))
        elif materialize:
            keep(record, materialize_now=True)
        else:
            return  # several usages of one parameter: their cross terms need them all, at the end
        record.activation, record.output_grad = None, None  # consumed

    on_grad_hook = on_grad if streamed is not None or materialize else None
    # expert banks outside checkpointed layers keep their routed pairs' factors from the forward (experts.py)
    in_checkpointed = {m for layer in checkpointed for m in layer.modules()}
    banks = [m for m in per_row if m not in in_checkpointed]
    with _fsdp_root_unsharded(lm), routed_forwards(banks), \
            capture(hooked, batch, on_grad_hook, checkpointed, per_row) as (records, inputs_with_grad):
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                          **(model_inputs or {})).last_hidden_state
        h = hidden[:, length - completion_length - 1 : length - 1]
        h_op = h.detach() if head_dtype is None else h.detach().to(head_dtype)
        labels = input_ids[:, length - completion_length :]
        mask = completion_mask.to(torch.float32)
        head_weight, head_bias = _plain(head.weight, lm), None if head.bias is None else _plain(head.bias, lm)
        if head_dtype is not None:
            head_weight = head_weight.to(head_dtype)
        # Streamed, the head weight's own products come with its output gradient, from the same softmax chunks.
        head_self_k = stream_group_size if streamed is not None and head.weight.requires_grad else None
        with _fp32(input_ids.device):
            lse, grad_h, head_self = lm_head_terms(h_op, labels, mask, head_weight, head_bias, alpha, softcap,
                                                    head_self_k)
        if head_self is not None:
            streamed_parts.append(head_self)
        if hidden.requires_grad:
            full_grad = torch.zeros_like(hidden)
            full_grad[:, length - completion_length - 1 : length - 1] = grad_h.to(hidden.dtype)
            # Backward to the hooked modules' inputs (their output gradients are all we need) plus the trainable
            # parameters of modules whose input carries no gradient (the input embedding).
            first_layer_params = [
                p for r in records if not r.input_has_grad for p in r.module.parameters(recurse=False) if p.requires_grad
            ]
            targets = inputs_with_grad + first_layer_params
            if not targets:
                targets = [p for p in backbone.parameters() if p.requires_grad]
            try:
                torch.autograd.grad(hidden, targets, grad_outputs=full_grad, allow_unused=True)
            except RuntimeError as error:
                if "use_reentrant=True" not in str(error):
                    raise
                raise RuntimeError(
                    "Per-sequence gradient norms need non-reentrant gradient checkpointing: set "
                    "gradient_checkpointing_kwargs={'use_reentrant': False} (TRL's and transformers' default)."
                ) from error

    cast_cache.clear()
    if streamed_parts:
        streamed += torch.stack(streamed_parts).sum(0)
        streamed_parts.clear()
    for record in records:
        if isinstance(record.activation, hooks.Call):
            if any(g is not None for g in record.output_grad):
                module = record.module
                if module in borrowed:  # its own parameters and those it uses functionally, row by row
                    names = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
                    found = generic.per_row_usages(module, record.activation, record.output_grad, batch,
                                                   names + list(borrowed[module]))
                else:
                    found = call_usages(module, record.activation, record.output_grad, batch)
                for name, usage in found.items():
                    usages[slot_of[_slot(module, name)]].append(usage)
            continue
        if record.output_grad is None:  # streamed, a recomputation under gradient checkpointing, or an unused output
            continue
        keep(record, materialize_now=False)
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
        delta = SoftmaxDelta(h_op, head_weight, head_bias, alpha, lse, labels, mask, softcap)
        if head.weight.requires_grad:
            head_usage = Factored(delta, Dense(h_op))
            usages[slot_of[(head, "weight")]].append(head_usage)
            if head_self is not None:
                self_done.add(id(head_usage))
        if head.bias is not None and head.bias.requires_grad:
            with _fp32(input_ids.device):
                usages[slot_of[(head, "bias")]].append(Materialized(delta.cols(0, delta.width).sum(1)))
    return PerSequenceGradients(usages, batch, input_ids.device, streamed, slots=list(owners), self_done=self_done)


