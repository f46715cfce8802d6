"""benchmarks/grad_variance.py: the logit-proxy weights it scores each completion with, the methods' advantages from
them, and the rank correlation it reports, each against a brute-force reference."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

SPEC = importlib.util.spec_from_file_location(
    "grad_variance", Path(__file__).resolve().parents[1] / "benchmarks" / "grad_variance.py"
)
grad_variance = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(grad_variance)


def brute_spearman(a, b):
    """Pearson correlation of average ranks, ranks counted by comparisons (ties share the mean of their positions)."""

    def ranks(x):
        return [sum(y < v for y in x) + (sum(y == v for y in x) - 1) / 2 for v in x]

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def test_spearman_matches_the_rank_formula_and_handles_ties():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(9, generator=g), torch.randn(9, generator=g)
    d = a.argsort().argsort().double() - b.argsort().argsort().double()
    assert grad_variance.spearman(a, b) == pytest.approx(1 - 6 * float((d**2).sum()) / (9 * 80), abs=1e-12)
    assert grad_variance.spearman(a, a.exp()) == pytest.approx(1.0)
    assert grad_variance.spearman(a, -a) == pytest.approx(-1.0)
    tied_a = torch.tensor([1.0, 2.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    tied_b = torch.tensor([0.3, 0.1, 0.4, 0.4, 0.2, 0.9, 0.5])
    assert grad_variance.spearman(tied_a, tied_b) == pytest.approx(brute_spearman(tied_a.tolist(), tied_b.tolist()))
    assert grad_variance.spearman(torch.ones(5), a[:5]) is None  # a constant has no ranking
    assert grad_variance.spearman(a[:2], b[:2]) is None


def test_completion_score_returns_the_score_and_its_logit_proxy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, completion = [3, 5, 7, 11], [13, 2, 29]
    score, proxy = grad_variance.completion_score(model, params, prompt, completion)

    ids = torch.tensor([prompt + completion])
    probs = torch.softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double(), -1)
    expected_proxy = sum(1 - 2 * probs[t, tok] + (probs[t] ** 2).sum() for t, tok in enumerate(completion))
    assert proxy == pytest.approx(float(expected_proxy), rel=1e-5)

    logp = sum(torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 + t], -1)[tok]
               for t, tok in enumerate(completion))
    grads = torch.autograd.grad(logp, params)
    torch.testing.assert_close(score, torch.cat([g.reshape(-1) for g in grads]).double(), rtol=1e-5, atol=1e-6)


def test_logit_methods_are_the_weighted_baseline_with_proxy_weights():
    g = torch.Generator().manual_seed(1)
    K, G = 3, 4
    r = torch.randint(0, 2, (K, G), generator=g).double()
    w, lengths, proxy = (torch.rand(K, G, generator=g, dtype=torch.float64) + 0.1 for _ in range(3))
    for method, loo in (("logit", False), ("logit_loo", True)):
        got = grad_variance.advantages(method, r, w, lengths, proxy)
        for k, i in itertools.product(range(K), range(G)):
            others = [j for j in range(G) if j != i] if loo else list(range(G))
            b = sum(proxy[k, j] * r[k, j] for j in others) / sum(proxy[k, j] for j in others)
            assert float(got[k, i]) == pytest.approx(float(r[k, i] - b))
    assert "logit_loo" in grad_variance.METHODS and "logit" in grad_variance.LABELS
