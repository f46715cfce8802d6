"""Discovery for the coverage ledger: which trainable modules a model uses functionally (their forward never runs
while autograd reaches their parameters), and the ancestor that borrows them onto the exact per-row path. See
:mod:`.coverage` for the whole mechanism and its costs. No engine, no rule: :mod:`.engine` and :mod:`.support` read it."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .lm import output_head
from .plan import plan_of_lm, trainable_names, view_of  # noqa: F401 (trainable_names: imported from here too)
from .quantized import compute_dtype, packed, quantized

PROBE_BATCH, PROBE_PROMPT, PROBE_COMPLETION = 2, 4, 4


def sharded(lm: nn.Module) -> bool:
    """Parameters that are shards (FSDP2 DTensors, DeepSpeed ZeRO-3 partitions): no plain forward can run here."""
    return any(hasattr(p, "device_mesh") or hasattr(p, "ds_id") for p in lm.parameters())


def probe_batch(lm: nn.Module, batch: int = PROBE_BATCH, prompt: int = PROBE_PROMPT,
                completion: int = PROBE_COMPLETION) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``completion_mask`` of a small batch on the model's device: random token
    ids (never the pad id 0), the first row's prompt left-padded by 2, the last row's completion ending early."""
    embedding = lm.get_input_embeddings()
    if hasattr(embedding, "get_base_layer"):  # PEFT's adapter on the embedding (LoRA): the nn.Embedding it wraps
        embedding = embedding.get_base_layer()
    vocab, device = embedding.weight.shape[0], embedding.weight.device
    head = output_head(lm)
    if isinstance(head, nn.Linear):  # ids the head can score too (CPM-Ant's embedding is wider than its vocabulary)
        vocab = min(vocab, head.out_features)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(2, min(vocab, 1000)), (batch, prompt + completion), generator=g)
    attention = torch.ones_like(ids)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    ids[0, :2], attention[0, :2] = 0, 0
    completion_mask[-1, completion - 1 :] = 0
    attention[-1, -1] = 0
    return ids.to(device), attention.to(device), completion_mask.to(device)


def _accelerate_wrapped(module: nn.Module) -> bool:
    """Whether ``module``'s forward is Accelerate's mixed-precision wrapper (``prepare`` under ``bf16``/``fp16``: the
    forward run inside an autocast region, its outputs made float32), which keeps the forward it wrapped as
    ``_original_forward``."""
    forward = module.__dict__.get("forward")
    wrapped = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    return "_original_forward" in module.__dict__ and type(wrapped).__name__ == "ConvertOutputsToFp32"


@contextmanager
def plain_mode(lm: nn.Module):
    """Eval mode (no dropout, no gradient checkpointing), no autocast and full float32 matmuls (no TF32, whose 1e-3
    rounding is above the probe's 1e-4), for discovery, the head's observation and the probe; each module's own
    train/eval flag and the matmul precision are put back after (a model with some layers in eval and others in train
    keeps them so). Inside an autocast region, the region's own casts are left as they were. Accelerate's
    mixed-precision wrapper of the forward (which turns autocast on again inside) is set aside while inside, as
    Accelerate's own ``extract_model_from_parallel`` does, and put back after: the checks see the forward the trainer
    was constructed with. While inside, the model's plan keeps its view (what a check sets aside is the check's)."""
    plan = plan_of_lm(lm)
    outer = plan.view.outer if plan.view is not None else None
    modes = [(m, m.training) for m in lm.modules()]
    wrapped = [m for m in dict.fromkeys((lm, outer)) if m is not None and _accelerate_wrapped(m)]
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    device = lm.get_input_embeddings().weight.device
    plan.held += 1
    forwards = [(m, m.__dict__["forward"]) for m in wrapped]
    for m in wrapped:
        m.__dict__["forward"] = m._original_forward
    lm.eval()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    finally:
        for m, training in modes:
            m.training = training
        for m, forward in forwards:
            m.__dict__["forward"] = forward
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        plan.held -= 1


@contextmanager
def float32_mode(lm: nn.Module, dtype: torch.dtype = torch.float32):
    """The model computing in ``dtype`` (float32, or float64 for the probe's second look) while inside: each floating
    parameter and buffer in another dtype is replaced, in its module, by a copy in ``dtype`` (tied ones by one copy,
    a parameter's copy trainable as it is), and the originals are put back after. The user's tensors are never cast
    in place: their values, dtypes and autograd identity stay as they were (an in-place cast would rebuild a weight's
    autograd link, and an enclosing autocast region's cached casts of it would no longer reach it). A
    bf16/fp16/float32 value is exact in a wider type. In half precision the reference itself is too coarse to judge
    by: bf16 logits of a 49k vocabulary are spaced 0.125 apart near 20, which moves each sequence's gradient by tens
    of percent. A quantized model (weights stored 4- or 8-bit, whatever the storage dtype: :func:`~.quantized.packed`)
    keeps those weights: its floating parameters (the adapters, norms, biases) and buffers are copied upcast, and
    layers with their own compute dtype (bitsandbytes' 4-bit) compute in float32; it cannot run in float64 (the
    dequantizing kernels have no float64). While inside, the model's plan keeps its view (the copies are the check's).
    Yields whether the model runs in ``dtype``. Cost: a copy of every parameter not yet in ``dtype``, while inside."""
    wide = (torch.float32, torch.float64) if dtype == torch.float32 else (torch.float64,)
    if quantized(lm) and dtype != torch.float32:
        yield False
        return
    copies: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []

    def copy_of(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in copies:
            value = t.detach().to(dtype)
            copies[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if parameter else value
        return copies[id(t)]

    plan = plan_of_lm(lm)
    plan.held += 1
    try:
        for m in lm.modules():
            for store, parameter in ((m._parameters, True), (m._buffers, False)):
                for name, t in store.items():
                    if t is not None and not packed(t) and t.dtype not in wide:  # codes stay as stored
                        swapped.append((store, name, t))
                        store[name] = copy_of(t, parameter)
        with compute_dtype(lm, dtype):
            yield True
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t
        plan.held -= 1


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
    finds it; kept on the plan through the change sharding makes to the model's state), or nothing."""
    view = view_of(model)
    lm, names, plan = view.lm, view.trainable, view.plan
    known = plan.owners
    if known is not None and (known[0] == view.key or sharded(lm)):
        return known[1]
    if not names:
        return {}
    if sharded(lm):  # found before sharding (the same modules), where each still sits under its ancestor
        modules = set(lm.modules())
        return {m: a for m, a in (plan.last_owners or {}).items()
                if m in modules and a in modules and any(d is m for d in a.modules())}
    with plain_mode(lm):
        owners = _discover(lm, view.backbone)
    plan.owners = (view.key, owners)
    plan.last_owners = owners
    return owners
