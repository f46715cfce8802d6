"""OBLR-PO under DeepSpeed ZeRO (stages 1-3) on CPU processes (gloo), against a plain run on the same data.

Each run is `distributed/equivalence_run.py` (deterministic completions, the real norms pass, baseline and SNR step)
with the Trainer's own ``deepspeed`` argument; the two-process tests also launch through ``accelerate launch`` with
``examples/accelerate_configs/deepspeed_zero*.yaml``. In fp32 a ZeRO run and a plain run differ only in the order of
float sums (~1e-8 relative). The lr each ZeRO step was taken with is read by a step pre-hook on the torch optimizer
ZeRO wraps, registered after OBLR-PO's: it is the lr that moved the parameters.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import EQUIVALENCE_SCRIPT as SCRIPT, assert_ran, launch_env, run_equivalence as run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # every test here runs torchrun (one or two processes)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LR, MAX_STEPS = 1e-2, 2  # the harness's learning_rate and max_steps: linear decay to 0


def scheduled(step: int) -> float:
    """The linear schedule's lr at optimizer step ``step`` (0-based), computed here, not read from the trainer."""
    return LR * (1 - step / MAX_STEPS)


def assert_ran_zero(result, stage: int, world_size: int = 1):
    assert result["world_size"] == len(result["fsdp"]) == world_size
    for facts in result["fsdp"]:
        assert facts["distributed_type"] == "DistributedType.DEEPSPEED" and facts["zero_stage"] == stage
        assert facts["zero_optimizer"].startswith("DeepSpeedZeroOptimizer")


def assert_applied_is_scheduled_times_scale(result, first_step: int = 0):
    """At every step, on every rank, every group's update was taken with the scheduled lr x the logged scale."""
    steps = range(first_step, len(result["lr_scale"]))
    for rank_lrs in result["applied_lrs"]:
        assert len(rank_lrs) == len(steps)
        for applied, step in zip(rank_lrs, steps):
            expected = scheduled(step) * result["lr_scale"][step]
            assert applied == pytest.approx([expected] * len(applied), rel=1e-12)
            assert result["learning_rate"][step] == pytest.approx(scheduled(step), rel=1e-12)
            assert result["lr"][step] == pytest.approx(expected, rel=1e-12)


def assert_same_training(plain, zero, rel=1e-6):
    """Same completions and advantages, same gradient norm and lr scale at each step, same trained parameters."""
    for ours, theirs in zip(plain["records"], zero["records"]):
        assert [r[:2] for r in ours] == [r[:2] for r in theirs]
        assert max(abs(a[2] - b[2]) for a, b in zip(ours, theirs)) < 1e-6
    assert zero["num_samples"] == plain["num_samples"]
    assert zero["grad_norm"] == pytest.approx(plain["grad_norm"], rel=rel)
    assert zero["lr_scale"] == pytest.approx(plain["lr_scale"], rel=rel)
    assert 0 < plain["lr_scale"][0] < 1
    assert zero["param_abs_sum"] == pytest.approx(plain["param_abs_sum"], rel=rel)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plain"), 1, 16, "fp32")


@pytest.mark.parametrize("stage", [2, 3])
def test_one_zero_process_matches_the_plain_run(plain, tmp_path, stage):
    """ZeRO-2 / ZeRO-3 in one process: the same advantages, gradient norm (DeepSpeed's pre-clip global norm), lr
    scale and trained parameters (clipped the same way) as the plain run; every update taken with scheduled lr x logged scale. ZeRO-2 is
    asked for one_backward, which DeepSpeed switches off (two passes, same result)."""
    zero = run(tmp_path, 1, 16, f"zero{stage}+fp32" + ("+one_backward" if stage == 2 else ""))
    assert_ran_zero(zero, stage)
    assert plain["grad_norm"][0] > 1.0  # above max_grad_norm (1.0): both runs clip (TRL's clip, DeepSpeed's clip)
    assert not zero["one_backward"]
    if stage == 2:  # one_backward=True switched off once, saying why
        (why,) = [w for w in zero["warnings"] if "one_backward" in w]
        assert "two passes" in why and "DeepSpeed (ZeRO owns the gradient buffers" in why
    assert_same_training(plain, zero)
    assert_applied_is_scheduled_times_scale(zero)


def test_zero1_and_zero3_with_parameter_offload_match_the_plain_run(plain, tmp_path):
    for mode, stage in (("zero1+fp32", 1), ("zero3+fp32+offload", 3)):
        zero = run(tmp_path, 1, 16, mode)
        assert_ran_zero(zero, stage)
        assert_same_training(plain, zero)
        assert_applied_is_scheduled_times_scale(zero)


def test_zero2_with_gradient_accumulation_matches_the_plain_run(tmp_path):
    """Two micro-batches per step: DeepSpeed divides each micro-batch's loss by the accumulation steps itself (where
    Accelerate does it for a plain run) and steps once, at the boundary: the step is sized once, from both."""
    plain, zero = run(tmp_path, 1, 8, "fp32+ga2"), run(tmp_path, 1, 8, "zero2+fp32+ga2")
    assert_ran_zero(zero, 2)
    assert_same_training(plain, zero)
    assert_applied_is_scheduled_times_scale(zero)


def test_zero2_bf16_follows_the_plain_bf16_run(tmp_path):
    """bf16: DeepSpeed trains bf16 weights with fp32 master copies where a plain run autocasts fp32 weights, so the
    two differ at bf16 precision (~1e-2 relative here) by design; the step is still sized exactly as logged."""
    plain, zero = run(tmp_path, 1, 16, "ddp"), run(tmp_path, 1, 16, "zero2")
    assert_ran_zero(zero, 2)
    assert zero["lr_scale"] == pytest.approx(plain["lr_scale"], rel=5e-2)
    assert zero["grad_norm"] == pytest.approx(plain["grad_norm"], rel=5e-2)
    assert_applied_is_scheduled_times_scale(zero)


def test_zero2_checkpoint_resume_carries_the_snr_state(tmp_path):
    """Two steps straight (checkpoint in DeepSpeed's format after each) vs resumed from checkpoint-1: step 2 has the
    same scale (it depends on step 1's SNR EMA state) and the run ends at the same parameters."""
    straight = run(tmp_path, 1, 16, "zero2+fp32+ema+save")
    assert os.path.isdir(tmp_path / "checkpoints" / "checkpoint-1" / "global_step1")  # DeepSpeed's own checkpoint
    os.rename(tmp_path / "zero2+fp32+ema+save-1.json", tmp_path / "straight.json")
    resumed = run(tmp_path, 1, 16, "zero2+fp32+ema+resume")
    assert resumed["lr_scale"] == pytest.approx(straight["lr_scale"], rel=1e-9)  # step 1 from the checkpoint's log, step 2 computed again
    assert resumed["param_abs_sum"] == pytest.approx(straight["param_abs_sum"], rel=1e-9)
    assert_applied_is_scheduled_times_scale(resumed, first_step=1)


def test_zero_stage_0_is_refused_at_construction(tmp_path):
    """Without ZeRO there is no ZeRO optimizer step to size: refused before training, naming the option."""
    out = tmp_path / "stage0.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", SCRIPT, str(out),
           "16", "zero0+fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=launch_env())
    assert proc.returncode != 0 and not out.exists()
    assert "zero_optimization.stage" in proc.stderr and "got stage 0" in proc.stderr


# ------------------------------------------------------------------ two processes (~15-30 s each on 2 cores)
@pytest.mark.parametrize("stage", [2, 3])
def test_two_zero_processes_match_one_plain_process(plain, tmp_path, stage):
    """2 ZeRO processes x 8 rows = 1 plain process x 16 (torchrun, the Trainer's `deepspeed` argument): every
    rank's update taken with the one scaled lr."""
    zero = run(tmp_path, 2, 8, f"zero{stage}+fp32")
    assert_ran_zero(zero, stage, world_size=2)
    assert_same_training(plain, zero, rel=1e-5)
    assert_applied_is_scheduled_times_scale(zero)


def test_accelerate_launch_with_the_example_zero3_config_on_two_processes(plain, tmp_path):
    """`accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml --num_processes 2`: the
    DeepSpeed plugin comes from the launcher (no `deepspeed` argument), its "auto" batch sizes are filled from the
    2-process world, and the run matches the plain one."""
    out = tmp_path / "accelerate.json"
    cmd = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
           os.path.join(ROOT, "examples", "accelerate_configs", "deepspeed_zero3.yaml"), "--num_processes", "2",
           "--mixed_precision", "no", SCRIPT, str(out), "8", "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=launch_env())
    assert_ran(proc)
    zero = json.loads(out.read_text())
    assert_ran_zero(zero, 3, world_size=2)
    assert_same_training(plain, zero, rel=1e-5)


# ------------------------------------------- LoRA + gradient checkpointing under ZeRO-3 (TRL forces reentrant there)
@pytest.fixture(scope="module")
def plain_lora(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plain_lora"), 1, 16, "fp32+lora")


@pytest.mark.parametrize("nproc", [1, 2])
def test_lora_with_checkpointing_under_accelerate_zero3_matches_the_plain_run(plain_lora, tmp_path, nproc):
    """TRL's `--use_peft` recipe under `accelerate launch` with the example ZeRO-3 config: GRPOTrainer forces
    reentrant gradient checkpointing for PEFT there; the norms pass runs those layers under its own checkpoint. The
    same advantages, lr scales and trained adapters as a plain LoRA run (non-reentrant), every rank's update taken
    with the one scaled lr. (Before: refused at the first norms pass.)"""
    out = tmp_path / f"zero3-lora-{nproc}.json"
    cmd = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
           os.path.join(ROOT, "examples", "accelerate_configs", "deepspeed_zero3.yaml"), "--num_processes",
           str(nproc), "--mixed_precision", "no", SCRIPT, str(out), str(16 // nproc), "fp32+lora"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=launch_env())
    assert_ran(proc)
    zero = json.loads(out.read_text())
    assert_ran_zero(zero, 3, world_size=nproc)
    assert all(facts["reentrant_checkpointing"] for facts in zero["fsdp"])  # as TRL set it, on every rank
    assert zero["gradient_checkpointing"] and not any(f["reentrant_checkpointing"] for f in plain_lora["fsdp"])
    assert_same_training(plain_lora, zero, rel=1e-5)
    assert_applied_is_scheduled_times_scale(zero)


def test_zero2_under_reentrant_checkpointing_matches_the_plain_run(plain, tmp_path):
    """Full fine-tuning with `use_reentrant=True` under ZeRO-2, one process: the norms pass runs the layers under its
    own checkpoint; the same training as the plain (non-reentrant) run."""
    zero = run(tmp_path, 1, 16, "zero2+fp32+reentrant")
    assert_ran_zero(zero, 2)
    assert all(facts["reentrant_checkpointing"] for facts in zero["fsdp"])
    assert_same_training(plain, zero)
    assert_applied_is_scheduled_times_scale(zero)


@pytest.mark.parametrize("nproc", [1, 2])
def test_exact_norms_on_zero3_partitioned_models(tmp_path, nproc):
    """The norms pass on models ZeRO-3 has partitioned (`deepspeed.initialize`, every parameter 0 elements outside its
    module's forward), each rank its own batch: full fine-tuning (its RMSNorms' rules are recognised on the gathered
    weights), LoRA on lm_head tied and untied (the head's adapter gathered for the pass), trainable_token_indices tied
    and untied (the rows PEFT's forward reads outside their module's forward, gathered for the pass). Per-sample
    autograd on an unpartitioned copy is the reference. (Before: every RMSNorm was refused, "The expanded size of the
    tensor (0)"; untied trainable tokens failed in PEFT's forward; tied ones, after a first forward, left out the
    embedding's share of the rows' gradient.)"""
    out = tmp_path / "zero3.json"
    script = os.path.join(os.path.dirname(__file__), "distributed", "zero3_norms.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script,
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=launch_env())
    assert_ran(proc)
    ranks = json.loads(out.read_text())
    assert len(ranks) == nproc
    assert nproc == 1 or ranks[0]["full fine-tuning, tied"]["reference"] != ranks[1]["full fine-tuning, tied"]["reference"]
    for results in ranks:
        assert len(results) == 5
        for name, result in results.items():
            assert result["partitioned"] and result["no_grad_left"], name
            assert sum(result["reference"]) > 0, name
            assert result["ours"] == pytest.approx(result["reference"], rel=1e-5), name
