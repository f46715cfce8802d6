"""One pass of exact per-sequence gradient norms of ``sum_t log pi(o_t | q, o_<t)``: one forward and one backward.

It reads plan -> hook -> record -> rule -> slot -> head: the plan handed in (``covering``, the coverage's
:func:`~.coverage.pass_plan`) says which rule each trainable module takes, chosen once per model; :mod:`.hooks` record
each one's input activation and output gradient (or whole call); the layer rules (:mod:`.rules`) turn each record into
per-sequence gradients, factored (:mod:`.factors`); each parameter has one slot (a tied weight shared); :mod:`.head`
forms the LM head's terms in vocabulary chunks, never holding the ``(B, T, V)`` logits. No coverage check here: the
public :func:`~.api.per_sequence_grads` runs :func:`~.coverage.check_once` first.
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
    TokenSpans,
    Usage,
    autocast_operands,
    materializing_saves_memory,
    per_sample_dtype,
    self_products,
    trimmed,
)
from . import factors, hooks
from .head import HeadPass, adapter_of, lm_head_terms, transform_of
from .hooks import Record, capture, checkpointed_layers, norms_checkpointing
from .result import PerSequenceGradients, Replay, Slot, Unsupported, UnsupportedModulesError, _fp32
from .rules import per_row
from .rules.experts import RoutedCaptures
from .model import ModelPlan, ModelView, module_names
from .rules import soft_prompt


def _hooked_modules(plan: ModelPlan) -> tuple[list[nn.Module], set[nn.Module], dict[nn.Module, tuple[str, ...]]]:
    """The trainable modules of the model's backbone to hook, those of them whose whole call is recorded (per-row and
    routed paths), and the parameters each borrows from descendants that use them functionally (dotted names), from
    the model's plan (:func:`~.coverage.coverage_plan`)."""
    modules = [c.module for c in plan.covered]
    whole_call = {c.module for c in plan.covered if c.whole_call}
    return modules, whole_call, {c.module: c.borrowed for c in plan.covered if c.borrowed}


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


def _zero3_partitioned(params) -> list[torch.Tensor]:
    """The DeepSpeed ZeRO-3 partitioned parameters among ``params`` (ZeRO-3 gives each a ``ds_id``)."""
    return [p for p in params if p is not None and hasattr(p, "ds_id")]


def _head_params(params, gathered: set[int] = frozenset()) -> dict[int, torch.Tensor]:
    """Under DeepSpeed ZeRO-3: detached full copies of the head's parameters (its weight and bias, an adapter's),
    by ``id``, gathered from their partitions before the pass (the pass reads the head directly, where no ZeRO-3 hook
    gathers it; a tied head shares the input embedding, which ZeRO-3 releases after the embedding's forward). Empty
    when the head is not partitioned: it is read in place then. The backbone's layers are gathered by ZeRO-3's own
    module hooks, forward and backward."""
    partitioned = _zero3_partitioned(params)
    if not partitioned:
        return {}
    held = [p for p in partitioned if id(p) in gathered]  # gathered for the whole pass already (_borrowed_gathered)
    rest = [p for p in partitioned if id(p) not in gathered]
    import deepspeed  # present: the parameters are ZeRO-3's

    with deepspeed.zero.GatheredParameters(rest, enabled=bool(rest), modifier_rank=None):
        return {id(p): p.detach().clone() for p in held + rest}


@contextmanager
def _borrowed_gathered(run: "_Pass"):
    """Under DeepSpeed ZeRO-3: every parameter under a module that uses its descendants' parameters outside their own
    forward (the ancestors that borrow them, :func:`~.ledger.functional_owners`: PEFT's trainable token rows and the
    embedding weight they patch, a Mamba conv's weight) gathered while the pass runs, forward, backward and the
    per-row re-runs; yields their ids. ZeRO-3's module hooks gather a module's own parameters for its forward only; the
    engine's forward, which gathers such parameters as they are read, is not the pass's."""
    params = _zero3_partitioned(list({id(p): p for m in run.borrowed for p in m.parameters()}.values()))
    if not params:
        yield set()
        return
    import deepspeed  # present: the parameters are ZeRO-3's

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield {id(p) for p in params}


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


def _slots(hooked: list[nn.Module], head: nn.Module, borrowed: dict[nn.Module, tuple[str, ...]]
           ) -> tuple[dict[Slot, Slot], list[Slot], set[nn.Module]]:
    """Each trainable parameter's slot, ``(module, name)`` of its first owner, for every ``(module, name)`` that
    reaches it; the slots in module order; the modules whose parameters have several owners (a tied embedding and
    head share one slot). Found by the parameters' identity now and kept as modules, because FSDP2 swaps the parameter
    objects when it unshards them inside the pass."""
    slot_of: dict[Slot, Slot] = {}
    first_owner: dict[int, Slot] = {}
    own = [(m, n) for m in hooked + [head] for n, p in m.named_parameters(recurse=False) if p.requires_grad]
    for slot in own + [_slot(m, n) for m, names in borrowed.items() for n in names]:
        slot_of[slot] = first_owner.setdefault(id(getattr(*slot)), slot)
    owners = Counter(slot_of.values())
    sharing = {module for (module, _), slot in slot_of.items() if owners[slot] > 1}
    return slot_of, list(owners), sharing


class _Pass:
    """One pass run from the model's plan (:func:`~.coverage.coverage_plan`: each module's rule, chosen once per
    model), and what it builds: each parameter's per-sequence gradients (usages), and, streamed, the within-block
    inner products of the layers consumed as their output gradients arrived. It owns what the forward hands to the
    backward (``routed``: the expert banks' routed pairs, :class:`~.rules.experts.RoutedCaptures`)."""

    def __init__(self, view: ModelView, covering, batch: int, device: torch.device, stream_group_size: int | None,
                 materialize: bool):
        self.adapter = adapter_of(view.head)  # an nn.Linear, or one under LoRA or trained tokens (head.py)
        self.head = self.adapter.linear
        self.head_pass: HeadPass | None = None  # the head's operands under its adapter, set by the pass
        plan, prompt_covered = covering(view)
        self.hooked, self.whole_call, self.borrowed = _hooked_modules(plan)
        self.rules = {c.module: c.rule for c in plan.covered}
        self.view = view
        for covered in prompt_covered:  # a soft prompt's encoder (rules/soft_prompt.py): its layers, each by its rule
            self.hooked.append(covered.module)
            self.rules[covered.module] = covered.rule
            if covered.whole_call:
                self.whole_call.add(covered.module)
        self.routed = RoutedCaptures(plan.memo)
        self.slot_of, self.slots, self.sharing = _slots(self.hooked + self.adapter.modules, self.head, self.borrowed)
        self.batch, self.device, self.k, self.materialize = batch, device, stream_group_size, materialize
        self.failed: list[Unsupported] = []
        self.usages: dict[Slot, list[Usage]] = defaultdict(list)
        self.cast_cache: dict = {}  # the last half-precision cast of a layer input, for the layers that share it
        self.gram_cache: dict = {}  # streamed: the last token Gram of a layer input, for the layers that share it
        self.spans: TokenSpans | None = None  # each row's tokens that can carry a gradient (set by run_pass)
        self.parts: list[torch.Tensor] = []  # each streamed layer's products, summed once at the end (fewer launches)
        self.self_done: set[int] = set()
        self.presummed = None  # without streaming: the head's own (B, 1, 1) products, formed with its output gradient
        self.head_grads = None  # streamed: a small tied head's (B, V, d) per-sample gradients, kept (_head_terms)
        self.streamed = None
        if stream_group_size is not None:
            if batch % stream_group_size:
                raise ValueError(f"group_size={stream_group_size} must divide the batch size {batch}.")
            self.streamed = torch.zeros(batch // stream_group_size, stream_group_size, stream_group_size,
                                        device=device)

    @property
    def names(self) -> dict[nn.Module, str]:
        """Each module's qualified name (a soft prompt encoder's in the ``PeftModel``): only a refusal needs them."""
        names = dict(module_names(self.view))
        if self.view.prompted is not None:
            names.update({m: n for n, m in soft_prompt.encoder_modules(self.view.prompted)})
        return names

    def refusal(self, module: nn.Module, error: Exception) -> Unsupported:
        """A failure forming ``module``'s per-sequence gradients, as an entry of the library's refusal: its path and
        the reason."""
        what = str(error) if isinstance(error, hooks.RowsError) else f"{type(error).__name__}: {error}"
        return Unsupported(self.names.get(module, ""), type(module).__name__,
                           f"forming its per-sequence gradients fails: {what}")

    @contextmanager
    def refusing(self, module: nn.Module):
        """A rule's or the per-row re-run's failure, kept (the pass goes on, so that :meth:`result` refuses every
        failing module at once), never a bare error to the user."""
        try:
            yield
        except UnsupportedModulesError as error:
            self.failed.extend(error.modules)
        except Exception as error:
            self.failed.append(self.refusal(module, error))

    @property
    def on_grad_hook(self):
        return self.on_grad if self.streamed is not None or self.materialize else None

    def keep(self, record: Record, materialize_now: bool) -> None:
        """The record's per-sample gradients, by parameter: factored, or materialized where that saves memory."""
        found = {}
        with self.refusing(record.module):
            found = self.rules[record.module](record.module, record.activation, record.output_grad)
        for name, usage in found.items():
            usage = autocast_operands(usage, self.cast_cache)
            if materialize_now and materializing_saves_memory(usage):
                with _fp32(self.device):
                    usage = trimmed(usage, self.spans, 1, formed=True)
                    usage = Materialized(usage.materialize().to(per_sample_dtype(usage)))
            else:
                usage = trimmed(usage, self.spans, self.k or 1)
            self.usages[self.slot_of[(record.module, name)]].append(usage)

    def on_grad(self, record: Record, calls: dict) -> None:
        """A record complete during the backward: streamed (its products now), materialized, or kept for the end."""
        module = record.module
        if self.streamed is not None and calls[module] == 1 and module not in self.sharing:
            with _fp32(self.device), self.refusing(module):
                for name, usage in self.rules[module](module, record.activation, record.output_grad).items():
                    if getattr(usage, "concatenable", False):
                        # a norm gain's or a bias's few values: kept, and all their products taken at the end in one
                        # (summed_self_products), fewer operator calls than a set of them each
                        self.usages[self.slot_of[(module, name)]].append(usage)
                        continue
                    usage = trimmed(autocast_operands(usage, self.cast_cache), self.spans, self.k)
                    self.parts.append(self_products(usage, self.k, self.gram_cache))
        elif self.materialize:
            self.keep(record, materialize_now=True)
        else:
            return  # several usages of one parameter: their cross terms need them all, at the end
        record.activation, record.output_grad = None, None  # consumed

    def take_call(self, record: Record) -> None:
        """A whole call's usages: its own parameters and those it borrows row by row, or its call rule's."""
        module = record.module
        if not any(g is not None for g in record.output_grad):
            return
        found = {}
        with self.refusing(module):
            if self.rules[module] is not None:  # its call rule (one that borrows, :mod:`.rules.lora_experts`, if it does)
                found = self.rules[module].usages(module, record.activation, record.output_grad, self.batch,
                                                  self.routed)
            elif module in self.borrowed:
                names = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
                found = per_row.per_row_usages(module, record.activation, record.output_grad, self.batch,
                                               names + list(self.borrowed[module]))
            else:
                found = per_row.per_row_usages(module, record.activation, record.output_grad, self.batch)
        for name, usage in found.items():
            self.usages[self.slot_of[_slot(module, name)]].append(usage)

    def collect(self, records: list[Record]) -> None:
        """After the backward: every record not consumed on the way."""
        self.cast_cache.clear()
        self.gram_cache.clear()
        if self.parts:
            self.streamed += torch.stack(self.parts).sum(0)
            self.parts.clear()
        for record in records:
            if isinstance(record.activation, hooks.Call):
                self.take_call(record)
            elif record.output_grad is not None:  # else streamed, a recomputation, or an unused output
                self.keep(record, materialize_now=False)

    def add_head(self, delta: SoftmaxDelta, self_products_done: bool) -> None:
        head, h = self.head, self.head_pass.h
        for module, name, usage in self.head_pass.usages(delta):  # an adapter's (head.py)
            self.usages[self.slot_of[_slot(module, name)]].append(usage)
        if head.weight.requires_grad:
            # the tied head's per-sample gradients where the pass kept them (_head_terms): the embedding's share of the
            # weight is then materialized too, and their cross terms are two products (result.PerSequenceGradients)
            usage = Factored(delta, Dense(h)) if self.head_grads is None else Materialized(self.head_grads)
            self.usages[self.slot_of[(head, "weight")]].append(usage)
            if self_products_done:
                self.self_done.add(id(usage))
        if head.bias is not None and head.bias.requires_grad:
            with _fp32(self.device):
                self.usages[self.slot_of[(head, "bias")]].append(Materialized(delta.cols(0, delta.width).sum(1)))

    def refused(self, more: list[Unsupported] = ()) -> UnsupportedModulesError:
        """Every module that failed in this pass, once each (its first reason), in the model's module order."""
        order = {name: i for i, name in enumerate(self.names.values())}
        first = {}
        for entry in [*self.failed, *more]:
            first.setdefault(entry.name, entry)
        return UnsupportedModulesError(sorted(first.values(), key=lambda entry: order.get(entry.name, -1)))

    def result(self) -> PerSequenceGradients:
        if self.failed:
            raise self.refused()
        return PerSequenceGradients(self.usages, self.batch, self.device, self.streamed, slots=self.slots,
                                   self_done=self.self_done, presummed=self.presummed)


REENTRANT_ADVICE = (
    "transformers' gradient checkpointing, reentrant or not, is handled (grad_norms/hooks.py); a module that "
    "calls torch.utils.checkpoint.checkpoint(..., use_reentrant=True) in its own forward is not: pass "
    "use_reentrant=False in that call, or train without exact norms: "
    "OBLRPOConfig(grad_norm_estimator='length', snr_lr=False).")


def _backward_to_hooks(hidden: torch.Tensor, grad: torch.Tensor, records: list[Record],
                       inputs_with_grad: list[torch.Tensor], backbone: nn.Module,
                       borrowed: dict[nn.Module, tuple[str, ...]], retain_graph: bool = False) -> None:
    """The backward of ``<hidden, grad>`` to the hooked modules' inputs (their output gradients are all the rules
    need) plus, for modules whose input carries no gradient (the input embedding; the first layer's adapters), their
    hooked output where the record holds it (``Record.output_edge``: the backward stops there, and the embedding's
    dense ``(V, d)`` weight gradient is never formed), else their trainable parameters, their own and those they
    borrow (VeRA's, LoHa's, LoKr's and IA3's sit in ParameterDicts that their layer uses functionally; before, the
    backward stopped short of them, and their gradient was 0): no other parameter's gradient is computed, and no
    ``.grad`` is touched. Taken to the lowest of these only (:func:`~.hooks.lowest_edges`: the embeddings' outputs, in
    a plain decoder), it runs the same nodes and holds one gradient each instead of one per hooked layer's input."""
    first_layer_params = [
        p for r in records if not r.input_has_grad
        for p in ([r.output_edge] if r.output_edge is not None else
                  [*r.module.parameters(recurse=False), *map(r.module.get_parameter, borrowed.get(r.module, ()))])
        if r.output_edge is not None or p.requires_grad
    ]
    targets = inputs_with_grad + first_layer_params or [p for p in backbone.parameters() if p.requires_grad]
    targets = hooks.lowest_edges(targets)
    if not targets:  # nothing trainable below the head (LoRA on the head alone, the inputs' gradients on)
        return
    try:
        torch.autograd.grad(hidden, targets, grad_outputs=grad, allow_unused=True, retain_graph=retain_graph)
    except RuntimeError as error:
        if "use_reentrant=True" not in str(error):
            raise
        raise UnsupportedModulesError(
            [Unsupported("", type(backbone).__name__, "a module of it calls torch's reentrant checkpoint in its own "
                         "forward, which the per-sequence gradient pass cannot go through (transformers' gradient "
                         "checkpointing, reentrant or not, is handled); pass use_reentrant=False in that call")],
            advice=REENTRANT_ADVICE,
        ) from error


def _head_operands(lm: nn.Module, head: nn.Linear, hidden: torch.Tensor, span: slice, device_type: str, read):
    """The head's input rows (the positions that predict completion tokens) and weight, detached and, when the pass
    runs under autocast, in the autocast dtype, as the fused head's products run. ``read(param)``: a parameter as a
    plain tensor (gathered before the pass under DeepSpeed ZeRO-3, :func:`_head_params`)."""
    half = torch.is_autocast_enabled(device_type) and device_type in factors.HALF_OPERAND_DEVICES
    head_dtype = torch.get_autocast_dtype(device_type) if half else None
    h = hidden[:, span].detach()
    weight, bias = read(head.weight), None if head.bias is None else read(head.bias)
    if head_dtype is not None:
        h, weight = h.to(head_dtype), weight.to(head_dtype)
    return h, weight, bias


def _head_terms(run: _Pass, lm: nn.Module, hidden: torch.Tensor, span: slice, scored: tuple, alpha: float,
                transform, gathered: dict):
    """The head's operands (its bias with the observed offset folded in, :mod:`.head`), the log-sum-exp of
    the scored logits and the head's output gradient. Streamed, the head weight's own products come with its output
    gradient, from the same softmax chunks: streamed, in blocks of the stream's group (added to the pass's parts);
    with materialize (one_backward, which needs the norms), each row's alone (kept as the pass's presummed products).
    The last value returned says whether they were formed. Under a head adapter (LoRA, trained tokens:
    :mod:`.head`) ``h`` and the weight returned are its widened operands, the output gradient is the head
    input's, and no products come with it."""
    head = run.head

    def read(param):
        return gathered[id(param)] if id(param) in gathered else _plain(param, lm)

    h, weight, bias = _head_operands(lm, head, hidden, span, hidden.device.type, read)
    run.head_pass = HeadPass(run.adapter, read)
    h, weight = run.head_pass.operands(h, weight, hidden[:, span])
    bias = transform.bias(bias)
    k = (run.k if run.streamed is not None else 1 if run.materialize else None) if head.weight.requires_grad else None
    k = k if run.adapter.plain else None
    # streamed, a tied head's per-sample gradients where they are formed and small (factors.TIED_HEAD_KEPT)
    kept = [] if (k is not None and run.streamed is not None and head in run.sharing
                  and run.batch * weight.shape[0] * weight.shape[1] <= factors.TIED_HEAD_KEPT) else None
    with _fp32(hidden.device):
        lse, grad_h, head_self = lm_head_terms(h, *scored, weight, bias, alpha, transform.softcap, k, kept)
        grad_h = run.head_pass.input_grad(grad_h)
    if kept:
        run.head_grads = kept[0] if len(kept) == 1 else torch.cat(kept, dim=1)  # (B, V, d)
    if head_self is not None and run.streamed is not None:
        run.parts.append(head_self)
    elif head_self is not None:
        run.presummed = head_self
    return h, weight, bias, lse, grad_h, head_self is not None


def run_pass(
    view: ModelView,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    covering,
    temperature: float = 1.0,
    stream_group_size: int | None = None,
    materialize: bool = False,
    model_inputs: dict | None = None,
    keep_graph: bool = False,
) -> PerSequenceGradients:
    """Forward and backward of ``sum_t log pi(o_{i,t})`` for every row, captured as factored per-sequence gradients.

    ``view``: the model resolved (:func:`~.model.view_of`), which every room of the pass reads; ``covering(view)``:
    the rules the pass runs by, ``(the model's plan, a soft prompt's encoder's layers)``, or the refusal of every
    module none covers (:func:`~.coverage.pass_plan`, which the public
    :func:`~.api.per_sequence_grads` hands in after its coverage check).

    The backward goes to the hooked modules' inputs only: no parameter's ``.grad`` is touched. With
    ``stream_group_size=k``, each layer whose parameters have one usage (called once, not tied) adds its within-block
    inner products as its output gradient arrives and drops its factors, so the pass holds no more than autograd does
    (only :meth:`PerSequenceGradients.inner_products` with that ``k`` can be taken then); small per-sample gradients
    (norm gains, biases: ``B x d`` values) are kept, and their products taken together at the end.

    With ``materialize=True`` (what ``OBLRPOConfig(one_backward=True)`` uses), each layer whose per-sample gradients
    take no more memory than its factors (:func:`~.factors.materializing_saves_memory`: long sequences through narrow
    layers) forms them as its output gradient arrives, one contraction over the tokens (the cost of its weight
    gradient), and keeps them instead of the factors (in bf16 under bf16 autocast, as autograd's own weight gradients
    are there; sums over them in fp32). Its inner products and its weighted sum are then nearly free, where the
    factors would cost a token Gram or a materialization now and a contraction again for the update.
    With ``keep_graph=True`` (``one_backward`` replayed, under gradient checkpointing) the backbone's graph is kept
    and the result's ``replay`` holds what the update needs once the advantages are known (:class:`.result.Replay`):
    the last hidden state, its per-row output gradient and the head's usages (a backward of the hidden state with
    each row's gradient scaled gives the backbone's part of ``sum_i s_i u_i``; the head's usages give the rest).
    See :func:`~.api.per_sequence_grad_sq_norms` for the other arguments.
    """
    batch, length = input_ids.shape
    completion_length = completion_mask.shape[1]
    if completion_length >= length:
        raise ValueError("completion_mask must cover fewer positions than input_ids (a prompt token is needed).")
    lm, prompted = view.lm, view.prompted
    if batch == 0 or not any(p.requires_grad for p in (prompted or lm).parameters()):
        return PerSequenceGradients(defaultdict(list), batch, input_ids.device)
    run = _Pass(view, covering, batch, input_ids.device, stream_group_size, materialize)
    if model_inputs:  # images: the modules that see them (a vision tower) have rows that are not the sequences
        refuse_outside_decoder(lm, run.hooked, model_inputs)
    transform = transform_of(view)  # the head's scale, soft cap and offset, as observed on the model's own logits
    alpha = transform.scale / temperature
    virtual = 0 if prompted is None else prompted.peft_config[prompted.active_adapter].num_virtual_tokens
    span = slice(virtual + length - completion_length - 1, virtual + length - 1)  # those that predict completions
    labels, mask = input_ids[:, length - completion_length :], completion_mask.to(torch.float32)
    run.spans = token_spans(attention_mask, mask, span, virtual)
    with _borrowed_gathered(run) as gathered:
        records, (h, head_weight, head_bias, lse, head_self_done), graph = _forward_backward(
            run, view, (input_ids, attention_mask, model_inputs), span, (labels, mask), alpha, transform, keep_graph,
            gathered)
        run.collect(records)
    before = {slot: len(usages) for slot, usages in run.usages.items()}
    head = run.head
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad) or not run.adapter.plain:
        run.add_head(SoftmaxDelta(h, head_weight, head_bias, alpha, lse, labels, mask, transform.softcap),
                     head_self_done)
    result = run.result()
    if keep_graph:  # the head's usages, added after the backbone's, and the hidden state's graph (Replay)
        result.replay = Replay(*graph, {slot: usages[before.get(slot, 0):] for slot, usages in run.usages.items()
                                        if len(usages) > before.get(slot, 0)})
    return result


def token_spans(attention_mask: torch.Tensor, mask: torch.Tensor, span: slice, virtual: int) -> TokenSpans | None:
    """Each row's tokens that can carry a gradient (:class:`~.factors.TokenSpans`), on a CPU (elsewhere None: the
    rows' products stay batched): from its first attended token (the first, under a soft prompt's virtual tokens) to
    the one that predicts its last scored token. Only read as a claim: :func:`~.factors.trimmed` checks each factor
    zero outside them before it skips anything."""
    if mask.device.type != "cpu":
        return None
    scored, attended = mask > 0, attention_mask > 0
    ends = torch.where(scored.any(1), span.stop - scored.flip(1).int().argmax(1), 0)  # a row scoring none: empty
    starts = torch.zeros_like(ends) if virtual else torch.where(attended.any(1), attended.int().argmax(1), 0)
    starts, ends = torch.stack([starts, ends]).tolist()  # one read of both
    return TokenSpans.of(starts, ends, attention_mask.shape[1] + virtual, mask.device)


def _forward_backward(run: _Pass, view: ModelView, inputs: tuple, span: slice, scored: tuple, alpha: float,
                      transform, keep_graph: bool = False, gathered: set[int] = frozenset()):
    """The pass's forward and backward of ``inputs`` (``input_ids``, ``attention_mask``, ``model_inputs``) under its
    hooks and its expert banks' routed forwards: the records, and the head's operands and terms (:func:`_head_terms`:
    ``h``, weight, bias, log-sum-exp, and whether its own products were formed), and, for ``keep_graph``, the last
    hidden state and its output gradient (``(None, None)`` when it carries no gradient). The view's ``prompted``: a soft
    prompt's ``PeftModel``, whose virtual tokens go first (:mod:`.rules.soft_prompt`)."""
    input_ids, attention_mask, model_inputs = inputs
    lm, backbone, prompted = view.lm, view.backbone, view.prompted
    checkpointed = checkpointed_layers(backbone)
    # expert banks outside checkpointed layers keep their routed pairs' factors from the forward (experts.py)
    in_checkpointed = {m for layer in checkpointed for m in layer.modules()}
    banks = [m for m in run.whole_call if m not in in_checkpointed]
    zero3_head = _head_params([run.head.weight, run.head.bias, *(p for m in run.adapter.modules
                                                                for p in m.parameters())], gathered)  # ZeRO-3
    try:
        with norms_checkpointing(checkpointed) as reentrant, _fsdp_root_unsharded(lm), \
                run.routed.routed_forwards(banks), capture(
                run.hooked, run.batch, run.on_grad_hook, checkpointed, run.whole_call) as (records, inputs_with_grad):
            if prompted is None:
                tokens = dict(input_ids=input_ids, attention_mask=attention_mask)
            else:
                embeds, prompted_mask = soft_prompt.prompted_inputs(prompted, input_ids, attention_mask)
                tokens = dict(inputs_embeds=embeds, attention_mask=prompted_mask)
            hidden = backbone(**tokens, use_cache=False, **(model_inputs or {})).last_hidden_state
            h, head_weight, head_bias, lse, grad_h, head_self_done = _head_terms(
                run, lm, hidden, span, scored, alpha, transform, zero3_head)
            if keep_graph and reentrant:
                raise NotImplementedError(
                    "keep_graph=True (one_backward replayed) needs non-reentrant gradient checkpointing: a second "
                    "backward of a reentrant checkpoint's graph would write no parameter's .grad. Take the two-pass "
                    "path (OBLRPOConfig(one_backward=False)) or keep_graph=False.")
            if hidden.requires_grad:
                full_grad = torch.zeros_like(hidden)
                full_grad[:, span] = grad_h.to(hidden.dtype)
                _backward_to_hooks(hidden, full_grad, records, inputs_with_grad, backbone, run.borrowed, keep_graph)
    except hooks.RowsError as error:  # rows that cannot be paired with the sequences: refused by the module's path
        raise run.refused([run.refusal(e.module, e) for e in (error, *error.more)]) from error
    graph = (hidden, full_grad) if hidden.requires_grad else (None, None)
    return records, (h, head_weight, head_bias, lse, head_self_done), graph


def refuse_outside_decoder(lm: nn.Module, hooked: list[nn.Module], model_inputs: dict) -> None:
    """With inputs beyond the token ids (a VLM's images), every hooked (trainable) module must be inside the text
    decoder: the others (a vision tower: patch embedding, vision blocks, merger) see rows that are image patches, not
    the batch's sequences, and pairing them with the sequences would be wrong. Raises, naming them all."""
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    inside = set(decoder.modules()) if isinstance(decoder, nn.Module) else set()
    names = {m: n for n, m in lm.named_modules()}
    outside = [m for m in hooked if m not in inside]
    if not outside:
        return
    found = [Unsupported(names.get(m, ""), type(m).__name__,
                         f"outside the text decoder, it sees the inputs {sorted(model_inputs)} (image patches, not "
                         "sequences)") for m in outside]
    base = getattr(lm, "base_model", lm)
    towers = [f"model.{names[c]}" for c in base.children()
              if c not in inside and decoder not in set(c.modules()) and set(c.modules()) & set(outside)]
    towers = towers or sorted({f"model.{names.get(m, '')}" for m in outside})
    raise UnsupportedModulesError(found, advice=(
        f"Freeze the vision tower ({', '.join(f'{t}.requires_grad_(False)' for t in towers)}): its parameters then "
        "take no gradient, and the text decoder's norms are exact with the images in the batch. Or train without "
        "exact norms: OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."))
