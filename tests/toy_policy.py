"""Toy softmax policies with closed-form policy-gradient quantities (a test utility, no model involved).

One "prompt" is a softmax policy over ``K`` actions: logits ``theta``, fixed rewards ``r(a)``, ``pi = softmax(theta)``.
Everything the paper's estimators are about is exact here:

* score of action ``a``: ``s_a = d log pi_a / d theta = e_a - pi`` (so ``||s_a||^2 = 1 - 2 pi_a + ||pi||^2``);
* policy gradient: ``grad J = E_a[r_a s_a] = pi * (r - E r)``;
* the single-sample REINFORCE estimator with a constant baseline ``b``, ``(r_a - b) s_a``, has
  ``tr Cov = E[(r_a - b)^2 ||s_a||^2] - ||grad J||^2``, minimized by the gradient-weighted baseline
  ``b* = E[||s||^2 r] / E[||s||^2]`` (Theorem 7).

Every function takes a leading batch of independent policies (one per prompt): ``theta`` and ``rewards`` of shape
``(..., K)``. Expectations are sums over the ``K`` actions, so they are exact up to float64 rounding.
"""

from __future__ import annotations

import itertools

import torch

DTYPE = torch.float64


def random_policy(
    num_actions: int, generator: torch.Generator, batch: tuple[int, ...] = (), logit_scale: float = 1.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits ``N(0, logit_scale^2)`` and rewards ``U(0, 1)``, shape ``batch + (num_actions,)``, float64."""
    shape = (*batch, num_actions)
    theta = logit_scale * torch.randn(shape, generator=generator, dtype=DTYPE)
    rewards = torch.rand(shape, generator=generator, dtype=DTYPE)
    return theta, rewards


def probs(theta: torch.Tensor) -> torch.Tensor:
    """``pi = softmax(theta)``."""
    return torch.softmax(theta, dim=-1)


def scores(theta: torch.Tensor) -> torch.Tensor:
    """Score table ``S[..., a, :] = e_a - pi`` (closed form), shape ``(..., K, K)``."""
    pi = probs(theta)
    eye = torch.eye(theta.shape[-1], dtype=theta.dtype)
    return eye - pi.unsqueeze(-2)


def autograd_scores(theta: torch.Tensor) -> torch.Tensor:
    """The score table of a single policy (``theta`` of shape ``(K,)``) by autograd of ``log_softmax``.

    An independent check of :func:`scores`: no closed form involved.
    """
    rows = []
    for a in range(theta.shape[-1]):
        t = theta.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(torch.log_softmax(t, dim=-1)[a], t)
        rows.append(grad)
    return torch.stack(rows)


def score_sq_norms(theta: torch.Tensor) -> torch.Tensor:
    """``||s_a||^2`` for every action, shape ``(..., K)``."""
    return scores(theta).pow(2).sum(-1)


def expected_reward(theta: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """``J = E_a[r_a]`` (also the population mean baseline of GRPO/RLOO)."""
    return (probs(theta) * rewards).sum(-1)


def policy_gradient(theta: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """``grad J = pi * (r - E r)``, shape ``(..., K)``."""
    pi = probs(theta)
    return pi * (rewards - expected_reward(theta, rewards).unsqueeze(-1))


def optimal_baseline(theta: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """Theorem 7's variance-optimal constant baseline ``b* = E[||s||^2 r] / E[||s||^2]``."""
    pw = probs(theta) * score_sq_norms(theta)
    return (pw * rewards).sum(-1) / pw.sum(-1)


def estimator_cov_trace(theta: torch.Tensor, rewards: torch.Tensor, baseline: torch.Tensor | float) -> torch.Tensor:
    """Exact ``tr Cov[(r_a - b) s_a]`` of the single-sample estimator with constant baseline ``b``, by enumeration.

    Computed as ``sum_a pi_a ||(r_a - b) s_a - mu||^2`` with ``mu = sum_a pi_a (r_a - b) s_a`` (the definition, not the
    simplified formula in the module docstring).
    """
    pi = probs(theta)
    b = torch.as_tensor(baseline, dtype=theta.dtype)
    if b.dim() == theta.dim() - 1:
        b = b.unsqueeze(-1)
    g = (rewards - b).unsqueeze(-1) * scores(theta)  # (..., K actions, K coords)
    mu = (pi.unsqueeze(-1) * g).sum(-2, keepdim=True)
    return (pi * (g - mu).pow(2).sum(-1)).sum(-1)


def sample_actions(theta: torch.Tensor, num_draws: int, generator: torch.Generator) -> torch.Tensor:
    """``num_draws`` i.i.d. actions from each policy in the batch, shape ``theta.shape[:-1] + (num_draws,)``."""
    pi = probs(theta)
    flat = pi.reshape(-1, pi.shape[-1])
    actions = torch.multinomial(flat, num_draws, replacement=True, generator=generator)
    return actions.reshape(*theta.shape[:-1], num_draws)


def all_action_tuples(num_actions: int, group_size: int) -> torch.Tensor:
    """Every group ``(a_1, ..., a_G)`` of actions, shape ``(K**G, G)``, for exact expectations over a group."""
    return torch.tensor(list(itertools.product(range(num_actions), repeat=group_size)), dtype=torch.long)


def group_estimates(
    actions: torch.Tensor, baselines: torch.Tensor, theta: torch.Tensor, rewards: torch.Tensor
) -> torch.Tensor:
    """Per-group REINFORCE estimates ``(1/G) sum_i (r_{a_i} - b_i) s_{a_i}`` of a single policy.

    ``actions`` and ``baselines`` are ``(n_groups, G)``; returns ``(n_groups, K)``.
    """
    num_actions = theta.shape[-1]
    adv = rewards[actions] - baselines  # (n_groups, G)
    # Sum the advantages per action, then apply the score table: sum_i A_i s_{a_i} = sum_a (sum_{i: a_i=a} A_i) s_a.
    per_action = torch.zeros(actions.shape[0], num_actions, dtype=adv.dtype)
    per_action.scatter_add_(1, actions, adv)
    return per_action @ scores(theta) / actions.shape[1]
