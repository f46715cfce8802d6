"""benchmarks/proxies.py: the batched per-sequence LoRA-B score vectors and logit proxies (one forward, one backward,
hooks + einsum) equal the one-completion-at-a-time autograd reference, and the sampler draws from the policy."""

import importlib.util
from pathlib import Path

import torch

import peft  # an install requirement (setup.cfg): missing is a failure, not a skip

SPEC = importlib.util.spec_from_file_location("proxies", Path(__file__).resolve().parents[1] / "benchmarks" / "proxies.py")
proxies = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(proxies)


def tiny_lora_model(seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=5,
                         tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=3, lora_alpha=3, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.eval()
    return model


def test_batched_scores_equal_one_at_a_time_autograd():
    model = tiny_lora_model()
    params = [p for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n]
    modules = proxies.lora_b_modules(model)
    assert [m.weight for m in modules] == params
    prompt = [1, 7, 9, 11, 3]
    completions = [[20, 21, 5], [30, 31, 32, 33, 34, 35], [40], [50, 51, 52, 53]]  # ragged: right padding matters
    S, proxy, fwd, bwd = proxies.batched_scores(model, modules, prompt, completions)
    assert S.shape == (4, sum(p.numel() for p in params)) and fwd > 0 and bwd > 0
    for i, c in enumerate(completions):
        s, p = proxies.completion_score(model, params, prompt, c)  # one at a time, plain autograd
        assert s.norm() > 0
        assert (S[i] - s).norm() <= 1e-4 * s.norm(), i
        assert abs(float(proxy[i]) - p) <= 1e-4 * abs(p), i
    # the per-sequence gradients sum to the batch gradient (a second, independent check of the hook bookkeeping)
    total = sum(proxies.completion_score(model, params, prompt, c)[0] for c in completions)
    assert (S.sum(0) - total).norm() <= 1e-4 * total.norm()


def test_sampler_draws_the_policy():
    """First-token frequencies of the KV-cache sampler match softmax(logits) (chi-square-sized tolerance), completions
    end at their first eos, and the draws are reproducible from the generator."""
    model = tiny_lora_model(1)
    with torch.no_grad():
        model.get_base_model().model.norm.weight.mul_(12.0)  # peaked logits, so a wrong sampler would show
    prompt = [1, 7, 9]
    with torch.no_grad():
        pi = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert 0.5 * (pi - 1 / pi.numel()).abs().sum() > 0.4  # far from uniform
    n = 3000
    draws = proxies.sample_completions(model, prompt, n, 3, eos_token_id=5, generator=torch.Generator().manual_seed(0),
                                       batch=1000)
    again = proxies.sample_completions(model, prompt, n, 3, eos_token_id=5, generator=torch.Generator().manual_seed(0),
                                       batch=1000)
    assert draws == again
    assert all(1 <= len(c) <= 3 and (5 not in c[:-1]) for c in draws)
    freq = torch.bincount(torch.tensor([c[0] for c in draws]), minlength=pi.numel()).double() / n
    # total variation between empirical and exact first-token law: ~sqrt(V / n) / 2 for a correct sampler
    assert 0.5 * (freq - pi.double()).abs().sum() < 0.12
    # second tokens follow the policy given the first (checked on the most frequent first token)
    top = int(freq.argmax())
    with torch.no_grad():
        pi2 = torch.softmax(model(input_ids=torch.tensor([prompt + [top]])).logits[0, -1].float(), -1).double()
    seconds = [c[1] for c in draws if c[0] == top and len(c) > 1]
    f2 = torch.bincount(torch.tensor(seconds), minlength=pi.numel()).double() / len(seconds)
    assert 0.5 * (f2 - pi2).abs().sum() < 0.5 * (pi.numel() / len(seconds)) ** 0.5 + 0.05


def test_stratified_oracle_is_the_full_sample_ratio_and_consistent_from_mixed_groups():
    """All scored: exactly sum w r / sum w. Only mixed groups scored (the benchmark's saving): Monte Carlo against the
    closed form E[w r] / E[w] of a known law, where the naive ratio over the scored samples alone is biased."""
    gen = torch.Generator().manual_seed(0)
    r = torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0, 0.0])
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
    assert abs(proxies.stratified_oracle(r, w, torch.ones(6, dtype=torch.bool)) - float((w * r).sum() / w.sum())) < 1e-12
    assert proxies.stratified_oracle(r, w, torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)) is None  # 0.5 unseen
    # law: r ~ Bernoulli(0.15); w | r=1 ~ 1 + Exp(1) * 3, w | r=0 ~ 1 + Exp(1); E[w r]/E[w] = 0.15*4 / (0.15*4 + 0.85*2)
    truth = 0.15 * 4 / (0.15 * 4 + 0.85 * 2)
    K, G = 20000, 4
    rr = (torch.rand(K, G, generator=gen) < 0.15).double()
    ww = 1 + torch.empty(K, G, dtype=torch.float64).exponential_(generator=gen) * (1 + 2 * rr)
    mixed = (rr.max(1).values > rr.min(1).values)[:, None].expand(K, G).reshape(-1)
    est = proxies.stratified_oracle(rr.reshape(-1), ww.reshape(-1), mixed)
    naive = float((ww.reshape(-1)[mixed] * rr.reshape(-1)[mixed]).sum() / ww.reshape(-1)[mixed].sum())
    assert abs(est - truth) < 0.01 < abs(naive - truth)


def test_plugin_values_are_what_bootstrap_resamples_average_to():
    """The basic interval's premise: over resamples of the K groups, the debiased estimates average to the plug-in
    values (covariance over K, means not debiased), not to the debiased point estimates."""
    gen = torch.Generator().manual_seed(1)
    K, D = 6, 5

    def entry():
        vecs = {m: torch.randn(K, D, generator=gen, dtype=torch.float64) + 0.7 for m in proxies.METHODS}
        return {"gram": {m: v @ v.T for m, v in vecs.items()},
                "gram_d": {m: (v - vecs["rloo"]) @ (v - vecs["rloo"]).T for m, v in vecs.items()}}

    per_prompt = [entry(), entry()]
    point = proxies.pooled(per_prompt, K)
    plug = proxies.pooled(per_prompt, K, plugin=True)
    n = 4000
    sums = {m: dict(tr=0.0, signal=0.0, bias_sq=0.0) for m in proxies.METHODS}
    for _ in range(n):
        b = proxies.pooled(per_prompt, K, [torch.randint(0, K, (K,), generator=gen) for _ in per_prompt])
        for m in proxies.METHODS:
            for k in sums[m]:
                sums[m][k] += b[m][k] / n
    for m in ("exact_loo", "grpo"):
        for k in ("tr", "signal", "bias_sq"):
            assert abs(sums[m][k] - plug[m][k]) < 0.05 * abs(plug[m][k]) + 0.02, (m, k)
        assert abs(plug[m]["signal"] - point[m]["signal"]) > 0.05  # the two differ: the check has teeth
    lo, hi = proxies.basic_interval(1.0, 1.2, [1.1, 1.2, 1.3] * 10)
    assert abs(lo - 0.9) < 0.02 and abs(hi - 1.1) < 0.02
    assert proxies.basic_interval(1.0, 1.0, [float("nan")] * 5 + [1.0]) is None
