"""Fused MoE expert banks (transformers 5's ``*Experts`` modules: ``Qwen3MoeExperts``, ``MixtralExperts``,
``DeepseekV3Experts``, ``Glm4MoeExperts``, ``GptOssExperts``...) by the routed tokens: each expert's per-sequence
gradient from the tokens routed to it, so the cost is proportional to the tokens each expert sees.

A bank holds 3-D weights ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` (``(E, out, in)``, or ``(E, in, out)``
when ``is_transposed``), optional biases ``(E, out)``, and computes, for token ``n`` routed to experts
``idx[n, j]`` with routing weights ``w[n, j]`` (transformers' ``batched_mm_experts_forward`` is the reference):

    y_n = sum_j w[n, j] * down_e(gate(up_e(x_n))),   e = idx[n, j]

with ``up_e(x) = x W_e^T + b_e`` and ``gate`` the module's own ``_apply_gate`` (``act(gate) * up``, GPT-OSS's clamped
SwiGLU) or, without a gate, its ``act_fn``. A bank is taken by this rule only when its forward, run on a probe, equals
that formula (:func:`recognise_bank`); anything else stays on the exact per-row path (:mod:`.per_row`).

The engine records the bank's whole call (input ``(N, d)`` with ``N = B * T`` tokens, routing indices and weights)
and its output gradient ``G``. For each pair ``(n, j)`` routed to ``e`` the rule recomputes (one forward of the bank's
matmuls on the routed tokens, in float32): ``u = up_e(x_n)``, ``h = gate(u)``, the gradient reaching ``down_e``'s
output ``g = w[n, j] G_n``, and ``du = J_gate(u)^T (g W_down_e)`` (one vector-Jacobian product of ``gate`` over all
pairs at once). Then expert ``e``'s weights get, per sequence ``b``, ``sum_{t in b, routed to e} g_t (x) h_t``
(down) and ``du_t (x) x_t`` (gate_up): a :class:`~..factors.Factored` gradient over that expert's tokens, padded per
sequence to the most any sequence routes to it, whose inner products take the cheaper of the token Grams and the
materialized per-sequence gradients (:func:`~..factors.block_inner_products`), expert by expert.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import torch
from torch import nn

from ..factors import Dense, Factored, Materialized, block_inner_products, block_weighted_rows
from .. import hooks
from . import per_row
from .recognition import remembered
from .registry import register_call_rule


class PerExpert:
    """The per-sample gradient of one 3-D expert-bank parameter ``(E, n_L, n_R)``, by the tokens routed to each
    expert: experts grouped by how many tokens one sequence routes to them at most (``T_e``, in bands of a factor
    ``2^(1/4)``), each group a :class:`~..factors.Factored` usage with factors ``(E_g * B, W_g, n)`` (expert-major,
    then sequence; ``W_g``: the group's largest ``T_e``; padding rows are zero). One batched Gram or materialization
    per group, not per expert; a group's width is at most ``2^(1/4)`` times any of its experts' ``T_e``."""

    def __init__(self, num_experts: int, shape: tuple[int, int], batch: int,
                 groups: list[tuple[list[int], Factored]]):
        self.num_experts, self.shape, self.batch, self.groups = num_experts, shape, batch, groups

    def blocked(self, k: int) -> "PerExpert":
        return PerExpert(self.num_experts, self.shape, self.batch // k, [(ex, f.blocked(k)) for ex, f in self.groups])

    def _per_expert(self) -> dict[int, Factored]:
        out = {}
        for experts, f in self.groups:
            n = len(experts)
            left, right = (t.reshape(n, -1, *t.shape[1:]) for t in (f.left.t, f.right.t))
            for i, e in enumerate(experts):
                out[e] = Factored(Dense(left[i]), Dense(right[i]))
        return out

    def materialize(self) -> torch.Tensor:
        """``(B, E, n_L, n_R)``, float32."""
        device = self.groups[0][1].left.t.device if self.groups else None
        out = torch.zeros(self.batch, self.num_experts, *self.shape, device=device)
        for experts, f in self.groups:
            out[:, experts] = f.materialize().reshape(len(experts), self.batch, *self.shape).transpose(0, 1)
        return out

    def block_inner_products(self, other, k: int) -> torch.Tensor:
        """Blocked usages in (``self.batch`` blocks of ``k`` rows), ``(B/k, k, k)`` out: the sum over experts."""
        if not isinstance(other, PerExpert):
            raise TypeError("An expert bank's routed usage pairs only with another; materialize both first.")
        out = torch.zeros(self.batch, k, k, device=self.groups[0][1].left.t.device if self.groups else None)
        if other is self:
            for experts, f in self.groups:
                out += block_inner_products(f, f, k).reshape(len(experts), self.batch, k, k).sum(0)
            return out
        mine, theirs = self._per_expert(), other._per_expert()  # two calls of one bank: expert by expert
        for e, f in mine.items():
            if e in theirs:
                out += block_inner_products(f, theirs[e], k)
        return out

    def weighted_rows(self, scale: torch.Tensor, k: int, start: int, end: int) -> torch.Tensor:
        """``sum_{i in block} scale_i g_i[start:end]``: experts ``start:end``, ``(B/k, end - start, n_L * n_R)``."""
        nb = scale.shape[0] // k
        out = torch.zeros(nb, end - start, self.shape[0] * self.shape[1], device=scale.device)
        for experts, f in self.groups:
            inside = [i for i, e in enumerate(experts) if start <= e < end]
            if not inside:
                continue
            n = len(experts)
            sub = Factored(*(Dense(t.reshape(n, self.batch, *t.shape[1:])[inside].flatten(0, 1))
                             for t in (f.left.t, f.right.t)))
            rows = block_weighted_rows(sub, scale.repeat(len(inside)), k, 0, self.shape[0])
            out[:, [experts[i] - start for i in inside]] = rows.reshape(len(inside), nb, -1).transpose(0, 1)
        return out if nb > 1 else out[0]  # one block: no block axis (factors.block_weighted_rows)


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


def _weights(module: nn.Module, layout: dict, e: int, dtype=torch.float32, delta=None):
    """Expert ``e``'s (up weight, up bias, down weight, down bias), cast to ``dtype`` (None: as stored); ``delta``
    (a LoRA adapter's, :mod:`.lora_experts`): ``delta(name, e)``, what is added to the weight ``name`` (or None)."""
    up, has_bias = layout["up"], layout["has_bias"]
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))

    def weight(name: str) -> torch.Tensor:
        w = cast(getattr(module, name)[e])
        extra = None if delta is None else delta(name, e)
        return w if extra is None else w + extra.to(w.dtype)

    up_b = cast(getattr(module, f"{up}_bias")[e]) if has_bias else None
    down_b = cast(module.down_proj_bias[e]) if has_bias else None
    return weight(up), up_b, weight("down_proj"), down_b


def mirror(module: nn.Module, layout: dict, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
           delta=None) -> torch.Tensor:
    """The formula this rule differentiates, on ``(N, d)`` tokens, float32 (``delta``: see :func:`_weights`)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            up_w, up_b, down_w, down_b = _weights(module, layout, e, delta=delta)
            h = _gate(module, layout, _linear(x[n : n + 1].float(), up_w, up_b, layout["transposed"]))
            out[n] += w[n, j].float() * _linear(h, down_w, down_b, layout["transposed"])[0]
    return out


def call_arguments(module: nn.Module, args, kwargs):
    """``(hidden_states, top_k_index, top_k_weights)`` of a call, whatever the keyword names."""
    try:
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    except (TypeError, ValueError):
        return None
    values = list(bound.arguments.values())[1:]
    if len(values) != 3 or not all(torch.is_tensor(v) for v in values):
        return None
    return values


def probe_inputs(module: nn.Module, layout: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A probe's call of the bank: 5 random tokens ``(5, d)``, each routed to 2 distinct experts with random weights."""
    up_w = getattr(module, layout["up"])
    d = up_w.shape[1] if layout["transposed"] else up_w.shape[2]
    e = layout["num_experts"]
    g = torch.Generator().manual_seed(0)
    n, k = 5, min(2, e)
    x = torch.randn(n, d, generator=g).to(up_w.device, up_w.dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(up_w.device)
    w = torch.rand(n, k, generator=g).to(up_w.device, up_w.dtype)
    return x, idx, w


def _probe_matches(module: nn.Module, layout: dict) -> bool:
    x, idx, w = probe_inputs(module, layout)
    with torch.no_grad(), hooks.replay():  # the capture hooks, if any, record nothing
        y = module(x, idx, w)
        expected = mirror(module, layout, x, idx, w)
    return agrees(y, expected, x.dtype)


def agrees(y, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a probe's output ``y`` is the formula's ``expected`` (within the rounding of ``dtype``), and not 0."""
    if not torch.is_tensor(y) or y.shape != expected.shape or float(expected.abs().max()) == 0:
        return False  # a degenerate probe (all-zero weights) proves nothing
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(y.float(), expected, rtol=tol, atol=tol * float(expected.abs().max())))


def recognise_bank(module: nn.Module, memo: dict | None = None) -> dict | None:
    """The bank's layout if this module is a fused expert bank whose forward verifiably computes the formula above
    (checked on a probe of 5 tokens with its own weights, once per model with ``memo``, its plan's), else None."""
    def find() -> dict | None:
        try:
            candidate = _layout(module)
            if candidate is not None and _probe_matches(module, candidate):
                return candidate
        except Exception:  # a forward that will not run on the probe (another signature, sharded weights): not ours
            pass
        return None

    return remembered(memo, ("bank", module), find)


# ----------------------------------------------------------------------------------------------------------- the rule
class _Padding:
    """Where each routed pair goes (pairs sorted by expert, then sequence) in the groups of :class:`PerExpert`:
    expert ``e`` of group ``g`` holds sequence ``b``'s pairs at rows ``b * W_g ...`` of its ``(B, W_g)`` block. All
    groups live in one flat buffer, so each factor takes one copy."""

    def __init__(self, expert: torch.Tensor, seq: torch.Tensor, batch: int, num_experts: int):
        key = expert * batch + seq
        counts = torch.bincount(key, minlength=num_experts * batch)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(key.numel(), device=key.device) - starts[key]
        widths = counts.reshape(num_experts, batch).amax(1).tolist()
        by_size: dict[int, list[int]] = {}
        for e, w in enumerate(widths):
            if w:
                by_size.setdefault(math.ceil(4 * math.log2(w)), []).append(e)  # widths within a factor 2^(1/4)
        first_row, width = [0] * num_experts, [0] * num_experts
        self.groups, offset = [], 0
        for experts in by_size.values():
            w = max(widths[e] for e in experts)
            for i, e in enumerate(experts):
                first_row[e], width[e] = offset + i * batch * w, w
            self.groups.append((experts, offset, w))
            offset += len(experts) * batch * w
        first_row, width = (torch.tensor(v, device=key.device) for v in (first_row, width))
        self.row = first_row[expert] + seq * width[expert] + pos
        self.rows, self.batch = offset, batch

    def __call__(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``(pairs, n)`` -> per group ``(E_g * B, W_g, n)``."""
        flat = values.new_zeros(self.rows, values.shape[-1])
        flat.index_copy_(0, self.row, values)
        return [flat[o : o + len(ex) * self.batch * w].view(len(ex) * self.batch, w, -1) for ex, o, w in self.groups]


def _pairs(idx: torch.Tensor, num_experts: int):
    """The routed (token, expert) pairs of ``(N, k)`` routing indices, sorted by expert then token (so, within an
    expert, by sequence): ``(order, token, expert, counts per expert)``; ``order`` indexes the flattened ``(N*k,)``
    routing. Expert-parallel sentinels (index ``num_experts``) carry nothing and are dropped."""
    tokens, k = idx.shape
    token = torch.arange(tokens, device=idx.device).repeat_interleave(k)
    expert = idx.reshape(-1)
    keep = ((expert >= 0) & (expert < num_experts)).nonzero()[:, 0]
    order = keep[torch.argsort(expert[keep] * tokens + token[keep], stable=True)]
    expert = expert[order]
    return order, token[order], expert, torch.bincount(expert, minlength=num_experts).tolist()


class _Captured:
    """What :func:`_routed_forward` kept of one call: the routed pairs' inputs and gate outputs, and (from the
    backward) the gradients reaching the up projection's and the down projection's outputs."""

    __slots__ = ("x", "order", "token", "expert", "counts", "xs", "h", "du", "g")

    def __init__(self, x, order, token, expert, counts, xs, h):
        self.x, self.order, self.token, self.expert, self.counts = x, order, token, expert, counts
        self.xs, self.h, self.du, self.g = xs, h, None, None


def _routed_forward(module: nn.Module, layout: dict, kept: list[_Captured]):
    """The bank's forward as the formula above, pair by pair in expert order (the probe checked it equals the
    module's own), keeping each pair's input and gate output, with hooks that keep the gradients reaching the up and
    down projections' outputs (in ``kept``, the pass's :class:`RoutedCaptures`): then the norms need no recomputation
    of the bank."""

    def forward(*args, **kwargs):
        x, idx, w = call_arguments(module, args, kwargs)
        d = x.shape[-1]
        flat = x.reshape(-1, d)
        idx, w = idx.reshape(flat.shape[0], -1), w.reshape(flat.shape[0], -1)
        order, token, expert, counts = _pairs(idx, layout["num_experts"])
        xs = flat[token]
        hit = [e for e, count in enumerate(counts) if count]
        if not hit:
            return torch.zeros_like(x)
        sizes = [counts[e] for e in hit]  # torch.split, not slices: one backward node, not one full-size per expert
        u = torch.cat([_linear(part, *_weights(module, layout, e, dtype=None)[:2], layout["transposed"])
                       for e, part in zip(hit, torch.split(xs, sizes))])
        h = _gate(module, layout, u)
        o = torch.cat([_linear(part, *_weights(module, layout, e, dtype=None)[2:], layout["transposed"])
                       for e, part in zip(hit, torch.split(h, sizes))])
        y = torch.zeros_like(flat).index_add(0, token, (o * w.reshape(-1)[order, None]).to(flat.dtype))
        if torch.is_grad_enabled() and u.requires_grad and not hooks.replaying() and not hooks.in_backward():
            entry = _Captured(x.detach(), order, token, expert, counts, xs.detach(), h.detach())
            kept.append(entry)
            u.register_hook(lambda grad: setattr(entry, "du", grad.detach()))
            o.register_hook(lambda grad: setattr(entry, "g", grad.detach()))
        return y.reshape(x.shape)

    return forward


def below_wrappers(module: nn.Module) -> nn.Module:
    """The module under PEFT's ``ParamWrapper``s (LoRA on a module's parameters, nested one per parameter; see
    :mod:`.lora_experts`), or ``module`` itself."""
    while type(module).__name__ == "ParamWrapper" and isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


class RoutedCaptures:
    """What one pass's routed forwards (:func:`_routed_forward`) keep for its backward, by bank, each call's entry
    matched to the recorded call by its input's storage (:meth:`take`). Owned by the pass (:class:`~..engine._Pass`),
    so two passes, of two models or of one, never see each other's; ``memo`` (the model's plan's) remembers each
    bank's layout."""

    def __init__(self, memo: dict | None = None):
        self.memo = {} if memo is None else memo
        self.entries: dict[nn.Module, list[_Captured]] = {}

    def layout(self, module: nn.Module) -> dict | None:
        return recognise_bank(module, self.memo)

    @contextmanager
    def routed_forwards(self, modules):
        """Inside, each recognised bank among ``modules`` runs :func:`_routed_forward` (an instance attribute
        shadowing its class's forward), its captures kept here. They outlive the block (the usages are formed after
        it) and are taken by :func:`bank_usages`."""
        below = dict.fromkeys(below_wrappers(m) for m in modules)  # LoRA's wrappers run the bank they wrap
        banks = [m for m in below if self.layout(m) is not None and "forward" not in vars(m)]
        for m in banks:
            self.entries.pop(m, None)
            m.forward = _routed_forward(m, self.layout(m), self.entries.setdefault(m, []))
        try:
            yield
        finally:
            for m in banks:
                del m.forward

    def take(self, module: nn.Module, x: torch.Tensor) -> _Captured | None:
        """The capture of the call whose input is ``x`` (the same storage), if its gradients arrived."""
        entries = self.entries.get(module, [])
        for i, entry in enumerate(entries):
            if entry.x.data_ptr() == x.data_ptr() and entry.x.shape == x.shape:
                entries.pop(i)
                return entry if entry.du is not None and entry.g is not None else None
        return None


def _recompute_routed(module: nn.Module, layout: dict, x, grad, idx, w, delta=None):
    """The bank's routed (token, expert) pairs and, per pair, the input ``xs``, the gated hidden ``h``, the gradient
    ``du`` at the up projection's output and ``gs`` at the down projection's output, recomputed from the call (None
    when no token was routed; ``delta``: a LoRA adapter's, see :func:`_weights`)."""
    num_experts, transposed = layout["num_experts"], layout["transposed"]
    order, token, expert, counts = _pairs(idx, num_experts)
    xs = x[token].float()
    gs = grad[token].float() * w.reshape(-1)[order].float()[:, None]  # the gradient reaching down_e's output
    us, dhs, start = [], [], 0
    for e, count in enumerate(counts):
        if count:
            up_w, up_b, down_w, _ = _weights(module, layout, e, delta=delta)
            us.append(_linear(xs[start : start + count], up_w, up_b, transposed))
            dhs.append(gs[start : start + count] @ (down_w.T if transposed else down_w))
            start += count
    if not us:
        return None
    with torch.enable_grad():
        u = torch.cat(us).requires_grad_(True)
        h = _gate(module, layout, u)
        (du,) = torch.autograd.grad(h, u, torch.cat(dhs))
    return token, expert, xs, h.detach(), du, gs


class Routed:
    """A bank call's routed pairs in the padded groups of :class:`PerExpert`: ``groups`` (each group's experts), and
    per group the up projection's inputs ``px`` and output gradients ``pdu``, the down projection's inputs ``ph`` and
    output gradients ``pg`` (``(E_g * B, W_g, n)`` each, float32), and per pair ``du`` (for the biases)."""

    __slots__ = ("groups", "px", "pdu", "ph", "pg", "du", "d")

    def __init__(self, groups, px, pdu, ph, pg, du, d):
        self.groups, self.px, self.pdu, self.ph, self.pg, self.du, self.d = groups, px, pdu, ph, pg, du, d


def routed(module: nn.Module, layout: dict, call: hooks.Call, output_grad: torch.Tensor, batch: int,
           handoff: RoutedCaptures, delta=None) -> Routed | None:
    """The routed pairs of one recorded call of the bank ``module`` (what :func:`_routed_forward` kept in
    ``handoff``, else recomputed, with ``delta``: see :func:`_weights`), padded per expert and sequence; None when no
    token was routed. Raises where the call's rows cannot be paired with the sequences."""
    x, idx, w = call_arguments(module, call.args, call.kwargs)
    captured = handoff.take(module, x)
    d = x.shape[-1]
    x, grad = x.reshape(-1, d), output_grad.reshape(-1, d)
    tokens = x.shape[0]
    if tokens % batch or grad.shape[0] != tokens or idx.reshape(tokens, -1).shape != w.reshape(tokens, -1).shape:
        raise NotImplementedError(
            f"{type(module).__name__}'s input has {tokens} token rows, not a multiple of the batch ({batch}) matching "
            "its output gradient and routing: its rows cannot be paired with the sequences. Freeze its parameters "
            "(module.requires_grad_(False)) or use OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
        )
    idx, w = idx.reshape(tokens, -1), w.reshape(tokens, -1)
    if captured is not None:
        token, expert = captured.token, captured.expert
        xs, h, du, gs = (t.float() for t in (captured.xs, captured.h, captured.du, captured.g))
    else:
        recomputed = _recompute_routed(module, layout, x, grad, idx, w, delta)
        if recomputed is None:
            return None
        token, expert, xs, h, du, gs = recomputed
    padding = _Padding(expert, token // (tokens // batch), batch, layout["num_experts"])
    px, pg, ph, pdu = (padding(v) for v in (xs, gs, h, du))
    return Routed([experts for experts, _, _ in padding.groups], px, pdu, ph, pg, du, d)


@register_call_rule("expert_bank", lambda module, memo=None: recognise_bank(module, memo) is not None)
def bank_usages(module: nn.Module, call: hooks.Call, output_grads: list, batch: int,
                handoff: RoutedCaptures | None = None) -> dict:
    """``{name: usage}`` of a recognised expert bank from its recorded call and output gradient (and what
    :func:`_routed_forward` kept in the pass's ``handoff``, if it ran; else the bank's matmuls are recomputed on the
    routed tokens)."""
    handoff = RoutedCaptures() if handoff is None else handoff
    layout = handoff.layout(module)
    if layout is None or call_arguments(module, call.args, call.kwargs) is None or len(output_grads) != 1:
        return per_row.per_row_usages(module, call, output_grads, batch)
    if output_grads[0] is None:
        return {}
    with torch.autocast(device_type=output_grads[0].device.type, enabled=False), torch.no_grad():
        found = routed(module, layout, call, output_grads[0], batch, handoff)
        return {} if found is None else _bank_usages(module, layout, found, batch)


def _bank_usages(module: nn.Module, layout: dict, found: Routed, batch: int) -> dict:
    """The bank's own parameters' usages from its routed pairs (those that require a gradient)."""
    num_experts, transposed, d = layout["num_experts"], layout["transposed"], found.d
    up, up_bias = layout["up"], f"{layout['up']}_bias"
    wanted = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    usages: dict = {}
    up_shape, down_shape = tuple(getattr(module, up).shape[1:]), tuple(module.down_proj.shape[1:])
    groups = found.groups
    if "down_proj" in wanted:
        usages["down_proj"] = PerExpert(num_experts, down_shape, batch, [
            (ex, Factored(Dense(hh), Dense(gg)) if transposed else Factored(Dense(gg), Dense(hh)))
            for ex, hh, gg in zip(groups, found.ph, found.pg)])
    if up in wanted:
        usages[up] = PerExpert(num_experts, up_shape, batch, [
            (ex, Factored(Dense(xx), Dense(dd)) if transposed else Factored(Dense(dd), Dense(xx)))
            for ex, xx, dd in zip(groups, found.px, found.pdu)])
    if layout["has_bias"]:
        sums = {up_bias: (found.pdu, found.du.shape[-1]), "down_proj_bias": (found.pg, d)}
        for name, (parts, width) in sums.items():
            if name in wanted:
                total = torch.zeros(batch, num_experts, width, device=found.du.device)
                for ex, part in zip(groups, parts):
                    total[:, ex] = part.sum(1).reshape(len(ex), batch, width).transpose(0, 1)
                usages[name] = Materialized(total)
    return usages
