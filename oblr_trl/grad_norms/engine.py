"""Exact per-sequence gradient norms of ``sum_t log pi(o_t | q, o_<t)`` from one forward and one backward.

Hooks record each trainable module's input activation and output gradient; the rules in :mod:`.rules` turn them into
factored per-sample gradients; :mod:`.factors` takes their inner products from token Grams. The LM head is handled
here, as TRL's fused head does it: the ``(B, T, V)`` logits are never held, the head's output gradient is computed in
vocabulary chunks, and a head tied to the input embedding gets the norm of the summed gradient (cross terms included).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from contextlib import contextmanager

import torch
from torch import nn

from .factors import (
    Dense,
    Factored,
    Materialized,
    SoftmaxDelta,
    VOCAB_CHUNK,
    Usage,
    as_operand,
    autocast_operands,
    mm32,
    head_logits,
    block_inner_products,
    block_weighted_rows,
    materializing_saves_memory,
    per_sample_dtype,
)
from . import factors, generic
from .experts import call_usages, routed_forwards
from .rules import find_rule
from .coverage import check_once, functional_owners
from .lm import output_head, text_config as _text_config, unwrap_causal_lm
from .support import UnsupportedModulesError, coverage_plan, refuse_outside_decoder


Slot = tuple[nn.Module, str]  # a parameter, as (owning module, attribute name)


def _logit_scale(lm: nn.Module) -> float:
    config = _text_config(lm)
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(config, name, None) is not None:
            return float(getattr(config, name))
    if getattr(config, "logits_scaling", None) is not None:
        return 1.0 / float(config.logits_scaling)
    return 1.0


class _Record:
    __slots__ = ("module", "activation", "output_grad", "input_has_grad")

    def __init__(self, module: nn.Module, activation):
        self.module, self.activation, self.output_grad, self.input_has_grad = module, activation, None, True


def _per_row(t: torch.Tensor, batch: int, module: nn.Module, what: str) -> torch.Tensor:
    """``t`` with the batch as its leading axis: as is, expanded from a leading 1 (an input shared by every row, such
    as GPT-Neo's ``(1, T)`` position ids: each row's gradient then comes from its own output gradient), or a flattened
    ``(B * T, d)`` (OPT's MLP; at most 2-D, so a sequence-first ``(T, B, d)`` is not mistaken for it) reshaped to
    ``(B, T, d)``. Anything else is refused, naming the module: pairing
    such rows with the batch's sequences would be wrong."""
    lead = t.shape[0] if t.dim() else 0
    if lead == batch:
        return t
    if lead == 1:
        return t.expand(batch, *t.shape[1:])
    if lead and lead % batch == 0 and t.dim() <= 2:  # tokens flattened to (B*T, d) or (B*T,); a 3-D (T, B, d) is not
        return t.reshape(batch, lead // batch, *t.shape[1:])
    raise NotImplementedError(
        f"{type(module).__name__}'s {what} has leading dimension {lead} (shape {tuple(t.shape)}), which is neither the "
        f"batch ({batch}), 1, nor a multiple of the batch: its rows cannot be paired with the sequences. Freeze its "
        "parameters (module.requires_grad_(False)) or use OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
    )


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (where checkpointed layers recompute their forward)."""
    return torch._C._current_graph_task_id() != -1


def _checkpointed_layers(backbone: nn.Module) -> list[nn.Module]:
    """Layers that transformers will run under (non-reentrant) gradient checkpointing in this forward."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        return []
    return [
        m for m in backbone.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training
    ]


@contextmanager
def _capture(modules: list[nn.Module], batch: int, on_grad=None, checkpointed_layers: list[nn.Module] = (),
             calls_of: set[nn.Module] = frozenset()):
    """Record (activation, output gradient) of every call of ``modules`` during the forward/backward inside.

    ``on_grad(record, calls)``, if given, runs as soon as a record has both halves (``calls``: how many times each
    module ran in the forward, recomputations not counted); it may consume the record.

    Inside a checkpointed layer a module's input is not kept from the forward: the backward recomputes the layer, and
    the input is taken from that recomputation, just before (or just after) the module's output gradient arrives. So
    the pass keeps what checkpointing keeps, plus one layer's factors at a time when ``on_grad`` consumes them.

    An output whose leading dimension is 1 while the batch is ``batch`` (computed once, broadcast to every row) is
    replaced by its expansion to the batch, so that its gradient arrives per row instead of summed over the rows.
    Modules in ``calls_of`` (handled by :mod:`.generic`) have their whole call recorded: arguments, keyword arguments
    and every output that carries a gradient.
    """
    records: list[_Record] = []
    calls: dict[nn.Module, int] = defaultdict(int)
    in_checkpointed = {m for layer in checkpointed_layers for m in layer.modules()}
    waiting: dict[nn.Module, deque] = defaultdict(deque)  # forward records awaiting their recomputed input
    # Tensors the backward is taken with respect to, so that it reaches every hooked output without computing (and
    # discarding) the parameters' gradients: inputs of hooked modules outside checkpointed layers, and the inputs of
    # the checkpointed layers (which checkpointing keeps anyway).
    inputs_with_grad: list[torch.Tensor] = []

    def ready(record: _Record) -> None:
        if on_grad is not None:
            on_grad(record, calls)

    def layer_pre_hook(layer, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not _in_backward() and torch.is_tensor(hidden) and hidden.requires_grad:
            inputs_with_grad.append(hidden)

    def recompute_pre_hook(module, args):
        # A checkpointed layer's recomputation: the input, now. A pre-hook, because the recomputation stops early
        # (torch's checkpoint early stop) right after the last saved tensor it needs, possibly inside this module.
        if not (_in_backward() and waiting[module]) or not args or not torch.is_tensor(args[0]):
            return
        if calls[module] != 1:
            raise NotImplementedError(
                f"{type(module).__name__} runs {calls[module]} times in one forward inside a checkpointed layer; "
                "per-sequence norms cannot pair its recomputed inputs. Disable gradient checkpointing."
            )
        record = waiting[module].popleft()
        record.activation = _per_row(args[0].detach(), batch, module, "input")
        if record.output_grad is not None:
            ready(record)

    def call_hook(module, args, kwargs, output):
        if generic.replaying() or (_in_backward() and calls[module]):
            return None
        if batch > 1 and torch.is_tensor(output) and output.dim() and output.shape[0] == 1 and output.requires_grad:
            output = output.expand(batch, *output.shape[1:])  # shared by every row: gradient per row
        # Each output that carries a gradient is replaced by a fresh view of itself, so that its hook sees only the
        # gradient from outside the module (an output the module itself used further, such as eager attention's
        # probabilities, would otherwise also carry the gradient of the outputs computed from it).
        output = returned = generic.fresh_views(output)
        outputs = generic.output_tensors(output)
        if not outputs:
            return None
        if batch > 1 and any(o.dim() == 0 or o.shape[0] == 1 for o in outputs):
            raise NotImplementedError(
                f"{type(module).__name__} returns an output shared by the whole batch inside a tuple: its per-sequence "
                "gradients cannot be told apart. Freeze its parameters (module.requires_grad_(False)) or use "
                "OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
            )
        calls[module] += 1
        record = _Record(module, generic.Call(args, kwargs, [o.detach() for o in outputs]))
        record.output_grad = [None] * len(outputs)
        records.append(record)
        live_inputs = generic.input_tensors(args, kwargs)
        inputs_with_grad.extend(live_inputs)
        record.input_has_grad = bool(live_inputs)
        for i, o in enumerate(outputs):
            o.register_hook(lambda grad, record=record, i=i: record.output_grad.__setitem__(i, grad.detach()))
        return returned

    def forward_hook(module, args, output):
        if generic.replaying():
            return None
        if not args or not torch.is_tensor(args[0]) or not torch.is_tensor(output) or not output.requires_grad:
            return None
        if batch > 1 and output.dim() and output.shape[0] == 1:
            output = output.expand(batch, *output.shape[1:])  # shared by every row: expanded, its gradient is per row
            returned = output
        else:
            returned = None
        if _in_backward() and module in in_checkpointed and calls[module]:
            return returned  # the recomputation of a module that ran in the forward: paired by the pre-hook
        deferred = module in in_checkpointed and not _in_backward()
        record = _Record(module, None if deferred else _per_row(args[0].detach(), batch, module, "input"))
        records.append(record)
        if not _in_backward():
            calls[module] += 1
        if deferred:
            waiting[module].append(record)
        if not args[0].requires_grad:
            record.input_has_grad = False
        elif not deferred:
            inputs_with_grad.append(args[0])

        def grad_hook(grad, record=record):
            record.output_grad = _per_row(grad.detach(), batch, record.module, "output gradient")
            if record.activation is not None:
                ready(record)

        output.register_hook(grad_hook)
        return returned

    handles = [m.register_forward_hook(forward_hook) for m in modules if m not in calls_of]
    handles += [m.register_forward_hook(call_hook, with_kwargs=True) for m in calls_of]
    handles += [m.register_forward_pre_hook(recompute_pre_hook) for m in modules if m in in_checkpointed]
    handles += [m.register_forward_pre_hook(layer_pre_hook, with_kwargs=True) for m in checkpointed_layers]
    try:
        yield records, inputs_with_grad
    finally:
        for handle in handles:
            handle.remove()
    unpaired = [r for queue in waiting.values() for r in queue if r.output_grad is not None]
    if unpaired:
        raise RuntimeError(
            f"{len(unpaired)} output gradient(s) of checkpointed modules never met their recomputed inputs "
            f"(first: {type(unpaired[0].module).__name__}); the per-sequence norms would be incomplete."
        )


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


@torch.no_grad()
def _lm_head_terms(h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, weight, bias, alpha: float,
                   softcap: float | None = None, self_products: int | None = None):
    """Log-sum-exp of the scored logits and ``d sum_t log p / d h`` of the head, in vocabulary chunks. ``h`` and
    ``weight`` in half precision (the head under autocast) are multiplied as they are, into float32 (:func:`mm32`).

    With ``self_products=k``, also the head weight's own ``(B/k, k, k)`` per-sample inner products, from the same
    chunks of the softmax delta as the output gradient (:func:`~.factors.head_self_products`), else None: the widest
    tensors of the pass are then formed twice (log-sum-exp, then delta) instead of three times."""
    lse = torch.full(h.shape[:-1], -float("inf"), device=h.device)
    chunks = [(start, min(start + VOCAB_CHUNK, weight.shape[0])) for start in range(0, weight.shape[0], VOCAB_CHUNK)]
    for start, end in chunks:
        z, _ = head_logits(h, weight[start:end], None if bias is None else bias[start:end], alpha, softcap)
        lse = torch.logaddexp(lse, torch.logsumexp(z, dim=-1))
    delta = SoftmaxDelta(h, weight, bias, alpha, lse, labels, mask, softcap)
    grad_h = torch.zeros_like(h, dtype=torch.float32)
    dtype = delta.operand_dtype
    k = self_products or 1

    def columns():
        for start, end in chunks:
            cols = as_operand(delta.cols(start, end), dtype)
            grad_h.add_(mm32(cols, as_operand(weight[start:end], dtype)))
            yield start, end, cols.reshape(h.shape[0] // k, k * h.shape[1], end - start)  # blocked by k

    if self_products is None:
        for _ in columns():
            pass
        return lse, grad_h, None
    usage = Factored(delta, Dense(h)).blocked(k)
    return lse, grad_h, factors.head_self_products(usage, k, columns())


def _reduce_scatter_like(grad: torch.Tensor, param) -> torch.Tensor:
    """A full-size gradient from this rank's samples -> the sum over ranks, sharded like the DTensor ``param``."""
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(grad, param.device_mesh, [Partial()] * param.device_mesh.ndim, run_check=False)
    return partial.redistribute(param.device_mesh, param.placements)


def _fp32(device: torch.device):
    """Autocast off: the Grams, the head's softmax terms and the weighted sums are accumulated in float32 even when
    the forward runs under bf16/fp16 autocast (which would otherwise run these matmuls in half precision)."""
    return torch.autocast(device_type=device.type, enabled=False)


class PerSequenceGradients:
    """The per-sequence gradients ``u_i`` of one forward/backward, held per parameter: factored, or materialized
    where that takes no more memory (``materialize=True``; never for a large matrix over short sequences).

    Their inner products give the weights of Theorem 7 and the SNR terms (:meth:`inner_products`); their weighted
    sum ``sum_i s_i u_i`` is the policy gradient once the advantages are known (:meth:`accumulate_grad`), which is how
    ``OBLRPOConfig(one_backward=True)`` gets the norms and the update from a single backward.
    """

    def __init__(self, usages: dict[Slot, list[Usage]], batch: int, device, streamed: torch.Tensor | None = None,
                 slots: list[Slot] = (), self_done: set[int] = frozenset()):
        self.usages, self.batch, self.device = usages, batch, device
        # ids of usages whose products with themselves are already in ``streamed`` (the LM head's, formed with its
        # output gradient)
        self.self_done = set(self_done)
        # inner products already summed during the backward (layers whose factors were consumed as they arrived)
        self.streamed = streamed
        self.slots = list(slots) or list(usages)  # every trainable parameter, in module order

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
        with _fp32(self.device):
            self._add_inner_products(out, group_size)
        return out

    def _add_inner_products(self, out: torch.Tensor, group_size: int) -> None:
        for param_usages in self.usages.values():
            if any(isinstance(u, Materialized) for u in param_usages):
                param_usages = [
                    u if isinstance(u, Materialized) else Materialized(u.materialize().flatten(1)) for u in param_usages
                ]
            blocked = [u.blocked(group_size) for u in param_usages]
            for a in range(len(blocked)):
                if id(param_usages[a]) not in self.self_done:
                    out += block_inner_products(blocked[a], blocked[a], group_size)
                for b in range(a + 1, len(blocked)):
                    cross = block_inner_products(blocked[a], blocked[b], group_size)
                    out += cross + cross.transpose(1, 2)

    ROW_BUDGET = 1 << 24  # float32 elements of one (blocks, rows, columns) buffer of accumulate_grad

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
        sq = torch.zeros(nb, device=self.device, dtype=sq_dtype)
        for slot in self.slots:
            param, param_usages = getattr(*slot), self.usages.get(slot, [])
            sharded = hasattr(param, "device_mesh")  # an FSDP2 DTensor: every rank reduces every parameter, in order
            if not param_usages and not sharded:
                continue
            rows = param.shape[0] if param.dim() else 1
            cols = param.numel() // max(rows, 1)
            step = max(1, min(rows, self.ROW_BUDGET // max(1, nb * cols)))
            for u in param_usages:  # the LM head's (B, T, rows) softmax slice is a buffer too
                if isinstance(u, Factored) and isinstance(u.left, SoftmaxDelta):
                    step = min(step, VOCAB_CHUNK, max(1, self.ROW_BUDGET // (self.batch * u.right.t.shape[1])))
            grad = torch.zeros(rows, cols, device=self.device)
            with _fp32(self.device):
                for start in range(0, rows, step):
                    end = min(start + step, rows)
                    if not param_usages:
                        continue
                    part = sum(block_weighted_rows(u, scale, k, start, end) for u in param_usages)
                    if group_size is not None:
                        sq += part.pow(2).sum(dim=(1, 2), dtype=sq_dtype)
                    grad[start:end] = part.sum(0)
            grad = grad.reshape(param.shape).to(param.dtype)
            if sharded:  # this rank's full gradient: summed over ranks and sharded as the parameter is
                grad = _reduce_scatter_like(grad, param)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
        return sq if group_size is not None else None


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
    check_once(model)  # every trainable parameter accounted for (a probe, once per model): else refused by name
    head = output_head(lm)
    if not isinstance(head, nn.Linear):
        raise NotImplementedError(f"The LM head must be an nn.Linear, got {type(head).__name__}.")
    backbone = lm.base_model
    alpha = _logit_scale(lm) / temperature
    # The head's products run in the autocast dtype when the pass runs under autocast, as the fused head's do.
    device_type = input_ids.device.type
    half = torch.is_autocast_enabled(device_type) and device_type in factors.HALF_OPERAND_DEVICES
    head_dtype = torch.get_autocast_dtype(device_type) if half else None
    softcap = getattr(_text_config(lm), "final_logit_softcapping", None)
    hooked, per_row, borrowed = _hooked_modules(lm)
    if model_inputs:  # images: the modules that see them (a vision tower) have rows that are not the sequences
        refuse_outside_decoder(lm, hooked, model_inputs)
    checkpointed = _checkpointed_layers(backbone)
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

    def keep(record: _Record, materialize_now: bool) -> None:
        """The record's per-sample gradients, by parameter: factored, or materialized where that saves memory."""
        for name, usage in find_rule(record.module)(record.module, record.activation, record.output_grad).items():
            usage = autocast_operands(usage, cast_cache)
            if materialize_now and materializing_saves_memory(usage):
                with _fp32(input_ids.device):
                    usage = Materialized(usage.materialize().to(per_sample_dtype(usage)))
            usages[slot_of[(record.module, name)]].append(usage)

    def on_grad(record: _Record, calls: dict) -> None:
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
            _capture(hooked, batch, on_grad_hook, checkpointed, per_row) as (records, inputs_with_grad):
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
            lse, grad_h, head_self = _lm_head_terms(h_op, labels, mask, head_weight, head_bias, alpha, softcap,
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
        if isinstance(record.activation, generic.Call):
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


def per_sequence_grad_inner_products(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    group_size: int = 1,
    temperature: float = 1.0,
    model_inputs: dict | None = None,
) -> torch.Tensor:
    """Inner products ``<u_i, u_j>`` of ``u_i = grad_theta sum_t log pi(o_{i,t} | q, o_{i,<t})`` within groups.

    Rows ``i`` of one group are ``group_size`` consecutive rows of ``input_ids``. Returns a float32 tensor
    ``(B / group_size, group_size, group_size)``; with ``group_size=1`` its entries are ``||u_i||^2``. See
    :func:`per_sequence_grad_sq_norms` for the arguments.
    """
    if input_ids.shape[0] % group_size:
        raise ValueError(f"group_size={group_size} must divide the batch size {input_ids.shape[0]}.")
    grads = per_sequence_grads(
        model, input_ids, attention_mask, completion_mask, temperature=temperature, stream_group_size=group_size,
        model_inputs=model_inputs,
    )
    return grads.inner_products(group_size)


def per_sequence_grad_sq_norms(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    model_inputs: dict | None = None,
) -> torch.Tensor:
    """``||grad_theta sum_t log pi_theta(o_t | q, o_<t)||^2`` for each row: the weights ``w_i`` of Theorem 7.

    Exact, over the model's trainable parameters (LoRA adapters only, under PEFT), from the activations and output
    gradients of one forward and one backward of the batch; no per-sample gradient of a large matrix is materialized
    and the logits are never held whole. No ``.grad`` is left on any parameter.

    Args:
        model: a causal LM (``*ForCausalLM``), possibly wrapped by PEFT or DDP.
        input_ids: ``(B, L)`` prompt + completion token ids; prompts may be left-padded.
        attention_mask: ``(B, L)``.
        completion_mask: ``(B, C)``; the completion is the last ``C`` positions of ``input_ids`` (right-padded: the
            mask is 0 after the end). Only its tokens enter the sum.
        temperature: the sampling temperature the trainer scores log-probs with (logits are divided by it).
        model_inputs: further inputs of the backbone's forward, e.g. a VLM's images (see :func:`per_sequence_grads`).

    Returns:
        float32 tensor ``(B,)``.
    """
    products = per_sequence_grad_inner_products(
        model, input_ids, attention_mask, completion_mask, group_size=1, temperature=temperature,
        model_inputs=model_inputs,
    )
    return products.reshape(-1)
