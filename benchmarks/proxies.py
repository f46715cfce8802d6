"""Baseline-weight proxies against exact per-sequence gradient norms on a real LLM (SmolLM2-135M-Instruct), at fixed
parameters (issue 18).

For a few prompts, draw K independent groups of G completions each from the model itself (temperature 1, no top-k/p),
score them with the task's reasoning-gym verifier, and take for every distinct completion

* its exact score vector ``s_i = grad sum_t log pi(o_i,t)`` in a **LoRA gradient space** (rank ``--rank`` adapters on
  every linear layer of the 30 blocks, B = 0 so the policy is the model's own: the gradient w.r.t. B is the full weight
  gradient ``delta x^T`` projected on A's random rows, a sketch of the full gradient);
* the proxies from the same forward: ``|o_i|`` (verl OPO's ``"length"``) and ``sum_t (1 - 2 pi_t + sum_v pi_v^2)``
  (verl's optimal-token baseline, ``"logit"``, :func:`oblr_trl.estimators.logit_proxy_weights`).

Reported per weight source (length, logit, exact ``||s_i||^2``): Spearman rank correlation of ``w_i`` with the exact
norms (per prompt, then averaged); the leave-one-out baseline's RMS error against the oracle optimal baseline
``E[w r] / E[w]`` (Theorem 7, exact weights, all K*G samples of the prompt); and the trace of the covariance of the
group's policy-gradient estimate ``g = (1/G) sum_i A_i s_i`` across the K groups, as a ratio to RLOO's, with paired
bootstrap 90% intervals (the K groups resampled with replacement, the same resample for every method). Also GRPO
(mean, /std) and RLOO. And the SNR of one group's gradient across all prompts' groups (the step size's input), from
which N SNR / (1 + N SNR) at N = 8 prompts (rough: few prompts).

    python benchmarks/proxies.py                # ~25 min on 2 shared CPU cores
    python benchmarks/proxies.py --quick        # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from grad_variance import gram_stats, sample_prompt  # noqa: E402

from oblr_trl import gradient_weighted_baseline, mean_baseline  # noqa: E402
from oblr_trl.estimators import logit_proxy_weights, token_log_sum_sq_probs  # noqa: E402
from oblr_trl.tasks import make_dataset, make_reward_func  # noqa: E402

METHODS = ["grpo", "rloo", "length", "logit", "exact"]
LABELS = {
    "grpo": "GRPO (mean, /std)",
    "rloo": "RLOO (leave-one-out mean)",
    "length": "OPO proxy w=|o| (leave-one-out)",
    "logit": "logit proxy w=sum(1-2pi+sum pi^2) (leave-one-out)",
    "exact": "OBLR-PO exact w=||s||^2 (leave-one-out)",
}
INSTRUCTION = " Reply with the number only."


def advantages(method: str, r: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    K, G = r.shape
    flat = r.reshape(-1)
    if method == "grpo":
        return (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    if method == "rloo":
        return r - mean_baseline(flat, None, G, True)[0].view(K, G)
    return r - gradient_weighted_baseline(flat, weights[method].reshape(-1), G, True)[0].view(K, G)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm() + 1e-30))


def score_and_proxy(model, params, prompt_ids: list[int], completion: list[int]) -> tuple[torch.Tensor, float, float]:
    """(LoRA-space score vector s_i (float32), logit proxy, seconds of the forward) for one completion."""
    ids = torch.tensor([prompt_ids + completion])
    t0 = time.perf_counter()
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None])[:, 0]
    with torch.no_grad():
        proxy = logit_proxy_weights(logps[None].detach(), token_log_sum_sq_probs(logits.detach())[None],
                                    torch.ones(1, len(completion)))
    forward_s = time.perf_counter() - t0
    grads = torch.autograd.grad(logps.sum(), params)
    return torch.cat([g.reshape(-1) for g in grads]).float(), float(proxy), forward_s


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/work/cache/smollm2-135m-instruct")
    parser.add_argument("--task", default="basic_arithmetic")
    parser.add_argument("--prompts", type=int, default=3, help="prompts kept (with mixed rewards in the pilot)")
    parser.add_argument("--candidates", type=int, default=16, help="prompts piloted")
    parser.add_argument("--repeats", type=int, default=8, help="K groups per prompt")
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=12)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--bootstrap", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "proxies"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.candidates, args.repeats, args.group_size, args.bootstrap = 1, 4, 3, 4, 50
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.eval()
    params = [p for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n]  # B = 0: A gets no gradient
    dim = sum(p.numel() for p in params)
    reward_func = make_reward_func(args.task, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    data = make_dataset(args.task, size=args.candidates, seed=args.seed, min_terms=2, max_terms=2, min_digits=1,
                        max_digits=1)
    K, G = args.repeats, args.group_size
    start = time.time()

    def prompt_of(row):
        return [{"role": "user", "content": row["prompt"][0]["content"] + INSTRUCTION}]

    def rewards_of(row, texts):
        return reward_func(prompts=None, completions=texts, entry=[row["entry"]] * len(texts))

    # pilot: keep the first prompts whose sampled completions are sometimes right, sometimes wrong
    kept, pilot = [], []
    for i in range(len(data)):
        _, _, texts = sample_prompt(model, tokenizer, prompt_of(data[i]), 16, args.max_new_tokens)
        acc = sum(rewards_of(data[i], texts)) / len(texts)
        pilot.append(acc)
        if 0 < acc < 1:
            kept.append(i)
        if len(kept) == args.prompts:
            break
    print(f"pilot accuracies {pilot}; kept prompts {kept}", flush=True)

    per_prompt, all_groups_U, fwd_s, bwd_s = [], [], [], []
    for i in kept:
        row = data[i]
        prompt_ids, completions, texts = sample_prompt(model, tokenizer, prompt_of(row), K * G, args.max_new_tokens)
        r = torch.tensor(rewards_of(row, texts), dtype=torch.float64).view(K, G)
        cache, unique, proxies, index = {}, [], [], []
        for c in completions:
            key = tuple(c)
            if key not in cache:
                t0 = time.perf_counter()
                s, proxy, f = score_and_proxy(model, params, prompt_ids, c)
                fwd_s.append(f)
                bwd_s.append(time.perf_counter() - t0 - f)
                cache[key] = len(unique)
                unique.append(s)
                proxies.append(proxy)
            index.append(cache[key])
        U = torch.stack(unique).double()
        UU = U @ U.T
        index = torch.tensor(index)
        weights = {
            "exact": torch.diagonal(UU)[index].view(K, G),
            "logit": torch.tensor(proxies, dtype=torch.float64)[index].view(K, G),
            "length": torch.tensor([len(c) for c in completions], dtype=torch.float64).view(K, G),
        }
        coeffs = {}
        for m in METHODS:
            C = torch.zeros(K, len(unique), dtype=torch.float64)
            C.scatter_add_(1, index.view(K, G), advantages(m, r, weights) / G)
            coeffs[m] = C
        w_ex = weights["exact"].reshape(-1)
        oracle = float((w_ex * r.reshape(-1)).sum() / w_ex.sum())
        entry = {
            "prompt": row["prompt"][0]["content"], "mean_reward": float(r.mean()),
            "mixed_groups": float(((r.max(1).values - r.min(1).values) > 0).double().mean()),
            "distinct": len(unique),
            "spearman": {m: spearman(weights[m].reshape(-1), w_ex) for m in ("length", "logit")},
            "baseline_rmse": {},
            "gram": {m: C @ UU @ C.T for m, C in coeffs.items()},
        }
        for m in ("rloo", "length", "logit", "exact"):
            b = r - advantages(m, r, weights)
            entry["baseline_rmse"][m] = float(((b - oracle) ** 2).mean().sqrt())
        per_prompt.append(entry)
        all_groups_U.append(coeffs["exact"] @ U)  # (K, dim): each group's gradient with the default advantages
        print(f"prompt {i}: reward {entry['mean_reward']:.2f}, mixed {entry['mixed_groups']:.2f}, distinct "
              f"{len(unique)}, spearman {entry['spearman']}, {time.time() - start:.0f}s", flush=True)

    # tr Cov ratios to RLOO, paired bootstrap over groups (same resample for every method and prompt)
    gen = torch.Generator().manual_seed(args.seed)

    def tr_cov(m, idx=None):
        return sum(gram_stats(e["gram"][m], idx)[0] for e in per_prompt) / len(per_prompt)

    point = {m: tr_cov(m) / tr_cov("rloo") for m in METHODS}
    boot = {m: [] for m in METHODS}
    for _ in range(args.bootstrap):
        idx = torch.randint(0, K, (K,), generator=gen)
        ref = tr_cov("rloo", idx)
        if not ref > 0:  # a resample of identical groups (tiny K): no ratio
            continue
        for m in METHODS:
            boot[m].append(tr_cov(m, idx) / ref)
    ci = {m: (float(torch.tensor(v).quantile(0.05)), float(torch.tensor(v).quantile(0.95))) for m, v in boot.items()}

    # one group's gradient as the SNR's sample, across every prompt's groups (g_q = the group's gradient)
    g = torch.cat(all_groups_U)
    mean = g.mean(0)
    noise = float(((g - mean) ** 2).sum(1).mean() * g.shape[0] / (g.shape[0] - 1))
    signal = max(float(mean @ mean) - noise / g.shape[0], 0.0)
    snr = signal / noise
    n_step = 8
    result = dict(
        command="python " + " ".join(["benchmarks/proxies.py", *sys.argv[1:]]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.node()} ({os.cpu_count()} CPUs shared with other jobs, 1 torch thread)",
        model=args.model, task=args.task, lora_rank=args.rank, gradient_dim=dim, K=K, G=G, prompts=kept,
        pilot_accuracies=pilot, elapsed_s=round(time.time() - start),
        spearman={m: sum(e["spearman"][m] for e in per_prompt) / len(per_prompt) for m in ("length", "logit")},
        baseline_rmse={m: sum(e["baseline_rmse"][m] for e in per_prompt) / len(per_prompt)
                       for m in ("rloo", "length", "logit", "exact")},
        tr_cov_vs_rloo=point, tr_cov_ci90=ci, group_snr=snr,
        scale_at_8_prompts=n_step * snr / (1 + n_step * snr),
        seconds_forward_per_completion=sum(fwd_s) / len(fwd_s), seconds_backward_per_completion=sum(bwd_s) / len(bwd_s),
        per_prompt=[{k: v for k, v in e.items() if k != "gram"} for e in per_prompt],
    )
    lines = [
        "# Baseline-weight proxies vs exact norms on SmolLM2-135M-Instruct (fixed parameters)",
        "",
        f"Generated by `{result['command']}` on {result['date']}, {result['machine']}; "
        f"{result['elapsed_s'] / 60:.1f} min. Task {args.task} (2 one-digit terms, the prompt plus "
        f"'{INSTRUCTION.strip()}'), {len(kept)} prompts with mixed rewards in a 16-sample pilot "
        f"(pilot accuracies {', '.join(f'{a:.2f}' for a in pilot)}), K={K} groups of G={G} per prompt, "
        f"max {args.max_new_tokens} new tokens. Gradient space: LoRA rank {args.rank} on every linear layer, "
        f"gradient w.r.t. B at B=0 ({dim:,} dims; the full weight gradient projected on A's random rows).",
        "",
        "| weights | Spearman w vs exact | baseline RMSE vs oracle | tr Cov / RLOO's | 90% CI |",
        "|---|---|---|---|---|",
    ]
    for m in METHODS:
        sp = {"exact": "1"}.get(m, f"{result['spearman'][m]:.2f}" if m in result["spearman"] else "-")
        rm = f"{result['baseline_rmse'][m]:.3f}" if m in result["baseline_rmse"] else "-"
        lines.append(f"| {LABELS[m]} | {sp} | {rm} | {point[m]:.3f} | {ci[m][0]:.3f}-{ci[m][1]:.3f} |")
    lines += [
        "",
        f"Cost per completion (this loop, one sequence at a time, CPU under other jobs' load): forward with both "
        f"proxies {result['seconds_forward_per_completion']:.2f} s, the exact norm's backward "
        f"{result['seconds_backward_per_completion']:.2f} s more.",
        "",
        f"SNR of one group's gradient (exact weights, leave-one-out) across all {len(kept) * K} groups: "
        f"{snr:.4f}, so N SNR / (1 + N SNR) = {result['scale_at_8_prompts']:.3f} at N = 8 prompts per step "
        f"(rough: {len(kept)} prompts).",
        "",
        "Per prompt: " + "; ".join(f"reward {e['mean_reward']:.2f}, mixed groups {e['mixed_groups']:.2f}, "
                                  f"{e['distinct']} distinct" for e in per_prompt) + ".",
        "",
    ]
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
