"""A model's state, bit for bit, as one comparable value: what "a refusal leaves the model unchanged" and "the repair
gives back the model as loaded" are checked against (``tests/grad_norms/test_quantized.py``,
``tests/test_construction_unchanged.py``, the PEFT sweep ``benchmarks/studies/peft_sweep.py``). Test apparatus: not
installed with the package; the tests and ``python benchmarks/peft_sweep.py`` find it on their import path."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def fingerprint(model: nn.Module) -> dict[str, object]:
    """By name: every parameter's and buffer's type, dtype, shape and a digest of its bytes (a tensor subclass's inner
    tensors, as it flattens itself: torchao's, quanto's quantized weights), every field of each packed weight's
    quantization state (bitsandbytes' ``QuantState``, its nested state and what was recorded before a CPU repacking
    included), and each bitsandbytes layer's repacking switch. Two models with equal fingerprints are the same bit
    for bit."""
    out: dict[str, object] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        _tensor(out, name, tensor)
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            _fields(out, f"{name}.quant_state", vars(state))
    for name, module in model.named_modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            out[f"{name}.support_avx512bf16_for_cpu"] = module.support_avx512bf16_for_cpu
    return out


def differences(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The names whose entries differ between two fingerprints (or are in one only), sorted."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k, "absent") != after.get(k, "absent"))


def _tensor(out: dict[str, object], name: str, tensor: torch.Tensor) -> None:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, nn.Parameter):
        inner, context = flatten()
        out[name] = (type(tensor).__name__, str(tensor.dtype), tuple(tensor.shape), repr(context))
        for part in inner:
            _tensor(out, f"{name}.{part}", getattr(tensor, part))
        return
    data = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest() if data.numel() else ""
    out[name] = (type(tensor).__name__, str(tensor.dtype), tuple(tensor.shape), digest)


def _fields(out: dict[str, object], name: str, fields: dict) -> None:
    for key, value in sorted(fields.items()):
        if isinstance(value, torch.Tensor):
            _tensor(out, f"{name}.{key}", value)
        elif isinstance(value, dict):
            _fields(out, f"{name}.{key}", value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):  # a nested quantization state
            _fields(out, f"{name}.{key}", vars(value))
        else:
            out[f"{name}.{key}"] = repr(value)
