"""benchmarks/bench_gpu.py (issues 47 and 56, `make bench-gpu`) runs end to end on a CPU with its small model: every
mode of the update timed beside the FLOP model, the memory-tight and QLoRA rows, the whole RL step of both trainers
with generation's share, the first row again at the end, and the table; a failing row is recorded and the run goes
on; rows past the time budget are skipped."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import bench_gpu  # noqa: E402


def test_bench_gpu_quick_on_cpu(tmp_path, capsys):
    trl_level = logging.getLogger("trl").level
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--rl_steps", "1", "--out", str(tmp_path),
                           "--stem", "b"]) == 0
    assert "bench_gpu: CPU, " in capsys.readouterr().out  # the device and the date, first
    res = json.loads((tmp_path / "b.json").read_text())
    kinds = [(r["lora"], r.get("kind"), bool(r.get("repeat"))) for r in res["update"]]
    assert kinds == [(False, "plain", False), (True, "plain", False), (False, "tight", False),
                     (True, "qlora", False), (False, "plain", True)]
    for r in res["update"][:2]:
        assert set(r["modes"]) == set(bench_gpu.MODES)
        assert r["modes"]["grpo"]["ran"] == "grpo"
        assert r["modes"]["one_backward"]["ran"].startswith("one_backward/")
        assert r["modes"]["two_passes"]["ran"].startswith("two_passes/")
        assert all(v["seconds"] > 0 and v["flops"] > 0 for v in r["modes"].values())
        # the FLOP model: two passes cost more than one backward, which costs at least GRPO's update
        f = {m: v["flops"] for m, v in r["modes"].items()}
        assert f["two_passes"] > f["one_backward"] >= f["grpo"] * 0.9
    for r in res["update"][2:]:  # tight (no fraction off a GPU), QLoRA, the first row again: GRPO and the default
        assert set(r["modes"]) == {"grpo", "auto"} and all("seconds" in v for v in r["modes"].values()), r
    assert res["qlora"]["max_rel_err"] < 1e-5  # the norms on a 4-bit base against per-row autograd
    for v in res["rl"]["modes"].values():
        assert 0 < v["generation"] < v["seconds"] and 0 < v["share"] < 1 and v["generator"] == "hf"
    assert logging.getLogger("trl").level == trl_level  # the libraries' loggers are as they were (a shared process)
    text = (tmp_path / "b.md").read_text()
    assert "on **CPU**" in text and "## The whole RL step (HF generate" in text and text.count("| two_passes |") == 2
    assert "(again, last)" in text and "largest relative error" in text


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """An OOM in one mode, bitsandbytes missing, and the time budget: each said in the table, nothing raised."""
    real = bench_gpu.time_update

    def flaky(cfg, mode, *a, **kw):
        if mode == "one_backward" and not cfg["lora"]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, mode, *a, **kw)

    def no_bnb(*a, **kw):
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setenv("OUT", str(tmp_path / "out"))  # the device tool's folder: a copy after every row
    monkeypatch.setattr(bench_gpu, "time_update", flaky)
    monkeypatch.setattr(bench_gpu, "build_qlora_base", no_bnb)
    monkeypatch.setattr(bench_gpu, "time_rl_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no generate")))
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--out", str(tmp_path), "--stem", "f"]) == 0
    assert "the QLoRA row is skipped: bitsandbytes does not import" in capsys.readouterr().out
    res = json.loads((tmp_path / "f.json").read_text())
    assert res["update"][0]["modes"]["one_backward"]["error"].startswith("RuntimeError: CUDA out of memory")
    assert "seconds" in res["update"][0]["modes"]["auto"]  # the row's other modes ran
    assert res["update"][3]["skipped"].startswith("bitsandbytes does not import") and "skipped" in res["qlora"]
    assert res["rl"]["modes"]["grpo"]["error"] == "RuntimeError: no generate"
    text = (tmp_path / "f.md").read_text()
    assert "RuntimeError: CUDA out of memory" in text and "skipped: bitsandbytes does not import" in text
    assert (tmp_path / "out" / "f.md").read_text() == text
    # past the budget every row is skipped, said so, and the table is still written
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--budget_s", "0", "--out", str(tmp_path),
                           "--stem", "s"]) == 0
    res = json.loads((tmp_path / "s.json").read_text())
    assert all(r["skipped"].startswith("past the run's time budget") for r in res["update"])


def test_bench_gpu_one_tuning_and_the_profile_on_cpu(tmp_path):
    """``--tuning lora``: LoRA's rows alone and no RL step; ``--profile``: the full-fine-tuning rows of three modes
    under torch.profiler, with their top operators."""
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--tuning", "lora", "--out", str(tmp_path),
                           "--stem", "l"]) == 0
    res = json.loads((tmp_path / "l.json").read_text())
    assert [r["lora"] for r in res["update"]] == [True, True, True] and res["rl"] is None
    assert res["update"][-1]["repeat"] and res["update"][-1]["kind"] == "plain"  # the first LoRA row, again
    assert "not in this run" in (tmp_path / "l.md").read_text()
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--profile", "--out", str(tmp_path),
                           "--stem", "p"]) == 0
    prof = json.loads((tmp_path / "p_profile.json").read_text())["profile"]
    assert [r["mode"] for r in prof] == ["grpo", "auto", "one_backward"]
    assert all(r["profile"]["kernel_ms"] > 0 and r["profile"]["top"] for r in prof)


def test_slim_wheel_drops_the_members_and_their_record_lines(tmp_path):
    """``make gpu-wheels`` slims the bitsandbytes wheel to the CUDA 13 libraries (benchmarks/slim_wheel.py): the
    dropped members leave the archive and its RECORD; the rest is unchanged."""
    import zipfile

    import slim_wheel

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "pkg/__init__.py,sha256=a,1\npkg/libpkg_cuda118.so,sha256=b,2\npkg/libpkg_cuda130.so,sha256=c,3\n" \
             "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg/libpkg_cuda118.so", b"\0" * 1000)
        z.writestr("pkg/libpkg_cuda130.so", b"\1" * 10)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    assert slim_wheel.main([str(wheel), "--drop", "pkg/libpkg_cuda1[12]*"]) == 0
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py", "pkg/libpkg_cuda130.so"]
        assert "cuda118" not in z.read("pkg-1.0.dist-info/RECORD").decode()
        assert z.read("pkg/__init__.py") == b"x = 1\n"


def test_the_memory_tight_fraction_refuses_one_backward_and_holds_grpos_peak(monkeypatch):
    """The memory-tight row's per-process fraction (a GPU's queries replaced): what is allocated, the default's margin,
    the optimizer's state to come and 0.9x one_backward's smallest need; not forced where GRPO's peak would not fit."""
    import types

    import torch
    from datasets import Dataset

    from oblr_trl import cost_model

    cfg = dict(width="small", batch=8, completion=16, lora=False, ckpt=True)
    model = bench_gpu.build_model("small", "cpu")
    args = bench_gpu.config_args("auto", "cpu", per_device_train_batch_size=8, gradient_checkpointing=True,
                                 max_completion_length=16)
    trainer = bench_gpu.make_trainer("auto", model, args, bench_gpu.build_tokenizer(vocab_size=512),
                                     Dataset.from_list([{"prompt": "x"}] * 8), False)
    trainer.create_optimizer()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 * 2**30)
    fraction, note = bench_gpu.tight_fraction(trainer, cfg, need_gib=1.0)
    total = 80 * 2**30
    pending = 8.0 * sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)  # Adam's state to come
    room = cost_model.memory_room(fraction * total, total, 2 * 2**30, 2 * 2**30, fraction,
                                  cost_model.margin_bytes(total), pending)
    assert "fraction" in note and room < cost_model.MEMORY_SAFETY * min(
        cost_model.peak_bytes(bench_gpu.one_backward_shape(trainer, cfg), "one_backward", c) for c in (8,))
    assert bench_gpu.tight_fraction(trainer, cfg, need_gib=10.0)[0] is None  # GRPO's 10 GiB would not fit: not forced
