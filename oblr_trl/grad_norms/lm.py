"""The parts of a causal LM the per-sequence gradients need: the ``*ForCausalLM`` under its wrappers, its LM head and
its text config. No rule, hook or formula here: every other module of :mod:`oblr_trl.grad_norms` may import it."""

from __future__ import annotations

from torch import nn


def unwrap_distributed(model: nn.Module) -> nn.Module:
    """The model under DDP/Accelerate wrappers, as the trainer's forward calls it (a PEFT wrapper kept: its forward
    can add what the ``*ForCausalLM`` never sees, a prompt-learning adapter's virtual tokens)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module) and not hasattr(model, "get_base_model"):
        model = model.module  # DistributedDataParallel
    return model


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` module under DDP/Accelerate and PEFT wrappers."""
    return under_peft(unwrap_distributed(model))


def under_peft(outer: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a PEFT wrapper (``outer`` itself where it has none); ``outer`` is already
    unwrapped of DDP (:func:`unwrap_distributed`)."""
    return outer.get_base_model() if hasattr(outer, "get_base_model") else outer  # peft.PeftModel


def output_head(lm: nn.Module) -> nn.Module | None:
    """The LM head that computes the logits: ``get_output_embeddings()``, or, under PEFT's ``modules_to_save``
    (``ModulesToSaveWrapper``), the trainable copy its forward runs (the original stays frozen). None where the model
    has no head."""
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    copies = getattr(head, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict) and not getattr(head, "disable_adapters", False):
        active = list(getattr(head, "active_adapters", None) or [])
        if active and active[0] in copies:
            return copies[active[0]]
    return head


def text_config(lm: nn.Module):
    config = getattr(lm, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def backbone_of(lm: nn.Module) -> nn.Module:
    """The module under the head whose forward returns ``last_hidden_state``: ``base_model``, or, where that is the
    ``*ForCausalLM`` itself (Llama 4's and Mllama's text models name their prefix after a wrapper they lack), its
    decoder or ``model``."""
    base = getattr(lm, "base_model", lm)
    if base is not lm:
        return base
    for candidate in (lm.get_decoder() if hasattr(lm, "get_decoder") else None, getattr(lm, "model", None)):
        if isinstance(candidate, nn.Module) and candidate is not lm:
            return candidate
    return base
