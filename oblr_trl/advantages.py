"""OBLR-PO's advantages ``r_i - b_i`` (Theorem 7) for a generated batch: a pure function of all ranks' rewards,
completion lengths and squared gradient norms (or proxy weights), returning what it found instead of logging it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .advice import WEIGHT_RATIO_WARNING
from .estimators import (baseline_metrics, baseline_uses_weights, baseline_weights, clip_weights, get_baseline,
                         max_weight_ratio, weight_estimator)


@dataclass(frozen=True)
class BaselineStats:
    """What the baseline's metrics (:func:`.estimators.baseline_metrics`) are formed from, for some rows: all ranks'
    ``rewards`` (NaN: unscorable), their ``baseline`` and ``weights``, the rows whose baseline fell back to the plain
    mean (``num_fallback``) and the weights clipped (``num_clipped``): ints or 0-d tensors on the device.

    Merged across the chunks of one micro-batch (:meth:`merge`) before logging, so ``one_backward``'s micro-batch logs
    once however many chunks it runs in: the chunks hold disjoint whole groups, so their rows concatenate and their
    counts add. Micro-batches are not merged: each logs its own (the two-pass path logs once per generation batch),
    and TRL averages what was logged over the logging interval.
    """

    rewards: torch.Tensor
    baseline: torch.Tensor
    weights: torch.Tensor
    num_fallback: int | torch.Tensor
    num_clipped: int | torch.Tensor

    @classmethod
    def merge(cls, parts: Sequence["BaselineStats"]) -> "BaselineStats":
        """One value for the rows of ``parts`` (chunks of one micro-batch, in row order): tensors concatenated,
        counts summed."""
        return cls(torch.cat([p.rewards for p in parts]), torch.cat([p.baseline for p in parts]),
                   torch.cat([p.weights for p in parts]), sum(p.num_fallback for p in parts),
                   sum(p.num_clipped for p in parts))

    def metrics(self) -> dict[str, float]:
        """The metrics to log, without the ``oblr/`` prefix (:func:`.estimators.baseline_metrics`)."""
        return baseline_metrics(self.rewards, self.baseline, self.weights, self.num_fallback, self.num_clipped)


def raised(*found: dict) -> tuple[str, ...]:
    """The keys of :data:`.advice.WARNINGS` that apply, from dicts of ``key -> whether it applies`` (a bool, or a 0-d
    tensor still on the device): every tensor read by the host at once, one sync however many checks and chunks
    there are (a chunked ``one_backward`` step read each check of each chunk on its own). In first-seen
    order, each key once."""
    flat = [(k, v) for d in found for k, v in d.items()]
    tensors = [v.reshape(()).bool() for _, v in flat if torch.is_tensor(v)]
    read = iter(torch.stack(tensors).tolist() if tensors else ())
    hits = [k for k, v in flat if (next(read) if torch.is_tensor(v) else bool(v))]
    return tuple(dict.fromkeys(hits))


@dataclass(frozen=True)
class AdvantageResult:
    """``values``: the local rows' advantages. ``stats``: what the baseline's metrics are formed from (all ranks'
    rows). ``found``: for each check, key of :data:`.advice.WARNINGS` -> whether it applies (a 0-d tensor, read when
    :attr:`warnings` or :func:`raised` asks)."""

    values: torch.Tensor
    stats: BaselineStats
    found: dict

    @property
    def warnings(self) -> tuple[str, ...]:
        """The keys that apply (reads the checks: one host sync)."""
        return raised(self.found)


def identical_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per row: whether its group's scorable rewards (2 or more) are all equal. Their advantages are exactly 0: a
    weighted mean of equal values is that value, but in floating point ``sum_j w_j r / sum_j w_j`` differs from
    ``r`` by an ulp, and those ulps would make a step of identical groups look like a tiny gradient of pure noise
    instead of the zero gradient it is (``status="zero_gradient"`` in :func:`.snr_formulas.snr_step_size`)."""
    r = rewards.reshape(-1, group_size)
    valid = ~torch.isnan(r)
    high = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(1)
    low = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(1)
    return ((high == low) & (valid.sum(1) >= 2)).repeat_interleave(group_size)


def compute_advantages(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    sq_norms: torch.Tensor | None,
    *,
    args,
    loss_type: str,
    group_size: int,
    local: slice,
    unscorable: torch.Tensor | None = None,
    trl_advantages: torch.Tensor | None = None,
) -> AdvantageResult:
    """The advantages of the rows ``local`` of an all-rank batch.

    ``rewards`` (NaN: unscorable), ``lengths`` (completion tokens in the loss) and ``sq_norms`` (each completion's
    ``||grad log pi||^2``, or the logit proxy's weight; ``None`` where no weight estimator needs them) cover every
    rank's rows, groups of ``group_size`` consecutive. ``unscorable`` marks completions whose norm was not finite:
    they are treated as unscorable too. ``args`` is the :class:`.OBLRPOConfig` (baseline, leave_one_out,
    grad_norm_estimator, weight_clip, scale_rewards). With ``scale_rewards != "none"`` (plain GRPO, an ablation) TRL's
    own ``trl_advantages`` stand and only the metrics are formed.
    """
    found = {}
    if unscorable is not None:
        rewards = torch.where(unscorable, torch.full_like(rewards, float("nan")), rewards)
    if sq_norms is None and weight_estimator(args.grad_norm_estimator).needs is not None:
        sq_norms = torch.zeros_like(lengths, dtype=torch.float32)  # not formed: the baseline is the mean, no SNR
    weights = baseline_weights(args.grad_norm_estimator, loss_type, lengths, sq_norms)
    if args.weight_clip is None and baseline_uses_weights(args.baseline):
        found["weight_spread"] = (max_weight_ratio(weights, group_size) > WEIGHT_RATIO_WARNING).any()
    num_clipped = 0
    if args.weight_clip is not None:
        weights, num_clipped = clip_weights(weights, group_size, args.weight_clip)
    if args.scale_rewards != "none":
        baseline, num_fallback = get_baseline("mean")(rewards, weights, group_size, False)
        values = trl_advantages
    else:
        baseline, num_fallback = get_baseline(args.baseline)(rewards, weights, group_size, args.leave_one_out)
        values = torch.nan_to_num(rewards - baseline, nan=0.0)
        values = torch.where(identical_groups(rewards, group_size), torch.zeros_like(values), values)[local]
    found["fallback"] = torch.as_tensor(num_fallback, device=rewards.device) > 0
    found["unscorable"] = torch.isnan(rewards).any()
    stats = BaselineStats(rewards, baseline, weights, num_fallback, num_clipped)
    return AdvantageResult(values, stats, found)
