"""One process with the global batch vs two DDP processes (torchrun, gloo on CPU) with half each."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed", "equivalence_run.py")


def run(tmp_path, nproc: int, per_device: int, mode: str = "ddp") -> dict:
    out = tmp_path / f"{mode}-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           SCRIPT, str(out), str(per_device), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


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


def test_exact_norms_on_an_fsdp2_sharded_model(tmp_path):
    """The norms pass gathers the root's parameters itself (it bypasses the root's forward hook), runs as a collective
    on every rank with each rank's own batch, matches per-sample autograd, and leaves the sharded model trainable."""
    out = tmp_path / "fsdp2.json"
    script = os.path.join(os.path.dirname(__file__), "distributed", "fsdp2_norms.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2 and ranks[0]["reference"] != ranks[1]["reference"]  # different data per rank
    for result in ranks:
        assert result["ours"] == pytest.approx(result["reference"], rel=1e-4)
        assert result["no_grad_left"] and result["step_ok"]
