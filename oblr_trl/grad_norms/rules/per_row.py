"""The exact path for small parameters that no rule covers (GPT-OSS attention ``sinks``, a router's weight, the
biases and gains of exotic modules, a tiny model's expert bank).

The module's whole call is recorded in the forward (positional and keyword arguments, detached, and every output
that carries a gradient); once the backward has delivered the outputs' gradients, the module is run again on each
sequence's rows alone and one vector-Jacobian product with that sequence's output gradients gives the per-sequence
gradient of the module's own parameters, held materialized, ``(B, *param.shape)``.

It is exact whenever the module treats the sequences independently (true of every layer of a transformer LM:
nothing mixes rows), and it checks that: each row's re-run output must equal that row of the recorded output, or
the pass stops naming the module. Cost: one forward and backward of the module per sequence (in total about one more
forward+backward of that module on the batch, in ``B`` small calls), ``B x`` its direct parameters in memory, and its
inputs kept from the forward until the end of the backward. Hence the limit :data:`MAX_NUMEL` on the parameters it
takes; larger modules need a rule (or freezing).
"""

from __future__ import annotations

import torch
from torch import nn

from ..factors import Materialized
from ..hooks import Call, _map, output_tensors, replay

MAX_NUMEL = 1 << 21  # trainable elements of one module's own parameters that the per-row path takes at most

def trainable_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)


def per_row_usages(module: nn.Module, call: Call, output_grads: list, batch: int,
                   names: list[str] | None = None) -> dict[str, Materialized]:
    """``{name: Materialized((B, *shape))}``: each sequence's gradient of the module's own trainable parameters (or of
    ``names``, relative to it, dotted for a descendant's parameter it uses functionally), from a re-run per row."""
    if names is None:
        names = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    params = [module.get_parameter(n) for n in names]
    lead = call.outputs[0].shape[0] if call.outputs[0].dim() else 0
    flattened = lead != batch and call.outputs[0].dim() <= 2  # (B*T, d) token lists; never a 3-D (T, B, d)
    if lead == 0 or (lead != batch and not (flattened and lead % batch == 0)):
        raise NotImplementedError(
            f"{type(module).__name__}'s output has shape {tuple(call.outputs[0].shape)}: neither the batch ({batch}) "
            "leading nor tokens flattened to (B*T, d), so its rows cannot be paired with the sequences. Freeze its parameters "
            "(module.requires_grad_(False)) or use OBLRPOConfig(grad_norm_estimator='length', snr_lr=False)."
        )
    per = lead // batch  # output rows per sequence
    # a ZeRO-3 parameter is partitioned (0 elements) outside its module's forward: its shape before partitioning
    grads = [torch.zeros(batch, *(getattr(p, "ds_shape", None) or p.shape), dtype=torch.float32, device=p.device)
             for p in params]

    def rows(t: torch.Tensor, b: int) -> torch.Tensor:
        if per and t.dim() and t.shape[0] == lead:
            return t[b * per : (b + 1) * per]
        if t.dim() and t.shape[0] == batch:
            return t[b : b + 1]
        return t

    with replay(), torch.enable_grad():
        for b in range(batch):
            grad_outputs = [None if g is None else rows(g, b) for g in output_grads]
            if all(g is None for g in grad_outputs):
                continue
            out = output_tensors(module(*_map(lambda t: rows(t, b), call.args),
                                        **_map(lambda t: rows(t, b), call.kwargs)))
            if len(out) != len(call.outputs):
                raise NotImplementedError(f"{type(module).__name__} returned different outputs when re-run per row.")
            for o, recorded in zip(out, call.outputs):
                expected = rows(recorded, b)
                tol = (1e-3 if o.dtype == torch.float32 else 3e-2) * float(expected.abs().max()) + 1e-6
                if o.shape != expected.shape or float((o.detach() - expected).abs().max()) > tol:
                    raise NotImplementedError(
                        f"{type(module).__name__} does not treat the sequences independently (a row re-run alone "
                        "gives another output; dropout in train mode does that too): its per-sequence gradients "
                        "cannot be taken row by row. Freeze its parameters (module.requires_grad_(False)), call "
                        "model.eval() to disable dropout, or use OBLRPOConfig(grad_norm_estimator='length', "
                        "snr_lr=False)."
                    )
            pairs = [(o, g) for o, g in zip(out, grad_outputs) if g is not None]
            row = torch.autograd.grad([o for o, _ in pairs], params, [g.to(o.dtype) for o, g in pairs],
                                      allow_unused=True)
            for acc, r in zip(grads, row):
                if r is not None:
                    acc[b] = r.float()
    return {n: Materialized(g) for n, g in zip(names, grads)}
