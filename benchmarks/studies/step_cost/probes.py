"""step_cost.py's probes of the largest configuration: FLOP estimates, a profile of the norms pass, the plain backbone's
cost, and what the alternatives to the Linear rule would cost."""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from .calls import autocast, sync
from .design import GROUP


def flop_estimates(model, batch: int, length: int, completion: int, group: int) -> dict:
    """Rough GFLOP of one forward+backward and of the ghost-norm Gram products (bmm only), from the shapes."""
    cfg = model.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    linears = [m for n, m in model.model.named_modules() if isinstance(m, nn.Linear)]
    lin_params = sum(m.in_features * m.out_features for m in linears)
    head_dim = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    fwdbwd = 6 * lin_params * batch * length + 6 * batch * completion * vocab * d + 6 * batch * length ** 2 * attn
    rows = batch * group  # (B/G) blocks of G*T tokens: B*G*T^2 Gram entries
    gram_lin = sum(2 * rows * length ** 2 * (m.in_features + m.out_features) for m in linears)
    gram_emb = 2 * rows * length ** 2 * d
    # head: Gram of the softmax deltas (width V, both sides recomputed per vocab chunk) + Gram of h
    gram_head = 2 * rows * completion ** 2 * vocab + 2 * 2 * batch * group * completion * vocab * d \
        + 2 * rows * completion ** 2 * d
    materialize = 2 * batch * length * lin_params + 2 * batch * completion * vocab * d  # per-sample grads instead
    return dict(fwdbwd=fwdbwd / 1e9, gram_linear=gram_lin / 1e9, gram_embedding=gram_emb / 1e9,
                gram_head=gram_head / 1e9, gram_total=(gram_lin + gram_emb + gram_head) / 1e9,
                materialize=materialize / 1e9)

def profile_norms(model, batch, device, dtype, fns, forms=("norms", "group"), top: int = 8) -> dict:
    """Where one call of each norms form spends its time: torch.profiler's operators by self time (the whole public
    call profiled; nothing patched), plus a plain backbone forward/backward and the linear layers' alternatives."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    result = {}
    for name in forms:
        fns[name]()  # warm
        sync(device)
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            fns[name]()
            sync(device)
        total = time.perf_counter() - t0
        events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
        ops = {e.key: getattr(e, key) / 1e6 for e in events[:top]}
        result[name] = dict(total=total, ops=ops, profiled_total=sum(getattr(e, key) for e in events) / 1e6)
    result["plain_backbone"] = plain_backbone(model, batch, device, dtype)
    result["linear_alternatives"] = linear_alternatives(model, batch[0].shape[0], batch[0].shape[1], device)
    return result

def plain_backbone(model, batch, device, dtype) -> dict:
    """The backbone's forward and backward without the norms' hooks, for their overhead."""
    input_ids, attention_mask, _ = batch
    with autocast(device, dtype):
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        sync(device)
        t0 = time.perf_counter()
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        sync(device)
        t1 = time.perf_counter()
    params = [p for p in model.model.parameters() if p.requires_grad]
    torch.autograd.grad(hidden, params, grad_outputs=torch.ones_like(hidden), allow_unused=True)
    sync(device)
    t2 = time.perf_counter()
    # backward to the embedding output only: every module's output gradient, no weight gradient
    with autocast(device, dtype):
        embeds = model.model.embed_tokens(input_ids).detach().requires_grad_()
        hidden = model.model(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False).last_hidden_state
    sync(device)
    t3 = time.perf_counter()
    torch.autograd.grad(hidden, [embeds], grad_outputs=torch.ones_like(hidden))
    sync(device)
    t4 = time.perf_counter()
    return dict(forward=t1 - t0, backward=t2 - t1, backward_inputs_only=t4 - t3)

def linear_alternatives(model, batch: int, length: int, device) -> dict:
    """Seconds, summed over the backbone's nn.Linear layers, of their share of the per-sequence (G=1) and group (G=8)
    inner products by token Grams vs by materializing each sequence's weight gradient ``sum_t g_t x_t^T``
    (``(B, d_out, d_in)``, then the G x G Gram of the flattened gradients). Random factors of the layers' shapes;
    one warm-up call per shape."""
    shapes = defaultdict(int)
    for m in model.model.modules():
        if isinstance(m, nn.Linear):
            shapes[(m.in_features, m.out_features)] += 1
    totals = dict(gram_sq=0.0, gram_group=0.0, materialize_sq=0.0, materialize_group=0.0)
    for (d_in, d_out), count in shapes.items():
        x = torch.randn(batch, length, d_in, device=device)
        g = torch.randn(batch, length, d_out, device=device)

        def gram(k):
            xb, gb = x.reshape(batch // k, k * length, d_in), g.reshape(batch // k, k * length, d_out)
            prod = torch.bmm(gb, gb.transpose(1, 2)) * torch.bmm(xb, xb.transpose(1, 2))
            return prod.reshape(batch // k, k, length, k, length).sum(dim=(2, 4))

        def materialize(k):
            per_sample = torch.einsum("btl,btr->blr", g, x).reshape(batch // k, k, -1)
            return torch.bmm(per_sample, per_sample.transpose(1, 2))

        for name, fn, k in (("gram_sq", gram, 1), ("gram_group", gram, GROUP), ("materialize_sq", materialize, 1),
                            ("materialize_group", materialize, GROUP)):
            fn(k)
            sync(device)
            t0 = time.perf_counter()
            fn(k)
            sync(device)
            totals[name] += count * (time.perf_counter() - t0)
    return totals
