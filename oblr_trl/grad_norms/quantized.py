"""Quantized bases (bitsandbytes 4-bit and 8-bit, others by duck typing) as the coverage probe and the engine need
them: a backward that is the derivative of the forward, and a float32 forward to check it in.

**bitsandbytes' CPU inference path has no backward.** On a CPU with AVX512-BF16, the first time a ``Linear4bit`` runs
in eval mode on an input that does not require grad (a ``torch.no_grad`` generation, an evaluation, a discovery
forward), bitsandbytes repacks its weight for a faster kernel (``quant_state.packing_format_for_cpu``) and from then
on computes every forward with ``gemv_4bit``, an operator with no autograd formula. Its output is right; the gradient
through it to the layer's input is not (PyTorch warns "an autograd kernel was not registered ... silently incorrect").
Every LoRA gradient upstream of the layer is then wrong, autograd's own included: on a 2-layer Llama under QLoRA the
squared norms came out 2-6x too small, and GRPOTrainer would train on the same wrong gradient.
:func:`keep_differentiable` switches that repacking off on every such layer and undoes it where it has happened
(bitsandbytes' own inverse), so the forward and its backward agree again; :func:`~.coverage.validate` calls it, so
``OBLRPOTrainer``'s construction and the first norm pass do.

**Any operator without a backward** (a quantization library's inference kernel, a custom op registered without an
autograd formula) makes PyTorch fall back to "no gradient through it", with only a warning. :func:`backward_gaps`
collects those warnings around a backward; the coverage probe refuses a model whose backward passes through one,
naming the operator, since autograd's gradient, the probe's own reference, is wrong there too.
"""

from __future__ import annotations

import logging
import re
import warnings
from contextlib import contextmanager

import torch
from torch import nn

logger = logging.getLogger(__name__)


def quantized(lm: nn.Module) -> bool:
    """Whether any parameter of ``lm`` is stored in a non-floating type (4-bit or 8-bit packed weights)."""
    return any(not p.is_floating_point() for p in lm.parameters())


def _packed_for_cpu(module: nn.Module) -> bool:
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def keep_differentiable(lm: nn.Module) -> list[str]:
    """Switch off bitsandbytes' CPU repacking of 4-bit weights (see the module docstring) on every layer of ``lm``
    that has it, and undo it on those already repacked. Returns the names of the layers undone (each was computing a
    wrong backward until now), after logging them once as a warning. Nothing changes on a GPU or without
    bitsandbytes: the flag exists only on bitsandbytes' layers, and the repacking happens only on the CPU."""
    undone = []
    for name, module in lm.named_modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        if _packed_for_cpu(module):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight = module.weight
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
            undone.append(name)
    if undone:
        logger.warning(
            "%d bitsandbytes 4-bit layer(s) (%s%s) had been repacked for bitsandbytes' CPU inference kernel, which has "
            "no backward: gradients through them were wrong, autograd's too. Repacking is now switched off on this "
            "model and the weights are back in their trainable layout.", len(undone), ", ".join(undone[:3]),
            ", ..." if len(undone) > 3 else "")
    return undone


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
    return isinstance(weight, torch.Tensor) and not weight.is_floating_point()


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
