"""benchmarks/bench_gpu.py (issue 47's `make bench-gpu`) runs end to end on a CPU with its small model: every mode of
the update timed beside the FLOP model, the whole RL step of both trainers with generation's share, and the table."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import bench_gpu  # noqa: E402


def test_bench_gpu_quick_on_cpu(tmp_path):
    trl_level = logging.getLogger("trl").level
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--rl_steps", "1", "--out", str(tmp_path),
                           "--stem", "b"]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert [r["lora"] for r in res["update"]] == [False, True]
    for r in res["update"]:
        assert set(r["modes"]) == set(bench_gpu.MODES)
        assert r["modes"]["grpo"]["ran"] == "grpo"
        assert r["modes"]["one_backward"]["ran"] == "one_backward" and r["modes"]["two_passes"]["ran"] == "two_passes"
        assert all(v["seconds"] > 0 and v["flops"] > 0 for v in r["modes"].values())
        # the FLOP model: two passes cost more than one backward, which costs at least GRPO's update
        f = {m: v["flops"] for m, v in r["modes"].items()}
        assert f["two_passes"] > f["one_backward"] >= f["grpo"] * 0.9
    for v in res["rl"]["modes"].values():
        assert 0 < v["generation"] < v["seconds"] and 0 < v["share"] < 1
    assert logging.getLogger("trl").level == trl_level  # the libraries' loggers are as they were (a shared process)
    text = (tmp_path / "b.md").read_text()
    assert "on **CPU**" in text and "## The whole RL step" in text and text.count("| two_passes |") == 2


def test_bench_gpu_one_tuning_and_the_profile_on_cpu(tmp_path):
    """``--tuning lora``: LoRA's rows alone and no RL step; ``--profile``: the full-fine-tuning rows of three modes
    under torch.profiler, with their top operators."""
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--tuning", "lora", "--out", str(tmp_path),
                           "--stem", "l"]) == 0
    res = json.loads((tmp_path / "l.json").read_text())
    assert [r["lora"] for r in res["update"]] == [True] and res["rl"] is None
    assert "not in this run" in (tmp_path / "l.md").read_text()
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--profile", "--out", str(tmp_path),
                           "--stem", "p"]) == 0
    prof = json.loads((tmp_path / "p_profile.json").read_text())["profile"]
    assert [r["mode"] for r in prof] == ["grpo", "auto", "one_backward"]
    assert all(r["profile"]["kernel_ms"] > 0 and r["profile"]["top"] for r in prof)
