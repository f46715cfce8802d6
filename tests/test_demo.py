"""examples/demo.py end to end on the embedded tiny model (the real model's run is benchmarks/demo_seeds.py's job):
one progress bar instead of printed log dicts, the summary table, the saved model, and a re-score command that works."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_tiny_quick_output_and_rescore(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OBLR_TRL_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "examples/demo.py", "--model", "tiny", "--quick", "--warmup_steps", "5", "--output_dir",
         str(out), "--prompt_template", "{question}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "{'loss'" not in console and "'reward':" not in console, "a log dict was printed"
    assert re.search(r"OBLR-PO: 100%.*3/3.*reward=[\d.]+, lr scale=[\d.e-]+, SNR=[\d.e-]+", console)
    assert re.search(r"accuracy \(exact answers\), greedy\s+[\d.]+%\s+[\d.]+%", proc.stdout)
    assert re.search(r"mean score, greedy\s+[\d.]+\s+[\d.]+", proc.stdout)
    assert "before -> after" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["model"] == "embedded tiny Qwen3"
    assert (out / "training_curves.png").exists() and (out / "model" / "config.json").exists()
    assert json.loads((out / "model" / "oblr_task.json").read_text())["task"] == "chain_sum"
    assert summary["answer_extractor"] == "final_number"
    assert 0 <= summary["accuracy_after"] <= summary["mean_score_after"] <= 1  # exact answers score 1
    # the saved model's card is ours: the OBLR-PO section, held-out results, the citation; no template left
    card = (out / "model" / "README.md").read_text()
    assert "## OBLR-PO training" in card and "### Held-out results" in card and "huang2025oblrpo" in card
    assert "accuracy (exact answers), greedy" in card and "[More Information Needed]" not in card

    # the printed command re-scores the saved model on the same held-out problems, with the same greedy accuracy
    command = proc.stdout.split("Re-score it:\n", 1)[1].splitlines()[0].strip()
    argv = shlex.split(command)
    assert argv[0] in (sys.executable, os.path.relpath(sys.executable)) and argv[1] == "examples/evaluate.py"
    assert argv[argv.index("--prompt_template") + 1] == "{question}"  # asked in the demo's wording
    rescore = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    assert rescore.returncode == 0, rescore.stdout[-3000:] + rescore.stderr[-3000:]
    assert (f"| {summary['accuracy_after']:.1%} | {summary['mean_score_after']:.3f} | {summary['num_eval']} |"
            in rescore.stdout)
    # ... and puts its row into the card's held-out results
    assert "From `eval_results.json`" in (out / "model" / "README.md").read_text()
    assert "(its held-out results)" in rescore.stdout


def _demo(tmp_path, out, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OBLR_TRL_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "examples/demo.py", "--model", "tiny", "--quick", "--warmup_steps", "5", "--output_dir",
         str(out), *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def grpo_demo(tmp_path_factory):
    """``--trainer grpo`` at the quick size, run once: (its folder's parent, which holds the warmed model's cache the
    runs compared with it reuse, and the finished process). The tests only read its folder."""
    root = tmp_path_factory.mktemp("grpo_demo")
    return root, _demo(root, root / "grpo", "--trainer", "grpo")


@pytest.mark.slow
def test_demo_grpo_trainer_reused_before_accuracy_and_pass_through_flags(grpo_demo, tmp_path):
    # --trainer grpo: TRL's GRPOTrainer on the same setting; its first step sees the same samples as OBLR-PO's
    root, grpo = grpo_demo
    assert grpo.returncode == 0, grpo.stdout[-3000:] + grpo.stderr[-3000:]
    assert re.search(r"GRPO: 100%.*3/3", grpo.stdout + grpo.stderr) and "before GRPO" in grpo.stdout
    g = json.loads((root / "grpo" / "summary.json").read_text())
    assert g["trainer"] == "grpo" and g["mean_lr_scale"] is None and "baseline" not in g
    # GRPO has no SNR factor: its applied lr is the schedule's (the tiny preset: linear from 3e-4 over 3 steps)
    history = json.loads((root / "grpo" / "log_history.json").read_text())
    scheduled = [e["learning_rate"] for e in history if "loss" in e]
    assert len(scheduled) == 3 and g["mean_applied_lr"] == pytest.approx(sum(scheduled) / 3)
    assert max(scheduled) == pytest.approx(3e-4)
    before = json.loads((root / "grpo" / "before.json").read_text())
    assert before["accuracy_before"] == g["accuracy_before"] and before["seed"] == 0

    # OPO through the pass-through flags, its before-RL accuracy reused from the GRPO run (same seed: identical)
    opo = _demo(root, tmp_path / "opo", "--grad_norm_estimator", "length", "--snr_lr", "false",
                "--leave_one_out", "true", "--before_from", str(root / "grpo"))
    assert opo.returncode == 0, opo.stdout[-3000:] + opo.stderr[-3000:]
    assert f"(from {root / 'grpo'})" in opo.stdout
    o = json.loads((tmp_path / "opo" / "summary.json").read_text())
    assert (o["trainer"], o["grad_norm_estimator"], o["snr_lr"], o["leave_one_out"]) == ("oblrpo", "length", False, True)
    assert (o["accuracy_before"], o["sampled_accuracy_before"]) == (g["accuracy_before"], g["sampled_accuracy_before"])
    assert o["reward_first_steps"] == pytest.approx(g["reward_first_steps"])  # same data, seed and sampling

    # --skip_before_eval: null before-RL entries, "n/a" in the table, and the run completes
    skip = _demo(root, tmp_path / "skip", "--skip_before_eval", "--max_steps", "1")
    assert skip.returncode == 0, skip.stdout[-3000:] + skip.stderr[-3000:]
    assert re.search(r"accuracy \(exact answers\), greedy\s+n/a\s+[\d.]+%", skip.stdout)
    s = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert s["accuracy_before"] is None and s["sampled_accuracy_before"] is None and s["accuracy_after"] is not None
    assert not (tmp_path / "skip" / "before.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("arm", [["--trainer", "grpo"], ["--baseline", "mean", "--snr_lr", "false"]],
                         ids=["GRPO", "RLOO"])
def test_demo_micro_batch_makes_the_same_run_in_micro_batches(tmp_path, arm, request):
    """--micro_batch: the step's 64 completions in 4 backward passes of 16 (what lets the ablation run GRPO and RLOO
    beside another arm): the same losses, gradient norms and rewards, step after step, as all 64 at once. (GRPO's
    whole run is the one `grpo_demo` made.)"""
    root, whole_run = request.getfixturevalue("grpo_demo") if arm == ["--trainer", "grpo"] else (tmp_path, None)

    def steps(out, *flags, run=None):
        run = run or _demo(root, out, *arm, *flags)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        history = json.loads((out / "log_history.json").read_text())
        return [(e["loss"], e["grad_norm"], e["reward"]) for e in history if "loss" in e], \
            json.loads((out / "summary.json").read_text())

    whole, whole_summary = steps(root / ("grpo" if whole_run else "whole"), run=whole_run)
    micro, micro_summary = steps(tmp_path / "micro", "--micro_batch", "16")
    assert len(whole) == len(micro) == 3
    for (loss_w, norm_w, reward_w), (loss_m, norm_m, reward_m) in zip(whole, micro):
        assert reward_m == reward_w and norm_m == pytest.approx(norm_w, rel=1e-5)
        assert loss_m == pytest.approx(loss_w, rel=1e-4, abs=1e-8)
    assert (whole_summary["micro_batch"], micro_summary["micro_batch"]) == (None, 16)
    assert (whole_summary["backward_passes_per_step"], micro_summary["backward_passes_per_step"]) == (1, 4)
    assert micro_summary["accuracy_after"] == whole_summary["accuracy_after"]


def test_demo_refuses_a_micro_batch_that_splits_a_group_or_the_step(tmp_path):
    for bad in ("12", "48"):  # not a multiple of the group size 8; does not divide the 64 completions
        refused = _demo(tmp_path, tmp_path / "x", "--micro_batch", bad)
        assert refused.returncode == 2 and f"--micro_batch {bad} must be a multiple of --num_generations 8 " \
            "that divides --per_device_train_batch_size 64 (e.g. --micro_batch 8)" in refused.stderr


def test_demo_refuses_oblr_options_with_grpo_and_a_mismatched_before_from(tmp_path):
    refused = _demo(tmp_path, tmp_path / "x", "--trainer", "grpo", "--baseline", "mean")
    assert refused.returncode == 2 and "--baseline configure OBLR-PO" in refused.stderr
    assert "--trainer oblrpo" in refused.stderr
    (tmp_path / "before.json").write_text(json.dumps(dict(
        seed=0, task="chain_sum", model="embedded tiny Qwen3", prompt_template=None, num_eval=99, eval_seed=12345,
        eval_samples=2, max_completion_length=8, answer_extractor="final_number", accuracy_before=0.5,
        sampled_accuracy_before=0.5)))
    mismatch = _demo(tmp_path, tmp_path / "y", "--before_from", str(tmp_path / "before.json"), "--max_steps", "1")
    assert mismatch.returncode != 0 and "num_eval=99 (this run: 16)" in mismatch.stderr
    assert "Drop --before_from" in mismatch.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arm", [["--trainer", "grpo"], []], ids=["GRPO", "OBLR-PO"])
def test_a_runs_first_steps_do_not_depend_on_its_length(tmp_path, arm):
    """With a constant lr, a seed's run of 4 steps begins as its run of 2 steps: the same rewards, losses, SNR factor
    and held-out evaluation at step 2. The ablation's stability window rests on this: its 20-step cells at an lr a
    40-step run already ran are that run's evaluation at step 20 (benchmarks/ablation.py)."""
    def run(steps):
        out = tmp_path / f"steps{steps}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OBLR_TRL_CACHE": str(tmp_path / "cache")}
        done = subprocess.run(
            [sys.executable, "examples/demo.py", "--model", "tiny", "--warmup_steps", "5", "--num_train", "64",
             "--num_eval", "16", "--eval_samples", "2", "--lr_scheduler_type", "constant", "--eval_every", "2",
             "--max_steps", str(steps), "--output_dir", str(out), *arm],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        history = [e for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]
        summary = json.loads((out / "summary.json").read_text())
        return history, {c["step"]: c for c in summary["curve"]}

    (short, short_curve), (long, long_curve) = run(2), run(4)
    assert len(short) == 2 and len(long) == 4
    for s, l in zip(short, long):
        assert s["reward"] == l["reward"] and s["loss"] == pytest.approx(l["loss"], rel=1e-5, abs=1e-8)
        if "grpo" in arm:  # no SNR step
            assert s.get("oblr/lr_scale") is None and l.get("oblr/lr_scale") is None
        else:
            assert s["oblr/lr_scale"] == pytest.approx(l["oblr/lr_scale"], rel=1e-5)
        assert s["learning_rate"] == l["learning_rate"]
    assert short_curve[2] == long_curve[2]
