"""MoE routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``,
``GptOssTopKRouter``...) by their logits: a router computes ``z_t = x_t W^T (+ b)`` and then a function of each
token's logits alone (softmax, top-k, renormalisation, group-limited choice, scaling), so a sequence's gradient is
``sum_t dz_t (x) x_t`` (``db = sum_t dz_t``): a :class:`~..factors.Factored` usage with ghost norms, like a linear
layer's, instead of one re-run of the router per sequence.

``dz`` comes from one re-run of the router on the recorded call, with ``F.linear`` intercepted (a
``TorchFunctionMode``) where it takes the router's weight: its output is replaced by a leaf, and one vector-Jacobian
product with the recorded output gradients gives ``dz`` for every token at once. A router is taken only when its own
forward, on a probe, uses its weight (and bias) in exactly that one ``F.linear`` and nowhere else, and treats tokens
independently (a prefix of the probe's tokens gives the same first rows); anything else stays on the per-row path.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import hooks
from . import per_row
from .recognition import remembered
from .registry import register_call_rule
from ..factors import Dense, Factored, Materialized


class _LinearTap(TorchFunctionMode):
    """Replaces the output of ``F.linear(input, weight, bias)`` by a leaf wherever ``weight`` is the router's, and
    counts every other use of the weight or the bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.inputs, self.logits, self.other_uses = [], [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = hooks._tensors((args, kwargs))
        uses = any(t is self.weight or (self.bias is not None and t is self.bias) for t in flat)
        if func is nn.functional.linear and uses:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if w is not self.weight or (b is not None and b is not self.bias) or (b is None) != (self.bias is None):
                self.other_uses += 1
                return func(*args, **kwargs)
            with torch.no_grad():
                z = func(*args, **kwargs)
            z = z.detach().requires_grad_(True)
            self.inputs.append(x.detach())
            self.logits.append(z)
            return z
        if uses and getattr(func, "__name__", "") not in ("__get__", "dim", "size", "shape", "dtype", "device",
                                                          "requires_grad"):
            if func is torch.Tensor.type and args and args[0] is self.weight and len(args) > 1 \
                    and args[1] in (self.weight.dtype, str(self.weight.dtype)):
                return func(*args, **kwargs)  # a cast to its own dtype returns the weight itself
            self.other_uses += 1
        return func(*args, **kwargs)


def _run_tapped(module: nn.Module, args, kwargs):
    weight, bias = module.weight, getattr(module, "bias", None)
    tap = _LinearTap(weight, bias if isinstance(bias, torch.Tensor) else None)
    with tap, hooks.replay():
        out = module(*args, **kwargs)
    return tap, out


def _shape_ok(module: nn.Module) -> bool:
    own = dict(module.named_parameters(recurse=False))
    weight = own.get("weight")
    if weight is None or weight.dim() != 2 or set(own) - {"weight", "bias"}:
        return False
    bias = own.get("bias")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        return False
    return not any(p.requires_grad for c in module.children() for p in c.parameters())


def _probe(module: nn.Module) -> bool:
    weight = module.weight
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, weight.shape[1], generator=g).to(weight.device, weight.dtype)
    with torch.enable_grad():
        tap, out = _run_tapped(module, (x,), {})
        halves = [(rows, module(x[rows])) for rows in (slice(0, 3), slice(3, 6))]
    if len(tap.logits) != 1 or tap.other_uses or tap.logits[0].shape[0] != 6:
        return False
    outs = hooks._tensors(out)
    if not outs:
        return False
    for rows, half in halves:  # tokens independent: each half of the probe alone gives the same rows
        parts = hooks._tensors(half)
        if len(parts) != len(outs):
            return False
        for o, p in zip(outs, parts):
            if o.dim() == 0 or o.shape[0] != 6 or p.shape[0] != 3:
                return False
            if o.is_floating_point():
                if not torch.allclose(o[rows].detach().float(), p.detach().float(), rtol=1e-4, atol=1e-6):
                    return False
            elif not torch.equal(o[rows], p):
                return False
    return any(o.requires_grad for o in outs)  # something carries the logits' gradient


def recognise_router(module: nn.Module, memo: dict | None = None) -> bool:
    """Whether ``module`` is a router this rule takes (checked on a probe of 6 tokens, once per model with ``memo``,
    its plan's)."""
    def find() -> bool:
        try:
            return _shape_ok(module) and _probe(module)
        except Exception:  # a forward that will not run on the probe: not ours
            return False

    return remembered(memo, ("router", module), find)


@register_call_rule("router", recognise_router)
def router_usages(module: nn.Module, call: hooks.Call, output_grads: list, batch: int, handoff=None) -> dict:
    """``{"weight": Factored(dz, x), "bias": Materialized(sum_t dz_t)}`` from the recorded call and output gradients
    (``handoff``, the pass's: unused, a router keeps nothing from the forward)."""
    with torch.enable_grad(), torch.autocast(device_type=call.outputs[0].device.type, enabled=False):
        tap, out = _run_tapped(module, call.args, call.kwargs)
        outs = hooks.output_tensors(out)
        if len(tap.logits) != 1 or tap.other_uses or len(outs) != len(output_grads):
            return per_row.per_row_usages(module, call, output_grads, batch)
        pairs = [(o, g) for o, g in zip(outs, output_grads) if g is not None]
        if not pairs:
            return {}
        (dz,) = torch.autograd.grad([o for o, _ in pairs], tap.logits, [g.to(o.dtype) for o, g in pairs],
                                    allow_unused=True)
    x = tap.inputs[0]
    tokens = x.reshape(-1, x.shape[-1]).shape[0]
    if dz is None:
        dz = torch.zeros(tokens, module.weight.shape[0], device=x.device)
    if tokens % batch:
        raise NotImplementedError(
            f"{type(module).__name__}'s input has {tokens} token rows, not a multiple of the batch ({batch}): its rows "
            "cannot be paired with the sequences. Freeze its parameters (module.requires_grad_(False)) or use "
            "OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
        )
    dz = dz.detach().float().reshape(batch, tokens // batch, -1)
    x = x.float().reshape(batch, tokens // batch, -1)
    usages = {}
    if module.weight.requires_grad:
        usages["weight"] = Factored(Dense(dz), Dense(x))
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.requires_grad:
        usages["bias"] = Materialized(dz.sum(1))
    return usages
