"""Fused MoE expert banks (transformers 5's ``*Experts`` modules: ``Qwen3MoeExperts``, ``MixtralExperts``,
``DeepseekV3Experts``, ``Glm4MoeExperts``, ``GptOssExperts``...) by the routed tokens: each expert's per-sequence
gradient from the tokens routed to it, so the cost is proportional to the tokens each expert sees.

A bank holds 3-D weights ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` (``(E, out, in)``, or ``(E, in, out)``
when ``is_transposed``), optional biases ``(E, out)``, and computes, for token ``n`` routed to experts
``idx[n, j]`` with routing weights ``w[n, j]`` (transformers' ``batched_mm_experts_forward`` is the reference):

    y_n = sum_j w[n, j] * down_e(gate(up_e(x_n))),   e = idx[n, j]

with ``up_e(x) = x W_e^T + b_e`` and ``gate`` the module's own ``_apply_gate`` (``act(gate) * up``, GPT-OSS's clamped
SwiGLU) or, without a gate, its ``act_fn``. A bank is taken by this rule only when its forward, run on a probe, equals
that formula (:func:`recognise_bank`); anything else stays on the exact per-row path (:mod:`.generic`).

The engine records the bank's whole call (input ``(N, d)`` with ``N = B * T`` tokens, routing indices and weights)
and its output gradient ``G``. For each pair ``(n, j)`` routed to ``e`` the rule recomputes (one forward of the bank's
matmuls on the routed tokens, in float32): ``u = up_e(x_n)``, ``h = gate(u)``, the gradient reaching ``down_e``'s
output ``g = w[n, j] G_n``, and ``du = J_gate(u)^T (g W_down_e)`` (one vector-Jacobian product of ``gate`` over all
pairs at once). Then expert ``e``'s weights get, per sequence ``b``, ``sum_{t in b, routed to e} g_t (x) h_t``
(down) and ``du_t (x) x_t`` (gate_up): a :class:`~.factors.Factored` gradient over that expert's tokens, padded per
sequence to the most any sequence routes to it, whose inner products take the cheaper of the token Grams and the
materialized per-sequence gradients (:func:`~.factors.block_inner_products`), expert by expert.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from .factors import Dense, Factored, Materialized, block_inner_products, block_weighted_rows
from . import generic


class PerExpert:
    """The per-sample gradient of one 3-D expert-bank parameter ``(E, n_L, n_R)``: for each expert hit, a
    :class:`~.factors.Factored` usage over the tokens routed to it, ``(B, T_e, n_L)`` and ``(B, T_e, n_R)``
    (``T_e``: the most tokens one sequence routes to expert ``e``; padding rows are zero)."""

    def __init__(self, num_experts: int, shape: tuple[int, int], parts: dict[int, Factored]):
        self.num_experts, self.shape, self.parts = num_experts, shape, parts

    def blocked(self, k: int) -> "PerExpert":
        return PerExpert(self.num_experts, self.shape, {e: f.blocked(k) for e, f in self.parts.items()})

    def materialize(self) -> torch.Tensor:
        """``(B, E, n_L, n_R)``, float32."""
        first = next(iter(self.parts.values()), None)
        batch = 0 if first is None else first.left.t.shape[0]
        device = None if first is None else first.left.t.device
        out = torch.zeros(batch, self.num_experts, *self.shape, device=device)
        for e, f in self.parts.items():
            out[:, e] = f.materialize()
        return out

    def block_inner_products(self, other, k: int) -> torch.Tensor:
        """Blocked usages in, ``(B/k, k, k)`` out: the sum over experts hit by both."""
        if not isinstance(other, PerExpert):
            raise TypeError("An expert bank's routed usage pairs only with another; materialize both first.")
        out = None
        for e, f in self.parts.items():
            g = other.parts.get(e)
            if g is None:
                continue
            part = block_inner_products(f, f if other is self else g, k)
            out = part if out is None else out + part
        if out is None:
            first = next(iter(self.parts.values()), None) or next(iter(other.parts.values()))
            nb = first.left.t.shape[0]
            out = torch.zeros(nb, k, k, device=first.left.t.device)
        return out

    def weighted_rows(self, scale: torch.Tensor, k: int, start: int, end: int) -> torch.Tensor:
        """``sum_{i in block} scale_i g_i[start:end]``: experts ``start:end``, ``(B/k, end - start, n_L * n_R)``."""
        nb = scale.shape[0] // k
        out = torch.zeros(nb, end - start, self.shape[0] * self.shape[1], device=scale.device)
        for e, f in self.parts.items():
            if start <= e < end:
                out[:, e - start] = block_weighted_rows(f, scale, k, 0, self.shape[0]).reshape(nb, -1)
        return out


# ----------------------------------------------------------------------------------------------- what a bank computes
def _layout(module: nn.Module) -> dict | None:
    """The bank's parameter names and flags (transformers' ``use_experts_implementation`` attributes), or None."""
    if getattr(module, "has_post_expert_norm", False) or getattr(module, "_is_expert_parallel", False):
        return None
    has_gate = getattr(module, "has_gate", True)
    up = "gate_up_proj" if has_gate else "up_proj"
    has_bias = getattr(module, "has_bias", False)
    names = {up, "down_proj"} | ({f"{up}_bias", "down_proj_bias"} if has_bias else set())
    own = dict(module.named_parameters(recurse=False))
    if set(own) != names or any(p.requires_grad for c in module.children() for p in c.parameters()):
        return None
    up_w, down_w = own[up], own["down_proj"]
    if up_w.dim() != 3 or down_w.dim() != 3 or up_w.shape[0] != down_w.shape[0]:
        return None
    if not has_gate and not hasattr(module, "act_fn"):
        return None
    if has_gate and not (hasattr(module, "_apply_gate") or hasattr(module, "act_fn")):
        return None
    return dict(up=up, has_gate=has_gate, has_bias=has_bias, transposed=bool(getattr(module, "is_transposed", False)),
                num_experts=up_w.shape[0])


def _gate(module: nn.Module, layout: dict, u: torch.Tensor) -> torch.Tensor:
    if not layout["has_gate"]:
        return module.act_fn(u)
    if hasattr(module, "_apply_gate"):
        return module._apply_gate(u)
    gate, up = u.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ weight if transposed else x @ weight.T
    return y if bias is None else y + bias


def _weights(module: nn.Module, layout: dict, e: int, dtype=torch.float32):
    up, t = layout["up"], layout
    up_b = getattr(module, f"{up}_bias")[e].to(dtype) if t["has_bias"] else None
    down_b = module.down_proj_bias[e].to(dtype) if t["has_bias"] else None
    return getattr(module, up)[e].to(dtype), up_b, module.down_proj[e].to(dtype), down_b


def _mirror(module: nn.Module, layout: dict, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The formula this rule differentiates, on ``(N, d)`` tokens, float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            up_w, up_b, down_w, down_b = _weights(module, layout, e)
            h = _gate(module, layout, _linear(x[n : n + 1].float(), up_w, up_b, layout["transposed"]))
            out[n] += w[n, j].float() * _linear(h, down_w, down_b, layout["transposed"])[0]
    return out


def _call_arguments(module: nn.Module, args, kwargs):
    """``(hidden_states, top_k_index, top_k_weights)`` of a call, whatever the keyword names."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return None
    values = list(bound.arguments.values())
    if len(values) != 3 or not all(torch.is_tensor(v) for v in values):
        return None
    return values


def _probe_matches(module: nn.Module, layout: dict) -> bool:
    up_w = getattr(module, layout["up"])
    d = up_w.shape[1] if layout["transposed"] else up_w.shape[2]
    e = layout["num_experts"]
    g = torch.Generator().manual_seed(0)
    n, k = 5, min(2, e)
    x = torch.randn(n, d, generator=g).to(up_w.device, up_w.dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(up_w.device)
    w = torch.rand(n, k, generator=g).to(up_w.device, up_w.dtype)
    with torch.no_grad(), generic._replay():  # the capture hooks, if any, record nothing
        y = module(x, idx, w)
        expected = _mirror(module, layout, x, idx, w)
    if not torch.is_tensor(y) or y.shape != expected.shape or float(expected.abs().max()) == 0:
        return False  # a degenerate probe (all-zero weights) proves nothing
    tol = 1e-4 if up_w.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(y.float(), expected, rtol=tol, atol=tol * float(expected.abs().max())))


_RECOGNISED: "weakref.WeakKeyDictionary[nn.Module, dict | None]" = weakref.WeakKeyDictionary()


def recognise_bank(module: nn.Module) -> dict | None:
    """The bank's layout if this module is a fused expert bank whose forward verifiably computes the formula above
    (checked once per module on a probe of 5 tokens with its own weights), else None."""
    if module not in _RECOGNISED:
        layout = None
        try:
            candidate = _layout(module)
            if candidate is not None and _probe_matches(module, candidate):
                layout = candidate
        except Exception:  # a forward that will not run on the probe (another signature, sharded weights): not ours
            layout = None
        _RECOGNISED[module] = layout
    return _RECOGNISED[module]


# ----------------------------------------------------------------------------------------------------------- the rule
class _Padding:
    """Where each routed pair goes when the pairs (sorted by expert, then sequence) are laid out per expert as
    ``(B, T_e, n)``, zero-padded per sequence (``T_e``: the most tokens one sequence routes to expert ``e``); all
    experts' blocks in one flat buffer, so each factor takes one scatter."""

    def __init__(self, expert: torch.Tensor, seq: torch.Tensor, batch: int, num_experts: int):
        key = expert * batch + seq
        counts = torch.bincount(key, minlength=num_experts * batch)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(key.numel(), device=key.device) - starts[key]
        widths = counts.reshape(num_experts, batch).amax(1)
        offsets = torch.cumsum(widths * batch, 0) - widths * batch  # first row of expert e's block
        self.row = offsets[expert] + seq * widths[expert] + pos
        self.rows = int((widths * batch).sum())
        self.blocks = [(e, int(o), int(w)) for e, (o, w) in enumerate(zip(offsets.tolist(), widths.tolist())) if w]
        self.batch = batch

    def __call__(self, values: torch.Tensor) -> dict[int, torch.Tensor]:
        flat = values.new_zeros(self.rows, values.shape[-1])
        flat[self.row] = values
        return {e: flat[o : o + self.batch * w].view(self.batch, w, -1) for e, o, w in self.blocks}


def bank_usages(module: nn.Module, call: generic.Call, output_grads: list, batch: int) -> dict:
    """``{name: usage}`` of a recognised expert bank from its recorded call and output gradient."""
    layout = recognise_bank(module)
    arguments = _call_arguments(module, call.args, call.kwargs)
    if layout is None or arguments is None or len(output_grads) != 1:
        return generic.per_row_usages(module, call, output_grads, batch)
    if output_grads[0] is None:
        return {}
    x, idx, w = arguments
    d = x.shape[-1]
    x, grad = x.reshape(-1, d), output_grads[0].reshape(-1, d)
    tokens = x.shape[0]
    if tokens % batch or grad.shape[0] != tokens or idx.reshape(tokens, -1).shape != w.reshape(tokens, -1).shape:
        raise NotImplementedError(
            f"{type(module).__name__}'s input has {tokens} token rows, not a multiple of the batch ({batch}) matching "
            "its output gradient and routing: its rows cannot be paired with the sequences. Freeze its parameters "
            "(module.requires_grad_(False)) or use OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
        )
    idx, w = idx.reshape(tokens, -1), w.reshape(tokens, -1)
    k, num_experts, transposed = idx.shape[1], layout["num_experts"], layout["transposed"]
    token = torch.arange(tokens, device=x.device).repeat_interleave(k)
    expert, weight = idx.reshape(-1), w.reshape(-1)
    keep = (expert >= 0) & (expert < num_experts)  # expert-parallel sentinels (num_experts) carry nothing
    token, expert, weight = token[keep], expert[keep], weight[keep]
    seq = token // (tokens // batch)
    order = torch.argsort(expert * batch + seq, stable=True)  # by expert, then sequence
    token, expert, weight, seq = token[order], expert[order], weight[order], seq[order]
    counts = torch.bincount(expert, minlength=num_experts).tolist()
    up, up_bias = layout["up"], f"{layout['up']}_bias"
    wanted = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    with torch.autocast(device_type=x.device.type, enabled=False), torch.no_grad():
        xs = x[token].float()
        gs = grad[token].float() * weight.float()[:, None]  # the gradient reaching down_e's output
        us, dhs, start = [], [], 0
        segments = {}
        for e, count in enumerate(counts):
            if not count:
                continue
            segments[e] = (start, start + count)
            up_w, up_b, down_w, _ = _weights(module, layout, e)
            us.append(_linear(xs[start : start + count], up_w, up_b, transposed))
            dhs.append(gs[start : start + count] @ (down_w.T if transposed else down_w))
            start += count
        if not segments:
            return {}
        with torch.enable_grad():
            u = torch.cat(us).requires_grad_(True)
            h = _gate(module, layout, u)
            (du,) = torch.autograd.grad(h, u, torch.cat(dhs))
        h = h.detach()
        usages: dict = {}
        down_parts, up_parts = {}, {}
        up_shape, down_shape = tuple(getattr(module, up).shape[1:]), tuple(module.down_proj.shape[1:])
        bias_sums = {up_bias: torch.zeros(batch, num_experts, du.shape[-1], device=x.device),
                     "down_proj_bias": torch.zeros(batch, num_experts, d, device=x.device)} if layout["has_bias"] else {}
        padding = _Padding(expert, seq, batch, num_experts)
        padded = {name: padding(v) for name, v in (("x", xs), ("g", gs), ("h", h), ("du", du))}
        for e in segments:
            px, pg, ph, pdu = (padded[name][e] for name in ("x", "g", "h", "du"))
            if "down_proj" in wanted:
                down_parts[e] = Factored(Dense(ph), Dense(pg)) if transposed else Factored(Dense(pg), Dense(ph))
            if up in wanted:
                up_parts[e] = Factored(Dense(px), Dense(pdu)) if transposed else Factored(Dense(pdu), Dense(px))
            if layout["has_bias"]:
                bias_sums[up_bias][:, e] = pdu.sum(1)
                bias_sums["down_proj_bias"][:, e] = pg.sum(1)
        if "down_proj" in wanted:
            usages["down_proj"] = PerExpert(num_experts, down_shape, down_parts)
        if up in wanted:
            usages[up] = PerExpert(num_experts, up_shape, up_parts)
        for name, sums in bias_sums.items():
            if name in wanted:
                usages[name] = Materialized(sums)
    return usages


def call_usages(module: nn.Module, call: generic.Call, output_grads: list, batch: int) -> dict:
    """The usages of a module whose whole call was recorded: an expert bank by its routed tokens, anything else by
    the per-row path."""
    if recognise_bank(module) is not None:
        return bank_usages(module, call, output_grads, batch)
    return generic.per_row_usages(module, call, output_grads, batch)
