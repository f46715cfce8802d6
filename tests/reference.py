"""Brute-force oracles for the tests: one ``torch.autograd.grad`` per sequence (the slow, obviously-correct way)."""

import torch

from oblr_trl.grad_norms.coverage import completion_logprob_sums, per_row_grads  # noqa: F401 (re-exported for tests)


def per_sample_grads(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """List of per-row flattened gradients of ``sum_t log pi`` over the trainable parameters (the package's oracle,
    :func:`oblr_trl.grad_norms.coverage.per_row_grads`, flattened; zeros where a row does not reach a parameter)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.cat([(gi if gi is not None else torch.zeros_like(p)).flatten() for gi, p in zip(row, params)])
            for row in per_row_grads(model, input_ids, attention_mask, completion_mask, temperature, params)]


def per_sample_sq_norms(*args, **kwargs):
    return torch.stack([g.double().pow(2).sum() for g in per_sample_grads(*args, **kwargs)])


def within_group_products(grads, group_size):
    """``(B / k, k, k)`` inner products ``<g_i, g_j>`` of per-sample gradients within consecutive groups of ``k``."""
    blocks = torch.stack([g.double() for g in grads]).reshape(len(grads) // group_size, group_size, -1)
    return blocks @ blocks.transpose(1, 2)


def padded_batch(vocab, batch=6, prompt=5, completion=6, seed=0):
    """Left-padded prompts, right-padded completions, one empty completion (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, prompt + completion), generator=g)
    attention = torch.ones_like(ids)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    ids[0, :2], attention[0, :2] = 0, 0  # left padding
    ids[1, :1], attention[1, :1] = 0, 0
    completion_mask[1, 3:] = 0  # right padding
    ids[1, prompt + 3 :], attention[1, prompt + 3 :] = 0, 0
    completion_mask[2] = 0  # empty completion
    ids[2, prompt:], attention[2, prompt:] = 0, 0
    return ids, attention, completion_mask


def module_sq_norms(module, x, seed=0, **kwargs):
    """Opacus's ``run_test`` for one layer: ``(ours, reference)`` squared norms of each row's gradient of
    ``<module(x)_b, r_b>`` (``r``: a fixed random output weighting) w.r.t. the module's own trainable parameters.
    Ours: the capture hooks plus the module's rule (or the per-row path), as the whole-model pass uses them.
    Reference: one ``torch.autograd.grad`` per row, the module run on that row alone."""
    from oblr_trl.grad_norms import engine, hooks
    from oblr_trl.grad_norms.rules.registry import call_usages
    from oblr_trl.grad_norms.coverage import how_handled, resolve

    batch = x.shape[0]
    how = how_handled(module)
    assert how is not None, f"{type(module).__name__} is not covered"
    out = module(x, **kwargs)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    per_row = {module} if how in ("per-row", "routed") else set()
    with hooks.capture([module], batch, calls_of=per_row) as (records, _):
        y = module(x, **kwargs)
        (y.float() * r).sum().backward(inputs=[p for p in module.parameters() if p.requires_grad])
    usages = {}
    for record in records:
        if isinstance(record.activation, hooks.Call):
            found = call_usages(module, record.activation, record.output_grad, batch)
        else:
            found = resolve(module)[1](module, record.activation, record.output_grad)
        for name, usage in found.items():
            usages.setdefault((module, name), []).append(usage)
    for p in module.parameters():
        p.grad = None
    ours = engine.PerSequenceGradients(usages, batch, x.device).inner_products(1).reshape(-1)
    params = [p for p in module.parameters(recurse=False) if p.requires_grad]
    reference = []
    for b in range(batch):
        rb = r[b : b + 1] if r.shape[0] == batch else r
        grads = torch.autograd.grad((module(x[b : b + 1], **kwargs).float() * rb).sum(), params, allow_unused=True)
        reference.append(sum(g.double().pow(2).sum() for g in grads if g is not None))
    return ours.double(), torch.stack(reference)


# One layer at a time: the shapes, inputs and weights every rule's test feeds `module_sq_norms`.
B, T, D = 4, 5, 12


def randomised(module):
    """The module with every parameter drawn from N(0, 1) (seed 3): no zero or one left at its initial value."""
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def hidden(seed=1):
    """A (B, T, D) batch of hidden states."""
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def token_ids(n=20):
    """A (B, T) batch of token ids below n."""
    return torch.randint(0, n, (B, T), generator=torch.Generator().manual_seed(2))


def assert_rule_matches_per_sample_autograd(build, inputs):
    """The layer `build()` (randomised) is handled by a rule, registered or recognised by what it computes, and its
    per-row squared norms on `inputs()` equal per-row autograd's (all above 0)."""
    from oblr_trl.grad_norms.coverage import how_handled

    module = randomised(build())
    assert how_handled(module) == "rule"
    ours, reference = module_sq_norms(module, inputs())
    assert reference.min() > 0
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)
