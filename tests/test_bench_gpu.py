"""benchmarks/bench_gpu.py (issues 47 and 56, `make bench-gpu`) runs end to end on a CPU with its small model: every
mode of the update timed beside the FLOP model, the memory-tight and QLoRA rows, the first row again, the whole RL
step of both trainers last with generation's share, and the table; a failing row is recorded and the run goes on;
rows past the time budget are skipped. A row's trainers are timed in interleaved rounds (studies/paired.py, tested
here with fake steps) and each trainer's memory is its own (studies/gpu_memory.py's Meter, with fake counters)."""

from __future__ import annotations

import json
import logging

import bench_gpu  # noqa: E402


def test_bench_gpu_quick_on_cpu(tmp_path, capsys):
    trl_level = logging.getLogger("trl").level
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--rl_steps", "1", "--out", str(tmp_path),
                           "--stem", "b"]) == 0
    assert "bench_gpu: CPU, " in capsys.readouterr().out  # the device and the date, first
    res = json.loads((tmp_path / "b.json").read_text())
    kinds = [(r["lora"], r.get("kind"), bool(r.get("repeat")), r["paired"]) for r in res["update"]]
    assert kinds == [(False, "plain", False, True), (True, "plain", False, True), (False, "tight", False, False),
                     (True, "qlora", False, True), (False, "plain", True, True)]
    for r in res["update"]:  # every mode: its timed steps, their median and its per-round ratio to GRPO
        for v in r["modes"].values():
            assert len(v["times"]) == 1 and v["seconds"] == v["times"][0] and v["ratio_range"][0] <= v["ratio"]
        assert r["modes"]["grpo"]["ratio"] == 1.0
    for r in res["update"][:2]:
        assert list(r["modes"]) == list(bench_gpu.MODES)  # the row's order, though `auto` is built first
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
    assert text.count("| paired |") == 12 and text.count("| alone |") == 2 and "| range |" in text
    assert "(again, last)" in text and "largest relative error" in text


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """An OOM in one mode, bitsandbytes missing, and the time budget: each said in the table, nothing raised."""
    real = bench_gpu.prepared_trainer

    def flaky(cfg, mode, *a, **kw):  # a build that fails in a paired row
        if mode == "one_backward" and not cfg["lora"]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, mode, *a, **kw)

    def no_bnb(*a, **kw):
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setenv("OUT", str(tmp_path / "out"))  # the device tool's folder: a copy after every row
    monkeypatch.setattr(bench_gpu, "prepared_trainer", flaky)
    monkeypatch.setattr(bench_gpu, "build_qlora_base", no_bnb)
    monkeypatch.setattr(bench_gpu, "time_rl_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no generate")))
    assert bench_gpu.main(["--device", "cpu", "--quick", "--repeats", "1", "--out", str(tmp_path), "--stem", "f"]) == 0
    assert "the QLoRA row is skipped: bitsandbytes does not import" in capsys.readouterr().out
    res = json.loads((tmp_path / "f.json").read_text())
    assert res["update"][0]["modes"]["one_backward"]["error"].startswith("RuntimeError: CUDA out of memory")
    assert all("seconds" in res["update"][0]["modes"][m] for m in ("grpo", "auto", "two_passes"))  # the others ran
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


def test_the_update_rows_come_first_the_repeat_next_and_the_rl_step_last(tmp_path, monkeypatch):
    """The order of a run (the RL step took 238 s of a 400 s budget in the middle on 2026-11-27, and 8 rows were
    skipped): every update row, then the first row again, then the whole RL step."""
    calls = []

    def row(cfg, args, res, log, over):
        calls.append(("repeat" if len(calls) == len(configs) else "update", cfg["width"], cfg["kind"]))
        return dict({k: v for k, v in cfg.items() if k != "modes"}, modes={})

    configs = bench_gpu.update_configs(True)
    monkeypatch.setattr(bench_gpu, "time_update", lambda *a, **k: {})  # the untimed first step
    monkeypatch.setattr(bench_gpu, "measure_row", row)
    monkeypatch.setattr(bench_gpu, "rl_step", lambda args, res, *a: calls.append(("rl", args.rl_steps)))
    assert bench_gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--stem", "o"]) == 0
    assert calls == [("update", c["width"], c["kind"]) for c in configs] + [("repeat", "small", "plain"), ("rl", 1)]


def test_the_rows_most_wanted_first():
    """Qwen3-0.6B's modes side by side first, then LoRA at TRL's default, the fallbacks (the memory-tight row after
    its unconstrained twin, whose GRPO peak it reads), the larger models, Qwen3-0.6B's other shapes last; paired
    but for the memory-tight row and two full Qwen3-1.7B trainers."""
    rows = bench_gpu.update_configs(False)
    key = [(r["width"], r["batch"], r["completion"], r["lora"], r["ckpt"], r["kind"]) for r in rows]
    w = "Qwen3-0.6B"
    assert key[:3] == [(w, 8, 512, False, False, "plain"), (w, 8, 512, False, True, "plain"),
                       (w, 8, 2048, False, True, "plain")] and all(len(r["modes"]) == 4 for r in rows[:3])
    assert key[3] == (w, 8, 512, True, True, "plain")
    tight = [k[-1] for k in key].index("tight")
    assert key.index((w, 8, 2048, False, True, "plain")) < tight < [k[-1] for k in key].index("qlora")
    larger = [i for i, k in enumerate(key) if k[0] != w]
    assert larger == list(range(larger[0], larger[0] + 3)) and larger[0] > tight
    assert all(k[0] == w and k[-1] == "plain" for k in key[larger[-1] + 1:])
    assert [(r["width"], r["kind"]) for r in rows if not r["paired"]] == [(w, "tight"), ("Qwen3-1.7B", "plain")]
    assert all(r["modes"][:2] == ["grpo", "auto"] for r in rows)


def test_paired_rounds_rotate_and_take_each_rounds_ratio():
    """Pure (studies/paired.py), with fake steps: each round runs every mode once, the order rotated, so each is first
    once in as many rounds; the ratio is the median of the per-round ratios, and a drift that slows every mode in one
    round (which a ratio of medians measured apart would keep) does not move it."""
    import itertools

    from studies import paired

    assert [paired.rotation(["g", "a", "o"], r) for r in range(4)] == [["g", "a", "o"], ["a", "o", "g"],
                                                                        ["o", "g", "a"], ["g", "a", "o"]]
    order, clock = [], itertools.count()
    drift = {0: 1.0, 1: 4.0, 2: 1.0, 3: 1.0}  # round 1 runs 4x slower for everyone (clocks, a neighbour's job)
    base = {"grpo": 0.25, "auto": 0.5, "two": 1.0}

    def step(name):
        def run():
            order.append(name)
            return base[name] * drift[next(clock) // 3]
        return run

    times, errors = paired.interleave({m: step(m) for m in base}, 4)
    assert not errors and order == ["grpo", "auto", "two", "auto", "two", "grpo", "two", "grpo", "auto",
                                    "grpo", "auto", "two"]
    assert times["auto"] == [0.5, 2.0, 0.5, 0.5]
    out = paired.summarise(times, "grpo")
    assert out["auto"]["ratio"] == 2.0 and out["two"]["ratio"] == 4.0 and out["grpo"]["ratio"] == 1.0
    assert out["auto"]["seconds"] == 0.5 and out["auto"]["ratio_range"] == [2.0, 2.0]
    # one round noisy for one mode alone widens its range; the median stays
    times["auto"][2] = 1.0
    out = paired.summarise(times, "grpo")
    assert out["auto"]["ratio"] == 2.0 and out["auto"]["ratio_range"] == [2.0, 4.0]


def test_a_failing_step_drops_its_mode_and_the_others_go_on():
    from studies import paired

    calls = {"grpo": 0, "auto": 0}

    def step(name, fail_at=None):
        def run():
            calls[name] += 1
            if calls[name] == fail_at:
                raise RuntimeError("CUDA out of memory")
            return 1.0
        return run

    times, errors = paired.interleave({"grpo": step("grpo"), "auto": step("auto", fail_at=2)}, 4)
    assert list(times) == ["grpo"] and times["grpo"] == [1.0] * 4 and calls["auto"] == 2
    assert isinstance(errors["auto"], RuntimeError)
    rows = paired.with_ratios({"grpo": dict(times=[1.0, 2.0]), "auto": dict(times=[3.0, 2.0]), "x": dict(error="e")},
                              "grpo")
    assert rows["auto"]["ratio"] == 2.0 and rows["auto"]["ratio_range"] == [1.0, 3.0] and "ratio" not in rows["x"]
    nan = paired.summarise({"auto": [1.0]}, "grpo")["auto"]  # no GRPO to pair with: no ratio
    assert nan["ratio"] != nan["ratio"] and nan["seconds"] == 1.0


def test_each_trainers_memory_is_its_own_beside_the_others(monkeypatch):
    """gpu_memory.Meter with a fake allocator: 10 GiB of another trainer already allocated; this one's build peaks at
    16 GiB (6 above), holds 4 GiB after its warm-up, and its steps rise 3 and 5 GiB above their start; its figures
    leave the other trainer out: peak from build 6, resident 4, step peak 4 + 5 = 9."""
    import torch

    from studies import gpu_memory

    g = 2**30
    state = dict(now=10 * g, peak=10 * g)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: state.update(peak=state["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: state["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["peak"])

    def rise(by):
        state["peak"] = max(state["peak"], state["now"] + by)
        return 0.1

    meter = gpu_memory.Meter(cuda=True)
    state.update(now=14 * g, peak=16 * g)  # built, warmed up
    meter.built()
    assert [meter.step(lambda by=by: rise(by)) for by in (3 * g, 5 * g)] == [0.1, 0.1]
    assert meter.gib() == dict(peak_gib=6.0, resident_gib=4.0, step_peak_gib=9.0)
    cpu = gpu_memory.Meter(cuda=False)
    cpu.built()
    assert cpu.step(lambda: 0.2) == 0.2 and all(v != v for v in cpu.gib().values())  # NaN off a GPU


def test_the_table_says_how_each_row_was_timed():
    """The rendered table: `paired`/`alone`, the per-round ratio and its range; a record from before the per-round
    ratios (none stored) shows the medians' ratio."""
    from studies.gpu_report import render

    mode = dict(ran="grpo", seconds=0.2, flops=1.0, grpo_flops=1.0, peak_gib=1.0, step_peak_gib=2.0)
    cfg = dict(width="w", batch=8, completion=16, lora=False, ckpt=True, kind="plain")
    res = dict(machine=dict(date="d", torch="t", transformers="x", trl="y"), device_name="D", command="c", rl=None,
               update=[dict(cfg, paired=True, modes=dict(grpo=dict(mode, ratio=1.0, ratio_range=[1.0, 1.0]),
                                                         auto=dict(mode, seconds=0.5, ratio=1.2,
                                                                   ratio_range=[1.1, 1.4]))),
                       dict(cfg, modes=dict(grpo=mode, auto=dict(mode, seconds=0.3)))])  # an old record
    text = render(res, 32, 8)
    assert "| paired | auto | grpo | 500.0 | 1.20x | 1.10-1.40x |" in text  # not 0.5 / 0.2 = 2.50x
    assert "| alone | auto | grpo | 300.0 | 1.50x | - |" in text


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

    from oblr_trl import cost_model, path_choice

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
    room = path_choice.memory_room(fraction * total, total, 2 * 2**30, 2 * 2**30, fraction,
                                   path_choice.margin_bytes(total), pending)
    assert "fraction" in note and room < path_choice.MEMORY_SAFETY * min(
        cost_model.peak_bytes(bench_gpu.one_backward_shape(trainer, cfg), "one_backward", c) for c in (8,))
    assert bench_gpu.tight_fraction(trainer, cfg, need_gib=10.0)[0] is None  # GRPO's 10 GiB would not fit: not forced
