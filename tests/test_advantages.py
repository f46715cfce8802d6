"""`compute_advantages`: the trainer's r_i - b_i, against a per-completion loop written from Theorem 7's definition
(leave-one-out weighted mean of the others' rewards, weights shape_i^2 ||u_i||^2), with unscorable completions,
weight clipping, the local slice and GRPO's own advantages."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from oblr_trl.advantages import BaselineStats, compute_advantages

G = 4


def args(**kw):
    base = dict(baseline="gradient_weighted", leave_one_out=True, grad_norm_estimator="exact", weight_clip=None,
                scale_rewards="none")
    return SimpleNamespace(**{**base, **kw})


def brute_force(rewards, weights, leave_one_out=True):
    """b_i = sum_{j != i, scorable} w_j r_j / sum_{j != i, scorable} w_j within each group (plain mean if the weights
    sum to 0); advantage 0 for an unscorable completion."""
    out = []
    for g in range(len(rewards) // G):
        idx = range(g * G, (g + 1) * G)
        for i in idx:
            if math.isnan(rewards[i]):
                out.append(0.0)
                continue
            others = [j for j in idx if (j != i or not leave_one_out) and not math.isnan(rewards[j])]
            total = sum(weights[j] for j in others)
            b = (sum(weights[j] * rewards[j] for j in others) / total if total > 0
                 else sum(rewards[j] for j in others) / len(others))
            out.append(rewards[i] - b)
    return out


def test_gradient_weighted_leave_one_out_by_hand():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(2 * G, generator=g, dtype=torch.float64).float()
    lengths = torch.tensor([3, 5, 2, 7, 4, 4, 6, 1])
    sq = torch.rand(2 * G, generator=g) * 10
    result = compute_advantages(rewards, lengths, sq, args=args(), loss_type="dapo", group_size=G,
                                local=slice(0, 2 * G))
    weights = sq  # dapo sums tokens: shape 1, w_i = ||u_i||^2
    assert result.values.tolist() == pytest.approx(brute_force(rewards.tolist(), weights.tolist()), abs=1e-6)
    assert result.warnings == ()
    # a per-sequence-mean loss weighs ||u_i||^2 / |o_i|^2
    result = compute_advantages(rewards, lengths, sq, args=args(), loss_type="grpo", group_size=G,
                                local=slice(0, 2 * G))
    weights = (sq / lengths.float() ** 2).tolist()
    assert result.values.tolist() == pytest.approx(brute_force(rewards.tolist(), weights), abs=1e-6)


def test_the_local_slice_and_unscorable_completions():
    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.0, 0.0, 1.0, 1.0])
    sq = torch.tensor([1.0, 2.0, 3.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    bad = torch.tensor([False, False, False, False, False, True, False, False])  # non-finite norm: unscorable too
    result = compute_advantages(rewards, torch.ones(8, dtype=torch.long), sq, args=args(), loss_type="dapo",
                                group_size=G, local=slice(4, 8), unscorable=bad)
    expected = brute_force([1.0, 0.0, math.nan, 1.0, 0.0, math.nan, 1.0, 1.0], sq.tolist())[4:]
    assert result.values.tolist() == pytest.approx(expected) and result.values[1] == 0.0
    assert "unscorable" in result.warnings


def test_weight_clip_caps_a_dominant_weight_and_counts_it():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    sq = torch.tensor([1e6, 1.0, 1.0, 1.0])
    unclipped = compute_advantages(rewards, torch.ones(4, dtype=torch.long), sq, args=args(), loss_type="dapo",
                                   group_size=G, local=slice(0, 4))
    assert "weight_spread" in unclipped.warnings
    clipped = compute_advantages(rewards, torch.ones(4, dtype=torch.long), sq, args=args(weight_clip=10.0),
                                 loss_type="dapo", group_size=G, local=slice(0, 4))
    assert clipped.stats.num_clipped == 1 and "weight_spread" not in clipped.warnings
    assert clipped.values.tolist() == pytest.approx(brute_force(rewards.tolist(), [10.0, 1.0, 1.0, 1.0]))


def test_mean_baseline_needs_no_norms_and_grpo_keeps_trls_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    rloo = compute_advantages(rewards, torch.ones(4, dtype=torch.long), None, args=args(baseline="mean"),
                              loss_type="dapo", group_size=G, local=slice(0, 4))
    assert rloo.values.tolist() == pytest.approx(brute_force(rewards.tolist(), [1.0] * 4))
    trl = torch.tensor([0.9, -0.9, -0.9, 0.9])
    grpo = compute_advantages(rewards, torch.ones(4, dtype=torch.long), None,
                              args=args(baseline="mean", leave_one_out=False, scale_rewards="group"),
                              loss_type="dapo", group_size=G, local=slice(0, 4), trl_advantages=trl)
    assert grpo.values is trl and grpo.stats.baseline.tolist() == [0.5] * 4  # logged baseline: the group mean


def test_identical_groups_get_advantages_of_exactly_zero():
    """issue 46: the weighted mean of equal rewards is that reward, but in floating point it misses by an ulp in most
    draws; those ulps made a step of identical groups a tiny gradient of pure noise. A group whose scorable rewards
    (2 or more) are all equal gets advantages of exactly 0; a lone scorable reward keeps its own (no baseline)."""
    torch.manual_seed(0)
    nan = float("nan")
    rewards = torch.tensor([0.3] * G + [0.7, nan, 0.7, 0.7] + [nan, 0.9, nan, nan] + [0.1, 0.2, 0.3, 0.4])
    weights = torch.rand(4 * G) * 10
    a = dict(args=args(), loss_type="dr_grpo", group_size=G, local=slice(None))
    values = compute_advantages(rewards, torch.full((4 * G,), 5), weights, **a).values
    assert values[: 2 * G].tolist() == [0.0] * (2 * G)
    assert values[2 * G + 1] == pytest.approx(0.9) and (values[3 * G :] != 0).all()
    from oblr_trl import gradient_weighted_baseline

    plain = rewards[:G] - gradient_weighted_baseline(rewards[:G], weights[:G], G, leave_one_out=True)[0]
    assert (plain != 0).any()  # what the weighted mean alone gives here: ulps, not zeros


def test_baseline_stats_of_chunks_merge_into_the_whole_batchs():
    """one_backward forms a micro-batch's advantages chunk by chunk (whole groups each) and logs once:
    BaselineStats.merge of the chunks' stats gives the metrics, values and counts of the whole batch at once."""
    nan = float("nan")
    rewards = torch.tensor([1.0, 0.0, nan, 1.0, 0.0, 0.0, 1.0, 1.0, 5.0, 5.0, 5.0, 0.0])
    sq = torch.tensor([1e6, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 3.0, 4.0, 5.0])  # a clip, a fallback, a NaN
    lengths = torch.tensor([3, 5, 2, 7, 4, 4, 6, 1, 2, 2, 3, 3])
    a = dict(args=args(weight_clip=10.0), loss_type="grpo", group_size=G)
    whole = compute_advantages(rewards, lengths, sq, local=slice(0, 12), **a)
    chunks = [compute_advantages(rewards[s : s + G], lengths[s : s + G], sq[s : s + G], local=slice(0, G), **a)
              for s in range(0, 12, G)]
    merged = BaselineStats.merge([c.stats for c in chunks])
    assert merged.num_clipped == whole.stats.num_clipped == 1 and merged.num_fallback == whole.stats.num_fallback == 4
    assert merged.metrics() == whole.stats.metrics() and merged.metrics()["unscorable"] == 1.0
    assert torch.equal(torch.cat([c.values for c in chunks]), whole.values)
    assert BaselineStats.merge([whole.stats]).metrics() == whole.stats.metrics()


def test_raised_reads_every_check_at_once_in_first_seen_order_each_key_once():
    from oblr_trl.advantages import raised

    found = [{"weight_spread": torch.tensor(False), "fallback": torch.tensor(True)},
             {"nonfinite_norms": True, "fallback": torch.tensor(False), "unscorable": torch.tensor([True])},
             {"weight_spread": torch.tensor(True), "group_span": False}]
    assert raised(*found) == ("fallback", "nonfinite_norms", "unscorable", "weight_spread")
    assert raised() == () and raised({"fallback": torch.tensor(False)}) == ()


def test_advantages_and_their_checks_take_no_host_sync_until_read():
    """Issue 56: a chunked ``one_backward`` step read each check of each chunk (weight spread, fallback count,
    unscorable rows, non-finite norms) on its own, 4 host syncs a chunk; the checks now stay on the device and the
    trainer reads them all once (``raised``: one ``.tolist()``), the counts with the metrics."""
    from studies.counting import HostSyncs

    from oblr_trl.advantages import raised

    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.0, 0.0, 0.0, 1.0])
    sq = torch.tensor([1.0, 2.0, 3.0, 0.0, 1e6, 1.0, 1.0, 1.0])
    with HostSyncs() as syncs:
        results = [compute_advantages(rewards, torch.full((8,), 4), sq, args=args(weight_clip=c), loss_type="dapo",
                                      group_size=G, local=slice(0, 8)) for c in (None, 3.0)]
    assert syncs.total == 0, syncs.calls
    with HostSyncs() as syncs:
        keys = raised(*(r.found for r in results))
    assert syncs.total == 1 and keys == ("weight_spread", "unscorable")
    assert results[0].warnings == ("weight_spread", "unscorable") and results[1].warnings == ("unscorable",)
    with HostSyncs() as syncs:
        metrics = BaselineStats.merge([r.stats for r in results]).metrics()
    assert syncs.total == 1 and metrics["clipped_weights"] == 1.0 and metrics["unscorable"] == 2.0
