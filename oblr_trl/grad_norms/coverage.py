"""The coverage ledger: which trainable parameters the per-sequence gradients account for, and a probe that proves it.

Hooks see a parameter only through its own module's forward. A model can reach a weight other ways: a mixer passes
``self.conv1d.weight`` to a functional causal convolution (Mamba-2, NemotronH, Bamba, Zamba2, Granite-4.0-H, the
gated delta-net), a parent's forward uses a child's weight, one weight is shared by two modules. Two mechanisms make
"a share silently left out" impossible, whatever the path:

1. **Discovery** (:func:`functional_owners`): one tiny forward records which modules run. A trainable module that
   never runs, but whose parameters autograd reaches from the hidden states, is used functionally by an ancestor:
   its parameters are *borrowed* by the nearest ancestor that runs, which takes them on the exact per-row path
   (:mod:`.generic`: that ancestor's call re-run per sequence, one vector-Jacobian product each), and the borrowed
   module gets no hooks of its own. Cost: one forward and one backward of a 2 x 8-token batch, once per model state
   (:func:`~.plan.state_key`); then, in every pass, the per-row path's cost for each borrowing ancestor.
2. **The probe** (:func:`probe`, run by :func:`validate`, so at ``OBLRPOTrainer`` construction, and by the engine
   once per model state, :func:`~.plan.state_key`): on a 2-sequence batch (one left-padded, one ending early), each
   sequence's gradient as the engine forms it must equal autograd's gradient of that sequence's log-probability run
   alone, within the promise: relative error <= 1e-4 per parameter (plus a floor of 1e-7 of the whole gradient,
   for parameters whose gradient is nearly 0) and over all parameters together. It runs in float32 (a bf16/fp16
   model is upcast while it runs, since bf16 logits are too coarse a reference; a quantized base keeps its packed
   weights and computes in float32, :mod:`.quantized`; only a model whose forward cannot run so is judged as it
   computes, at 0.2, with a warning); a parameter that misses in float32 is looked at again with the whole model in
   float64, where the model's own rounding is gone (the engine's float32 products leave about 1e-7), and only a miss
   there is refused. A parameter where it does not hold (a share no hook sees, rows paired with the wrong sequence, a
   head transform the engine does not compute), or a pass that fails, is refused by name before training. Before it,
   the head is checked by observation (:mod:`.head_transform`).
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

import torch
from torch import nn

from .engine import per_sequence_grads
from . import head_adapters, head_transform
from .ledger import float32_mode, functional_owners, plain_mode, probe_batch, sharded, trainable_names  # noqa: F401
from . import oracle
from .lm import output_head, unwrap_causal_lm, unwrap_distributed
from .quantized import LOST_SCALES, backward_gaps, lost_scales, quantized, restore, warn_undone
from .plan import ModelView, plan_of, view_of
from .support import ADVICE, Unsupported, UnsupportedModulesError, unsupported_modules

logger = logging.getLogger(__name__)

RTOL = 1e-4  # the promise, per parameter and in total (a half-precision model is upcast, see ledger.float32_mode)
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


def probe(model: nn.Module) -> list[Unsupported]:
    """Every trainable parameter whose per-sequence gradients, summed over a small batch, differ from autograd's
    gradient of that batch (see the module docstring), as :class:`~.support.Unsupported` entries by module; a pass
    that fails, or a model whose own backward is not its forward's derivative, is one entry naming the model. Empty
    when every parameter is accounted for. Leaves ``.grad`` and the train/eval mode as they were."""
    lm = unwrap_causal_lm(model)
    params, shown, modules = trained_parameters(model)
    if not params or sharded(lm):
        return []
    saved = {n: p.grad for n, p in params.items()}
    plan = plan_of(lm)
    plan.probing = True  # its own engine pass is not probed again
    try:
        for p in params.values():
            p.grad = None
        with plain_mode(lm):
            with float32_mode(lm) as upcast:
                found = _probe(model, lm, params, shown, modules, RTOL if upcast else NATIVE_HALF_RTOL)
            if found and not upcast or _pass_failed(found) and quantized(lm):
                logger.warning("%s cannot be checked in float32 (%s): checked as it computes, within %g.",
                               type(lm).__name__, found[0].reason, NATIVE_HALF_RTOL)
                found = _probe(model, lm, params, shown, modules, NATIVE_HALF_RTOL)
            elif found and upcast and all(f.name for f in found):  # float32 rounding, or a real miss: float64 says
                with float32_mode(lm, torch.float64) as wide_ok:
                    wide = _probe(model, lm, params, shown, modules, RTOL) if wide_ok else found
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


def _probe(model: nn.Module, lm: nn.Module, params: dict[str, nn.Parameter], shown: dict[str, str],
           modules: dict[str, nn.Module], rtol: float) -> list[Unsupported]:
    params, shown, modules = trained_parameters(model)  # as the model is now: float32_mode's copies, where swapped
    ids, attention, completion_mask = probe_batch(lm)
    outer = unwrap_distributed(model)

    def take() -> dict[str, torch.Tensor | None]:
        found = {n: p.grad for n, p in params.items()}
        for p in params.values():
            p.grad = None
        return found

    found = {n: (0.0, 0.0, 0.0) for n in params}
    try:
        grads = per_sequence_grads(model, ids, attention, completion_mask)
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
                (reference,) = oracle.per_row_grads(outer, *row, params=list(params.values()))
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
    """:func:`validate` with the probe, once per model state (:func:`~.plan.state_key`: its modules, their classes,
    forwards and hooks, its parameters and their dtypes, the config's caps and scales, the trainable parameters of
    the whole model handed in; the engine calls this at every pass, and the key is built again each time; the
    trainer's construction has usually done the check already). Refuses a call under ``no_grad`` or
    ``inference_mode``. Raises naming every uncovered module. What passed is remembered on the model's plan
    (:class:`~.plan.ModelPlan`). Returns the model resolved (:func:`~.plan.view_of`), for the pass that follows."""
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
    with ``strict=True`` raises :class:`~.support.UnsupportedModulesError` listing all of them at once, with advice
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
        raise UnsupportedModulesError(found, advice=LOST_SCALES_ADVICE if lost else ADVICE)
    return found


def _checked(model: nn.Module, run_probe: bool) -> list[Unsupported]:
    """:func:`validate`'s checks on a model in its trainable layout: by module type, the head, then the probe."""
    try:
        found = unsupported_modules(model)
        lm = unwrap_causal_lm(model)
        if any(p.requires_grad for p in lm.parameters()):  # the head: an nn.Linear, or one under an adapter it forms
            found = head_adapters.refusal(output_head(lm)) + found
        found = found or head_transform.check(model)
    except UnsupportedModulesError:
        raise
    except Exception as error:  # discovery's forward fails: refused, naming the model, never a bare error later
        found = [Unsupported("", type(unwrap_causal_lm(model)).__name__,
                             f"a forward of its backbone fails: {type(error).__name__}: {error}")]
    if not found and run_probe:
        found = probe(model)
        if not found:
            view = view_of(model)
            view.plan.probed, view.plan.ever_probed = view.key, True
    return found
