"""Which trainable modules the exact per-sequence norms cover, and :func:`validate` (as Opacus's), which lists every
one they do not, at once, with advice that works."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import generic
from .experts import recognise_bank
from .routers import recognise_router
from .rules import find_rule

ADVICE = (
    "Either freeze them (module.requires_grad_(False) for each), or train without exact norms: "
    "OBLRPOConfig(grad_norm_estimator='length', snr_lr=False) (a completion-length proxy for the baseline weights; "
    "the SNR step size needs the exact norms, so it must be off too), or register a rule with "
    "oblr_trl.grad_norms.register_grad_norm_rule."
)


@dataclass(frozen=True)
class Unsupported:
    name: str  # the module's qualified name ('' for the model itself)
    type: str  # its class name
    reason: str

    def __str__(self) -> str:
        return f"'{self.name}' ({self.type}): {self.reason}"


class UnsupportedModulesError(NotImplementedError):
    """Raised by :func:`validate`; ``.modules`` lists every unsupported trainable module."""

    def __init__(self, modules: list[Unsupported], advice: str = ADVICE):
        self.modules = modules
        lines = "\n".join(f"  - {m}" for m in modules)
        super().__init__(
            f"Exact per-sequence gradient norms do not cover {len(modules)} trainable module(s) of this model:\n"
            f"{lines}\n{advice}"
        )


def how_handled(module: nn.Module) -> str | None:
    """'rule' (a per-layer rule), 'routed' (a fused MoE expert bank, by its routed tokens: :mod:`.experts`; a router, by its
    logits: :mod:`.routers`),
    'per-row' (:mod:`.generic`), or None (unsupported) for a module with trainable parameters of its own."""
    if find_rule(module) is not None:
        return "rule"
    if recognise_bank(module) is not None or recognise_router(module):
        return "routed"
    if generic.trainable_numel(module) <= generic.MAX_NUMEL:
        return "per-row"
    return None


def _text_config(lm: nn.Module):
    config = getattr(lm, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def unsupported_modules(model: nn.Module) -> list[Unsupported]:
    """Every trainable module of ``model`` (a causal LM, possibly PEFT/DDP-wrapped) the exact norms do not cover."""
    from .engine import unwrap_causal_lm

    lm = unwrap_causal_lm(model)
    if not any(p.requires_grad for p in lm.parameters()):
        return []
    found: list[Unsupported] = []
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        found.append(Unsupported("lm_head", type(head).__name__, "the LM head must be an nn.Linear"))
    backbone = getattr(lm, "base_model", lm)
    for name, module in backbone.named_modules():
        if module is head or not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if how_handled(module) is None:
            trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            found.append(Unsupported(
                name, type(module).__name__,
                f"no rule for its type, and its trainable parameters {trainable} "
                f"({generic.trainable_numel(module):,} elements) exceed the per-row path's limit "
                f"({generic.MAX_NUMEL:,})",
            ))
    return found


def validate(model: nn.Module, *, strict: bool = True) -> list[Unsupported]:
    """Check, before any training, that exact per-sequence gradient norms cover every trainable module of ``model``.

    Returns the list of unsupported modules (empty when all are covered); with ``strict=True`` (the default) raises
    :class:`UnsupportedModulesError` listing all of them at once, with advice that works. Layouts that only the data
    reveal (an output whose leading dimension is not the batch) are checked during the pass itself, which stops
    naming the module.
    """
    found = unsupported_modules(model)
    if found and strict:
        raise UnsupportedModulesError(found)
    return found


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
