"""The forward-only logit proxy of the baseline weights against brute force (per-position autograd), and TRL 1.16's
fused LM head as its source of ``log sum pi^2``."""

from __future__ import annotations

import math

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from oblr_trl.demo.tiny import build_model, build_tokenizer
from oblr_trl.estimators import logit_proxy_weights, token_log_sum_sq_probs


def brute_force(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """sum_t ||d log pi(o_t) / d z_t||^2 by autograd, one position at a time."""
    out = torch.zeros(logits.shape[0], dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not mask[b, t]:
                continue
            z = logits[b, t].double().clone().requires_grad_()
            (g,) = torch.autograd.grad(torch.log_softmax(z / temperature, -1)[tokens[b, t]], z)
            out[b] += (g * temperature).pow(2).sum()  # the gradient in the tempered logits z / T
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logit_proxy_matches_per_position_autograd(temperature):
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11) * 3
    tokens = torch.randint(0, 11, (5, 7))
    mask = torch.rand(5, 7) > 0.3
    logps = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None])[..., 0]
    w = logit_proxy_weights(logps, token_log_sum_sq_probs(logits, temperature, chunk_size=4), mask)
    torch.testing.assert_close(w.double(), brute_force(logits, tokens, mask, temperature), rtol=1e-5, atol=1e-6)
    assert bool((w >= 0).all()) and bool((w <= 2 * mask.sum(-1)).all())


def test_logit_proxy_degenerate_input_is_defined():
    # a one-hot distribution on the sampled token gives 0; on another token, 2; masked non-finite values add nothing
    logps = torch.tensor([[0.0, -math.inf, float("nan")]])
    lssp = torch.tensor([[0.0, 0.0, float("nan")]])
    w = logit_proxy_weights(logps, lssp, torch.tensor([[1, 1, 1]]))
    assert w.tolist() == [2.0]
    assert logit_proxy_weights(logps, lssp, torch.zeros(1, 3)).tolist() == [0.0]


def test_trls_fused_head_returns_the_sum_of_squared_probabilities():
    """TRL 1.16's fused LM head (``outputs=(..., "log_sum_sq_probs")``) gives the proxy without materialized logits."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer).eval()
    ids = torch.randint(3, len(tokenizer), (3, 9))
    attention = torch.ones_like(ids)
    temperature = 0.8
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    labels = ids.clone()
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "log_sum_sq_probs"))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    assert out.log_sum_sq_probs.shape == (3, 8)  # scored positions: each token given its prefix
    torch.testing.assert_close(out.log_sum_sq_probs.float(), token_log_sum_sq_probs(logits, temperature),
                               rtol=1e-4, atol=1e-5)
    mask = torch.ones(3, 8, dtype=torch.bool)
    expected = brute_force(logits, ids[:, 1:], mask, temperature)
    fused = logit_proxy_weights(out.log_probs, out.log_sum_sq_probs, mask)
    torch.testing.assert_close(fused.double(), expected, rtol=1e-4, atol=1e-5)
