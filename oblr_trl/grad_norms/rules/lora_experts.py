"""LoRA on fused MoE expert banks: PEFT's ``ParamWrapper`` (``LoraConfig(target_parameters=[
"mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``, the gpt-oss recipe; and ``target_modules="all-linear"`` on
Qwen3-MoE and Mixtral, which PEFT turns into those targets), by the routed tokens, as :mod:`.experts` does for the
bank's own weights.

PEFT wraps the bank once per targeted parameter (the wrappers nested, each the ``base_layer`` of the next). For
adapter ``a`` with factors ``A = lora_A[a].weight`` ``(E r, n_in)`` and ``B = lora_B[a].weight`` ``(n_out, r E)``, each
expert ``e`` has ``A_e = A.reshape(E, r, n_in)[e]`` and ``B_e = B.reshape(n_out, r, E)[:, :, e]``, and while the
wrappers run the bank's forward, expert ``e``'s projection (as a map from its ``n_in`` inputs to its ``n_out``
outputs) is ``W_e + s B_e A_e``, ``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA): stored ``(E, n_out, n_in)``
(Qwen3-MoE, Mixtral), or transposed, ``(E, n_in, n_out)`` (GPT-OSS), where PEFT folds ``s A_e^T B_e^T`` in. No
dropout, bias or DoRA: PEFT refuses them on a wrapped parameter.

So the map's per-sequence gradient is the bank rule's ``M_e = sum_t g_t (x) h_t`` over sequence ``b``'s tokens routed
to ``e`` (``h``: the projection's input, ``g``: the gradient at its output, from the bank's routed pairs with the
adapted weights), and the factors' are ``M_e`` projected through the other factor:

    dA_e = s B_e^T M_e = sum_t (s B_e^T g_t) (x) h_t        (r x n_in)
    dB_e = s M_e A_e^T = sum_t g_t (x) (s A_e h_t)          (n_out x r)

each a :class:`~.experts.PerExpert` usage whose rows are laid out as PEFT's weight is (:class:`FactorRows`). A chain
of wrappers is taken whole, by the outermost wrapper (:func:`outermost`: the inner ones run inside its LoRA delta,
so a re-run of one alone computes something else), and only when a probe with random factors shows its forward is
that formula (:func:`recognise_lora_bank`); else the chain takes the exact per-row path, by its outermost wrapper.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import hooks
from . import per_row
from .experts import PerExpert, RoutedCaptures, agrees, below_wrappers, call_arguments, mirror, probe_inputs, routed
from .experts import recognise_bank
from ..factors import Dense, Factored
from .recognition import remembered
from .registry import register_call_rule


def is_wrapper(module: nn.Module) -> bool:
    """PEFT's ``ParamWrapper``: LoRA on one parameter of the module it wraps (``base_layer``)."""
    return type(module).__name__ == "ParamWrapper" and isinstance(getattr(module, "base_layer", None), nn.Module)


def outermost(owners: dict[nn.Module, nn.Module], lm: nn.Module) -> dict[nn.Module, nn.Module]:
    """``owners`` (``{module used functionally: the ancestor that borrows it}``, :func:`~..coverage.functional_owners`)
    with every ancestor that is a ``ParamWrapper`` nested in another replaced by the outermost of its chain: a chain
    is one call, whose inner wrappers run inside the outer ones' LoRA deltas."""
    parent = {m.base_layer: m for m in lm.modules() if is_wrapper(m) and is_wrapper(m.base_layer)}
    out = {}
    for module, ancestor in owners.items():
        while ancestor in parent:
            ancestor = parent[ancestor]
        out[module] = ancestor
    return out


def _chain(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The wrappers of a chain, outermost first, each with its name relative to ``module``."""
    found, prefix = [], ""
    while is_wrapper(module):
        found.append((prefix, module))
        module, prefix = module.base_layer, prefix + "base_layer."
    return found


def _adapters(wrapper: nn.Module) -> list[str]:
    """The adapters whose delta the wrapper adds in its forward."""
    if getattr(wrapper, "merged", False) or getattr(wrapper, "disable_adapters", False):
        return []
    return [a for a in wrapper.active_adapters if a in wrapper.lora_A]


def _factors(wrapper: nn.Module, adapter: str, weights: dict | None = None, prefix: str = ""):
    """``(A, B, s)``: expert by expert, ``A`` ``(E, r, n_in)``, ``B`` ``(E, n_out, r)``, float32 (``weights``: the
    factors' values by name, in place of the module's)."""
    a = (weights or {}).get(f"{prefix}lora_A.{adapter}.weight", wrapper.lora_A[adapter].weight)
    b = (weights or {}).get(f"{prefix}lora_B.{adapter}.weight", wrapper.lora_B[adapter].weight)
    e = wrapper.num_experts
    return (a.float().reshape(e, -1, a.shape[-1]), b.float().reshape(b.shape[0], -1, e).permute(2, 0, 1),
            float(wrapper.scaling[adapter]))


def _delta(chain, layout: dict, weights: dict | None = None):
    """``delta(name, e)`` for :func:`~.experts._weights`: what the chain's adapters add to expert ``e``'s weight
    ``name`` in its storage layout, float32 (None where nothing is added)."""
    by_param = {w.parameter_name: (prefix, w) for prefix, w in chain}

    def delta(name: str, e: int):
        if name not in by_param:
            return None
        prefix, wrapper = by_param[name]
        total = None
        for adapter in _adapters(wrapper):
            a, b, s = _factors(wrapper, adapter, weights, prefix)
            map_ = s * (b[e] @ a[e])  # (n_out, n_in)
            part = map_.T if layout["transposed"] else map_
            total = part if total is None else total + part
        return total

    return delta


def _fits(chain, bank: nn.Module, layout: dict) -> bool:
    """Every wrapper adapts one of the bank's two 3-D weights (once each), with one factor pair per expert, and the
    bank's own parameters are frozen."""
    names = [w.parameter_name for _, w in chain]
    if len(set(names)) != len(names) or not set(names) <= {layout["up"], "down_proj"}:
        return False
    if any(getattr(w, "num_experts", None) != layout["num_experts"] or not _adapters(w) for _, w in chain):
        return False
    return not any(p.requires_grad for p in bank.parameters(recurse=False))


def _probe(module: nn.Module, chain, bank: nn.Module, layout: dict) -> bool:
    """The chain's forward, with random factors in place of its own (a LoRA B at 0 would hide the layout), equals the
    bank's formula with their deltas."""
    x, idx, w = probe_inputs(bank, layout)
    g = torch.Generator().manual_seed(1)
    weights = {f"{prefix}lora_{ab}.{a}.weight": torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.5
               for prefix, wrapper in chain for a in _adapters(wrapper) for ab in "AB"
               for p in [getattr(wrapper, f"lora_{ab}")[a].weight]}
    with torch.no_grad(), hooks.replay():
        y = torch.func.functional_call(module, weights, (x, idx, w))
        expected = mirror(bank, layout, x, idx, w, _delta(chain, layout, weights))
    return agrees(y, expected, x.dtype)


def recognise_lora_bank(module: nn.Module, memo: dict | None = None) -> dict | None:
    """``{'bank', 'layout'}`` if ``module`` is a chain of PEFT ``ParamWrapper``s over a recognised expert bank
    (:func:`~.experts.recognise_bank`) whose forward is the formula above (checked on a probe, once per model with
    ``memo``), else None."""
    def find() -> dict | None:
        if not is_wrapper(module):
            return None
        chain, bank = _chain(module), below_wrappers(module)
        try:
            layout = recognise_bank(bank, memo)
            if layout is not None and _fits(chain, bank, layout) and _probe(module, chain, bank, layout):
                return dict(bank=bank, layout=layout)
        except Exception:  # a forward that will not run on the probe: not ours
            pass
        return None

    return remembered(memo, ("lora bank", module), find)


def why_not(module: nn.Module, name: str, memo: dict | None = None) -> str | None:
    """Why a chain of LoRA wrappers (``module``, at ``name``) does not take the rule, and what does, for its refusal
    where the per-row path cannot take it either; None for a module that is no wrapper."""
    if not is_wrapper(module):
        return None
    chain, bank = _chain(module), below_wrappers(module)
    wrapped = [w.parameter_name for _, w in chain]
    where = ".".join(name.split(".")[-2:])
    fix = (f"LoRA on the bank's two weights is exact: LoraConfig(target_parameters=['{where}.<up>', "
           f"'{where}.down_proj']) with the bank's own parameters frozen; or leave the experts out "
           "(target_modules on the attention projections, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj'])")
    layout = recognise_bank(bank, memo)
    if layout is None:
        why = (f"{type(bank).__name__} is not an expert bank the routed-token rule recognises (its forward, on a "
               "probe, is not the formula of grad_norms/experts.py)")
        fix = "leave the experts out (target_modules on the attention projections, e.g. ['q_proj', 'v_proj'])"
    elif not set(wrapped) <= {layout["up"], "down_proj"}:
        why = f"it adapts {wrapped} of {type(bank).__name__}, not only its 3-D weights {layout['up']}, down_proj"
    elif any(p.requires_grad for p in bank.parameters(recurse=False)):
        trained = [n for n, p in bank.named_parameters(recurse=False) if p.requires_grad]
        why = f"the bank's own parameters {trained} are trainable too"
    else:
        why = "its forward, on a probe with random factors, is not the bank's formula with W_e + s B_e A_e"
    return (f"LoRA (PEFT's ParamWrapper) on {type(bank).__name__}'s {wrapped} takes no exact rule: {why}; and the "
            f"per-row path's limit ({per_row.MAX_NUMEL:,} elements) is below its factors. "
            + fix.replace("<up>", layout["up"] if layout else "gate_up_proj") + ".")


class FactorRows(PerExpert):
    """A LoRA factor's per-sequence gradients by expert (:class:`~.experts.PerExpert`, ``shape`` per expert), its
    rows laid out as PEFT's weight: ``A`` ``(E r, n_in)``, expert-major rows; ``B`` ``(n_out, r E)``, column
    ``k E + e`` (``expert_last``). Inner products do not depend on the layout; the weighted sum and the materialized
    gradients do."""

    def __init__(self, num_experts, shape, batch, groups, expert_last: bool):
        super().__init__(num_experts, shape, batch, groups)
        self.expert_last = expert_last

    def blocked(self, k: int) -> "FactorRows":
        return FactorRows(self.num_experts, self.shape, self.batch // k, [(ex, f.blocked(k)) for ex, f in self.groups],
                          self.expert_last)

    def _as_weight(self, per_expert: torch.Tensor) -> torch.Tensor:
        """``(n, E, rows, cols)`` -> ``(n, *weight's shape)``."""
        if self.expert_last:
            return per_expert.permute(0, 2, 3, 1).flatten(2)
        return per_expert.flatten(1, 2)

    def materialize(self) -> torch.Tensor:
        return self._as_weight(super().materialize())

    def weighted_rows(self, scale: torch.Tensor, k: int, start: int, end: int) -> torch.Tensor:
        nb, (rows, cols) = scale.shape[0] // k, self.shape
        if self.expert_last:  # every expert holds a slice of each row
            first, last = 0, self.num_experts
        else:  # rows e r ... (e + 1) r - 1 are expert e's
            first, last = start // rows, -(-end // rows)
        part = super().weighted_rows(scale, k, first, last).reshape(nb, last - first, rows, cols)
        if self.expert_last:
            out = part[:, :, start:end].permute(0, 2, 3, 1).flatten(2)
        else:
            out = part.flatten(1, 2)[:, start - first * rows : end - first * rows]
        return out if nb > 1 else out[0]


def _projected(found, wrapper: nn.Module, adapter: str, up: bool, batch: int) -> dict[str, FactorRows]:
    """``{'A': usage, 'B': usage}`` of one adapter on the bank's up (``up``) or down projection, from its routed
    pairs (:class:`~.experts.Routed`), as the module docstring derives them."""
    a, b, s = _factors(wrapper, adapter)
    ins, grads = (found.px, found.pdu) if up else (found.ph, found.pg)
    a_groups, b_groups = [], []
    for ex, h, g in zip(found.groups, ins, grads):
        n, width = len(ex), h.shape[1]
        index = torch.tensor(ex, device=h.device)
        left = torch.bmm(g.reshape(n, -1, g.shape[-1]), b[index]).mul_(s)  # s B_e^T g_t
        right = torch.bmm(h.reshape(n, -1, h.shape[-1]), a[index].transpose(1, 2)).mul_(s)  # s A_e h_t
        a_groups.append((ex, Factored(Dense(left.reshape(n * batch, width, -1)), Dense(h))))
        b_groups.append((ex, Factored(Dense(g), Dense(right.reshape(n * batch, width, -1)))))
    e, r = wrapper.num_experts, a.shape[1]
    return {"A": FactorRows(e, (r, a.shape[2]), batch, a_groups, expert_last=False),
            "B": FactorRows(e, (b.shape[1], r), batch, b_groups, expert_last=True)}


@register_call_rule("lora_expert_bank", lambda module, memo=None: recognise_lora_bank(module, memo) is not None,
                    borrows=True)
def lora_bank_usages(module: nn.Module, call: hooks.Call, output_grads: list, batch: int,
                     handoff: RoutedCaptures | None = None) -> dict:
    """``{name relative to the outermost wrapper: usage}`` of every trainable LoRA factor of a recognised chain, from
    its recorded call and output gradient (the bank's routed pairs kept by its routed forward in ``handoff``, else
    recomputed with the adapted weights)."""
    handoff = RoutedCaptures() if handoff is None else handoff
    found = recognise_lora_bank(module, handoff.memo)
    chain = _chain(module)
    names = [f"{prefix}{n}" for prefix, w in chain for n, p in w.named_parameters() if p.requires_grad
             and not n.startswith("base_layer.")]
    if found is None or len(output_grads) != 1 or call_arguments(found["bank"], call.args, call.kwargs) is None:
        return per_row.per_row_usages(module, call, output_grads, batch, names)
    if output_grads[0] is None:
        return {}
    bank, layout = found["bank"], found["layout"]
    with torch.autocast(device_type=output_grads[0].device.type, enabled=False), torch.no_grad():
        pairs = routed(bank, layout, call, output_grads[0], batch, handoff, _delta(chain, layout))
        if pairs is None:
            return {}
        usages = {}
        for prefix, wrapper in chain:
            for adapter in _adapters(wrapper):
                both = _projected(pairs, wrapper, adapter, wrapper.parameter_name == layout["up"], batch)
                for ab, usage in both.items():
                    name = f"{prefix}lora_{ab}.{adapter}.weight"
                    if name in names:
                        usages[name] = usage
    if set(names) - set(usages):  # a trainable parameter of the chain beyond its active factors
        return per_row.per_row_usages(module, call, output_grads, batch, names)
    return usages
