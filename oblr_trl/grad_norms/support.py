"""Which trainable modules the exact per-sequence norms cover, and by which rule (:func:`coverage_plan`: resolved once
per model and kept on its :class:`~.plan.ModelPlan`), by module type; the entries :func:`~.coverage.validate` lists
for every one they do not, at once, with advice that works."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .rules import lora_experts, per_row as generic, soft_prompt  # the package registers every family's rules
from .ledger import functional_owners
from .model import ModelPlan, ModelView, soft_prompt_model, unwrap_causal_lm, unwrap_distributed, view_of
from .rules.recognition import find_rule
from .result import ADVICE, Unsupported, UnsupportedModulesError  # noqa: F401 (imported from here too)
from .rules.registry import CallRule, Rule, find_call_rule, registered, switched_off_now

def resolve(module: nn.Module, borrowed: int = 0,
            memo: dict | None = None) -> tuple[str, Rule | CallRule | None] | None:
    """The path and rule of a module with trainable parameters of its own, or ``borrowed`` trainable elements of
    descendants it uses functionally (those take the per-row path, with the module's own parameters, unless a call
    rule that borrows takes the module):
    ``('rule', rule)`` (a per-layer rule), ``('routed', call rule)`` (a fused MoE expert bank, by its routed tokens:
    :mod:`.experts`; LoRA on one, borrowing its factors: :mod:`.lora_experts`; a router, by its logits:
    :mod:`.routers`), ``('per-row', None)`` (:mod:`.generic`), or None (unsupported). ``memo``: what the
    recognisers' probes found, the model's plan's (:class:`~.plan.ModelPlan`)."""
    fits = generic.trainable_numel(module) + borrowed <= generic.MAX_NUMEL
    if borrowed:
        call_rule = find_call_rule(module, memo, borrows=True)
        if call_rule is not None:
            return "routed", call_rule
        return ("per-row", None) if fits else None
    rule = find_rule(module, memo)
    if rule is not None:
        return "rule", rule
    call_rule = find_call_rule(module, memo)
    if call_rule is not None:
        return "routed", call_rule
    return ("per-row", None) if fits else None


def how_handled(module: nn.Module, borrowed: int = 0, memo: dict | None = None) -> str | None:
    """'rule', 'routed', 'per-row' or None (unsupported): the path of :func:`resolve`."""
    found = resolve(module, borrowed, memo)
    return None if found is None else found[0]


@dataclass(frozen=True)
class Covered:
    """One hooked module: the rule its plan chose (a tensor rule, a :class:`~.rules.CallRule`, or None for the
    per-row path), and the dotted names (relative to it) of the parameters of descendants it uses functionally and so
    takes on the per-row path with its own."""
    module: nn.Module
    rule: Rule | CallRule | None
    borrowed: tuple[str, ...] = ()

    @property
    def how(self) -> str:
        """'rule', 'routed' or 'per-row' (see :func:`resolve`)."""
        return "per-row" if self.rule is None else "routed" if isinstance(self.rule, CallRule) else "rule"

    @property
    def whole_call(self) -> bool:
        """Whether its whole call is recorded (the per-row and routed paths), not its input and output gradient."""
        return self.how != "rule"


def borrowed_names(owners: dict[nn.Module, nn.Module]) -> dict[nn.Module, list[str]]:
    """``{ancestor: [dotted names, relative to it, of the trainable parameters it borrows]}`` from ``owners``
    (``{module used functionally: the ancestor that borrows it}``)."""
    out: dict[nn.Module, list[str]] = {}
    for module, ancestor in owners.items():
        prefix = next(n for n, m in ancestor.named_modules() if m is module)
        out.setdefault(ancestor, []).extend(
            f"{prefix}.{n}" for n, p in module.named_parameters(recurse=False) if p.requires_grad)
    return out


def _resolve_all(view: ModelView, owners: dict[nn.Module, nn.Module], memo: dict
                 ) -> tuple[list[Covered], list[Unsupported]]:
    """How each trainable module of the model's backbone is covered (the head is the engine's own), given ``owners``
    (``{module used functionally: the ancestor that borrows it}``, :func:`~.ledger.functional_owners`), and every
    module that is not: each module's rule resolved once (:func:`resolve`)."""
    head = view.head
    borrowing = borrowed_names(lora_experts.outermost(owners, view.lm))  # a chain of LoRA wrappers is one call
    covered: list[Covered] = []
    found: list[Unsupported] = []
    for name, module in view.backbone.named_modules():
        if module is head or module in owners:
            continue
        borrowed = tuple(borrowing.get(module, ()))
        if not borrowed and not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        extra = sum(module.get_parameter(n).numel() for n in borrowed)
        chosen = resolve(module, extra, memo)
        if chosen is not None:
            covered.append(Covered(module, chosen[1], borrowed))
            continue
        trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad] + list(borrowed)
        reason = ("no rule for its type, and its trainable parameters" if not borrowed else
                  "it uses the parameters of its descendants functionally (no hook sees those uses), and with its own "
                  "the per-row path would take") + f" {trainable} ({generic.trainable_numel(module) + extra:,} " \
            f"elements), more than the per-row path's limit ({generic.MAX_NUMEL:,})"
        found.append(Unsupported(name, type(module).__name__, lora_experts.why_not(module, name, memo) or reason))
    return covered, found


def coverage_plan(model: nn.Module) -> ModelPlan:
    """The model's plan (:class:`~.plan.ModelPlan`, carried on its ``*ForCausalLM``): ``covered``, each trainable
    backbone module with the rule chosen for it, and ``unsupported``, every module none covers. Resolved once per
    model: resolved again only when what it was resolved under changes (the model's state, :func:`~.plan.state_key`:
    its modules, forwards, hooks, parameters and trainable set; the per-row limit; the switched-off rules,
    :func:`~.rules.switched_off`; or the registered ones, :func:`~.rules.registered`); the recognisers' probes are
    kept in its ``memo`` while the model's structure stays as it was."""
    view = view_of(model)
    plan = view.plan
    key = (view.key, generic.MAX_NUMEL, switched_off_now(), registered())
    if plan.key != key:
        plan.covered, plan.unsupported = _resolve_all(view, functional_owners(view), plan.memo)
        plan.key = key
    return plan


PROMPT_LEARNING_ADVICE = (
    "PEFT's {kind} adds virtual tokens in the PeftModel's forward, which the per-sequence pass (it runs the "
    "{lm} itself) does not see. Train a LoRA adapter instead (peft_config=LoraConfig(...), exact on every layer), or "
    "keep the soft prompt without exact norms: OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
)
PREFIX_TUNING_ADVICE = (
    "PEFT's prefix tuning hands the model a past key-value cache, which the per-sequence pass does not see; "
    "GRPOTrainer itself (TRL 1.16) fails on it in its first forward. Use prompt tuning or a LoRA adapter."
)


def prompt_plan(prompted: nn.Module, memo: dict | None = None) -> list[Covered]:
    """How each trainable layer of a soft prompt's encoder (:mod:`.soft_prompt`: prompt tuning, P-tuning) is covered;
    raises naming every layer that no rule or path covers (P-tuning's LSTM above the per-row path's limit)."""
    covered, found = [], []
    for name, module in soft_prompt.encoder_modules(prompted):
        chosen = resolve(module, 0, memo)
        if chosen is None:
            trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            found.append(Unsupported(name, type(module).__name__, (
                f"a soft prompt's encoder layer with no rule for its type, and its trainable parameters {trainable} "
                f"({generic.trainable_numel(module):,} elements) are more than the per-row path's limit "
                f"({generic.MAX_NUMEL:,})")))
        else:
            covered.append(Covered(module, chosen[1]))
    if found:
        raise UnsupportedModulesError(found)
    return covered


def outside_modules(model: nn.Module) -> list[Unsupported]:
    """Trainable modules of the model as the trainer calls it that lie outside its ``*ForCausalLM`` and that the
    per-sequence pass does not take on: a soft prompt's encoder it covers (:func:`prompt_plan`) is not listed; prefix
    tuning's, or any other wrapper's trainable module, is refused by name, with advice that works."""
    outer, lm = unwrap_distributed(model), unwrap_causal_lm(model)
    prompted = soft_prompt_model(model)
    if prompted is not None:
        try:
            prompt_plan(prompted, view_of(model).plan.memo)  # the plan as of the model's state now
        except UnsupportedModulesError as error:
            return list(error.modules)
    inside = {id(p) for p in lm.parameters()}
    if prompted is not None:
        inside |= {id(p) for _, m in soft_prompt.encoder_modules(prompted) for p in m.parameters(recurse=False)}
    config = getattr(outer, "peft_config", {}).get(getattr(outer, "active_adapter", None), None) \
        if isinstance(getattr(outer, "peft_config", None), dict) else None
    kind = str(getattr(getattr(config, "peft_type", None), "value", "adapter")).lower().replace("_", " ")
    advice = (PREFIX_TUNING_ADVICE if kind == "prefix tuning" else
              PROMPT_LEARNING_ADVICE.format(kind=kind, lm=type(lm).__name__))
    found = []
    for name, module in outer.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad and id(p) not in inside]
        if own:
            found.append(Unsupported(name, type(module).__name__,
                                     f"trainable {own} outside the {type(lm).__name__}. {advice}"))
    return found


def unsupported_modules(model: nn.Module) -> list[Unsupported]:
    """Every trainable module of ``model`` (a causal LM, possibly PEFT/DDP-wrapped) the exact norms do not cover, by
    type; the head is :func:`~.head_adapters.refusal`'s, which :func:`~.coverage.validate` adds (its probe checks the
    rest by running them)."""
    lm = unwrap_causal_lm(model)
    found = outside_modules(model)
    if not any(p.requires_grad for p in lm.parameters()):
        return found
    return found + coverage_plan(model).unsupported


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
