"""The baselines proxies.py and variance_long.py compare at fixed parameters: GRPO, Dr. GRPO, RLOO, and the weighted
baseline ``sum w r / sum w`` with w = length (OPO), logit proxy or exact ``||s||^2``, each plain and leave-one-out."""

from __future__ import annotations

import torch

from oblr_trl import gradient_weighted_baseline, mean_baseline

METHODS = ["grpo", "dr_grpo", "rloo", "length", "length_loo", "logit", "logit_loo", "exact", "exact_loo"]
BASELINED = METHODS[1:]  # r - b with a baseline b (GRPO also divides by the group's std)
LABELS = {
    "grpo": "GRPO (mean, /std)",
    "dr_grpo": "Dr. GRPO (mean, no /std)",
    "rloo": "RLOO (leave-one-out mean)",
    "length": "OPO w=\\|o\\| (plain)",
    "length_loo": "OPO w=\\|o\\| (leave-one-out)",
    "logit": "logit proxy w=sum(1-2pi+sum pi^2) (plain)",
    "logit_loo": "logit proxy (leave-one-out)",
    "exact": "exact w=\\|\\|s\\|\\|^2 (plain)",
    "exact_loo": "OBLR-PO default: exact w=\\|\\|s\\|\\|^2 (leave-one-out)",
}


def advantages(method: str, r: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Advantages (K, G) of `method` for rewards `r` (K groups of G); `weights`: per source ("length", "logit",
    "exact") the (K, G) weights of the weighted baselines."""
    K, G = r.shape
    flat = r.reshape(-1)
    if method == "grpo":
        return (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    if method == "dr_grpo":
        return r - r.mean(1, keepdim=True)
    if method == "rloo":
        return r - mean_baseline(flat, None, G, True)[0].view(K, G)
    source, loo = method.removesuffix("_loo"), method.endswith("_loo")
    return r - gradient_weighted_baseline(flat, weights[source].reshape(-1), G, loo)[0].view(K, G)
