"""One process with the global batch vs two DDP or FSDP2 processes (torchrun, gloo on CPU) with half each."""

import json
import os
import subprocess
import sys

import pytest

from helpers import EQUIVALENCE_SCRIPT as SCRIPT, assert_ran, launch_env, run_equivalence as run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]



@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), 1, 16)


def test_two_ddp_processes_match_one(single, tmp_path):
    double = run(tmp_path, 2, 8)
    assert (single["world_size"], double["world_size"]) == (1, 2)
    # Same completions, same advantages: the weights are gathered across ranks like the rewards.
    first_one, first_two = single["records"][0], double["records"][0]
    assert [r[:2] for r in first_one] == [r[:2] for r in first_two]
    assert max(abs(a[2] - b[2]) for a, b in zip(first_one, first_two)) < 1e-4
    # Same step terms: per-sample norm sums and the gradient norm are all-reduced, every rank applies one scale.
    assert single["num_samples"] == double["num_samples"] == [4.0, 4.0]
    assert double["lr_scale"][0] == pytest.approx(single["lr_scale"][0], rel=1e-4)
    assert double["grad_norm"][0] == pytest.approx(single["grad_norm"][0], rel=1e-4)
    assert 0 < single["lr_scale"][0] < 1
    # After one Adam step float differences between layouts are amplified (g / (|g| + eps)); still close.
    assert double["lr_scale"][1] == pytest.approx(single["lr_scale"][1], rel=2e-2)


def test_a_rank_with_only_degenerate_data(tmp_path):
    """Rank 1 gets only empty completions with identical rewards: no deadlock in the collective norms pass or the
    step's gathers, everything finite, and the same answer as one process on the same data."""
    one, two = run(tmp_path, 1, 16, "degenerate"), run(tmp_path, 2, 8, "degenerate")
    first_one, first_two = one["records"][0], two["records"][0]
    assert [r[:2] for r in first_one] == [r[:2] for r in first_two]
    assert sum(1 for _, completion, _ in first_two if completion == "") == 8
    assert all(advantage == 0.0 for _, completion, advantage in first_two if completion == "")
    assert max(abs(a[2] - b[2]) for a, b in zip(first_one, first_two)) < 1e-4
    assert two["lr_scale"][0] == pytest.approx(one["lr_scale"][0], rel=1e-4)
    assert all(0.0 <= s <= 1.0 for s in two["lr_scale"])


def test_one_backward_on_two_ddp_processes_matches_one_process_two_passes(tmp_path):
    """one_backward under DDP: the weight gradients are formed outside autograd, so DDP's hooks never fire and the
    trainer all-reduces them itself. Same scale, gradient norm and trained parameters as one process with the default
    two passes (fp32)."""
    one, two = run(tmp_path, 1, 16, "fp32"), run(tmp_path, 2, 8, "fp32+one_backward")
    assert_one_backward_matches_one_process(one, two)


def test_one_backward_with_accumulation_on_two_ddp_processes_matches_one_process(tmp_path):
    """one_backward with gradient accumulation under DDP: each rank forms its micro-batches' gradients, which are
    all-reduced once, at the step's last micro-batch. 2 processes x 4 rows x 2 micro-batches = 1 process x 16."""
    one, two = run(tmp_path, 1, 16, "fp32"), run(tmp_path, 2, 4, "fp32+one_backward+ga2")
    assert_one_backward_matches_one_process(one, two)


def test_one_backward_in_chunks_on_two_ddp_and_fsdp2_processes_matches_one_process(tmp_path):
    """one_backward under checkpointing in chunks of one group (4 rows of a rank's 8): each chunk's gradients added,
    all-reduced (DDP) or reduce-scattered (FSDP2) as unchunked; the same step as one process with two passes."""
    one = run(tmp_path, 1, 16, "fp32")
    for mode in ("fp32+one_backward+chunk", "fsdp2+fp32+one_backward+chunk"):
        two = run(tmp_path, 2, 8, mode)
        assert two["gradient_checkpointing"] and two["chunk_rows"] == 4, mode
        assert_one_backward_matches_one_process(one, two)


def assert_one_backward_matches_one_process(one, two):
    """``two`` (2 processes, one_backward) took the same first step as ``one`` (1 process, two passes)."""
    assert two["one_backward"] and not one["one_backward"] and two["world_size"] == 2
    assert two["num_samples"] == one["num_samples"] == [4.0, 4.0]
    assert two["grad_norm"][0] == pytest.approx(one["grad_norm"][0], rel=1e-4)
    assert two["lr_scale"][0] == pytest.approx(one["lr_scale"][0], rel=1e-4)
    assert 0 < one["lr_scale"][0] < 1
    for step in range(2):
        assert_every_rank_applied(two, step, two["lr"][step])
    assert two["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-6)


def assert_ran_fsdp2(result):
    """Accelerate's own FSDP2 path ran on every rank: the Trainer saw FSDP, the model and the optimizer hold DTensors."""
    assert result["world_size"] == len(result["fsdp"]) == 2
    for facts in result["fsdp"]:
        assert facts["distributed_type"] == "DistributedType.FSDP" and facts["is_fsdp2"]
        assert facts["trainer_is_fsdp_enabled"] and facts["root_is_fsdp"]
        assert facts["all_params_dtensor"] and facts["optimizer_params_dtensor"]
        assert facts["fsdp_modules"] >= 4  # each decoder layer, the embedding / final norm / head unit, the root


def assert_every_rank_applied(result, step: int, lr: float):
    """The learning rate each rank's optimizer step was taken with (all param groups) is the logged, scaled one."""
    for rank_lrs in result["applied_lrs"]:
        assert rank_lrs[step] == pytest.approx([lr] * len(rank_lrs[step]), rel=1e-12)


def test_two_fsdp2_processes_match_one(tmp_path):
    """The trainer under Accelerate's real FSDP2 path (fully_shard via fsdp2_prepare_model, DTensor parameters) on 2
    processes matches 1 process with the global batch. In fp32: FSDP2's bf16 policy casts the parameters themselves,
    a plain run autocasts them, which differ by ~1e-3 by design."""
    one, two = run(tmp_path, 1, 16, "fsdp2+fp32"), run(tmp_path, 2, 8, "fsdp2+fp32")
    assert one["world_size"] == 1 and one["fsdp"][0]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert_ran_fsdp2(two)
    first_one, first_two = one["records"][0], two["records"][0]
    assert [r[:2] for r in first_one] == [r[:2] for r in first_two]
    assert max(abs(a[2] - b[2]) for a, b in zip(first_one, first_two)) < 1e-4
    assert one["num_samples"] == two["num_samples"] == [4.0, 4.0]
    assert two["lr_scale"][0] == pytest.approx(one["lr_scale"][0], rel=1e-4)
    assert two["grad_norm"][0] == pytest.approx(one["grad_norm"][0], rel=1e-4)
    assert 0 < one["lr_scale"][0] < 1
    for step in range(2):  # every rank steps with the one scaled lr, the same as the single process's
        assert_every_rank_applied(two, step, two["lr"][step])
        assert two["lr"][step] == pytest.approx(one["lr"][step], rel=1e-3)
    # the sharded step itself matched: step 2 (after one Adam step) still agrees closely
    assert max(abs(a[2] - b[2]) for a, b in zip(one["records"][1], two["records"][1])) < 1e-4
    assert two["lr_scale"][1] == pytest.approx(one["lr_scale"][1], rel=1e-3)
    assert two["grad_norm"][1] == pytest.approx(one["grad_norm"][1], rel=1e-3)


def test_one_backward_under_fsdp2_matches_one_process(tmp_path):
    """one_backward under FSDP2: each weight gradient is formed from the rank's samples and reduce-scattered into the
    parameter's DTensor shards. 2 FSDP2 processes x 8 = 1 process x 16 with the two-pass default."""
    one, two = run(tmp_path, 1, 16, "fp32"), run(tmp_path, 2, 8, "fsdp2+fp32+one_backward")
    assert_ran_fsdp2(two)
    assert_one_backward_matches_one_process(one, two)
    assert two["grad_norm"][1] == pytest.approx(one["grad_norm"][1], rel=1e-3)
    # with gradient accumulation: each micro-batch's gradients reduce-scattered and added to the shards
    assert_one_backward_matches_one_process(one, run(tmp_path, 2, 4, "fsdp2+fp32+one_backward+ga2"))
    # a rank with only empty, unscorable completions still takes part in every reduce-scatter: no deadlock
    one, two = run(tmp_path, 1, 16, "fp32+degenerate+nan"), run(tmp_path, 2, 8, "fsdp2+fp32+degenerate+nan+one_backward")
    assert two["one_backward"] and two["unscorable"] == one["unscorable"] == [8.0, 8.0]
    assert two["grad_norm"][0] == pytest.approx(one["grad_norm"][0], rel=1e-4)
    assert two["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-6)


def test_an_fsdp2_rank_with_only_degenerate_data(tmp_path):
    """Under FSDP2, rank 1 gets only empty completions whose rewards are None (NaN, unscorable): the sharded norms pass
    and the step's gathers still run on both ranks (no deadlock), and the answer is one process's on the same data."""
    one, two = run(tmp_path, 1, 16, "fsdp2+fp32+degenerate+nan"), run(tmp_path, 2, 8, "fsdp2+fp32+degenerate+nan")
    assert_ran_fsdp2(two)
    first_one, first_two = one["records"][0], two["records"][0]
    assert [r[:2] for r in first_one] == [r[:2] for r in first_two]
    assert sum(1 for _, completion, _ in first_two if completion == "") == 8
    assert all(advantage == 0.0 for _, completion, advantage in first_two if completion == "")
    assert max(abs(a[2] - b[2]) for a, b in zip(first_one, first_two)) < 1e-4
    assert one["unscorable"] == two["unscorable"] == [8.0, 8.0]
    assert two["grad_norm"][0] == pytest.approx(one["grad_norm"][0], rel=1e-4)
    # One group carries all the signal here: the SNR is ~0 in both layouts and the scale is ~0 (float noise), so it
    # is compared absolutely.
    assert two["lr_scale"] == pytest.approx(one["lr_scale"], abs=1e-5)
    assert all(0.0 <= s <= 1.0 for s in two["lr_scale"])
    for step in range(2):
        assert_every_rank_applied(two, step, two["lr"][step])


def test_exact_norms_on_an_fsdp2_sharded_model(tmp_path):
    """The norms pass gathers the root's parameters itself (it bypasses the root's forward hook), runs as a collective
    on every rank with each rank's own batch, matches per-sample autograd, and leaves the sharded model trainable."""
    out = tmp_path / "fsdp2.json"
    script = os.path.join(os.path.dirname(__file__), "distributed", "fsdp2_norms.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=launch_env())
    assert_ran(proc)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2 and ranks[0]["reference"] != ranks[1]["reference"]  # different data per rank
    for result in ranks:
        assert result["ours"] == pytest.approx(result["reference"], rel=1e-4)
        assert result["no_grad_left"] and result["step_ok"]


def test_two_ddp_processes_under_reentrant_checkpointing_match_one_plain_process(tmp_path):
    """`gradient_checkpointing_kwargs={"use_reentrant": True}` on two DDP processes: each rank's norms pass runs the
    layers under its own checkpoint (the model keeps its setting: DDP's backward is the reentrant one); the same
    advantages, gradient norm, lr scale and trained parameters as one non-reentrant process (fp32).
    (Before: refused at the first norms pass.)"""
    one, two = run(tmp_path, 1, 16, "fp32"), run(tmp_path, 2, 8, "fp32+reentrant")
    assert two["world_size"] == 2 and all(f["reentrant_checkpointing"] for f in two["fsdp"])
    assert not any(f["reentrant_checkpointing"] for f in one["fsdp"])
    for ours, theirs in zip(one["records"], two["records"]):
        assert [r[:2] for r in ours] == [r[:2] for r in theirs]
        assert max(abs(a[2] - b[2]) for a, b in zip(ours, theirs)) < 1e-5
    assert two["lr_scale"] == pytest.approx(one["lr_scale"], rel=1e-5) and 0 < one["lr_scale"][0] < 1
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["param_abs_sum"] == pytest.approx(one["param_abs_sum"], rel=1e-6)


def test_two_fsdp2_processes_under_reentrant_checkpointing_match_one_plain_process(tmp_path):
    """`gradient_checkpointing_kwargs={"use_reentrant": True}` under Accelerate's FSDP2 path on two processes: the
    norms pass runs the reentrant layers under its own checkpoint, inside the FSDP units' gathers (the model keeps its
    setting); the same advantages, lr scales and gradient norms as one non-reentrant plain process (fp32)."""
    one, two = run(tmp_path, 1, 16, "fp32"), run(tmp_path, 2, 8, "fsdp2+fp32+reentrant")
    assert_ran_fsdp2(two)
    assert all(f["reentrant_checkpointing"] for f in two["fsdp"])
    assert not any(f["reentrant_checkpointing"] for f in one["fsdp"])
    for ours, theirs in zip(one["records"], two["records"]):
        assert [r[:2] for r in ours] == [r[:2] for r in theirs]
        assert max(abs(a[2] - b[2]) for a, b in zip(ours, theirs)) < 1e-4
    assert two["lr_scale"] == pytest.approx(one["lr_scale"], rel=1e-4) and 0 < one["lr_scale"][0] < 1
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    for step in range(2):  # every rank steps with the one scaled lr
        assert_every_rank_applied(two, step, two["lr"][step])
