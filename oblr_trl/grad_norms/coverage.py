"""The coverage ledger: which trainable parameters the per-sequence gradients account for, and a probe that proves it.

Hooks see a parameter only through its own module's forward. A model can reach a weight other ways: a mixer passes
``self.conv1d.weight`` to a functional causal convolution (Mamba-2, NemotronH, Bamba, Zamba2, Granite-4.0-H, the
gated delta-net), a parent's forward uses a child's weight, one weight is shared by two modules. Two mechanisms make
"a share silently left out" impossible, whatever the path:

1. **Discovery** (:func:`functional_owners`): one tiny forward records which modules run. A trainable module that
   never runs, but whose parameters autograd reaches from the hidden states, is used functionally by an ancestor:
   its parameters are *borrowed* by the nearest ancestor that runs, which takes them on the exact per-row path
   (:mod:`.rules.per_row`: that ancestor's call re-run per sequence, one vector-Jacobian product each), and the borrowed
   module gets no hooks of its own. Cost: one forward and one backward of a 2 x 8-token batch, once per model state
   (:func:`~.model.state_key`); then, in every pass, the per-row path's cost for each borrowing ancestor.
2. **The probe** (:func:`probe`, run by :func:`validate`, so at ``OBLRPOTrainer`` construction, and by the engine
   once per model state, :func:`~.model.state_key`): on a 2-sequence batch (one left-padded, one ending early), each
   sequence's gradient as the engine forms it must equal autograd's gradient of that sequence's log-probability run
   alone, within the promise: relative error <= 1e-4 per parameter (plus a floor of 1e-7 of the whole gradient,
   for parameters whose gradient is nearly 0) and over all parameters together. It runs in float32 (a bf16/fp16
   model is upcast while it runs, since bf16 logits are too coarse a reference; a quantized base keeps its packed
   weights and computes in float32, :mod:`.quantized`; only a model whose forward cannot run so is judged as it
   computes, at 0.2, with a warning); a parameter that misses in float32 is looked at again with the whole model in
   float64, where the model's own rounding is gone (the engine's float32 products leave about 1e-7), and only a miss
   there is refused. A parameter where it does not hold (a share no hook sees, rows paired with the wrong sequence, a
   head transform the engine does not compute), or a pass that fails, is refused by name before training. Before it,
   the head is checked by observation (:mod:`.head`).
   What it checks is the model as the trainer runs it (:func:`trained_parameters`: under DDP, above PEFT, so a soft
   prompt's encoder is checked, never skipped), against autograd on that model; and since autograd is the reference,
   a backward through an operator with no backward formula (PyTorch's autograd fallback: bitsandbytes' CPU inference
   kernel) is refused naming the operator, as autograd itself is wrong there.
   This check also covers ``one_backward``: its update is the same per-sequence gradients, weighted. Cost: one
   engine pass of that batch and one forward+backward per sequence (twice where float32 misses), and two
   gradient-sized buffers while it runs (one sequence at a time: the engine's gradient and autograd's), so that
   construction's peak stays under a training step's (which holds the gradient and the optimizer's state).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from . import head
from .engine import run_pass
from .model import (ModelPlan, ModelView, float32_mode, output_head, plain_mode, probe_batch, sharded,
                    soft_prompt_model, unwrap_causal_lm, unwrap_distributed, view_of)
from .quantized import LOST_SCALES, backward_gaps, lost_scales, restore, warn_undone
from .result import ADVICE, Unsupported, UnsupportedModulesError
from .rules import lora_experts, per_row, soft_prompt  # the package registers every family's rules
from .rules.recognition import find_rule
from .rules.registry import CallRule, Rule, find_call_rule, registered, switched_off_now

logger = logging.getLogger(__name__)

RTOL = 1e-4  # the promise, per parameter and in total (a half-precision model is upcast, see model.float32_mode)
FLOOR = 1e-3  # of RTOL, relative to the whole gradient: parameters whose own gradient is nearly 0
NATIVE_HALF_RTOL = 0.2  # where it cannot be upcast (quantized weights): only what is missing or misattributed shows
LOST_SCALES_ADVICE = ("Reload the model and construct the trainer before any generate() or evaluation on it (from "
                      "then on the repacking is switched off), or import oblr_trl before the first generation.")


PAIR_CHUNK = 1 << 22  # elements of one parameter compared at a time, in float64 (bounds the probe's temporaries)


def pair_sums(got: torch.Tensor | None, ref: torch.Tensor | None) -> tuple[float, float, float]:
    """``||got - ref||^2``, ``||ref||^2`` and ``<got, ref>`` in float64 (``None``: a zero gradient), over slices of
    ``PAIR_CHUNK`` elements, so that the float64 copies never exceed a slice."""
    if ref is None and got is None:
        return 0.0, 0.0, 0.0
    a = None if got is None else got.reshape(-1)
    b = None if ref is None else ref.reshape(-1)
    err = size = dot = 0.0
    for start in range(0, (a if b is None else b).numel(), PAIR_CHUNK):
        x = None if a is None else a[start : start + PAIR_CHUNK].double()
        y = None if b is None else b[start : start + PAIR_CHUNK].double()
        err += float((x if y is None else y if x is None else x - y).pow(2).sum())
        size += 0.0 if y is None else float(y.pow(2).sum())
        dot += 0.0 if x is None or y is None else float((x * y).sum())
    return err, size, dot


def _mismatches(modules: dict[str, nn.Module], found: dict[str, tuple[float, float, float]],
                rtol: float) -> list[Unsupported]:
    """Parameters whose per-sequence gradients differ from autograd's, over all sequences, by more than ``rtol``
    (relative to the parameter's own gradient, plus a floor of ``rtol * FLOOR`` relative to the whole gradient), or,
    where all parameters together differ by more than ``rtol`` of the whole, every parameter off by more than ``rtol``
    of its own; as one entry per module (``modules``: by qualified name). ``found``: per parameter, :func:`pair_sums`
    summed over the sequences."""
    total = sum(size for _, size, _ in found.values()) ** 0.5
    total_err = sum(err for err, _, _ in found.values()) ** 0.5
    by_module: dict[str, list[str]] = defaultdict(list)
    for name, (err2, size2, dot) in found.items():
        err, size = err2**0.5, size2**0.5
        if err > rtol * size + rtol * FLOOR * total or (total_err > rtol * total and err > rtol * size):
            share = f"{dot / size2:.0%}" if size else "n/a"
            module, _, leaf = name.rpartition(".")
            by_module[module].append(f"{leaf} (relative error {err / max(size, 1e-30):.2g}, projection on "
                                     f"autograd's per-sequence gradients {share})")
    return [Unsupported(m, type(modules[m]).__name__,
                        "its per-sequence gradients differ from autograd's, sequence by sequence (a use of its "
                        f"weights no hook sees, or rows paired with the wrong sequences): {', '.join(found)}")
            for m, found in by_module.items()]


def trained_parameters(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, str], dict[str, nn.Module]]:
    """Every trainable parameter of the model as the trainer runs it (under DDP, above PEFT: a prompt-learning
    adapter's encoder lives beside the ``*ForCausalLM``, not in it), by its name in that model; the name each is
    reported by (relative to the ``*ForCausalLM`` for its own, as the rest of the package names them); and the
    modules by reported name."""
    outer, lm = unwrap_distributed(model), unwrap_causal_lm(model)
    inner = {id(p): n for n, p in lm.named_parameters()}
    inner_modules = {id(m): n for n, m in lm.named_modules()}
    params = {n: p for n, p in outer.named_parameters() if p.requires_grad}
    shown = {n: inner.get(id(p), n) for n, p in params.items()}
    modules = {inner_modules.get(id(m), n): m for n, m in outer.named_modules()}
    return params, shown, modules


def probe(model) -> list[Unsupported]:
    """Every trainable parameter whose per-sequence gradients, summed over a small batch, differ from autograd's
    gradient of that batch (see the module docstring), as :class:`~.result.Unsupported` entries by module; a pass
    that fails, or a model whose own backward is not its forward's derivative, is one entry naming the model. Empty
    when every parameter is accounted for. Leaves ``.grad`` and the train/eval mode as they were. ``model``: the model,
    or its view (:func:`~.model.view_of`), which the whole probe reads."""
    view = view_of(model)  # a view handed in (validate's) is used as it is
    lm = view.lm
    params, shown, modules = trained_parameters(view.outer)
    if not params or sharded(lm):
        return []
    saved = {n: p.grad for n, p in params.items()}
    plan = view.plan
    plan.probing = True  # its own engine pass is not probed again
    try:
        for p in params.values():
            p.grad = None
        with plain_mode(lm):
            with float32_mode(lm) as upcast:
                found = _probe(view, RTOL if upcast else NATIVE_HALF_RTOL)
            if found and not upcast or _pass_failed(found) and view.quantized:
                logger.warning("%s cannot be checked in float32 (%s): checked as it computes, within %g.",
                               type(lm).__name__, found[0].reason, NATIVE_HALF_RTOL)
                found = _probe(view, NATIVE_HALF_RTOL)
            elif found and upcast and all(f.name for f in found):  # float32 rounding, or a real miss: float64 says
                with float32_mode(lm, torch.float64) as wide_ok:
                    wide = _probe(view, RTOL) if wide_ok else found
                found = found if any(not f.name for f in wide) else wide  # a pass that fails in float64: float32's
            return found
    finally:
        plan.probing = False
        for n, p in params.items():
            p.grad = saved[n]


def _pass_failed(found: list[Unsupported]) -> bool:
    return any(not f.name and f.reason.startswith(("the per-sequence gradient pass fails", "its own forward"))
               for f in found)


def _refused(lm: nn.Module, error: Exception) -> list[Unsupported]:
    """The engine's pass failing: the modules it names (:class:`UnsupportedModulesError`), else the model, with what
    failed (a layout no rule handles, found by running it)."""
    if isinstance(error, UnsupportedModulesError):
        return list(error.modules)
    return [Unsupported("", type(lm).__name__,
                        f"the per-sequence gradient pass fails on it: {type(error).__name__}: {error}")]


def _probe(view: ModelView, rtol: float) -> list[Unsupported]:
    """:func:`probe`'s one look, within ``rtol``, at the model resolved as ``view`` (under :func:`~.model.plain_mode`,
    which keeps the view while a check's copies are swapped in)."""
    lm, outer = view.lm, view.outer
    params, shown, modules = trained_parameters(outer)  # as the model is now: float32_mode's copies, where swapped
    ids, attention, completion_mask = probe_batch(lm)

    def take() -> dict[str, torch.Tensor | None]:
        found = {n: p.grad for n, p in params.items()}
        for p in params.values():
            p.grad = None
        return found

    found = {n: (0.0, 0.0, 0.0) for n in params}
    try:
        grads = run_pass(view, ids, attention, completion_mask, covering=pass_plan)
    except Exception as error:
        take()
        return _refused(lm, error)
    for i in range(ids.shape[0]):  # one sequence at a time: two gradient-sized buffers at once, not two per sequence
        try:  # its row of the per-sequence gradients, weighted 1
            grads.accumulate_grad(torch.eye(ids.shape[0], device=ids.device)[i])
            ours = take()
        except Exception as error:
            take()
            return _refused(lm, error)
        row = ids[i : i + 1], attention[i : i + 1], completion_mask[i : i + 1]
        try:  # the sequence alone through the model as the trainer calls it: autograd's gradient (the oracle)
            with backward_gaps() as gaps:
                (reference,) = per_row_grads(outer, *row, params=list(params.values()))
        except Exception as error:  # its own logits cannot score the sequences: nothing to check against
            return [Unsupported("", type(lm).__name__, f"its own forward cannot score a completion's "
                                f"log-probability: {type(error).__name__}: {error}")]
        if gaps:  # autograd itself, the reference, is wrong: nothing can be checked, nor trained on
            return [Unsupported("", type(lm).__name__, (
                f"its backward passes through {', '.join(gaps)}, which has no backward formula (PyTorch lets no "
                "gradient through it, with only a warning): autograd's gradients, the ones GRPO would train on, are "
                "wrong. For bitsandbytes' 4-bit layers on a CPU, oblr_trl.grad_norms.keep_differentiable(model) "
                "switches them back to a kernel with a backward; for another library's, load the model with a "
                "quantization whose layers train (bitsandbytes' 4-bit or 8-bit under PEFT)"))]
        for name, ref in zip(params, reference):
            found[name] = tuple(x + y for x, y in zip(found[name], pair_sums(ours[name], ref)))
        del ours
        del reference
    return _mismatches(modules, {shown[n]: v for n, v in found.items()}, rtol)


NO_GRAD = ("Per-sequence gradients need autograd, and this call runs under {what}: the pass would record no "
           "output gradient. Call it outside the {what} block, or wrap the call in {fix}.")


def refuse_without_grad() -> None:
    """Refuses, naming the cause, a call under ``torch.no_grad()`` or ``torch.inference_mode()`` (every call: the
    grad mode is read each time, never remembered)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(NO_GRAD.format(what="torch.inference_mode()", fix="torch.inference_mode(False)"))
    if not torch.is_grad_enabled():
        raise RuntimeError(NO_GRAD.format(what="torch.no_grad() (grad mode off)", fix="torch.enable_grad()"))


def check_once(model: nn.Module) -> ModelView:
    """:func:`validate` with the probe, once per model state (:func:`~.model.state_key`: its modules, their classes,
    forwards and hooks, its parameters and their dtypes, the config's caps and scales, the trainable parameters of
    the whole model handed in; the engine calls this at every pass, and the key is built again each time; the
    trainer's construction has usually done the check already). Refuses a call under ``no_grad`` or
    ``inference_mode``. Raises naming every uncovered module. What passed is remembered on the model's plan
    (:class:`~.model.ModelPlan`). Returns the model resolved (:func:`~.model.view_of`), for the pass that follows."""
    refuse_without_grad()
    view = view_of(model)
    lm, plan = view.lm, view.plan
    if plan.probing or plan.probed == view.key:
        return view
    if sharded(lm):  # no plain forward can run on shards: what was checked before sharding stands
        if plan.probed is None and not plan.warned_unchecked and not plan.ever_probed:
            plan.warned_unchecked = True
            logger.warning(
                "The per-sequence gradients of %s were not checked: its parameters were already sharded (FSDP2, "
                "ZeRO-3) when first seen, so parameters it uses outside their modules' forward cannot be found. Call "
                "oblr_trl.validate(model) before sharding (OBLRPOTrainer does, at construction, on a model not "
                "loaded under ZeRO-3's zero.Init).", type(lm).__name__)
        return view
    validate(view.outer)
    return view_of(view.outer)  # validation may have changed the model (bitsandbytes' kernels switched back)


def validate(model: nn.Module, *, strict: bool = True, run_probe: bool = True) -> list[Unsupported]:
    """Check, before any training, that exact per-sequence gradient norms cover every trainable parameter of
    ``model`` (a causal LM, possibly PEFT/DDP-wrapped), as Opacus's ``validate``.

    First by module type (every trainable module has a rule, a routed path or fits the per-row path; parameters used
    functionally are borrowed by the ancestor that uses them), then, with ``run_probe`` (the default), by the probe:
    on a 2-sequence batch the per-sequence gradients must sum to autograd's gradient, parameter by parameter (cost:
    one forward and backward of that batch, twice). Returns every unsupported module (empty when all are covered);
    with ``strict=True`` raises :class:`~.result.UnsupportedModulesError` listing all of them at once, with advice
    that works.

    The model is changed only where it passes, and only to make it trainable: bitsandbytes' CPU repacking switched
    off and undone exactly (:func:`~.quantized.restore`). A refused model is left bit for bit as it came.
    """
    lm = unwrap_causal_lm(model)
    lost = lost_scales(lm)  # bitsandbytes' CPU repacking that cannot be undone exactly: refused before any change
    if lost:
        found = [Unsupported(name, "Linear4bit", LOST_SCALES) for name in lost]
    else:
        restored = restore(lm)  # bitsandbytes' CPU kernels without a backward: switched back, exactly
        found = _checked(model, run_probe)
        if found:
            restored.revert()
        else:
            warn_undone(restored.undone)
    if found and strict:
        advice = LOST_SCALES_ADVICE if lost else head.advice(found, ADVICE)
        raise UnsupportedModulesError(found, advice=advice)
    return found


def _checked(model: nn.Module, run_probe: bool) -> list[Unsupported]:
    """:func:`validate`'s checks on a model in its trainable layout: by module type, the head, then the probe, these two
    on the model resolved once (its view, :func:`~.model.view_of`)."""
    try:
        found = unsupported_modules(model)
        view = view_of(model)
        if any(p.requires_grad for p in view.lm.parameters()):  # the head: an nn.Linear, or one under an adapter
            found = head.refusal(view.head) + found
        found = found or head.check(view)
    except UnsupportedModulesError:
        raise
    except Exception as error:  # discovery's forward fails: refused, naming the model, never a bare error later
        found = [Unsupported("", type(unwrap_causal_lm(model)).__name__,
                             f"a forward of its backbone fails: {type(error).__name__}: {error}")]
    if not found and run_probe:
        found = probe(view)
        if not found:
            view = view_of(model)
            view.plan.probed, view.plan.ever_probed = view.key, True
    return found


# ---------------------------------------------------------------------------- which rule covers which module: the plan
def resolve(module: nn.Module, borrowed: int = 0,
            memo: dict | None = None) -> tuple[str, Rule | CallRule | None] | None:
    """The path and rule of a module with trainable parameters of its own, or ``borrowed`` trainable elements of
    descendants it uses functionally (those take the per-row path, with the module's own parameters, unless a call
    rule that borrows takes the module):
    ``('rule', rule)`` (a per-layer rule), ``('routed', call rule)`` (a fused MoE expert bank, by its routed tokens:
    :mod:`.rules.experts`; LoRA on one, borrowing its factors: :mod:`.rules.lora_experts`; a router, by its logits:
    :mod:`.rules.routers`), ``('per-row', None)`` (:mod:`.rules.per_row`), or None (unsupported). ``memo``: what the
    recognisers' probes found, the model's plan's (:class:`~.model.ModelPlan`)."""
    fits = per_row.trainable_numel(module) + borrowed <= per_row.MAX_NUMEL
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
    """One hooked module: the rule its plan chose (a tensor rule, a :class:`~.rules.registry.CallRule`, or None for the
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
    (``{module used functionally: the ancestor that borrows it}``, :func:`~.coverage.functional_owners`), and every
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
                  "the per-row path would take") + f" {trainable} ({per_row.trainable_numel(module) + extra:,} " \
            f"elements), more than the per-row path's limit ({per_row.MAX_NUMEL:,})"
        found.append(Unsupported(name, type(module).__name__, lora_experts.why_not(module, name, memo) or reason))
    return covered, found


def coverage_plan(model: nn.Module) -> ModelPlan:
    """The model's plan (:class:`~.model.ModelPlan`, carried on its ``*ForCausalLM``): ``covered``, each trainable
    backbone module with the rule chosen for it, and ``unsupported``, every module none covers. Resolved once per
    model: resolved again only when what it was resolved under changes (the model's state, :func:`~.model.state_key`:
    its modules, forwards, hooks, parameters and trainable set; the per-row limit; the switched-off rules,
    :func:`~.rules.registry.switched_off`; or the registered ones, :func:`~.rules.registry.registered`); the recognisers' probes are
    kept in its ``memo`` while the model's structure stays as it was."""
    view = view_of(model)
    plan = view.plan
    key = (view.key, per_row.MAX_NUMEL, switched_off_now(), registered())
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
    """How each trainable layer of a soft prompt's encoder (:mod:`.rules.soft_prompt`: prompt tuning, P-tuning) is covered;
    raises naming every layer that no rule or path covers (P-tuning's LSTM above the per-row path's limit)."""
    covered, found = [], []
    for name, module in soft_prompt.encoder_modules(prompted):
        chosen = resolve(module, 0, memo)
        if chosen is None:
            trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            found.append(Unsupported(name, type(module).__name__, (
                f"a soft prompt's encoder layer with no rule for its type, and its trainable parameters {trainable} "
                f"({per_row.trainable_numel(module):,} elements) are more than the per-row path's limit "
                f"({per_row.MAX_NUMEL:,})")))
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
    type; the head is :func:`~.head.refusal`'s, which :func:`~.coverage.validate` adds (its probe checks the
    rest by running them)."""
    lm = unwrap_causal_lm(model)
    found = outside_modules(model)
    if not any(p.requires_grad for p in lm.parameters()):
        return found
    return found + coverage_plan(model).unsupported


def pass_plan(view: ModelView) -> tuple[ModelPlan, list[Covered]]:
    """What a pass of the engine runs by (:func:`~.engine.run_pass`'s ``covering``): the model's plan
    (:func:`coverage_plan`), and how a soft prompt's encoder is covered (:func:`prompt_plan`; none without one).
    Refuses, listing every unsupported module at once."""
    plan = coverage_plan(view)
    if plan.unsupported:
        raise UnsupportedModulesError(plan.unsupported)
    prompted = view.prompted
    return plan, [] if prompted is None else prompt_plan(prompted, plan.memo)


# ---------------------------------------------------------------- discovery: the parameters a module uses functionally
def _discover(lm: nn.Module, backbone: nn.Module) -> dict[nn.Module, nn.Module]:
    head = output_head(lm)
    called: set[nn.Module] = set()
    handles = [m.register_forward_pre_hook(lambda m, args: called.add(m)) for m in backbone.modules()]
    ids, attention, _ = probe_batch(lm)
    try:
        with torch.enable_grad():
            hidden = backbone(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    names = {m: n for n, m in backbone.named_modules()}
    silent = [m for m in backbone.modules() if m not in called and m is not head
              and any(p.requires_grad for p in m.parameters(recurse=False))]
    params = [p for m in silent for p in m.parameters(recurse=False) if p.requires_grad]
    if not silent or not hidden.requires_grad:
        return {}
    reached = torch.autograd.grad(hidden.float().sum(), params, allow_unused=True)
    reached_ids = {id(p) for p, g in zip(params, reached) if g is not None}
    owners = {}
    for module in silent:
        if not any(id(p) in reached_ids for p in module.parameters(recurse=False)):
            continue  # not on this forward's path at all (a vision tower without images): nothing to borrow
        name = names[module]
        while name:  # the nearest ancestor that ran
            name = name.rpartition(".")[0]
            ancestor = backbone.get_submodule(name)
            if ancestor in called:
                owners[module] = ancestor
                break
    return owners


def functional_owners(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """``{module: ancestor}`` for every trainable module whose forward never runs while autograd reaches its
    parameters (they are used functionally): the ancestor that takes them on the per-row path. Found once per model
    state (:func:`~.model.state_key`: its modules, their forwards and hooks, its trainable set; a tiny forward and
    backward), then remembered on the model's plan (:class:`~.model.ModelPlan`). Models whose parameters are already
    shards cannot run that forward: they keep what was found before sharding (``validate`` at trainer construction
    finds it; kept on the plan through the change sharding makes to the model's state), or nothing."""
    view = view_of(model)
    lm, names, plan = view.lm, view.trainable, view.plan
    known = plan.owners
    if known is not None and (known[0] == view.key or sharded(lm)):
        return known[1]
    if not names:
        return {}
    if sharded(lm):  # found before sharding (the same modules), where each still sits under its ancestor
        modules = set(lm.modules())
        return {m: a for m, a in (plan.last_owners or {}).items()
                if m in modules and a in modules and any(d is m for d in a.modules())}
    with plain_mode(lm):
        owners = _discover(lm, view.backbone)
    plan.owners = (view.key, owners)
    plan.last_owners = owners
    return owners


# ------------------------------------------------------------------------ the oracle: autograd, one sequence at a time
def completion_logprob_sums(model: nn.Module, input_ids, attention_mask, completion_mask,
                            temperature: float = 1.0) -> torch.Tensor:
    """``sum_t log pi(o_t | q, o_<t)`` per row, from the full logits; the last ``completion_mask.shape[1]`` positions
    of ``input_ids`` are the completion."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    c = completion_mask.shape[1]
    logits = logits[:, -c - 1 : -1].float() / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, -c:, None]).squeeze(-1)
    return (logps * completion_mask).sum(-1)


def per_row_grads(model: nn.Module, input_ids, attention_mask, completion_mask, temperature: float = 1.0,
                  params: list[nn.Parameter] | None = None) -> list[tuple[torch.Tensor | None, ...]]:
    """Per row, the gradient of its ``sum_t log pi`` with respect to ``params`` (default: every trainable parameter),
    each row through the model alone; ``None`` for a parameter the row does not reach."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    out = []
    with torch.enable_grad():
        for i in range(input_ids.shape[0]):
            total = completion_logprob_sums(model, input_ids[i : i + 1], attention_mask[i : i + 1],
                                            completion_mask[i : i + 1], temperature).sum()
            out.append(torch.autograd.grad(total, params, allow_unused=True))
    return out


def per_row_sq_norms(model: nn.Module, input_ids, attention_mask, completion_mask,
                     temperature: float = 1.0) -> torch.Tensor:
    """``||grad sum_t log pi(o_i)||^2`` per row over the trainable parameters, in float64."""
    rows = per_row_grads(model, input_ids, attention_mask, completion_mask, temperature)
    return torch.stack([sum((g.double().pow(2).sum() for g in row if g is not None),
                            torch.zeros((), dtype=torch.float64)) for row in rows])
