"""The capture hooks: each hooked module's input activation and output gradient, or its whole call, recorded during
one forward/backward (checkpointed layers' inputs taken from their recomputation). They know no rule and no formula:
what a record turns into is the layer rules' business (:mod:`.rules`), and :mod:`.engine` wires the two.

**Reentrant gradient checkpointing, as the per-sequence pass runs it**

Torch's reentrant checkpoint (``use_reentrant=True``: PEFT's ``prepare_model_for_kbit_training`` default, and what
TRL forces for PEFT under DeepSpeed ZeRO-3) recomputes a layer in its backward and runs ``backward()`` there, into
every parameter's ``.grad``; it refuses ``torch.autograd.grad``, which the pass needs (it must touch no ``.grad``).
For the duration of one pass, each layer checkpointed that way runs under :class:`NormsCheckpoint` instead: the same
forward (no graph kept, only the layer's inputs; the same random state replayed in the recomputation), whose
backward recomputes the layer and takes ``torch.autograd.grad`` to the layer's inputs (and to the trainable
parameters of modules whose input carries no gradient), so that the capture hooks (above) see every module's
recomputed input and output gradient, and no ``.grad`` is written. Memory: as reentrant checkpointing's, one layer's
graph at a time. The layer's own setting is put back after the pass (:func:`norms_checkpointing`), also on errors:
the model trains under the checkpointing its user or TRL chose. Layers under non-reentrant checkpointing are left as
they are (the pass runs through it directly).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict, deque
from contextlib import contextmanager
from contextvars import ContextVar
import weakref

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge as gradient_edge
from torch.utils.checkpoint import (
    CheckpointFunction,
    detach_variable,
    set_device_states,
)

from . import factors


# a re-run under way in this thread/task (a per-row re-run, a recogniser's probe): a context variable, so that one
# model's re-run never silences the hooks of a pass running elsewhere
_REPLAYING: ContextVar[bool] = ContextVar("replaying", default=False)


# Inside a layer that the pass runs under its own reentrant checkpoint (:mod:`.hooks`): "forward" in the
# layer's forward (run without a graph), "recompute" in its backward's recomputation (where its modules are recorded);
# None elsewhere. With the trainable parameters the recomputation's backward must also reach (``targets``): those of
# modules whose input carries no gradient.
_REENTRANT: ContextVar[tuple[str, list] | None] = ContextVar("reentrant", default=None)


@contextmanager
def reentrant_stage(stage: str, targets: list | None = None):
    token = _REENTRANT.set((stage, targets if targets is not None else []))
    try:
        yield
    finally:
        _REENTRANT.reset(token)


def _reentrant_stage() -> str | None:
    found = _REENTRANT.get()
    return None if found is None else found[0]


def _recompute_targets(module: nn.Module) -> None:
    """A module recorded in a reentrant recomputation whose input carries no gradient: its trainable parameters (and
    those it uses functionally) become targets of that recomputation's backward, so that it reaches the module."""
    _REENTRANT.get()[1].extend(p for p in module.parameters() if p.requires_grad)


def replaying() -> bool:
    """Whether a per-row re-run is under way (the capture hooks then record nothing)."""
    return _REPLAYING.get()


@contextmanager
def replay():
    token = _REPLAYING.set(True)
    try:
        yield
    finally:
        _REPLAYING.reset(token)


def _map(fn, x):
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return x


def _tensors(x) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _map(lambda t: out.append(t) or t, x)
    return out


def output_tensors(output) -> list[torch.Tensor]:
    """The outputs of a call that carry a gradient, in a fixed order."""
    return [t for t in _tensors(output) if t.requires_grad and t.is_floating_point()]


def fresh_views(output):
    """``output`` with every tensor that carries a gradient replaced by a view of itself."""
    return _map(lambda t: t.view_as(t) if t.requires_grad and t.is_floating_point() else t, output)


def input_tensors(args, kwargs) -> list[torch.Tensor]:
    """The inputs of a call that carry a gradient (the backward must reach them, so that it reaches the outputs)."""
    return [t for t in _tensors((args, kwargs)) if t.requires_grad]


def lowest_edges(targets: list) -> list:
    """The targets (gradient edges, or leaf tensors) a backward must be taken to so that it runs every node it would
    run for all of ``targets``: those with no other target below them in the graph, once each. A node on a path to a
    dropped target is on a path through it to a kept one, so the backward runs it all the same; it only no longer
    holds each dropped target's gradient (one per hooked layer's input) to its end. One walk down from the targets,
    each node's children in order until one is found to lead to a target."""
    edges = [t if isinstance(t, tuple) else gradient_edge(t) for t in targets]
    leads: dict = {e.node: True for e in edges}  # whether a node is a target's or leads to one
    several = len(leads) > 1  # else nothing to walk: one node cannot lie below itself
    above = {node: several and _leads_to_target(node, leads) for node in list(leads)}
    kept = {}  # one of each edge (the layers reading one input name it once each)
    for t, e in zip(targets, edges):
        if not above[e.node]:
            kept.setdefault((e.node, e.output_nr), t)
    return list(kept.values())


def _leads_to_target(root, leads: dict) -> bool:
    """Whether a child of ``root`` is, or leads to, a node ``leads`` marks True (depth first, iterative; each node
    whose answer is found is remembered in ``leads``)."""
    path, children = [root], [iter(root.next_functions)]
    while children:
        for child, _ in children[-1]:
            if child is None:
                continue
            known = leads.get(child)
            if known is None:
                path.append(child)
                children.append(iter(child.next_functions))
                break
            if known:
                leads.update(dict.fromkeys(path[1:], True))
                return True
        else:  # every child seen, none leads to a target
            children.pop()
            done = path.pop()
            if path:
                leads[done] = False
    return False


class RowsError(NotImplementedError):
    """A module's rows cannot be paired with the batch's sequences; ``module`` names it (the engine refuses it by its
    path, :class:`~.result.UnsupportedModulesError`)."""

    def __init__(self, module: nn.Module, message: str):
        super().__init__(message)
        self.module = module
        self.more: list[RowsError] = []  # the other modules found in the same pass (all are refused at once)


class Call:
    """One recorded call: detached arguments and the outputs that carry a gradient."""

    __slots__ = ("args", "kwargs", "outputs")

    def __init__(self, args, kwargs, outputs: list[torch.Tensor]):
        self.args, self.kwargs = _map(torch.Tensor.detach, args), _map(torch.Tensor.detach, kwargs)
        self.outputs = outputs


class Record:
    """One hooked call: the module, its input activation (or whole call, :class:`Call`), its output gradient once the
    backward reaches it, whether its input carries a gradient, and, for a module outside checkpointed layers whose
    input carries none (the input embedding), the gradient edge of its hooked output (``output_edge``): the backward
    is taken to that edge, so that it reaches the output and stops there, computing no parameter's gradient."""

    __slots__ = ("module", "activation", "output_grad", "input_has_grad", "output_edge")

    def __init__(self, module: nn.Module, activation):
        self.module, self.activation, self.output_grad, self.input_has_grad = module, activation, None, True
        self.output_edge = None


def batch_rows(t: torch.Tensor, batch: int, module: nn.Module, what: str) -> torch.Tensor:
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
    raise RowsError(module,
        f"{type(module).__name__}'s {what} has leading dimension {lead} (shape {tuple(t.shape)}), which is neither the "
        f"batch ({batch}), 1, nor a multiple of the batch: its rows cannot be paired with the sequences. Freeze its "
        "parameters (module.requires_grad_(False)) or use OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
    )


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (where checkpointed layers recompute their forward)."""
    return torch._C._current_graph_task_id() != -1


def checkpointed_layers(backbone: nn.Module) -> list[nn.Module]:
    """Layers that transformers will run under gradient checkpointing in this forward (reentrant ones run under the
    pass's own checkpoint, :mod:`.hooks`)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        return []
    return [
        m for m in backbone.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training
    ]


class _Capture:
    """The hooks of one :func:`capture` and what they recorded (see there)."""

    def __init__(self, batch: int, on_grad, checkpointed: list[nn.Module]):
        self.batch, self.on_grad = batch, on_grad
        self.records: list[Record] = []
        self.calls: dict[nn.Module, int] = defaultdict(int)
        self.in_checkpointed = {m for layer in checkpointed for m in layer.modules()}
        self.waiting: dict[nn.Module, deque] = defaultdict(deque)  # forward records awaiting their recomputed input
        # What the backward is taken with respect to, so that it reaches every hooked output without computing (and
        # discarding) the parameters' gradients: inputs of hooked modules outside checkpointed layers, and the inputs
        # of the checkpointed layers. Held as gradient edges (the graph's nodes), not tensors: a layer's float32
        # input that autocast casts for its matmul is not kept alive by this list (GRPO's backward frees it too).
        self.inputs_with_grad: list = []
        self.cast: dict = {}  # the last half-precision cast of a hooked layer's input, for the layers that share it
        self.layer_output: torch.Tensor | None = None  # the last checkpointed layer's output in the forward
        self.failed: list[RowsError] = []  # calls whose rows cannot be paired, that a gradient reached
        # Set when the capture ends: the output-gradient hooks stay on the graph's nodes, and a later backward of the
        # same graph (``one_backward``'s replayed update, ``retain_graph``) must not record (and hold) every output
        # gradient again
        self.closed = False

    def ready(self, record: Record) -> None:
        if self.on_grad is not None:
            self.on_grad(record, self.calls)

    def layer_pre_hook(self, layer, args, kwargs):
        """A checkpointed layer's input, as a tensor the backward must reach, unless it is the previous checkpointed
        layer's output: then that layer's input, already a target, is reached through it. (The backward returns
        its targets' gradients at its end; one per layer, all held while ``one_backward`` replays the update by a
        second backward of the graph, kept with every layer's checkpointed input.)"""
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not in_backward() and torch.is_tensor(hidden) and hidden.requires_grad and hidden is not self.layer_output:
            self.inputs_with_grad.append(gradient_edge(hidden))

    def layer_post_hook(self, layer, args, output):
        if not in_backward():
            self.layer_output = next(iter(_tensors(output)), None)

    def recompute_pre_hook(self, module, args):
        """A checkpointed layer's recomputation: the input, now. A pre-hook, because the recomputation stops early
        (torch's checkpoint early stop) right after the last saved tensor it needs, possibly inside this module."""
        if not (in_backward() and self.waiting[module]) or not args or not torch.is_tensor(args[0]):
            return
        if self.calls[module] != 1:
            raise RowsError(module,
                f"{type(module).__name__} runs {self.calls[module]} times in one forward inside a checkpointed layer; "
                "per-sequence norms cannot pair its recomputed inputs. Disable gradient checkpointing."
            )
        record = self.waiting[module].popleft()
        record.activation = batch_rows(args[0].detach(), self.batch, module, "input")
        if record.output_grad is not None:
            self.ready(record)

    def call_hook(self, module, args, kwargs, output):
        """A whole call: arguments, keyword arguments and every output that carries a gradient."""
        batch = self.batch
        stage = _reentrant_stage()
        if replaying() or stage == "forward" or (in_backward() and self.calls[module] and stage != "recompute"):
            return None  # a reentrant layer's forward: recorded in its recomputation
        if batch > 1 and torch.is_tensor(output) and output.dim() and output.shape[0] == 1 and output.requires_grad:
            output = output.expand(batch, *output.shape[1:])  # shared by every row: gradient per row
        # Each output that carries a gradient is replaced by a fresh view of itself, so that its hook sees only the
        # gradient from outside the module (an output the module itself used further, such as eager attention's
        # probabilities, would otherwise also carry the gradient of the outputs computed from it).
        output = returned = fresh_views(output)
        outputs = output_tensors(output)
        if not outputs:
            return None
        if batch > 1 and any(o.dim() == 0 or o.shape[0] == 1 for o in outputs):
            raise RowsError(module,
                f"{type(module).__name__} returns an output shared by the whole batch inside a tuple: its per-sequence "
                "gradients cannot be told apart. Freeze its parameters (module.requires_grad_(False)) or use "
                "OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
            )
        self.calls[module] += 1
        record = Record(module, Call(args, kwargs, [o.detach() for o in outputs]))
        record.output_grad = [None] * len(outputs)
        self.records.append(record)
        live_inputs = input_tensors(args, kwargs)
        record.input_has_grad = bool(live_inputs)
        if stage != "recompute":
            self.inputs_with_grad.extend(map(gradient_edge, live_inputs))
        elif not live_inputs:
            _recompute_targets(module)
        for i, o in enumerate(outputs):
            o.register_hook(lambda grad, record=record, i=i: None if self.closed else
                            record.output_grad.__setitem__(i, grad.detach()))
        return returned

    def forward_hook(self, module, args, output):
        """A layer's input activation now (or, inside a checkpointed layer, from its recomputation) and its output
        gradient when the backward reaches it."""
        if replaying():
            return None
        stage = _reentrant_stage()
        if stage == "forward":  # a reentrant layer's forward (no graph): its calls counted, recorded when recomputed
            self.calls[module] += 1
            return None
        if not args or not torch.is_tensor(args[0]) or not torch.is_tensor(output) or not output.requires_grad:
            return None
        returned = None
        if self.batch > 1 and output.dim() and output.shape[0] == 1:
            output = returned = output.expand(self.batch, *output.shape[1:])  # shared by every row: gradient per row
        if in_backward() and module in self.in_checkpointed and self.calls[module] and stage != "recompute":
            return returned  # the recomputation of a module that ran in the forward: paired by the pre-hook
        deferred = module in self.in_checkpointed and not in_backward()
        try:
            record = Record(module, None if deferred else batch_rows(self.held_input(module, args[0], output),
                                                                         self.batch, module, "input"))
        except RowsError as error:  # refused only if a gradient flows back to it (DoRA's weight norm, on an identity
            output.register_hook(lambda grad, error=error: self.failed.append(error))  # matrix, is detached)
            return returned
        self.records.append(record)
        if not in_backward():
            self.calls[module] += 1
        if deferred:
            self.waiting[module].append(record)
        if not args[0].requires_grad:
            record.input_has_grad = False
            if stage == "recompute":
                _recompute_targets(module)
            elif not deferred and not in_backward():
                record.output_edge = gradient_edge(output)
        elif not deferred and stage != "recompute":
            self.inputs_with_grad.append(gradient_edge(args[0]))

        def grad_hook(grad, record=record):
            if self.closed:
                return
            grad = grad.detach() if grad.requires_grad else grad  # a hook's gradient carries no graph (an op saved)
            record.output_grad = batch_rows(grad, self.batch, record.module, "output gradient")
            if record.activation is not None:
                self.ready(record)

        output.register_hook(grad_hook)
        return returned

    def held_input(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """What a record keeps of a layer's input: the input, or, for a linear layer that ran under half-precision
        autocast on a device whose products take half-precision operands, the input as autocast cast it for the matmul
        (what its weight gradient, and so its per-sample gradients, are made of: the same cast the backward's
        ``autocast_operands`` would make), once for the layers that read one input. Half the bytes held to the
        backward, and the float32 input is freed as GRPO's backward frees it."""
        # the layers reading one input (q/k/v, gate/up; q_norm runs between q and k) share one detached view; held
        # weakly, so that nothing here outlives the records that use it (checkpointing's recomputed inputs)
        recent = self.cast.setdefault("detached", [])
        found = next((d() for src, d in recent if src() is x), None)
        if found is None:
            found = x.detach()
            recent[:] = [*recent[-3:], (weakref.ref(x), weakref.ref(found))]
        x = found
        if not (isinstance(module, nn.Linear) and x.dtype == torch.float32 and output.dtype in factors.HALF
                and x.device.type in factors.HALF_OPERAND_DEVICES):
            return x
        return factors.cast_once(x, output.dtype, self.cast)

    def release(self) -> None:
        """Drop what ties the hooks to the autograd graph. The output-gradient hooks live on the graph's nodes and
        close over this object, which holds tensors of the graph (``inputs_with_grad``): a cycle through C++ nodes that
        Python's garbage collector cannot see, which kept every pass's graph and factors alive (memory grew each step)."""
        self.inputs_with_grad.clear()
        for record in self.records:  # an output edge is a graph node too
            record.output_edge = None
        self.cast.clear()
        self.on_grad, self.layer_output, self.closed = None, None, True

    def check_paired(self) -> None:
        if self.failed:
            first, *self.failed[0].more = self.failed
            raise first
        unpaired = [r for queue in self.waiting.values() for r in queue if r.output_grad is not None]
        if unpaired:
            raise RowsError(unpaired[0].module,
                f"{len(unpaired)} output gradient(s) of checkpointed modules never met their recomputed inputs "
                f"(first: {type(unpaired[0].module).__name__}); the per-sequence norms would be incomplete."
            )


@contextmanager
def capture(modules: list[nn.Module], batch: int, on_grad=None, checkpointed: list[nn.Module] = (),
            calls_of: set[nn.Module] = frozenset()):
    """Record (activation, output gradient) of every call of ``modules`` during the forward/backward inside; yields
    the records and the tensors the backward must reach (so that it reaches every hooked output).

    ``on_grad(record, calls)``, if given, runs as soon as a record has both halves (``calls``: how many times each
    module ran in the forward, recomputations not counted); it may consume the record.

    Inside a checkpointed layer a module's input is not kept from the forward: the backward recomputes the layer, and
    the input is taken from that recomputation, just before (or just after) the module's output gradient arrives. So
    the pass keeps what checkpointing keeps, plus one layer's factors at a time when ``on_grad`` consumes them.

    An output whose leading dimension is 1 while the batch is ``batch`` (computed once, broadcast to every row) is
    replaced by its expansion to the batch, so that its gradient arrives per row instead of summed over the rows.
    Modules in ``calls_of`` (per-row and routed paths) have their whole call recorded: arguments, keyword arguments
    and every output that carries a gradient.
    """
    state = _Capture(batch, on_grad, checkpointed)
    handles = [m.register_forward_hook(state.forward_hook) for m in modules if m not in calls_of]
    handles += [m.register_forward_hook(state.call_hook, with_kwargs=True) for m in calls_of]
    handles += [m.register_forward_pre_hook(state.recompute_pre_hook) for m in modules if m in state.in_checkpointed]
    handles += [m.register_forward_pre_hook(state.layer_pre_hook, with_kwargs=True) for m in checkpointed]
    handles += [m.register_forward_hook(state.layer_post_hook) for m in checkpointed]
    try:
        yield state.records, state.inputs_with_grad
    finally:
        for handle in handles:
            handle.remove()
        state.release()
    state.check_paired()


# ------------------------------------------------------------------------ reentrant gradient checkpointing, as the pass runs it
_UNSET = object()


def is_reentrant(checkpoint_function) -> bool:
    """Whether a layer's ``_gradient_checkpointing_func`` (transformers': ``partial(checkpoint, **kwargs)``) runs
    reentrant: anything but a partial with ``use_reentrant=False`` (torch's own default, unset, is reentrant; another
    function, such as DeepSpeed's activation checkpointing, is reentrant too)."""
    return not (isinstance(checkpoint_function, functools.partial)
                and checkpoint_function.keywords.get("use_reentrant", True) is False)


def runs_reentrant(model) -> bool:
    """Whether any layer of ``model`` (as wrapped) is set to run under reentrant gradient checkpointing."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        return False
    return any(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
               and is_reentrant(getattr(m, "_gradient_checkpointing_func", None)) for m in model.modules())


class NormsCheckpoint(torch.autograd.Function):
    """Torch's reentrant checkpoint (its forward, :class:`torch.utils.checkpoint.CheckpointFunction`), whose backward
    takes ``torch.autograd.grad`` of the recomputed layer to its inputs instead of ``backward()`` into ``.grad``."""

    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        with reentrant_stage("forward"):
            return CheckpointFunction.forward(ctx, run_function, preserve_rng_state, *args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = list(ctx.inputs)
        for i, tensor in zip(ctx.tensor_indices, ctx.saved_tensors):
            inputs[i] = tensor
        devices = ctx.fwd_devices if ctx.preserve_rng_state and ctx.had_device_in_fwd else []
        targets: list[torch.Tensor] = []
        with torch.random.fork_rng(devices=devices, enabled=ctx.preserve_rng_state, device_type=ctx.device_type):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.fwd_cpu_state)
                if ctx.had_device_in_fwd:
                    set_device_states(ctx.fwd_devices, ctx.fwd_device_states, device_type=ctx.device_type)
            detached = detach_variable(tuple(inputs))
            device_autocast = (torch.amp.autocast(device_type=ctx.device_type, **ctx.device_autocast_kwargs)
                               if torch.amp.is_autocast_available(ctx.device_type) else contextlib.nullcontext())
            with torch.enable_grad(), device_autocast, torch.amp.autocast("cpu", **ctx.cpu_autocast_kwargs), \
                    reentrant_stage("recompute", targets):
                outputs = ctx.run_function(*detached)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        wanted = [x for x in detached if torch.is_tensor(x) and x.requires_grad]
        found = [None] * len(wanted)
        if pairs:
            extra = list({id(p): p for p in targets if all(p is not x for x in wanted)}.values())
            found = torch.autograd.grad([o for o, _ in pairs], wanted + extra, [g for _, g in pairs],
                                        allow_unused=True)[:len(wanted)]
        by_input = iter(found)
        return (None, None) + tuple(next(by_input) if torch.is_tensor(x) and x.requires_grad else None
                                    for x in detached)


def norms_checkpoint(function, *args, **kwargs):
    """A ``_gradient_checkpointing_func`` for the pass: :class:`NormsCheckpoint` (the random state replayed)."""
    del kwargs  # transformers passes the layer's keyword arguments inside ``function``
    return NormsCheckpoint.apply(function, True, *args)


@contextmanager
def norms_checkpointing(layers):
    """Each of ``layers`` (checkpointed, :func:`~.hooks.checkpointed_layers`) under reentrant checkpointing runs
    under :func:`norms_checkpoint` inside; its own ``_gradient_checkpointing_func`` is put back after, exactly (also
    when the pass fails). Yields the layers switched."""
    switched = [(layer, vars(layer).get("_gradient_checkpointing_func", _UNSET)) for layer in layers
                if is_reentrant(getattr(layer, "_gradient_checkpointing_func", None))]
    for layer, _ in switched:
        layer._gradient_checkpointing_func = norms_checkpoint
    try:
        yield [layer for layer, _ in switched]
    finally:
        for layer, before in switched:
            if before is _UNSET:
                del layer._gradient_checkpointing_func
            else:
                layer._gradient_checkpointing_func = before
