"""Per-completion gradient scores and their statistics, shared by grad_variance.py, proxies.py and variance_long.py:
one completion's score vector ``grad sum_t log pi(o_t)`` (plain autograd), a batch of them in a LoRA-B gradient space
from one forward and one backward, i.i.d. completions from the policy itself, and Gram-matrix statistics."""

from __future__ import annotations

import time

import torch

from oblr_trl.estimators import logit_proxy_weights, token_log_sum_sq_probs


def completion_score(model, params, prompt_ids: list[int], completion: list[int]) -> tuple[torch.Tensor, float]:
    """Flattened grad_theta of sum_t log pi(o_t | q, o_<t) for one completion (float64), and the forward-only logit
    proxy of its squared norm from the same forward (what ``grad_norm_estimator="logit"`` uses)."""
    ids = torch.tensor([prompt_ids + completion])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
    token_logps = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]
    proxy = logit_proxy_weights(
        token_logps[None].detach(), token_log_sum_sq_probs(logits.detach())[None], torch.ones(1, len(completion))
    )
    grads = torch.autograd.grad(token_logps.sum(), params, allow_unused=True)
    score = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])
    return score.double(), float(proxy[0])

def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman rank correlation of two 1-D tensors (average ranks for ties); None below 3 points or for a constant."""
    if a.numel() < 3:
        return None

    def ranks(x):
        order = torch.argsort(x)
        r = torch.empty_like(x, dtype=torch.float64)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in torch.unique(x):  # ties share their mean rank
            tie = x == v
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a.double()), ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.norm() * rb.norm()).item()
    return float((ra @ rb) / denom) if denom > 0 else None

def gram_stats(gram: torch.Tensor, idx: torch.Tensor | None = None) -> tuple[float, float]:
    """(tr Cov, ||mean||^2) of K vectors from their Gram matrix (optionally a resample ``idx`` of them)."""
    if idx is not None:
        gram = gram[idx][:, idx]
    K = gram.shape[0]
    sum_sq = torch.diagonal(gram).sum()
    total = gram.sum()
    mean_sq = total / K**2
    tr_cov = (sum_sq - total / K) / (K - 1)
    return float(tr_cov), float(mean_sq)


def lora_b_modules(model) -> list[torch.nn.Module]:
    """The LoRA B linears of a peft model, in the order of ``named_parameters`` (so their flattened weight gradients
    line up with :func:`completion_score`'s ``params``)."""
    return [m for n, m in model.named_modules() if n.split(".")[-2:-1] == ["lora_B"] and hasattr(m, "weight")]

@torch.no_grad()
def sample_completions(model, prompt_ids: list[int], n: int, max_new_tokens: int, eos_token_id: int,
                       generator: torch.Generator, batch: int = 64) -> list[list[int]]:
    """n i.i.d. completions of one prompt from the policy itself (temperature 1, full softmax), each up to and
    including its first eos: the prompt is prefilled once per chunk of ``batch`` and its KV cache repeated, then all
    rows decode together (no padding: a row that has ended keeps sampling, and what follows its eos is dropped)."""
    out = []
    for start in range(0, n, batch):
        b = min(batch, n - start)
        prefill = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        cache = prefill.past_key_values
        cache.batch_repeat_interleave(b)
        logits = prefill.logits[:, -1].float().expand(b, -1)
        rows = []
        for _ in range(max_new_tokens):
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)  # (b, 1)
            rows.append(nxt)
            step = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, logits = step.past_key_values, step.logits[:, -1].float()
        for row in torch.cat(rows, 1).tolist():
            ids = []
            for t in row:
                ids.append(t)
                if t == eos_token_id:
                    break
            out.append(ids)
    return out

def batched_scores(model, modules: list[torch.nn.Module], prompt_ids: list[int], completions: list[list[int]]
                   ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Per-completion LoRA-B score vectors and logit proxies from ONE batched forward and ONE backward.

    The batch is ``prompt + completion`` right-padded (causal attention: real tokens never see the padding, so no
    attention mask is needed and every row's values equal its unpadded forward); the loss is
    ``sum_i sum_t log pi(o_i,t)`` over the real completion tokens. Hooks record each LoRA B linear's input ``a_t = A x_t``
    (forward) and its output gradient ``delta_t`` (backward), and the per-sequence weight gradient is
    ``sum_t delta_t a_t^T`` (einsum over the sequence axis: Opacus-style materialised per-sample gradients).

    Returns ``(S (B, D) float32 in the order of `lora_b_modules`, logit proxies (B,) float64, forward s, backward s)``.
    """
    B, P = len(completions), len(prompt_ids)
    L = max(len(c) for c in completions)
    ids = torch.zeros(B, P + L, dtype=torch.long)
    mask = torch.zeros(B, L)
    for i, c in enumerate(completions):
        ids[i] = torch.tensor(prompt_ids + c + [c[-1]] * (L - len(c)))  # pad with any id: masked, never attended to
        mask[i, : len(c)] = 1
    sizes = [m.weight.numel() for m in modules]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    S = torch.zeros(B, sum(sizes))
    handles, inputs = [], {}

    def forward_hook(k):
        def hook(module, args, output):
            inputs[k] = args[0].detach()

            def grad_hook(grad):
                per_seq = torch.einsum("bto,btr->bor", grad.float(), inputs.pop(k).float())
                S[:, offsets[k] : offsets[k] + sizes[k]] = per_seq.reshape(B, -1)

            output.register_hook(grad_hook)
        return hook

    for k, m in enumerate(modules):
        handles.append(m.register_forward_hook(forward_hook(k)))
    try:
        t0 = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=L + 1).logits[:, :-1].float()  # (B, L, V)
        logps = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None])[..., 0]
        with torch.no_grad():
            proxy = logit_proxy_weights(logps.detach(), token_log_sum_sq_probs(logits.detach()), mask)
        loss = (logps * mask).sum()
        forward_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.autograd.grad(loss, [m.weight for m in modules])
        backward_s = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    if inputs:
        raise RuntimeError(f"studies.scores.batched_scores: {len(inputs)} LoRA B layers got no gradient (unused adapters?)")
    return S, proxy.double(), forward_s, backward_s

def gram64(U: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    """``U U^T`` accumulated in float64 over column chunks (U float32, (n, D))."""
    out = torch.zeros(U.shape[0], U.shape[0], dtype=torch.float64)
    for c in range(0, U.shape[1], chunk):
        block = U[:, c : c + chunk].double()
        out += block @ block.T
    return out
