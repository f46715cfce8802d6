"""OBLR-PO's estimators as pure tensor functions (no trainer state).

The baseline's formulas and the per-batch pieces the trainer moves its data through:

* :func:`gradient_weighted_baseline`: the variance-optimal baseline (Theorem 7),
  ``b(q) = sum_i w_i r_i / sum_i w_i`` with ``w_i = ||grad log pi(o_i|q)||^2``.
* :func:`mean_baseline`: the uniform baseline of GRPO (group mean) and RLOO (leave-one-out mean), for ablations.
* :func:`baseline_weights`: ``w_i`` from per-sequence squared norms (or a proxy), as each score enters the loss.
* :func:`unit_sq_norms`: each SNR sample's ``||H_q||^2 = ||sum_{i in q} a_i u_i||^2`` from within-sample Gram rows.
* :func:`logit_proxy_weights`: verl's forward-only proxy of the squared norms.

The SNR and Theorem 4's step-size factor are :mod:`oblr_trl.snr_formulas`'s, written once there, where the trainer runs
them (their public names: ``oblr_trl.gradient_snr``, ...).

Baselines (``BASELINES``, :func:`register_baseline`) and weight estimators (``GRAD_NORM_ESTIMATORS``,
:func:`register_weight_estimator`) are registered by name (:class:`oblr_trl.registry.Registry`, as verl's
``core_algos`` does) so that ``OBLRPOConfig.baseline`` and ``grad_norm_estimator`` select one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .loss_terms import sequence_shape
from .registry import Registry

BaselineFn = Callable[..., tuple[torch.Tensor, int]]
BASELINES = Registry("baseline", "baseline")  # name -> Baseline, selected by OBLRPOConfig.baseline


@dataclass(frozen=True)
class Baseline:
    """A registered baseline: ``fn(rewards, weights, group_size, leave_one_out) -> (baseline, num_fallback)``
    (``num_fallback``: an ``int`` or a 0-d integer tensor; the built-ins keep it on the device, so that the trainer
    reads it with the step's other figures instead of waiting for it), and
    whether it uses ``weights`` (the trainer then forms them, with the per-sequence norms the weight estimator needs,
    even with ``snr_lr=False``; otherwise it may skip the norms and pass weights it did not form)."""

    fn: BaselineFn
    uses_weights: bool

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, int | torch.Tensor]:
        return self.fn(*args, **kwargs)


def register_baseline(name: str, *, uses_weights: bool = True) -> Callable[[BaselineFn], BaselineFn]:
    """Register a baseline estimator under ``name`` (selected by ``OBLRPOConfig.baseline``); a taken name raises.
    ``uses_weights``: whether it reads the weights ``w_i`` (default True: they are formed for it, at the norms' cost;
    pass False for a baseline that ignores them, such as ``"mean"``). Returns the function unchanged."""
    def add(fn: BaselineFn) -> BaselineFn:
        BASELINES.add(name, Baseline(fn, bool(uses_weights)))
        return fn

    return add


def get_baseline(name: str) -> BaselineFn:
    return BASELINES.select(name)


def baseline_uses_weights(name: str) -> bool:
    """Whether the baseline registered as ``name`` uses the weights (an entry added without declaring it: True)."""
    return bool(getattr(BASELINES.select(name), "uses_weights", True))


def _grouped_weighted_mean(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, leave_one_out: bool
) -> tuple[torch.Tensor, int]:
    if rewards.dim() != 1 or weights.shape != rewards.shape:
        raise ValueError(
            f"rewards and weights must be 1-D tensors of the same length, got {tuple(rewards.shape)} and "
            f"{tuple(weights.shape)}."
        )
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the number of samples ({rewards.numel()}).")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, weights.dtype), torch.float32)
    r = rewards.to(dtype).view(-1, group_size)
    w = weights.to(dtype).view(-1, group_size)
    valid = ~torch.isnan(r)
    # NaN rewards (unscorable completions) and non-finite or negative weights enter no one's baseline.
    w = torch.where(valid & torch.isfinite(w) & (w > 0), w, torch.zeros_like(w))
    r0 = torch.where(valid, r, torch.zeros_like(r))

    # which samples enter whose baseline: everyone's, or (leave-one-out) everyone else's. Summing over this
    # (G, G) mask, rather than subtracting a sample from its group's total, leaves no rounding residue.
    enters = torch.ones(group_size, group_size, dtype=torch.bool, device=r.device)
    if leave_one_out:
        enters.fill_diagonal_(False)
    # set_w[q, i, j]: the weight of sample j in sample i's baseline, divided by the largest weight of that set. The
    # baseline is scale-free in the weights, and the normalized weights lie in [0, 1], so w_j * r_j cannot overflow
    # (w = 1e30, r = 1e10 in float32) nor underflow (w = r = 1e-30) where the weighted mean itself is representable.
    set_w = torch.where(enters, w.unsqueeze(1), torch.zeros_like(w).unsqueeze(1))
    set_max = set_w.amax(dim=-1, keepdim=True)
    set_w = set_w / torch.where(set_max > 0, set_max, torch.ones_like(set_max))
    wr_sum, w_sum = (set_w * r0.unsqueeze(1)).sum(-1), set_w.sum(-1)
    members = enters & valid.unsqueeze(1)
    r_sum = torch.where(members, r0.unsqueeze(1), torch.zeros_like(r0).unsqueeze(1)).sum(-1)
    n_sum = members.sum(-1).to(dtype)

    weighted_ok = w_sum > 0
    plain_mean = torch.where(n_sum > 0, r_sum / n_sum.clamp(min=1), torch.zeros_like(r_sum))
    weighted = wr_sum / torch.where(weighted_ok, w_sum, torch.ones_like(w_sum))
    baseline = torch.where(weighted_ok, weighted, plain_mean)
    num_fallback = (~weighted_ok).sum()  # on the device: read with the step's metrics (no host sync here)
    return baseline.reshape(-1).to(rewards.dtype), num_fallback


@register_baseline("gradient_weighted")
def gradient_weighted_baseline(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, leave_one_out: bool = False
) -> tuple[torch.Tensor, int]:
    """Variance-optimal baseline of OBLR-PO (Theorem 7): the gradient-weighted mean of the group's rewards.

    ``b_i = sum_j w_j r_j / sum_j w_j`` over sample ``i``'s group, ``w_j = ||grad_theta log pi(o_j|q)||^2``. With
    ``leave_one_out=True`` the sum runs over ``j != i``, so ``b_i`` does not depend on ``o_i`` and the policy gradient
    stays unbiased (Assumption 1).

    Args:
        rewards: flat ``(n_groups * group_size,)`` rewards, groups of ``group_size`` consecutive samples. A NaN
            reward (an unscorable completion) enters no one's baseline; its own baseline is still computed.
        weights: same shape, the per-sample squared gradient norms. Zero, negative or non-finite weights count as 0.
        group_size: samples per prompt (TRL's ``num_generations``).
        leave_one_out: leave the sample out of its own baseline.

    Returns:
        ``(baseline, num_fallback)``: the per-sample baseline, shaped like ``rewards``, and the number of samples whose
        set of weights summed to zero; those fall back to the plain mean of the set's rewards (0 for an empty set), as
        a 0-d tensor on the rewards' device (``int(num_fallback)`` reads it).
    """
    return _grouped_weighted_mean(rewards, weights, group_size, leave_one_out)


@register_baseline("mean", uses_weights=False)
def mean_baseline(
    rewards: torch.Tensor, weights: torch.Tensor | None, group_size: int, leave_one_out: bool = False
) -> tuple[torch.Tensor, int]:
    """Uniform baseline: GRPO's/Dr. GRPO's group mean, or RLOO's leave-one-out mean. ``weights`` is ignored."""
    return _grouped_weighted_mean(rewards, torch.ones_like(rewards), group_size, leave_one_out)


def clip_weights(weights: torch.Tensor, group_size: int, max_ratio: float) -> tuple[torch.Tensor, int]:
    """Guard against the "baseline explosion" failure signature: cap each ``w_i`` at ``max_ratio`` times the median of
    the positive finite weights of its group.

    When gradient norms vary wildly, the gradient-weighted baseline follows the one or two completions with the largest
    norms (its effective sample size collapses). Capping keeps the weighting's direction while bounding any one
    sample's influence; ``max_ratio = inf`` leaves the weights unchanged. Zero, negative and non-finite weights are
    returned as they are (the baseline ignores them).

    Returns:
        ``(clipped_weights, num_clipped)``, the count a 0-d tensor on the weights' device.
    """
    if not max_ratio >= 1.0:
        raise ValueError(f"max_ratio={max_ratio} must be >= 1.")
    w = weights.reshape(-1, group_size)
    usable = torch.isfinite(w) & (w > 0)
    masked = torch.where(usable, w, torch.full_like(w, float("nan")))
    median = torch.nanmedian(masked, dim=1, keepdim=True).values  # NaN for a group with no usable weight
    cap = median * max_ratio
    over = usable & (w > cap)
    clipped = torch.where(over, cap.expand_as(w), w)
    return clipped.reshape(weights.shape), over.sum()  # the count on the device, as num_fallback


# ------------------------------------------------------------------------------------------ baseline weights
@dataclass(frozen=True)
class WeightEstimator:
    """A source of the baseline weights ``w_i`` (``OBLRPOConfig.grad_norm_estimator``).

    ``weights(loss_type, lengths, sq_norms)``: the weights of one batch; ``needs``: what the trainer computes for
    ``sq_norms`` first: ``"norms"`` (the exact per-sequence squared norms, a norms pass or ``one_backward``),
    ``"logit_proxy"`` (:func:`logit_proxy_weights`, one forward without backward) or ``None`` (nothing).
    """

    weights: Callable[[str, torch.Tensor, torch.Tensor | None], torch.Tensor]
    needs: str | None


def _score_weights(loss_type: str, lengths: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """``shape_i^2 sq_norms_i``: the squared norm of each score as it enters ``loss_type``'s gradient."""
    return sq_norms.float() * sequence_shape(loss_type, lengths).to(sq_norms.device) ** 2


def _length_weights(loss_type: str, lengths: torch.Tensor, sq_norms: torch.Tensor | None) -> torch.Tensor:
    return lengths.float()


GRAD_NORM_ESTIMATORS = Registry("grad_norm_estimator", "weight estimator")  # name -> WeightEstimator
GRAD_NORM_ESTIMATORS.add("exact", WeightEstimator(_score_weights, needs="norms"))
GRAD_NORM_ESTIMATORS.add("length", WeightEstimator(_length_weights, needs=None))
GRAD_NORM_ESTIMATORS.add("logit", WeightEstimator(_score_weights, needs="logit_proxy"))


def register_weight_estimator(name: str, weights: Callable, needs: str | None) -> WeightEstimator:
    """Register a source of the baseline weights under ``name`` (selected by ``OBLRPOConfig.grad_norm_estimator``);
    ``needs`` as in :class:`WeightEstimator`. A taken name raises."""
    if needs not in (None, "norms", "logit_proxy"):
        raise ValueError(f"needs={needs!r}; allowed values: [None, 'norms', 'logit_proxy'].")
    return GRAD_NORM_ESTIMATORS.add(name, WeightEstimator(weights, needs))


def weight_estimator(name: str) -> WeightEstimator:
    """The registered :class:`WeightEstimator` ``name`` (an unknown one raises, naming the allowed values)."""
    return GRAD_NORM_ESTIMATORS.select(name)


def weights_need(baseline: str, estimator: str) -> str | None:
    """What a run must form before its baseline weights, as the weight estimator ``estimator`` declares it
    (:attr:`WeightEstimator.needs`: ``"norms"`` or ``"logit_proxy"``); None where the baseline ``baseline`` does not
    use the weights, or the estimator needs nothing. The one question the trainer and the config ask."""
    return weight_estimator(estimator).needs if baseline_uses_weights(baseline) else None


def baseline_weights(
    estimator: str, loss_type: str, lengths: torch.Tensor, sq_norms: torch.Tensor | None = None
) -> torch.Tensor:
    """The baseline weights ``w_i`` of Theorem 7 for one batch of completions, from the registered ``estimator``.

    ``"exact"``: the squared norm of each completion's score as it enters ``loss_type``'s gradient,
    ``shape_i^2 ||u_i||^2`` (``shape_i = 1/|o_i|`` for the losses that average each sequence, see
    :mod:`oblr_trl.loss_terms`), from the per-sequence ``sq_norms = ||grad sum_t log pi(o_i,t)||^2``.
    ``"logit"``: the same with ``sq_norms`` the forward-only proxy of :func:`logit_proxy_weights`.
    ``"length"``: verl OPO's proxy ``w_i = |o_i|`` (no norms needed).
    """
    entry = weight_estimator(estimator)
    if entry.needs is not None and sq_norms is None:
        raise ValueError(f"grad_norm_estimator={estimator!r} needs the per-sequence squared norms (or their proxy).")
    return entry.weights(loss_type, lengths, sq_norms)


def max_weight_ratio(weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group, the largest positive finite weight over the median of those weights (NaN for a group without any):
    large values mean the gradient-weighted baseline follows one or two completions ("baseline explosion")."""
    w = weights.reshape(-1, group_size)
    usable = torch.isfinite(w) & (w > 0)
    median = torch.nanmedian(torch.where(usable, w, torch.full_like(w, float("nan"))), dim=1).values
    largest = torch.where(usable, w, torch.zeros_like(w)).amax(dim=1)
    return largest / median


def weight_spread(weights: torch.Tensor) -> float:
    """Coefficient of variation of the weights (0 for fewer than 2 weights or a zero mean)."""
    if weights.numel() < 2 or not weights.mean() > 0:
        return 0.0
    return float(weights.std() / weights.mean())


# --------------------------------------------------------------------------------- the step's SNR samples
def unit_sq_norms(
    units: torch.Tensor, positions: torch.Tensor, coefficients: torch.Tensor, gram_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``||H_q||^2 = sum_{i,j in q} a_i a_j <u_i, u_j>`` for each SNR sample (unit) ``q`` present.

    Args:
        units: ``(n,)`` each row's unit id; positions: ``(n,)`` its position in the unit (``0 .. k-1``).
        coefficients: ``(n,)`` ``a_i = c_i A_i``; gram_rows: ``(n, k)`` ``<u_i, u_j>`` for the ``k`` members ``j``
            of ``i``'s unit, by position. Members absent from ``units`` (not in this step) contribute nothing.

    Returns:
        ``(unit_ids, sq_norms)``: the distinct units, ascending, and their ``||H_q||^2`` (float64).
    """
    unit_ids, slot = torch.unique(units, return_inverse=True)
    k = gram_rows.shape[1]
    a = torch.zeros(unit_ids.numel(), k, dtype=torch.float64, device=coefficients.device)
    gram = torch.zeros(unit_ids.numel(), k, k, dtype=torch.float64, device=gram_rows.device)
    a[slot, positions] = coefficients.double()
    gram[slot, positions] = gram_rows.double()
    return unit_ids, torch.einsum("qi,qij,qj->q", a, gram, a)


# ------------------------------------------------------------------------------------------ rewards and metrics
def aggregate_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor,
                      count_on_device: bool = False) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Each completion's reward as TRL's ``sum_then_normalize`` forms it (the weighted sum of the reward functions,
    NaN where every function returned None), with ``+-inf`` also made NaN (unscorable: no baseline, advantage 0).

    Returns ``(rewards, num_infinite)``; ``count_on_device``: ``num_infinite`` as a 0-d tensor (no host sync here).
    """
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    infinite = ~torch.isfinite(rewards) & ~unscorable
    count = infinite.sum()
    return (torch.where(unscorable | infinite, torch.full_like(rewards, float("nan")), rewards),
            count if count_on_device else int(count))


def mask_nonfinite_products(products: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Within-unit inner products ``(units, k, k)`` with every product of a completion whose own squared norm is not
    finite set to 0 (as are non-finite products); returns them and that completion mask, flat ``(units * k,)``."""
    bad = ~torch.isfinite(torch.diagonal(products, dim1=1, dim2=2))
    keep = ~bad
    ok = torch.isfinite(products) & keep[..., :, None] & keep[..., None, :]
    return torch.where(ok, products, torch.zeros_like(products)), bad.reshape(-1)


def baseline_metrics(
    rewards: torch.Tensor, baseline: torch.Tensor, weights: torch.Tensor, num_fallback: int | torch.Tensor,
    num_clipped: int | torch.Tensor
) -> dict[str, float]:
    """The baseline's metrics for one generation batch (unscorable rewards, NaN, excluded; 0 where nothing is left)."""
    valid = ~torch.isnan(rewards)
    # every value on the device first, read by the host in one transfer (one sync instead of six)
    dtype = torch.float32 if rewards.device.type == "mps" else torch.float64  # MPS has no float64
    v = valid.to(dtype)
    n = v.sum()
    mean = lambda x: (torch.where(valid, x.to(dtype), 0.0) * v).sum() / n.clamp(min=1)  # noqa: E731  (0 with none)
    w = torch.where(valid, weights.to(dtype), 0.0)
    w_mean = w.sum() / n.clamp(min=1)
    w_std = ((torch.where(valid, w - w_mean, 0.0) ** 2).sum() / (n - 1).clamp(min=1)).sqrt()
    spread = torch.where((n >= 2) & (w_mean > 0), w_std / torch.where(w_mean > 0, w_mean, 1.0), 0.0)
    count = lambda c: torch.as_tensor(c, device=n.device).to(dtype)  # noqa: E731  (an int, or a count on the device)
    values = torch.stack([mean(baseline), mean(rewards), spread, valid.numel() - n, count(num_fallback),
                          count(num_clipped)]).tolist()
    return {
        "baseline_mean": values[0],
        "reward_mean": values[1],
        "weight_spread": values[2],
        "fallback_samples": values[4],
        "clipped_weights": values[5],
        "unscorable": values[3],
    }


# ------------------------------------------------------------------------- logit proxy of the weights
def token_log_sum_sq_probs(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """``log sum_v pi_v^2`` per position, ``pi = softmax(logits / temperature)``, over the last axis, computed in chunks
    of ``chunk_size`` rows in float32 (what TRL 1.16's fused LM head returns as ``log_sum_sq_probs`` when added with
    ``outputs=(..., "log_sum_sq_probs")``; use that where the logits are not materialized)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, flat.shape[0], chunk_size):
        z = flat[s : s + chunk_size].float() / temperature
        out[s : s + chunk_size] = torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1)
    return out.reshape(logits.shape[:-1])


def logit_proxy_weights(token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's optimal-token-baseline proxy of ``||grad log pi(o_i|q)||^2`` from one forward, no backward:
    ``W_i = sum_t (1 - 2 pi_t + sum_v pi_v^2)`` over the completion tokens (``mask``), ``pi_t`` the sampled token's
    probability.

    Each term is exactly ``||d log pi_t / d z_t||^2 = ||e_t - pi||^2``, the squared gradient of the token's log-prob
    in the position's logits ``z_t``; the sum over tokens treats the positions' parameter gradients as orthogonal and
    every logit direction as equally amplified by the network (the proxy's two approximations). Pass it to
    :func:`baseline_weights` as the per-sequence ``sq_norms``, like the exact norms.

    Args:
        token_logps: ``(B, T)`` log-probabilities of the sampled tokens (at the sampling temperature).
        log_sum_sq_probs: ``(B, T)`` ``log sum_v pi_v^2`` at the same positions (TRL's fused head or
            :func:`token_log_sum_sq_probs`).
        mask: ``(B, T)`` 1 on the completion tokens that enter the loss.

    Returns:
        ``(B,)`` float32 weights, each in ``[0, 2 |o_i|]``; masked positions (and their non-finite values) add 0.
    """
    p = token_logps.float().exp()
    term = (1 - 2 * p + log_sum_sq_probs.float().exp()).clamp(min=0.0)
    keep = mask.bool() & torch.isfinite(term)
    return torch.where(keep, term, torch.zeros_like(term)).sum(-1)
