"""Gradient variance, bias and baseline-weight proxies on a real LLM (SmolLM2-135M-Instruct) at fixed parameters.

For the first ``--prompts`` prompts whose completions in a pilot have mixed rewards, draw K independent groups of G
completions each from the model itself (temperature 1, full softmax, :func:`sample_completions`), score them with the
task's reasoning-gym verifier, and take for every distinct completion in a group with mixed rewards (an all-equal group
has every method's advantages 0, so it contributes a zero gradient and needs no score vector)

* its exact score vector ``s_i = grad sum_t log pi(o_i,t)`` in a **LoRA gradient space** (rank ``--rank`` adapters on
  every linear layer of the 30 blocks, B = 0 so the policy is the model's own: the gradient w.r.t. B is the full weight
  gradient ``delta x^T`` projected on A's random rows, a sketch of the full gradient), for ``--batch`` completions at a
  time from one forward and one backward (:func:`batched_scores`: hooks on the LoRA B linears, a per-sequence einsum);
* the proxies from the same forward: ``|o_i|`` (verl OPO's ``"length"``) and ``sum_t (1 - 2 pi_t + sum_v pi_v^2)``
  (verl's optimal-token baseline, ``"logit"``, :func:`oblr_trl.estimators.logit_proxy_weights`).

Methods (advantages from the same samples): GRPO (mean, /std), Dr. GRPO (mean), RLOO, and the weighted baseline
``sum w r / sum w`` with w = length, logit proxy or exact ``||s||^2``, each plain and leave-one-out (the OBLR-PO default
is exact, leave-one-out). Reported, pooled over prompts with paired bootstrap 90% intervals (each prompt's K groups
resampled, the same resample for every method): tr Cov of one group's estimate ``g = (1/G) sum_i A_i s_i`` as a ratio to
RLOO's; the scale-free noise-to-signal ``tr Cov(g) / ||E g||^2``; the bias ``||E g - grad J||^2`` relative to tr Cov(g),
with grad J = RLOO's mean over all K groups (exactly unbiased) and the difference paired per group. And per weight
source: Spearman rank correlation of w_i with the exact norms, the baseline's RMS error against Theorem 7's optimal
baseline ``E[w r] / E[w]``, cost per completion, and the SNR of one group's gradient.

    python benchmarks/proxies.py --repeats 24   # results/proxies.md: 12 prompts x 24 groups x 8, 26 min (shared CPU)
    python benchmarks/proxies.py                # 12 prompts x 16 groups x 8: 13 min there
    python benchmarks/proxies.py --quick        # smoke run, < 1 min
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
from harness.memory import peak_rss_gb  # noqa: E402
from studies.baselines import BASELINED, LABELS, METHODS, advantages  # noqa: E402
from studies.scores import (batched_scores, completion_score, gram64, gram_stats, lora_b_modules,  # noqa: E402
                            sample_completions, spearman)

from oblr_trl.demo.tasks import make_dataset, make_reward_func  # noqa: E402

INSTRUCTION = " Reply with the number only."


def stratified_oracle(r: torch.Tensor, w: torch.Tensor, scored: torch.Tensor) -> float | None:
    """Theorem 7's optimal baseline ``E[w r] / E[w]`` for one prompt, with ``E[w | r = c]`` taken from the scored
    completions (those in mixed groups) and ``P(r = c)`` from all K*G rewards. Samples are i.i.d., so whether a
    sample's group is mixed depends on the sample only through its reward: a scored sample with reward c is a draw from
    the policy's completions with reward c, so each ``E[w | r = c]`` is unbiased and the ratio consistent. None if a
    reward value has no scored sample."""
    num = den = 0.0
    for c in r.unique():
        at = r == c
        if not (at & scored).any():
            return None
        p, ew = float(at.double().mean()), float(w[at & scored].mean())
        num += p * float(c) * ew
        den += p * ew
    return num / den if den > 0 else None


def tr_cov_stats(e: dict, m: str, idx=None) -> dict:
    tr, mean_sq = gram_stats(e["gram"][m], idx)
    trd, mean_d_sq = gram_stats(e["gram_d"][m], idx)
    return dict(tr=tr, mean_sq=mean_sq, trd=trd, mean_d_sq=mean_d_sq)


def pooled(per_prompt: list[dict], K: int, idx_list=None, plugin: bool = False) -> dict:
    """Per method, over prompts: mean tr Cov(g), ||E g||^2 (debiased), ||E d||^2 (debiased; d = g - g_rloo paired per
    group) and its noise floor tr Cov(d) / K.

    ``plugin=True``: the same quantities of the empirical distribution of the K groups itself (covariance over K, means
    not debiased). These are what a bootstrap resample's debiased estimates average to (a resample is K i.i.d. draws
    from that distribution), so they are the "true values" of the bootstrap world, used by :func:`basic_interval`."""
    out = {}
    for m in METHODS:
        acc = dict(tr=0.0, signal=0.0, bias_sq=0.0, floor=0.0)
        for j, e in enumerate(per_prompt):
            st = tr_cov_stats(e, m, None if idx_list is None else idx_list[j])
            if plugin:
                acc["tr"] += st["tr"] * (K - 1) / K
                acc["signal"] += st["mean_sq"]
                acc["bias_sq"] += st["mean_d_sq"]
            else:
                acc["tr"] += st["tr"]
                acc["signal"] += st["mean_sq"] - st["tr"] / K
                acc["bias_sq"] += st["mean_d_sq"] - st["trd"] / K
            acc["floor"] += st["trd"] / K
        out[m] = {k: v / len(per_prompt) for k, v in acc.items()}
    return out


def basic_interval(point: float, plugin: float, resampled: list[float], level: float = 0.9) -> list[float] | None:
    """The basic (reverse-percentile) bootstrap interval ``[point - (q_hi - plugin), point - (q_lo - plugin)]``: the
    resampled statistic's spread around the bootstrap world's true value ``plugin`` stands for the estimate's spread
    around the truth. (A plain percentile interval would be centred on ``plugin``, not on the debiased estimate: the
    signal and bias terms are debiased within each resample against a truth that is not debiased.) None when the
    statistic is undefined in more than 10% of the resamples."""
    v = torch.tensor([x for x in resampled if x == x and abs(x) != float("inf")], dtype=torch.float64)
    if len(v) < 0.9 * len(resampled) or point != point or plugin != plugin:
        return None
    a = (1 - level) / 2
    return [point - (float(v.quantile(1 - a)) - plugin), point - (float(v.quantile(a)) - plugin)]


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


STATISTICS = {  # name -> f(pooled, method)
    "tr_cov_vs_rloo": lambda p, m: ratio(p[m]["tr"], p["rloo"]["tr"]),
    "noise_to_signal": lambda p, m: ratio(p[m]["tr"], p[m]["signal"]),
    "noise_to_signal_vs_rloo": lambda p, m: ratio(ratio(p[m]["tr"], p[m]["signal"]),
                                                  ratio(p["rloo"]["tr"], p["rloo"]["signal"])),
    "bias_sq_vs_tr_cov": lambda p, m: ratio(p[m]["bias_sq"], p[m]["tr"]),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="oblr_trl.load_reference_model name or a local folder")
    parser.add_argument("--task", default="basic_arithmetic")
    parser.add_argument("--prompts", type=int, default=12, help="prompts kept (with mixed rewards in the pilot)")
    parser.add_argument("--candidates", type=int, default=60, help="prompts piloted at most")
    parser.add_argument("--pilot", type=int, default=24, help="completions per piloted prompt")
    parser.add_argument("--repeats", type=int, default=16, help="K groups per prompt")
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=10)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="completions per batched forward+backward")
    parser.add_argument("--check", type=int, default=8,
                        help="completions of the first prompt also scored one at a time (agreement and cost ratio)")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "proxies"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.candidates, args.pilot, args.repeats, args.group_size = 1, 12, 16, 3, 4
        args.bootstrap, args.check = 50, 2
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    from peft import LoraConfig, get_peft_model

    from oblr_trl.demo import load_reference_model

    base, tokenizer = load_reference_model(args.model)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.eval()
    modules = lora_b_modules(model)  # B = 0: A gets no gradient
    params = [m.weight for m in modules]
    dim = sum(p.numel() for p in params)
    eos = tokenizer.eos_token_id
    task_kwargs = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    reward_func = make_reward_func(args.task, **task_kwargs)
    data = make_dataset(args.task, size=args.candidates, seed=args.seed, **task_kwargs)
    K, G = args.repeats, args.group_size
    start = time.time()

    def prompt_ids_of(row):
        prompt = [{"role": "user", "content": row["prompt"][0]["content"] + INSTRUCTION}]
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)

    def rewards_of(row, completions):
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        return reward_func(prompts=None, completions=texts, entry=[row["entry"]] * len(texts))

    # pilot: keep the first prompts whose sampled completions are sometimes right, sometimes wrong
    kept, pilot = [], []
    for i in range(len(data)):
        rew = rewards_of(data[i], sample_completions(model, prompt_ids_of(data[i]), args.pilot, args.max_new_tokens,
                                                     eos, gen))
        acc = sum(rew) / len(rew)
        pilot.append(acc)
        if min(rew) < max(rew):
            kept.append(i)
        if len(kept) == args.prompts:
            break
    print(f"pilot accuracies {[round(a, 3) for a in pilot]}; kept prompts {kept} ({time.time() - start:.0f}s)",
          flush=True)

    per_prompt, group_sums, group_sq, fwd_s, bwd_s, gen_s, n_scored, n_samples = [], [], [], 0.0, 0.0, 0.0, 0, 0
    check = None
    for i in kept:
        row = data[i]
        prompt_ids = prompt_ids_of(row)
        t0 = time.perf_counter()
        completions = sample_completions(model, prompt_ids, K * G, args.max_new_tokens, eos, gen)
        gen_s += time.perf_counter() - t0
        r = torch.tensor(rewards_of(row, completions), dtype=torch.float64).view(K, G)
        mixed = (r.max(1).values - r.min(1).values) > 0  # (K,)
        scored = mixed[:, None].expand(K, G).reshape(-1)  # all-equal groups: every method's advantages are 0
        cache, unique, index = {}, [], []
        for j, c in enumerate(completions):
            if scored[j]:
                cache.setdefault(tuple(c), len(cache))
                index.append(cache[tuple(c)])
            else:
                index.append(-1)
        unique = sorted(cache, key=cache.get)
        order = sorted(range(len(unique)), key=lambda u: len(unique[u]))  # similar lengths batched together
        U = torch.zeros(len(unique), dim)
        proxy = torch.zeros(len(unique), dtype=torch.float64)
        for b in range(0, len(order), args.batch):
            rows = order[b : b + args.batch]
            S, px, f, bw = batched_scores(model, modules, prompt_ids, [list(unique[u]) for u in rows])
            U[rows], proxy[rows] = S, px
            fwd_s, bwd_s = fwd_s + f, bwd_s + bw
        n_scored, n_samples = n_scored + len(unique), n_samples + K * G
        if check is None and len(unique) and args.check:
            errs, one_s = [], 0.0
            for u in order[: args.check]:
                t0 = time.perf_counter()
                s1, p1 = completion_score(model, params, prompt_ids, list(unique[u]))
                one_s += time.perf_counter() - t0
                errs.append(max(float((U[u] - s1).norm() / s1.norm()), abs(float(proxy[u]) - p1) / abs(p1)))
            n = min(args.check, len(unique))
            check = dict(completions=n, max_rel_err=max(errs), one_at_a_time_s=one_s / n)
        UU = gram64(U)
        index = torch.tensor(index)
        sel = index >= 0
        ones = torch.ones(K * G, dtype=torch.float64)  # placeholder weights where no method uses them (A = 0)
        w_ex, w_lg = ones.clone(), ones.clone()
        w_ex[sel], w_lg[sel] = torch.diagonal(UU)[index[sel]], proxy[index[sel]]
        weights = {
            "exact": w_ex.view(K, G),
            "logit": w_lg.view(K, G),
            "length": torch.tensor([len(c) for c in completions], dtype=torch.float64).view(K, G),
        }
        coeffs = {}
        for m in METHODS:
            A = advantages(m, r, weights)
            if A[~mixed].abs().sum() > 1e-9:
                raise AssertionError(f"{m}: nonzero advantage in an all-equal group")
            C = torch.zeros(K, len(unique), dtype=torch.float64)
            if len(unique):  # no mixed group at all: every method's gradient is 0 on this prompt
                C.scatter_add_(1, index.clamp(min=0).view(K, G), torch.where(sel.view(K, G), A / G, 0.0))
            coeffs[m] = C
        flat_r = r.reshape(-1)
        oracle = stratified_oracle(flat_r, w_ex, sel)
        entry = {
            "prompt": row["prompt"][0]["content"], "mean_reward": float(r.mean()),
            "mixed_groups": float(mixed.double().mean()), "scored_distinct": len(unique),
            "spearman": {m: spearman(weights[m].reshape(-1)[sel], w_ex[sel]) if sel.sum() > 2 else None
                         for m in ("length", "logit")},
            "oracle_baseline": oracle, "baseline_rmse": {},
            "gram": {m: C @ UU @ C.T for m, C in coeffs.items()},
            "gram_d": {m: (C - coeffs["rloo"]) @ UU @ (C - coeffs["rloo"]).T for m, C in coeffs.items()},
        }
        if oracle is not None:
            for m in BASELINED:
                b = (r - advantages(m, r, weights)).reshape(-1)[sel]
                entry["baseline_rmse"][m] = float(((b - oracle) ** 2).mean().sqrt())
        per_prompt.append(entry)
        # each group's gradient with the default (exact, leave-one-out) advantages, for the SNR across groups
        Cd = coeffs["exact_loo"]
        group_sums.append(Cd.sum(0).float() @ U)
        group_sq.append(torch.diagonal(Cd @ UU @ Cd.T))
        del U, UU
        print(f"prompt {i}: reward {entry['mean_reward']:.3f}, mixed groups {entry['mixed_groups']:.2f}, "
              f"{len(unique)} distinct scored, spearman {entry['spearman']}, {time.time() - start:.0f}s", flush=True)

    point = pooled(per_prompt, K)
    boots = [pooled(per_prompt, K, [torch.randint(0, K, (K,), generator=gen) for _ in per_prompt])
             for _ in range(args.bootstrap)]

    plug = pooled(per_prompt, K, plugin=True)
    table = {}
    for m in METHODS:
        table[m] = dict(tr_cov=point[m]["tr"], bias_floor_vs_tr_cov=ratio(point[m]["floor"], point[m]["tr"]))
        for name, f in STATISTICS.items():
            table[m][name] = f(point, m)
            table[m][name + "_ci90"] = basic_interval(f(point, m), f(plug, m), [f(b, m) for b in boots])

    # SNR of one group's gradient (exact, leave-one-out) across all prompts' groups
    n_groups = K * len(per_prompt)
    total = torch.stack(group_sums).double().sum(0)
    sum_sq = float(torch.cat(group_sq).sum())
    mean_sq = float(total @ total) / n_groups**2
    noise = (sum_sq - n_groups * mean_sq) / (n_groups - 1)
    signal = max(mean_sq - noise / n_groups, 0.0)
    snr = signal / noise if noise > 0 else float("nan")
    n_step = 8
    valid = [e for e in per_prompt if e["spearman"]["logit"] is not None]
    with_oracle = [e for e in per_prompt if e["baseline_rmse"]]
    result = dict(
        command="python " + " ".join(["benchmarks/proxies.py", *sys.argv[1:]]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.node()} ({os.cpu_count()} CPUs, 1 torch thread)",
        model=args.model, task=args.task, lora_rank=args.rank, gradient_dim=dim, K=K, G=G, prompts=kept,
        pilot_accuracies=pilot, elapsed_s=round(time.time() - start), bootstrap=args.bootstrap,
        scored_completions=n_scored, sampled_completions=n_samples,
        spearman={m: sum(e["spearman"][m] for e in valid) / len(valid) if valid else None for m in ("length", "logit")},
        baseline_rmse={m: sum(e["baseline_rmse"][m] for e in with_oracle) / len(with_oracle) if with_oracle else None
                       for m in BASELINED},
        methods=table, group_snr=snr, scale_at_8_prompts=n_step * snr / (1 + n_step * snr),
        seconds_generate_per_completion=gen_s / n_samples,
        seconds_forward_per_completion=fwd_s / max(n_scored, 1),
        seconds_backward_per_completion=bwd_s / max(n_scored, 1),
        check_one_at_a_time=check,
        peak_rss_gb=peak_rss_gb(),
        per_prompt=[{k: v for k, v in e.items() if k not in ("gram", "gram_d")} for e in per_prompt],
    )
    write(result, args)


def fmt(x, digits=3):
    if x is None or x != x:
        return "-"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e4):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}f}"


def fmt_ci(c):
    return "-" if c is None else f"{fmt(c[0])} to {fmt(c[1])}"


def write(result: dict, args) -> None:
    K, G, n = result["K"], result["G"], len(result["prompts"])
    check = result["check_one_at_a_time"]
    lines = [
        "# Gradient variance, bias and baseline-weight proxies on SmolLM2-135M-Instruct (fixed parameters)",
        "",
        f"Generated by `{result['command']}` on {result['date']}, {result['machine']}; "
        f"{result['elapsed_s'] / 60:.1f} min wall clock. Task {result['task']} "
        f"(2 one-digit terms, the prompt plus '{INSTRUCTION.strip()}'), the first {n} prompts with mixed rewards in "
        f"a {args.pilot}-sample pilot (pilot accuracies {', '.join(f'{a:.2f}' for a in result['pilot_accuracies'])}), "
        f"K={K} independent groups of G={G} completions per prompt sampled from the model (temperature 1, full "
        f"softmax), max {args.max_new_tokens} new tokens. Gradient space: LoRA rank {result['lora_rank']} on every "
        f"linear layer of the 30 blocks, the gradient w.r.t. B at B=0 ({result['gradient_dim']:,} dims: the full "
        f"weight gradient projected on A's random rows). Every completion in a group with mixed rewards "
        f"({result['scored_completions']} of {result['sampled_completions']} sampled) gets its exact score vector "
        f"from batched forwards and backwards; groups whose rewards are all equal have every method's advantages 0 "
        f"and contribute a zero gradient.",
        "",
        f"Each group's estimate is g = (1/G) sum_i A_i s_i. Columns: tr Cov(g) across the K groups as a ratio to "
        f"RLOO's; the noise-to-signal ratio tr Cov(g) / ||E g||^2 (scale-free: GRPO's /std rescales g); the bias "
        f"||E g - grad J||^2 as a fraction of tr Cov(g) (so one group's mean squared error is tr Cov (1 + that)). "
        f"The reference grad J is RLOO's mean over all K groups of the prompt (RLOO is exactly unbiased), paired per "
        f"group (d = g - g_RLOO) so the shared sampling noise cancels; ||E d||^2 is debiased by tr Cov(d) / K, and "
        f"the resolution (what an unbiased method would show by chance, tr Cov(d) / K / tr Cov(g)) is the last "
        f"column. All pooled over prompts (means of per-prompt traces); 90% basic (reverse-percentile) bootstrap "
        f"intervals from {result['bootstrap']} paired resamples of each prompt's K groups (the same resample for every "
        f"method), centred on the debiased estimates.",
        "",
        "| method | tr Cov / RLOO's | 90% CI | noise / signal | its ratio to RLOO's | 90% CI | bias^2 / tr Cov | 90% CI "
        "| resolution |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        t = result["methods"][m]
        lines.append(
            f"| {LABELS[m]} | {fmt(t['tr_cov_vs_rloo'])} | {fmt_ci(t['tr_cov_vs_rloo_ci90'])} | "
            f"{fmt(t['noise_to_signal'], 2)} | {fmt(t['noise_to_signal_vs_rloo'])} | "
            f"{fmt_ci(t['noise_to_signal_vs_rloo_ci90'])} | {fmt(t['bias_sq_vs_tr_cov'])} | "
            f"{fmt_ci(t['bias_sq_vs_tr_cov_ci90'])} | {fmt(t['bias_floor_vs_tr_cov'])} |")
    lines += [
        "",
        "## Proxies against exact weights",
        "",
        "Spearman rank correlation of each proxy's w_i with the exact ||s_i||^2 over the scored completions of a "
        "prompt, averaged over prompts; baseline RMSE: the baseline each method applies to the scored completions "
        "against Theorem 7's optimal baseline E[w r] / E[w] (exact w; E[w | r] from the scored completions, P(r) from "
        "all K G), root-mean-square over completions, averaged over prompts.",
        "",
        "| weights | Spearman w vs exact | baseline RMSE vs optimal |",
        "|---|---|---|",
    ]
    for m in BASELINED:
        sp = "1" if m.startswith("exact") else fmt(result["spearman"].get(m.split("_")[0]), 2) \
            if m.split("_")[0] in result["spearman"] else "-"
        lines.append(f"| {LABELS[m]} | {sp} | {fmt(result['baseline_rmse'][m])} |")
    lines += [
        "",
        f"Cost per completion (CPU, 1 thread): sampling "
        f"{result['seconds_generate_per_completion']:.3f} s; the batched forward with both proxies (batches of "
        f"{args.batch}) {result['seconds_forward_per_completion']:.2f} s; the exact norms' batched backward with the "
        f"per-sequence einsum {result['seconds_backward_per_completion']:.2f} s more"
        + (f"; one completion at a time (forward + backward, {check['completions']} completions, same run) "
           f"{check['one_at_a_time_s']:.2f} s, agreeing with the batched score vectors and proxies to "
           f"{check['max_rel_err']:.1e} relative" if check else "") + ".",
        "",
        f"SNR of one group's gradient (exact weights, leave-one-out) across all {K * n} groups: "
        f"{result['group_snr']:.4f}, so N SNR / (1 + N SNR) = {result['scale_at_8_prompts']:.3f} at N = 8 prompts per "
        f"step.",
        "",
        "Per prompt: " + "; ".join(f"reward {e['mean_reward']:.2f}, mixed groups {e['mixed_groups']:.2f}, "
                                  f"{e['scored_distinct']} scored" for e in result["per_prompt"]) + ".",
        "",
    ]
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
