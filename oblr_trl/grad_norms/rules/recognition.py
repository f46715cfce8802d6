"""Rules for layers recognised by what they compute, where the class name says nothing (``Phi3RMSNorm``,
``Olmo2RMSNorm``, Gemma's ``(1 + w)`` norm, ``CohereLayerNorm``, Gemma's ``*ScaledWordEmbedding``, subclasses of
``nn.Linear``...).

A candidate is chosen by its shape (a 1-D ``weight`` and an epsilon; an ``nn.Embedding`` or ``nn.Linear`` subclass)
and accepted only if its forward, run on a random probe input with a random weight, equals the formula the rule
differentiates. A module that computes anything else gets no rule from here.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.func import functional_call

from .embeddings import _embed_scale, embedding_rule
from .linear import linear_rule
from .norms import centred_norm_rule, rms_norm_rule
from .registry import GRAD_NORM_RULES, _NAME_RULES, Rule, _original_class, is_on


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-4 if a.dtype == torch.float32 else 2e-2
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _own_trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False)}


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _single_input(module: nn.Module) -> bool:
    """Whether the forward takes one input and nothing else that could change its result (a gated norm's
    ``forward(hidden_states, gate=None)`` computes ``norm(x * silu(gate))`` when given a gate, which a probe on ``x``
    alone cannot see)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL,
             inspect.Parameter.KEYWORD_ONLY)
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return sum(p.kind in kinds for p in params) == 1


class _Unhooked(nn.Module):
    """``module``'s own ``forward``, without its hooks: a ZeRO-3 module's hooks fetch and release its partitioned
    parameters, which a probe's stand-in weight is not (and they would release the gathered ones mid-probe); an FSDP2
    unit's hooks would initialise its state as a root of its own, so that the model's root then refuses to run."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, *args):
        return self.inner.forward(*args)


@contextlib.contextmanager
def _gathered(module: nn.Module):
    """The module's own parameters whole while the probe runs, and the module to call (itself, with its hooks, as the
    model calls it). Under DeepSpeed ZeRO-3 its parameters are partitioned (0 elements) outside the module's forward:
    gathered here (every rank discovers the same modules in the same order, so the all-gather matches across ranks),
    and the probe calls the module's own forward without ZeRO-3's hooks (:class:`_Unhooked`). Under FSDP2 (DTensor
    shards) it is called without FSDP's hooks too: a norm's probe runs on its stand-in weight, and a probe that reads
    the sharded weights fails (no rule from here)."""
    own = list(module.parameters(recurse=False))
    partitioned = [p for p in own if hasattr(p, "ds_id")]
    if not partitioned:
        yield _Unhooked(module) if any(hasattr(p, "device_mesh") for p in own) else module
        return
    import deepspeed  # present: the parameters are ZeRO-3's

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield _Unhooked(module)


def _norm_rule(module: nn.Module) -> Rule | None:
    if not _single_input(module):
        return None
    params = _own_trainable(module)
    weight = params.get("weight")
    shape = getattr(weight, "ds_shape", None) or weight.shape  # ZeRO-3: the shape before partitioning
    if set(params) != {"weight"} or len(shape) != 1 or any(True for _ in module.children()):
        return None
    eps = _eps(module)
    if eps is None:
        return None
    g = torch.Generator().manual_seed(0)
    d = shape[0]
    x = torch.randn(2, 3, d, generator=g).to(weight.device, weight.dtype)
    w = torch.randn(d, generator=g).to(weight.device, weight.dtype)
    with torch.no_grad(), _gathered(module) as call:
        y = functional_call(call, {"weight" if call is module else "inner.weight": w}, (x,))
        if not torch.is_tensor(y):
            return None
        xf, wf = x.float(), w.float()
        rms = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if _close(y, wf * rms) or _close(y, (1 + wf) * rms):
            return rms_norm_rule
        if _close(y, wf * nn.functional.layer_norm(xf, (d,), eps=eps)):
            return centred_norm_rule
    return None


def _embedding_rule(module: nn.Embedding) -> Rule | None:
    ids = torch.randint(0, module.num_embeddings, (2, 5), generator=torch.Generator().manual_seed(0))
    ids = ids.to(module.weight.device)
    with torch.no_grad(), _gathered(module) as call:
        y = call(ids)
        expected = nn.functional.embedding(ids, module.weight)
        scale = _embed_scale(module)
        if scale is not None:
            expected = expected * scale
    return embedding_rule if torch.is_tensor(y) and _close(y, expected) else None


def _linear_rule(module: nn.Linear) -> Rule | None:
    x = torch.randn(2, 3, module.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(module.weight.device, module.weight.dtype)
    with torch.no_grad(), _gathered(module) as call:
        y = call(x)
        expected = nn.functional.linear(x, module.weight, module.bias)
    return linear_rule if torch.is_tensor(y) and _close(y, expected) else None


def recognise(module: nn.Module) -> Rule | None:
    """A rule whose formula this module's forward verifiably computes, or None."""
    try:
        if isinstance(module, nn.Embedding):
            return _embedding_rule(module)
        if isinstance(module, nn.Linear):
            return _linear_rule(module)
        return _norm_rule(module)
    except Exception:  # a forward that will not run on a probe (other signature, sharded weights): no rule from here
        return None


def remembered(memo: dict | None, key: tuple, find):
    """``find()``, kept in ``memo`` (a model's :attr:`~..model.ModelPlan.memo`) under ``key``; computed every time
    without one."""
    if memo is None:
        return find()
    if key not in memo:
        memo[key] = find()
    return memo[key]


def find_rule(module: nn.Module, memo: dict | None = None) -> Rule | None:
    """The module's rule: registered for its exact class (or class name), else recognised by what it computes
    (:mod:`.recognition`: a norm, a scaled embedding, a linear map, each verified on a probe input, remembered in
    ``memo``, the model's plan's), else None."""
    cls = _original_class(type(module))
    rule = GRAD_NORM_RULES.get(cls) or _NAME_RULES.get(cls.__name__)
    if rule is not None and is_on(rule):
        return rule
    rule = remembered(memo, ("rule", module), lambda: recognise(module))
    return rule if rule is not None and is_on(rule) else None
