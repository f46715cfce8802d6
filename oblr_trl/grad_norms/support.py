"""Which trainable modules the exact per-sequence norms cover, and how (:func:`coverage_plan`), by module type; the
entries :func:`~.coverage.validate` lists for every one they do not, at once, with advice that works."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import generic
from . import experts, routers  # noqa: F401 (their call rules register on import)
from .lm import backbone_of, output_head, unwrap_causal_lm
from .recognise import find_rule
from .rules import find_call_rule

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


def how_handled(module: nn.Module, borrowed: int = 0) -> str | None:
    """'rule' (a per-layer rule), 'routed' (a fused MoE expert bank, by its routed tokens: :mod:`.experts`; a router,
    by its logits: :mod:`.routers`), 'per-row' (:mod:`.generic`), or None (unsupported) for a module with trainable
    parameters of its own, or ``borrowed`` trainable elements of descendants it uses functionally (those always take
    the per-row path, with the module's own parameters)."""
    if borrowed:
        return "per-row" if generic.trainable_numel(module) + borrowed <= generic.MAX_NUMEL else None
    if find_rule(module) is not None:
        return "rule"
    if find_call_rule(module) is not None:
        return "routed"
    if generic.trainable_numel(module) <= generic.MAX_NUMEL:
        return "per-row"
    return None


@dataclass(frozen=True)
class Covered:
    """One hooked module: how its per-sequence gradients are formed, and the dotted names (relative to it) of the
    parameters of descendants it uses functionally and so takes on the per-row path with its own."""
    module: nn.Module
    how: str
    borrowed: tuple[str, ...] = ()


def borrowed_names(owners: dict[nn.Module, nn.Module]) -> dict[nn.Module, list[str]]:
    """``{ancestor: [dotted names, relative to it, of the trainable parameters it borrows]}`` from ``owners``
    (``{module used functionally: the ancestor that borrows it}``)."""
    out: dict[nn.Module, list[str]] = {}
    for module, ancestor in owners.items():
        prefix = next(n for n, m in ancestor.named_modules() if m is module)
        out.setdefault(ancestor, []).extend(
            f"{prefix}.{n}" for n, p in module.named_parameters(recurse=False) if p.requires_grad)
    return out


def coverage_plan(lm: nn.Module, owners: dict[nn.Module, nn.Module]) -> tuple[list[Covered], list[Unsupported]]:
    """How each trainable module of ``lm``'s backbone is covered (the head is the engine's own), given ``owners``
    (``{module used functionally: the ancestor that borrows it}``, :func:`~.coverage.functional_owners`), and every
    module that is not."""
    head = output_head(lm)
    borrowing = borrowed_names(owners)
    covered: list[Covered] = []
    found: list[Unsupported] = []
    backbone = backbone_of(lm)
    for name, module in backbone.named_modules():
        if module is head or module in owners:
            continue
        borrowed = tuple(borrowing.get(module, ()))
        if not borrowed and not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        extra = sum(module.get_parameter(n).numel() for n in borrowed)
        how = how_handled(module, extra)
        if how is not None:
            covered.append(Covered(module, how, borrowed))
            continue
        trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad] + list(borrowed)
        found.append(Unsupported(
            name, type(module).__name__,
            ("no rule for its type, and its trainable parameters" if not borrowed else
             "it uses the parameters of its descendants functionally (no hook sees those uses), and with its own the "
             "per-row path would take") + f" {trainable} ({generic.trainable_numel(module) + extra:,} elements), "
            f"more than the per-row path's limit ({generic.MAX_NUMEL:,})",
        ))
    return covered, found


def unsupported_modules(model: nn.Module, owners: dict[nn.Module, nn.Module] | None = None) -> list[Unsupported]:
    """Every trainable module of ``model`` (a causal LM, possibly PEFT/DDP-wrapped) the exact norms do not cover, by
    type (the probe of :func:`~.coverage.validate` checks the rest by running them)."""
    lm = unwrap_causal_lm(model)
    if not any(p.requires_grad for p in lm.parameters()):
        return []
    found: list[Unsupported] = []
    head = output_head(lm)
    if not isinstance(head, nn.Linear):
        found.append(Unsupported("lm_head", type(head).__name__, "the LM head must be an nn.Linear"))
    return found + coverage_plan(lm, owners or {})[1]


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
