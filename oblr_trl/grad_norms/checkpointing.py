"""Reentrant gradient checkpointing, as the per-sequence pass runs it.

Torch's reentrant checkpoint (``use_reentrant=True``: PEFT's ``prepare_model_for_kbit_training`` default, and what
TRL forces for PEFT under DeepSpeed ZeRO-3) recomputes a layer in its backward and runs ``backward()`` there, into
every parameter's ``.grad``; it refuses ``torch.autograd.grad``, which the pass needs (it must touch no ``.grad``).
For the duration of one pass, each layer checkpointed that way runs under :class:`NormsCheckpoint` instead: the same
forward (no graph kept, only the layer's inputs; the same random state replayed in the recomputation), whose
backward recomputes the layer and takes ``torch.autograd.grad`` to the layer's inputs (and to the trainable
parameters of modules whose input carries no gradient), so that the capture hooks (:mod:`.hooks`) see every module's
recomputed input and output gradient, and no ``.grad`` is written. Memory: as reentrant checkpointing's, one layer's
graph at a time. The layer's own setting is put back after the pass (:func:`norms_checkpointing`), also on errors:
the model trains under the checkpointing its user or TRL chose. Layers under non-reentrant checkpointing are left as
they are (the pass runs through it directly).
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import (
    CheckpointFunction,
    detach_variable,
    set_device_states,
)

from .hooks import reentrant_stage

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
