"""Discovery for the coverage ledger: which trainable modules a model uses functionally (their forward never runs
while autograd reaches their parameters), and the ancestor that borrows them onto the exact per-row path. See
:mod:`.coverage` for the whole mechanism and its costs. No engine, no rule: :mod:`.engine` and :mod:`.support` read it."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .model import output_head, plain_mode, probe_batch, sharded, view_of

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
    state (:func:`~.plan.state_key`: its modules, their forwards and hooks, its trainable set; a tiny forward and
    backward), then remembered on the model's plan (:class:`~.plan.ModelPlan`). Models whose parameters are already
    shards cannot run that forward: they keep what was found before sharding (``validate`` at trainer construction
    finds it), or nothing."""
    view = view_of(model)
    lm, names, plan = view.lm, view.trainable, view.plan
    known = plan.owners
    if known is not None and (known[0] == view.key or sharded(lm)):
        return known[1]
    if not names or sharded(lm):
        return {}
    with plain_mode(lm):
        owners = _discover(lm, view.backbone)
    plan.owners = (view.key, owners)
    return owners
