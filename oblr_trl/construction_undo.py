"""A refused construction leaves the user's model as it was: what GRPOTrainer's construction changed on the model
object it was handed, put back when OBLRPOTrainer's own checks then refuse.

Those checks (:func:`~.grad_norms.validate` above all) run after ``GRPOTrainer.__init__``, on the model as it will
train, and GRPOTrainer's construction changes the model it is given:

* on a quantized base it casts every trainable parameter to bf16 (QLoRA's adapters: ``param.data`` replaced);
* on a PEFT model with ``beta > 0`` it adds a ``ref`` adapter, a copy of the trained one;
* with a ``peft_config`` it wraps the model, injecting adapter layers into the model object;
* with gradient checkpointing on a PEFT model it hooks the input embeddings (``enable_input_require_grads``);
* with ``disable_dropout`` it sets every dropout's ``p`` to 0.

:func:`snapshot` records, before that construction, references to what it may replace (no tensor is copied), and
:meth:`Snapshot.restore` undoes each of those changes: every parameter holds its own tensor again (bit for bit, its
dtype, its ``requires_grad``), adapters the construction added are deleted, injected layers unloaded, the hook removed
and the dropouts' ``p`` back. An accepted construction keeps GRPOTrainer's changes (the model then trains as it would
under GRPOTrainer). ``tests/test_construction_unchanged.py`` compares every tensor, buffer and quantization state
with GRPOTrainer's construction on a second copy of the model.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Snapshot:
    model: nn.Module
    params: list[tuple[nn.Parameter, torch.Tensor, bool]]  # each parameter, the tensor it held, its requires_grad
    dropouts: list[tuple[nn.Module, float]]
    adapters: set[str] | None  # the PEFT adapters' names (None: not a PEFT model)
    hooked: bool  # whether the input embeddings' require-grads hook was there

    def restore(self, trained: nn.Module | None) -> None:
        """Undo what the construction changed; ``trained``: the model the trainer ended up with (a PEFT wrapper
        around :attr:`model` when TRL wrapped it; None when the construction failed before it)."""
        if trained is not None and trained is not self.model and _injected_into(trained, self.model):
            trained.base_model.unload()  # the layers get_peft_model put into the user's model, taken out
        for name in sorted(set(getattr(self.model, "peft_config", {})) - self.adapters if self.adapters else ()):
            self.model.delete_adapter(name)  # GRPOTrainer's 'ref' adapter (beta > 0)
        if not self.hooked and hasattr(self.model, "_require_grads_hook"):
            self.model.disable_input_require_grads()
        for param, tensor, requires_grad in self.params:
            if not _same(param, tensor):
                param.data = tensor
            param.requires_grad_(requires_grad)
        for module, p in self.dropouts:
            module.p = p


def undone_on_refusal(init):
    """``init`` (a trainer's ``__init__``, with ``GRPOTrainer.__init__``'s parameters) such that where it raises, the
    changes it made to the model object it was given are undone (:meth:`Snapshot.restore`, with the trainer's model
    as far as the construction got)."""
    from trl import GRPOTrainer

    parameters = inspect.signature(GRPOTrainer.__init__)

    @functools.wraps(init)
    def constructed(trainer, *args, **kwargs):
        before = snapshot(parameters.bind(trainer, *args, **kwargs).arguments.get("model"))
        try:
            init(trainer, *args, **kwargs)
        except BaseException:
            if before is not None:
                before.restore(getattr(trainer, "model", None))
            raise

    return constructed


def snapshot(model) -> Snapshot | None:
    """What GRPOTrainer's construction may change on ``model``, by reference; None for a model name (TRL loads it:
    nothing of the user's to keep)."""
    if not isinstance(model, nn.Module):
        return None
    adapters = set(model.peft_config) if isinstance(getattr(model, "peft_config", None), dict) else None
    return Snapshot(model=model, params=[(p, p.data, p.requires_grad) for p in model.parameters()],
                    dropouts=[(m, m.p) for m in model.modules() if isinstance(m, nn.Dropout)], adapters=adapters,
                    hooked=hasattr(model, "_require_grads_hook"))


def _same(param: nn.Parameter, tensor: torch.Tensor) -> bool:
    return param.dtype == tensor.dtype and param.shape == tensor.shape and param.data_ptr() == tensor.data_ptr()


def _injected_into(trained: nn.Module, model: nn.Module) -> bool:
    """Whether ``trained`` is a PEFT wrapper TRL built around ``model`` with layers injected into it (LoRA and the
    other tuners that replace modules; prompt learning leaves the model's modules alone)."""
    base = getattr(trained, "base_model", None)
    return getattr(base, "model", None) is model and hasattr(base, "unload")
