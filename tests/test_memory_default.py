"""Issue 56: the memory-aware default. Under gradient checkpointing (TRL's default) OBLR-PO takes ``one_backward``
(whole or in chunks) wherever its predicted peak fits the device, and the replayed update or two passes only where it
does not. Each branch on the CPU with a simulated budget: the pure functions of ``oblr_trl/path_choice.py``
(``memory_room``, ``fits``, ``choose_within``), ``path_choice.device_budget`` with the CUDA queries replaced, and the
trainer's choice and its logged reason."""

import logging

import pytest
import torch

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl import cost_model as cm
from oblr_trl import path_choice as pc
from helpers import common_args, qwen3_shape, train
GIB = 2**30


qwen3 = qwen3_shape


def test_memory_room_takes_free_memory_the_allocators_cache_the_fraction_and_the_margin():
    # 10 GiB free on an 80 GiB device, 6 allocated, 8 reserved (2 cached): 12 GiB can be allocated, less the margin
    assert pc.memory_room(10 * GIB, 80 * GIB, 6 * GIB, 8 * GIB, 1.0, 1 * GIB) == 11 * GIB
    # the per-process fraction binds: 0.1 of 80 GiB less the 6 allocated
    assert pc.memory_room(10 * GIB, 80 * GIB, 6 * GIB, 8 * GIB, 0.1, 1 * GIB) == 1 * GIB
    # pending allocations (the optimizer's state) come off; never below 0
    assert pc.memory_room(10 * GIB, 80 * GIB, 6 * GIB, 8 * GIB, 1.0, 1 * GIB, pending=4 * GIB) == 7 * GIB
    assert pc.memory_room(1 * GIB, 80 * GIB, 6 * GIB, 6 * GIB, 1.0, 4 * GIB) == 0
    assert pc.margin_bytes(80 * GIB) == 4 * GIB and pc.margin_bytes(8 * GIB) == pc.MARGIN_MIN


def test_fits_weighs_the_prediction_with_its_safety_factor_and_the_cap():
    budget = pc.Budget(room=125.0)
    assert pc.fits(100, 90, budget) and not pc.fits(101, 90, budget)
    assert pc.fits(100, 90, pc.Budget(float("inf"), cap=10)) and not pc.fits(100, 89, pc.Budget(float("inf"), cap=10))
    assert pc.fits(80, 90, pc.Budget(float("inf"), cap=0))  # less than GRPO's: within a cap of 0
    # no more than GRPO's own peak fits wherever GRPO's does, safety factor or not; more than it needs the room
    assert pc.fits(90, 90, pc.Budget(room=95.0)) and pc.fits(80, 90, pc.Budget(room=0.0))
    assert not pc.fits(91, 90, pc.Budget(room=100.0))


def test_a_batch_whose_grpo_peak_nearly_fills_the_device_is_not_chunked_where_one_backward_needs_no_more():
    """LoRA without checkpointing at 64 x 512 on Qwen3-0.6B's 151,936-token head: GRPO's own peak x1.25 exceeds the
    room, one_backward whole needs no more than GRPO: it runs whole (chunks cost operator calls and host syncs:
    3.00x GRPO's calls, +10 syncs, counted), not in chunks."""
    shape = qwen3(rows=64, lora=True, ckpt=False)
    p = _peaks(shape)
    assert p["one_backward"] <= p["grpo"]
    room = 1.1 * p["grpo"]  # GRPO fits, but not with the safety factor
    assert pc.MEMORY_SAFETY * p["one_backward"] > room
    choice = pc.choose_within(shape, pc.Budget(room=room))
    assert choice.one_backward and not choice.replay and choice.chunk == 64, choice


def _peaks(shape):
    return {mode: cm.peak_bytes(shape, mode) for mode in ("grpo", "one_backward", "replay")}


@pytest.mark.parametrize("width,rows", [("0.6B", 8), ("0.6B", 64), ("1.7B", 64)])
def test_each_branch_of_the_memory_aware_default_under_checkpointing(width, rows):
    """Full fine-tuning under checkpointing: with room for one_backward's kept factors, it runs whole; with room for
    one group's only, in chunks; with room for GRPO's peak alone, replayed; where replaying is not allowed (several
    processes), two passes."""
    shape = qwen3(width, rows=rows)
    p = _peaks(shape)
    assert p["one_backward"] > pc.BYTES_TARGET * p["grpo"]  # the ratio rule would refuse it
    whole = pc.choose_within(shape, pc.Budget(room=pc.MEMORY_SAFETY * p["one_backward"]))
    assert whole.one_backward and not whole.replay and whole.chunk == rows
    assert "fits" in whole.reason and whole.peak == pytest.approx(p["one_backward"])
    one_group = cm.peak_bytes(shape, "one_backward", 8)
    if rows > 8:
        chunked = pc.choose_within(shape, pc.Budget(room=pc.MEMORY_SAFETY * one_group))
        assert chunked.one_backward and not chunked.replay and 8 <= chunked.chunk < rows and chunked.chunk % 8 == 0
    tight = pc.Budget(room=pc.MEMORY_SAFETY * p["grpo"])  # GRPO's peak fits, no one_backward chunk does
    assert one_group > p["grpo"]
    replayed = pc.choose_within(shape, tight)
    assert replayed.one_backward and replayed.replay and "does not fit" in replayed.reason
    two = pc.choose_within(shape, tight, replay=False)
    assert not two.one_backward and two.chunk == 0 and "two passes" in two.reason
    # the cap: 0 GiB beyond GRPO's keeps the replayed update (its peak is below GRPO's) however much is free
    capped = pc.choose_within(shape, pc.Budget(room=float("inf"), cap=0))
    assert capped.replay


@pytest.mark.parametrize("width,rows", [("0.6B", 8), ("0.6B", 64), ("1.7B", 64)])
def test_on_a_cpu_the_default_keeps_the_ratio_target_in_chunks_and_takes_one_group_before_a_second_backward(width,
                                                                                                         rows):
    """The CPU's host rule (step_cost --quick: one group at a time 1.03x GRPO's step at 0.73x its peak RSS; whole
    0.96x at 1.54x; the replayed update 1.53x): the largest chunk within 1.1x GRPO's predicted peak where one is;
    else one group at a time where it fits the host's room; else the replayed update or two passes, as on a GPU."""
    shape = qwen3(width, rows=rows)
    grpo = cm.peak_bytes(shape, "grpo")
    roomy = pc.Budget(room=float("inf"), host=True)
    sizes = pc.chunk_sizes(rows, 8)
    within = [c for c in sizes if cm.peak_bytes(shape, "one_backward", c) <= pc.BYTES_TARGET * grpo]
    choice = pc.choose_on_host(shape, roomy)
    assert choice.one_backward and not choice.replay
    assert choice.chunk == (within[0] if within else 8), (within, choice)  # never the whole batch beyond the target
    assert "within 1.1x" in choice.reason if within else "one group at a time" in choice.reason
    # not even one group fits the host's room: the replayed update (GRPO's bytes), or two passes in several processes
    tight = pc.Budget(room=pc.MEMORY_SAFETY * grpo, host=True)
    if cm.peak_bytes(shape, "one_backward", 8) > grpo:
        assert pc.choose_on_host(shape, tight).replay
        assert not pc.choose_on_host(shape, tight, replay=False).one_backward
    # the cap binds as on a GPU: 0 GiB beyond GRPO's, and no chunk needs no more than GRPO
    capped = pc.choose_on_host(shape, pc.Budget(room=float("inf"), cap=0, host=True))
    assert not capped.one_backward or capped.replay or capped.peak <= grpo


def test_on_a_cpu_a_small_batch_within_the_target_runs_whole():
    shape = qwen3(lora=True)  # LoRA's kept factors are small: the whole micro-batch is within 1.1x GRPO's peak
    assert cm.peak_bytes(shape, "one_backward") <= pc.BYTES_TARGET * cm.peak_bytes(shape, "grpo")
    choice = pc.choose_on_host(shape, pc.Budget(room=float("inf"), host=True))
    assert choice.one_backward and choice.chunk == 8 and "within" in choice.reason


def test_lora_and_no_checkpointing_take_one_backward_when_it_fits_and_never_oom_where_grpo_fits():
    for shape in (qwen3(lora=True), qwen3(ckpt=False), qwen3("1.7B", rows=64, lora=True)):
        p = _peaks(shape)
        room = pc.MEMORY_SAFETY * max(p["grpo"], p["one_backward"])
        choice = pc.choose_within(shape, pc.Budget(room=room))
        assert choice.one_backward and not choice.replay
    # wherever GRPO's own peak fits a room, the path chosen fits it too (never more than GRPO needs, where that is all)
    for shape in (qwen3(), qwen3(rows=64), qwen3("1.7B", rows=64), qwen3(lora=True), qwen3(ckpt=False),
                  qwen3(completion=4096)):
        grpo = cm.peak_bytes(shape, "grpo")
        for room in (pc.MEMORY_SAFETY * grpo, 2 * grpo, 10 * grpo):
            choice = pc.choose_within(shape, pc.Budget(room=room))
            mode = "replay" if choice.replay else "one_backward" if choice.one_backward else "two_passes"
            chunk = choice.chunk if choice.one_backward else pc.norms_chunk(shape, pc.Budget(room=room))
            assert cm.peak_bytes(shape, mode, chunk) <= max(room / pc.MEMORY_SAFETY, grpo) * 1.0001, (shape, room)


def test_host_free_takes_the_available_memory_within_a_containers_limit_shared_by_processes():
    assert pc.host_free(20 * GIB) == 20 * GIB
    assert pc.host_free(20 * GIB, limit=16 * GIB, used=10 * GIB) == 6 * GIB  # the container binds
    assert pc.host_free(4 * GIB, limit=16 * GIB, used=2 * GIB) == 4 * GIB  # the host binds
    assert pc.host_free(20 * GIB, limit=8 * GIB, used=9 * GIB) == 0  # over its limit: nothing
    assert pc.host_free(20 * GIB, processes=2) == 10 * GIB  # torchrun --nproc_per_node 2 on one host


def test_device_budget_on_the_cpu_reads_the_hosts_available_memory(monkeypatch, tmp_path):
    """On the CPU the default is memory-aware too (issue 56: the ratio rule replayed the update under checkpointing,
    a second backward, where the host had room): psutil's available memory, a cgroup v2 limit, LOCAL_WORLD_SIZE."""
    import psutil
    from types import SimpleNamespace

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=20 * GIB, total=32 * GIB))
    monkeypatch.setattr(pc, "CGROUP", str(tmp_path / "absent"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    # 20 GiB available less the margin (1.6 GiB: 5% of 32) and the optimizer's state to come
    assert pc.device_budget("cpu", None, pending=2 * GIB) == pc.Budget(20 * GIB - 1.6 * GIB - 2 * GIB, None, host=True)
    assert pc.device_budget("cpu", 2.0).cap == 2 * GIB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pc.device_budget("cpu", None).room == 10 * GIB - 1.6 * GIB
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # a container of 8 GiB using 5 GiB, 1 GiB of it reclaimable page cache: 4 GiB free, a margin of 1 GiB
    (tmp_path / "memory.max").write_text(f"{8 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{5 * GIB}\n")
    (tmp_path / "memory.stat").write_text(f"anon 123\ninactive_file {GIB}\n")
    monkeypatch.setattr(pc, "CGROUP", str(tmp_path))
    assert pc.device_budget("cpu", None).room == 4 * GIB - 1 * GIB
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the host's figure
    assert pc.device_budget("cpu", None).room == 20 * GIB - 1.6 * GIB
    # a device with no free-memory figure: the ratio targets, or the cap alone
    assert pc.device_budget("meta", None) is None
    assert pc.device_budget("meta", 2.0) == pc.Budget(float("inf"), 2 * GIB)


def test_device_budget_reads_the_gpu_and_the_cap(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 1.0)
    budget = pc.device_budget("cuda", None, pending=3 * GIB)
    assert budget == pc.Budget(32 * GIB - 4 * GIB - 3 * GIB, None)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.25)  # 20 GiB for this process
    assert pc.device_budget("cuda:0", 1.5).room == 20 * GIB - 10 * GIB - 4 * GIB
    assert pc.device_budget("cuda:0", 1.5).cap == 1.5 * GIB


def test_the_optimizers_state_to_come_is_counted_before_its_first_step():
    model = torch.nn.Linear(4, 3)
    assert pc.optimizer_state_pending(model, None) == 8 * 15
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    assert pc.optimizer_state_pending(model, opt) == 8 * 15
    opt.step()
    assert pc.optimizer_state_pending(model, opt) == 0


@pytest.mark.parametrize("value", [-1, -0.5])
def test_max_extra_memory_gib_is_refused_at_construction_naming_the_option_and_allowed_values(value):
    with pytest.raises(ValueError, match=r"max_extra_memory_gib=.*allowed values: None .* >= 0"):
        OBLRPOConfig(**common_args(), max_extra_memory_gib=value)
    with pytest.raises(ValueError, match="max_extra_memory_gib='1' must be a number or None"):
        OBLRPOConfig(**common_args(), max_extra_memory_gib="1")


@pytest.mark.parametrize("room, cap, expect", [(float("inf"), None, "one_backward"),
                                               (float("inf"), 0.0, "one_backward"),  # tiny: below GRPO's peak
                                               (0.0, None, "two_passes")],
                         ids=["room-for-one_backward", "capped-at-grpo", "no-room"])
def test_the_trainer_chooses_by_the_simulated_budget_and_logs_why(room, cap, expect, monkeypatch, caplog):
    """The trainer asks path_choice.device_budget (here a simulated GPU) at the first generation and logs the
    choice, its reason, the predicted time and bytes."""
    seen = []

    def budget(device, cap, pending=0.0):
        seen.append((cap, pending))
        return pc.Budget(room, cap)

    monkeypatch.setattr(pc, "device_budget", budget)
    with caplog.at_level(logging.INFO, logger="oblr_trl.trainer"):
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1)))
    assert trainer.args.gradient_checkpointing and seen and seen[0][1] > 0  # the optimizer's state is still to come
    route = trainer.route
    assert route.on is (expect != "two_passes") and route.replay is (expect == "replay")
    assert "memory-aware" in caplog.text and "Predicted: time (FLOPs)" in caplog.text and "iB" in caplog.text
    assert ("fits" if expect == "one_backward" else "does not fit") in caplog.text


def test_each_kind_of_budget_has_its_rule():
    """path_choice.rule_for: the ratio targets without a budget, the host rule for the CPU's memory, the GPU's rule for
    a GPU's room (or a cap alone)."""
    assert pc.rule_for(None) is pc.choose
    assert pc.rule_for(pc.Budget(GIB, host=True)) is pc.choose_on_host
    assert pc.rule_for(pc.Budget(GIB)) is pc.choose_within
    assert pc.rule_for(pc.Budget(float("inf"), cap=0.0)) is pc.choose_within


def test_the_cpu_default_under_checkpointing_takes_the_host_rules_chunk(monkeypatch):
    """On the CPU (the host's memory read, here as roomy) the automatic choice under gradient checkpointing is the host
    rule's: one group at a time within the ratio target, where the GPU's rule would run the micro-batch whole."""
    from oblr_trl.path_choice import describe

    budgets, real = [], pc.device_budget
    monkeypatch.setattr(pc, "device_budget", lambda *a, **k: budgets.append(real(*a, **k)) or budgets[-1])
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1)))
    args, batch = trainer.args, trainer.generations[0]
    shape = describe(trainer.model, args.per_device_train_batch_size, batch["prompt_ids"].shape[1],
                     trainer.max_completion_length, 2 if args.bf16 else 4, True, trainer.num_generations)
    (budget,) = budgets
    assert args.gradient_checkpointing and budget.host and trainer.uses_one_backward
    host, gpu = pc.choose_on_host(shape, budget), pc.choose_within(shape, budget)
    assert trainer.route.chunk_rows == host.chunk == trainer.num_generations < gpu.chunk  # the rules differ here


def test_torch_compile_is_refused_by_name_where_the_norms_are_needed():
    with pytest.raises(ValueError, match=r"OBLRPOConfig.torch_compile=True is not supported.*Allowed values: "
                                         r"torch_compile=False"):
        OBLRPOConfig(**common_args(), torch_compile=True)
    # without the norms (no SNR step, a proxy weight) nothing of OBLR-PO's hooks the model: allowed
    config = OBLRPOConfig(**common_args(), torch_compile=True, snr_lr=False, grad_norm_estimator="length")
    assert config.torch_compile
