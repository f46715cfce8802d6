"""Quantized bases (bitsandbytes 4-bit and 8-bit, others by duck typing) as the coverage probe and the engine need
them: a backward that is the derivative of the forward, and a float32 forward to check it in.

**bitsandbytes' CPU inference path has no backward.** On a CPU with AVX512-BF16, the first time a ``Linear4bit`` runs
in eval mode on an input that does not require grad (a ``torch.no_grad`` generation, an evaluation, a discovery
forward), bitsandbytes repacks its weight for a faster kernel (``quant_state.packing_format_for_cpu``) and from then
on computes every forward with ``gemv_4bit``, an operator with no autograd formula. Its output is right; the gradient
through it to the layer's input is not (PyTorch warns "an autograd kernel was not registered ... silently incorrect").
Every LoRA gradient upstream of the layer is then wrong, autograd's own included: on a 2-layer Llama under QLoRA the
squared norms came out 2-6x too small, and GRPOTrainer would train on the same wrong gradient.
:func:`keep_differentiable` switches that repacking off on every such layer and undoes it where it has happened, so
the forward and its backward agree again; :func:`~.coverage.validate` calls it, so ``OBLRPOTrainer``'s construction
and the first norm pass do.

**Undone exactly, or refused.** The repacking is lossy in bitsandbytes' own terms: it rounds the block scales
(``absmax``, float32) to bf16, dequantizes double-quantized scales first, and its inverse
(``_convert_weight_packed_for_cpu_inverse``) leaves single-quantized scales in the repacked, transposed order and
re-quantizes double-quantized ones from their bf16 rounding: against a fresh load of the same model, dequantized
weights then moved by about 23% (logits 5% at hidden 64, 41% at hidden 256), or, with double quantization, 0.1%. So
from the moment this module is imported it records, on each layer's quantization state, the fields bitsandbytes is
about to replace when it repacks (references to the same tensors: the float32 scales, or the 8-bit scales and their
own state; no copy of the 4-bit weight, whose repacking is a permutation that bitsandbytes inverts exactly), and the
undoing puts them back: the layer is then bit for bit what it was when loaded. A layer repacked before this module
was imported (a ``generate()`` before ``import oblr_trl``) has lost its scales for good: it is refused by name
(:func:`lost_scales`), and nothing of the model is changed. Cost of the record: the float32 scales (an eighth of the
4-bit weight's bytes) stay alive while a layer is repacked for inference.

**A floating storage type is still packed.** FSDP-QLoRA stores the 4-bit codes in a bf16 tensor
(``bnb_4bit_quant_storage=torch.bfloat16``): :func:`packed` recognises bitsandbytes' parameters by their quantization
state, not by their dtype, so nothing ever casts those bytes (a float32 cast rewrites NaN bit patterns, and with them
some 4-bit codes).

**Any operator without a backward** (a quantization library's inference kernel, a custom op registered without an
autograd formula) makes PyTorch fall back to "no gradient through it", with only a warning. :func:`backward_gaps`
collects those warnings around a backward; the coverage probe refuses a model whose backward passes through one,
naming the operator, since autograd's gradient, the probe's own reference, is wrong there too.
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)


KEPT = "oblr_before_cpu_repacking"  # the attribute of a QuantState holding its fields from before the repacking
LOST_SCALES = (
    "bitsandbytes repacked its 4-bit weight for its CPU inference kernel (an eval-mode forward without gradients: a "
    "generate(), an evaluation) before oblr_trl was imported, which rounded its block scales to bf16; bitsandbytes' "
    "inverse cannot restore them, so no trainable layout reproduces the weights as loaded (they would move by up to "
    "23%). Reload the model, and generate after constructing the trainer (it switches that repacking off), or import "
    "oblr_trl before the first generation (it then keeps the exact scales and restores them)")


def packed(t: torch.Tensor) -> bool:
    """Whether ``t`` holds quantized codes, not values: a non-floating dtype (4-bit and 8-bit packed bytes), or
    bitsandbytes' ``Params4bit`` in any storage dtype (FSDP-QLoRA's ``bnb_4bit_quant_storage=torch.bfloat16``),
    recognised by its quantization state. Nothing may cast such a tensor."""
    return not t.is_floating_point() or getattr(t, "quant_state", None) is not None


def quantized(lm: nn.Module) -> bool:
    """Whether any parameter of ``lm`` holds quantized codes (:func:`packed`)."""
    return any(packed(p) for p in lm.parameters())


def _packed_for_cpu(module: nn.Module) -> bool:
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def _repackable(lm: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in lm.named_modules() if hasattr(m, "support_avx512bf16_for_cpu")]


def lost_scales(lm: nn.Module) -> list[str]:
    """The bitsandbytes layers of ``lm`` repacked for the CPU inference kernel with no record of their scales from
    before (repacked before this module was imported): none can be undone exactly (:data:`LOST_SCALES`)."""
    return [name for name, m in _repackable(lm) if _packed_for_cpu(m) and not hasattr(m.weight.quant_state, KEPT)]


@dataclass
class Restored:
    """What :func:`restore` changed: the layers undone (by name) and every layer's repacking switch as it was, so
    that :meth:`revert` leaves the model bit for bit as before (a refusal changes nothing)."""
    undone: list[str] = field(default_factory=list)
    switches: list[tuple[nn.Module, bool]] = field(default_factory=list)
    layers: list[nn.Module] = field(default_factory=list)

    def revert(self) -> None:
        """Repack the undone layers again (bitsandbytes' own conversion: from the exact fields it gives the same
        bytes and scales as the first time) and put every switch back."""
        import bitsandbytes.nn.modules as bnb_modules

        for module in self.layers:
            weight = module.weight
            weight.data, weight.quant_state = bnb_modules._convert_weight_packed_for_cpu(weight.data,
                                                                                          weight.quant_state)
        for module, switch in self.switches:
            module.support_avx512bf16_for_cpu = switch


def _unpack(module: nn.Module) -> None:
    """bitsandbytes' inverse for the weight's bytes (an exact permutation), then the quantization state's fields as
    recorded before the repacking (bitsandbytes' inverse leaves the scales rounded and, single-quantized, in the
    repacked order); the attributes the repacking added are gone, as on a freshly loaded layer."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    weight, state = module.weight, module.weight.quant_state
    kept = getattr(state, KEPT)
    weight.data, state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    state.__dict__.clear()
    state.__dict__.update(kept)
    weight.quant_state = state


def restore(lm: nn.Module) -> Restored:
    """Switch bitsandbytes' CPU repacking off on every layer of ``lm`` and undo it exactly where it has happened
    (:func:`_unpack`). The caller has checked :func:`lost_scales` is empty."""
    layers = _repackable(lm)
    done = Restored(switches=[(m, m.support_avx512bf16_for_cpu) for _, m in layers])
    for name, module in layers:
        module.support_avx512bf16_for_cpu = False
        if _packed_for_cpu(module):
            _unpack(module)
            done.undone.append(name)
            done.layers.append(module)
    return done


def keep_differentiable(lm: nn.Module) -> list[str]:
    """Switch off bitsandbytes' CPU repacking of 4-bit weights (see the module docstring) on every layer of ``lm``
    that has it, and undo it exactly on those already repacked. Returns the names of the layers undone (each was
    computing a wrong backward until now), after logging them once as a warning. Raises ``ValueError`` naming the
    layers, and changes nothing, where a layer's scales were lost (:func:`lost_scales`). Nothing changes on a GPU or
    without bitsandbytes: the switch exists only on bitsandbytes' layers, and the repacking happens only on the CPU."""
    lost = lost_scales(lm)
    if lost:
        raise ValueError(f"{len(lost)} bitsandbytes 4-bit layer(s) ({_names(lost)}): {LOST_SCALES}.")
    undone = restore(lm).undone
    warn_undone(undone)
    return undone


def warn_undone(undone: list[str]) -> None:
    """The warning that layers were undone (:func:`restore`), once, naming them; nothing where none was."""
    if undone:
        logger.warning(
            "%d bitsandbytes 4-bit layer(s) (%s) had been repacked for bitsandbytes' CPU inference kernel, which has "
            "no backward: gradients through them were wrong, autograd's too. Repacking is now switched off on this "
            "model and the weights are back, exactly, in the layout they were loaded in.", len(undone),
            _names(undone))


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _recording(convert):
    """bitsandbytes' repacking, recording first the quantization state's fields it is about to replace."""
    @functools.wraps(convert)
    def repack(qweight, quant_state, *args, **kwargs):
        kept = dict(vars(quant_state))
        kept.pop(KEPT, None)
        out = convert(qweight, quant_state, *args, **kwargs)
        setattr(out[1], KEPT, kept)
        return out

    repack.records = True
    return repack


def _record_repacking() -> None:
    """Wrap the repacking bitsandbytes' ``Linear4bit.forward`` calls (a module global it looks up at each call) so
    that it records (:func:`_recording`); once, where bitsandbytes imports."""
    try:
        import bitsandbytes.nn.modules as bnb_modules
    except Exception:  # not installed, or no backend here: nothing repacks
        return
    convert = getattr(bnb_modules, "_convert_weight_packed_for_cpu", None)
    if convert is not None and not getattr(convert, "records", False):
        bnb_modules._convert_weight_packed_for_cpu = _recording(convert)


@contextmanager
def compute_dtype(lm: nn.Module, dtype: torch.dtype):
    """Quantized layers that carry their own compute dtype (bitsandbytes' ``Linear4bit.compute_dtype``: the dtype
    its weight is dequantized to and its product runs in) compute in ``dtype`` while inside; put back after."""
    saved = [(m, m.compute_dtype) for m in lm.modules()
             if isinstance(getattr(m, "compute_dtype", None), torch.dtype) and _quantized_layer(m)]
    try:
        for module, _ in saved:
            module.compute_dtype = dtype
        yield
    finally:
        for module, old in saved:
            module.compute_dtype = old


def _quantized_layer(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and packed(weight)


_NO_BACKWARD = re.compile(r"^(\S+): an autograd kernel was not registered")


@contextmanager
def backward_gaps():
    """Collects, into the list it yields, the operators PyTorch backpropagated through without a backward formula
    (its autograd fallback's warning "an autograd kernel was not registered ... silently incorrect"), each once, by
    name (``bitsandbytes::gemv_4bit``). Other warnings pass through as usual."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    for warning in caught:
        match = _NO_BACKWARD.match(str(warning.message))
        if match:
            if match.group(1) not in found:
                found.append(match.group(1))
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


_record_repacking()
