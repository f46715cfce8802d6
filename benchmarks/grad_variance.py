"""Gradient variance of each method's advantage estimator at FIXED parameters (the paper's central claim).

For the warm tiny model of each task and a fixed set of prompts, draw K independent groups of G completions per prompt
(`model.generate(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)`: exactly the policy), score them with the
task's reasoning-gym verifier, take each completion's exact score vector s_i = grad_theta sum_t log pi(o_i | q)
(one autograd call per distinct completion, flattened over all ~130k parameters), and form, for every method and
every group, the policy-gradient estimate

    g = (1/G) sum_i A_i s_i

with the method's advantages A_i computed from the SAME samples:

    reinforce  A = r                                    (no baseline)
    grpo       A = (r - mean) / (std + 1e-4)            (TRL's scale_rewards="group"; std with Bessel, as TRL's nanstd)
    dr_grpo    A = r - mean                             (scale_rewards="none")
    rloo       A = r - leave-one-out mean
    opo        A = r - sum w r / sum w, w = |o|         (verl OPO; plain and leave-one-out)
    oblr       A = r - sum w r / sum w, w = ||s||^2     (OBLR-PO, Theorem 7; plain and leave-one-out = the default)
    oracle     A = r - E[w r] / E[w]                    (the optimal baseline of Theorem 7 with its expectations taken
                                                         over all K*G samples of the prompt: a lower bound, not a method)

Per method and prompt: tr Cov(g) across the K groups; averaged over prompts; ratios to GRPO and RLOO with paired
bootstrap intervals (the K groups of every prompt resampled with replacement, the same resample for every method).

Bias. The reference gradient is RLOO's mean over all K groups of the prompt, on the same samples: RLOO is exactly
unbiased (its baseline does not depend on the sample) and has lower variance than baseline-free REINFORCE, and pairing
(d_k = g_method,k - g_rloo,k per group) cancels the shared sampling noise, so E[d] = E[g_method] - grad J is measured far
more precisely than against an independent reference. Reported: ||mean d|| relative to ||grad J|| pooled over prompts,
its noise floor (what an unbiased method would show: sqrt(tr Cov(d) / K)), and the cosine of E[g_method] with grad J.

Because GRPO's std division rescales g, raw variance ratios favour or penalise it by that scale; the scale-free
figure is the noise-to-signal ratio tr Cov(g) / ||E g||^2 (the inverse of a one-group SNR), also reported.

    python benchmarks/grad_variance.py --quick     # <= 5 min on 2 CPU cores
    python benchmarks/grad_variance.py             # more prompts and groups
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
from harness import host, host_id, utc_now  # noqa: E402
from studies.scores import completion_score, gram_stats, spearman  # noqa: E402

from oblr_trl import gradient_weighted_baseline, mean_baseline  # noqa: E402
from oblr_trl.demo.tasks import make_dataset, make_reward_func  # noqa: E402
from oblr_trl.demo.tiny import load_or_build_warm_model  # noqa: E402

# The tasks (and their difficulty) the warm models are built for; the same as benchmarks/compare.py.
TASKS = {
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
}
# kwargs passed to load_or_build_warm_model (its cache key): chain_sum's are oblr_trl.demo.tasks' defaults, passed
# implicitly so that the demo's cached warm model is the one measured.
WARM_KWARGS = {"chain_sum": {}, "basic_arithmetic": TASKS["basic_arithmetic"]}
METHODS = ["reinforce", "grpo", "dr_grpo", "rloo", "opo", "opo_loo", "logit", "logit_loo", "oblr", "oblr_loo", "oracle"]
LABELS = {
    "reinforce": "REINFORCE (no baseline)",
    "grpo": "GRPO (mean, /std)",
    "dr_grpo": "Dr. GRPO (mean)",
    "rloo": "RLOO (leave-one-out mean)",
    "opo": "OPO (w=|o|, plain)",
    "opo_loo": "OPO (w=|o|, leave-one-out)",
    "logit": "logit proxy (w=sum_t(1-2pi_t+sum pi^2), plain)",
    "logit_loo": "logit proxy (leave-one-out)",
    "oblr": "OBLR-PO (w=||s||^2, plain)",
    "oblr_loo": "OBLR-PO (w=||s||^2, leave-one-out; default)",
    "oracle": "oracle optimal baseline (E[wr]/E[w] from all samples)",
}


def advantages(
    method: str, r: torch.Tensor, w: torch.Tensor, lengths: torch.Tensor, proxy: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantages ``(K, G)`` of ``method`` for K groups of G rewards ``r``; ``w`` = ||s||^2, ``lengths`` = |o|,
    ``proxy`` = the forward-only logit proxy of ||s||^2 (``oblr_trl.estimators.logit_proxy_weights``)."""
    K, G = r.shape
    flat = r.reshape(-1)
    if method == "reinforce":
        return r.clone()
    if method == "grpo":
        return (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    if method == "dr_grpo":
        return r - mean_baseline(flat, None, G, False)[0].view(K, G)
    if method == "rloo":
        return r - mean_baseline(flat, None, G, True)[0].view(K, G)
    if method in ("opo", "opo_loo"):
        return r - gradient_weighted_baseline(flat, lengths.reshape(-1), G, method == "opo_loo")[0].view(K, G)
    if method in ("logit", "logit_loo"):
        return r - gradient_weighted_baseline(flat, proxy.reshape(-1), G, method == "logit_loo")[0].view(K, G)
    if method in ("oblr", "oblr_loo"):
        return r - gradient_weighted_baseline(flat, w.reshape(-1), G, method == "oblr_loo")[0].view(K, G)
    if method == "oracle":
        b = (w * r).sum() / w.sum() if w.sum() > 0 else r.mean()
        return r - b
    raise ValueError(method)


def sample_prompt(model, tokenizer, prompt, n: int, max_new_tokens: int) -> tuple[list[int], list[list[int]], list[str]]:
    """n i.i.d. completions of one prompt (token lists up to and including eos) and their decoded texts."""
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    inputs = torch.tensor([prompt_ids]).repeat(n, 1)
    with torch.no_grad():
        out = model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )[:, len(prompt_ids) :]
    completions = []
    for row in out.tolist():
        ids = []
        for t in row:
            if t == tokenizer.pad_token_id and not ids:
                break
            ids.append(t)
            if t == tokenizer.eos_token_id:
                break
        completions.append(ids)
    texts = tokenizer.batch_decode([c for c in completions], skip_special_tokens=True)
    return prompt_ids, completions, texts


def run_task(task: str, args, generator: torch.Generator) -> dict:
    kwargs = TASKS[task]
    model, tokenizer = load_or_build_warm_model(task, steps=args.warmup_steps, **WARM_KWARGS[task])
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    dim = sum(p.numel() for p in params)
    reward_func = make_reward_func(task, **kwargs)
    data = make_dataset(task, size=args.prompts, seed=args.prompt_seed, **kwargs)
    K, G = args.repeats, args.group_size
    per_prompt = []
    t0 = time.time()
    for p_idx in range(len(data)):
        row = data[p_idx]
        prompt_ids, completions, texts = sample_prompt(model, tokenizer, row["prompt"], K * G, args.max_new_tokens)
        rewards = reward_func(prompts=[row["prompt"]] * len(texts), completions=texts, entry=[row["entry"]] * len(texts))
        r = torch.tensor(rewards, dtype=torch.float64).view(K, G)
        # distinct completions -> exact score vectors U (n_unique, D); sample i is row index[i] of U
        cache: dict[tuple, int] = {}
        unique, proxies, index = [], [], []
        for c in completions:
            key = tuple(c)
            if key not in cache:
                cache[key] = len(unique)
                score, proxy = completion_score(model, params, prompt_ids, c)
                unique.append(score)
                proxies.append(proxy)
            index.append(cache[key])
        U = torch.stack(unique)  # float64
        UU = U @ U.T
        index = torch.tensor(index)
        w = torch.diagonal(UU)[index].view(K, G)
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64).view(K, G)
        proxy = torch.tensor(proxies, dtype=torch.float64)[index].view(K, G)
        # g_k = sum_i (A_ki / G) s_ki = C_k U with C (K, n_unique): Grams and means without materialising g
        coeffs = {}
        for m in METHODS:
            A = advantages(m, r, w, lengths, proxy)  # (K, G)
            C = torch.zeros(K, len(unique), dtype=torch.float64)
            C.scatter_add_(1, index.view(K, G), A / G)
            coeffs[m] = C
        exact_unique = torch.diagonal(UU)
        lengths_unique = torch.tensor([float(len(c)) for c in cache], dtype=torch.float64)
        entry = {
            "spearman_logit": spearman(torch.tensor(proxies, dtype=torch.float64), exact_unique),
            "spearman_length": spearman(lengths_unique, exact_unique),
            "mean_reward": float(r.mean()),
            "mixed_groups": float(((r.max(1).values - r.min(1).values) > 0).double().mean()),
            "distinct_completions": len(cache),
            "w_mean_correct": float(w[r > 0].mean()) if (r > 0).any() else None,
            "w_mean_wrong": float(w[r <= 0].mean()) if (r <= 0).any() else None,
            "gram": {m: C @ UU @ C.T for m, C in coeffs.items()},
            "gram_d": {m: (C - coeffs["rloo"]) @ UU @ (C - coeffs["rloo"]).T for m, C in coeffs.items()},
            "mean": {m: C.mean(0) @ U for m, C in coeffs.items()},
        }
        per_prompt.append(entry)
        print(
            f"  [{task}] prompt {p_idx + 1}/{len(data)}: mean reward {entry['mean_reward']:.3f}, mixed groups "
            f"{entry['mixed_groups']:.2f}, {len(cache)} distinct completions ({time.time() - t0:.0f}s)",
            flush=True,
        )
    seconds = time.time() - t0
    return summarize(task, per_prompt, args, generator, seconds, dim)


def summarize(task, per_prompt, args, generator, seconds, dim) -> dict:
    K = args.repeats
    informative = [e for e in per_prompt if e["mixed_groups"] > 0]
    result = {
        "task": task,
        "task_kwargs": TASKS[task],
        "prompts": len(per_prompt),
        "prompts_with_signal": len(informative),
        "groups_per_prompt": K,
        "group_size": args.group_size,
        "params": dim,
        "mean_reward": sum(e["mean_reward"] for e in per_prompt) / len(per_prompt),
        "mixed_group_fraction": sum(e["mixed_groups"] for e in per_prompt) / len(per_prompt),
        "seconds": round(seconds, 1),
        "methods": {},
    }
    wc = [e["w_mean_correct"] for e in per_prompt if e["w_mean_correct"] is not None]
    ww = [e["w_mean_wrong"] for e in per_prompt if e["w_mean_wrong"] is not None]
    result["w_mean_correct"] = sum(wc) / len(wc) if wc else None
    result["w_mean_wrong"] = sum(ww) / len(ww) if ww else None
    for key in ("spearman_logit", "spearman_length"):
        vals = [e[key] for e in per_prompt if e[key] is not None]
        result[key] = sum(vals) / len(vals) if vals else None
    if not informative:
        result["note"] = "all-zero (or all-equal) rewards on every prompt: no gradient signal, task dropped"
        return result

    def pooled(idx_list):
        """Per-method pooled (over prompts) tr Cov, ||E g||^2 (debiased), tr Cov(d), ||mean d||^2."""
        out = {}
        for m in METHODS:
            tr, sig, trd, msd = 0.0, 0.0, 0.0, 0.0
            for e, idx in zip(per_prompt, idx_list):
                t, ms = gram_stats(e["gram"][m], idx)
                tr += t
                sig += ms - t / K
                td, md = gram_stats(e["gram_d"][m], idx)
                trd += td
                msd += md
            n = len(per_prompt)
            out[m] = dict(tr_cov=tr / n, signal=sig / n, tr_cov_d=trd / n, mean_d_sq=msd / n)
        return out

    point = pooled([None] * len(per_prompt))
    boots = []
    for _ in range(args.bootstrap):
        idx_list = [torch.randint(0, K, (K,), generator=generator) for _ in per_prompt]
        boots.append(pooled(idx_list))

    def ci(values):
        v = sorted(x for x in values if x == x and abs(x) != float("inf"))
        if not v:
            return [float("nan"), float("nan")]
        lo, hi = v[int(0.025 * (len(v) - 1))], v[int(0.975 * (len(v) - 1))]
        return [lo, hi]

    ref_signal = point["rloo"]["signal"]  # ||grad J||^2, debiased, from RLOO (unbiased)
    # cosine of E[g_method] with grad J, pooled over prompts (from the full-sample means)
    for m in METHODS:
        pm = point[m]
        dot = sum(float(e["mean"][m] @ e["mean"]["rloo"]) for e in per_prompt)
        nm = sum(float(e["mean"][m] @ e["mean"][m]) for e in per_prompt)
        nr = sum(float(e["mean"]["rloo"] @ e["mean"]["rloo"]) for e in per_prompt)
        bias_sq = pm["mean_d_sq"] - pm["tr_cov_d"] / K  # debiased ||E d||^2
        entry = {
            "tr_cov": pm["tr_cov"],
            "tr_cov_ci": ci([b[m]["tr_cov"] for b in boots]),
            "signal_sq": pm["signal"],
            "noise_to_signal": pm["tr_cov"] / pm["signal"] if pm["signal"] > 0 else float("inf"),
            "noise_to_signal_ci": ci([b[m]["tr_cov"] / b[m]["signal"] if b[m]["signal"] > 0 else float("inf") for b in boots]),
            "ratio_to_grpo": pm["tr_cov"] / point["grpo"]["tr_cov"],
            "ratio_to_grpo_ci": ci([b[m]["tr_cov"] / b["grpo"]["tr_cov"] if b["grpo"]["tr_cov"] > 0 else float("nan") for b in boots]),
            "ratio_to_rloo": pm["tr_cov"] / point["rloo"]["tr_cov"],
            "ratio_to_rloo_ci": ci([b[m]["tr_cov"] / b["rloo"]["tr_cov"] if b["rloo"]["tr_cov"] > 0 else float("nan") for b in boots]),
            "bias_rel": (pm["mean_d_sq"] / ref_signal) ** 0.5 if ref_signal > 0 else float("nan"),
            "bias_rel_debiased": (max(bias_sq, 0.0) / ref_signal) ** 0.5 if ref_signal > 0 else float("nan"),
            "bias_noise_floor_rel": (pm["tr_cov_d"] / K / ref_signal) ** 0.5 if ref_signal > 0 else float("nan"),
            "cosine_with_ref": dot / (nm * nr) ** 0.5 if nm > 0 and nr > 0 else float("nan"),
        }
        result["methods"][m] = entry
    return result


def fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if abs(x) != 0 and (abs(x) < 1e-3 or abs(x) >= 1e4):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}f}"


def write_markdown(results, args, path, command, seconds):
    lines = [
        "# Gradient variance at fixed parameters",
        "",
        f"Generated by `{command}` on {utc_now(minutes=True)}, {host(f'torch {torch.__version__}, 1 thread')}, "
        f"{seconds:.0f} s in all.",
        "",
        f"Warm tiny Qwen3 (`load_or_build_warm_model(task, steps={args.warmup_steps})`), parameters fixed; "
        f"{args.prompts} prompts (reasoning-gym seed {args.prompt_seed}) x {args.repeats} independent groups of "
        f"{args.group_size} completions each, sampled at temperature 1 (no top-k/top-p), max {args.max_new_tokens} new "
        "tokens, rewards from the task's verifier. Every method uses the same samples. g = (1/G) sum_i A_i grad "
        "sum_t log pi(o_i), exact per-sample gradients over all parameters.",
        "",
        "Columns: **tr Cov** = trace of the covariance of g across groups, per prompt, averaged over prompts; "
        "**/GRPO**, **/RLOO** = ratio of that to GRPO's / RLOO's (95% paired bootstrap interval over groups, "
        f"{args.bootstrap} resamples); **noise/signal** = tr Cov(g) / ||E g||^2 (scale-free: GRPO's std division "
        "rescales g); **bias** = ||mean_k (g_k - g_rloo,k)|| / ||grad J||, where grad J is RLOO's mean over all groups "
        "(unbiased; paired on the same samples); **floor** = the bias column's value for an exactly unbiased method "
        "(sampling noise, sqrt(tr Cov(d)/K)/||grad J||): bias well above the floor is real; **cos** = cosine of "
        "E[g] with grad J.",
        "",
    ]
    for res in results:
        lines += [
            f"## {res['task']} ({', '.join(f'{k}={v}' for k, v in res['task_kwargs'].items())})",
            "",
            f"Mean reward {res['mean_reward']:.3f}; groups with mixed rewards {res['mixed_group_fraction']:.2f}; "
            f"prompts with any signal {res['prompts_with_signal']}/{res['prompts']}; mean ||s||^2 of correct "
            f"completions {fmt(res['w_mean_correct'])}, of wrong ones {fmt(res['w_mean_wrong'])}; Spearman rank "
            f"correlation with the exact ||s||^2 over a prompt's distinct completions (mean over prompts): logit proxy "
            f"{fmt(res.get('spearman_logit'), 2)}, length {fmt(res.get('spearman_length'), 2)}; {res['seconds']:.0f} s.",
            "",
        ]
        if not res["methods"]:
            lines += [f"**{res.get('note', 'no signal')}**", ""]
            continue
        lines += [
            "| method | tr Cov | /GRPO [95% CI] | /RLOO [95% CI] | noise/signal [95% CI] | bias | floor | cos |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m in METHODS:
            e = res["methods"][m]
            lines.append(
                f"| {LABELS[m]} | {fmt(e['tr_cov'])} | {fmt(e['ratio_to_grpo'])} [{fmt(e['ratio_to_grpo_ci'][0])}, "
                f"{fmt(e['ratio_to_grpo_ci'][1])}] | {fmt(e['ratio_to_rloo'])} [{fmt(e['ratio_to_rloo_ci'][0])}, "
                f"{fmt(e['ratio_to_rloo_ci'][1])}] | {fmt(e['noise_to_signal'])} [{fmt(e['noise_to_signal_ci'][0])}, "
                f"{fmt(e['noise_to_signal_ci'][1])}] | {fmt(e['bias_rel'])} | {fmt(e['bias_noise_floor_rel'])} | "
                f"{fmt(e['cosine_with_ref'])} |"
            )
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=256, help="Independent groups per prompt (K).")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=8)
    p.add_argument("--warmup_steps", type=int, default=200, help="SFT steps of the warm model (the demo's).")
    p.add_argument("--prompt_seed", type=int, default=7, help="reasoning-gym seed of the prompts (not the warm-up's).")
    p.add_argument("--bootstrap", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="24 prompts x 128 groups per task (<= 5 min on 2 CPU cores).")
    p.add_argument("--out", default=None, help="Output stem (default results/grad_variance[_quick]).")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats, args.bootstrap = 24, 128, 300
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    stem = args.out or os.path.join(HERE, "results", "grad_variance" + ("_quick" if args.quick else ""))
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    command = "python benchmarks/grad_variance.py " + " ".join(sys.argv[1:] if argv is None else argv)
    start = time.time()
    results = [run_task(task, args, generator) for task in args.tasks]
    seconds = time.time() - start
    write_markdown(results, args, stem + ".md", command.strip(), seconds)
    with open(stem + ".json", "w") as f:
        json.dump(
            {
                "command": command.strip(),
                "date": utc_now(),
                "machine": host_id(),
                "torch": torch.__version__,
                "seconds": round(seconds, 1),
                "args": vars(args),
                "results": results,
            },
            f,
            indent=1,
        )
    print(open(stem + ".md").read())
    print(f"Wrote {stem}.md and {stem}.json ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
