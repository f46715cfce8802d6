"""The memory of ``benchmarks/bench_gpu.py``'s rows (issue 56): each trainer's own memory where several are alive
(:class:`Meter`), and the memory-tight row's per-process fraction that makes the default's ``one_backward`` not fit
while GRPO's measured peak still does, from the cost model's shape of a row."""

from __future__ import annotations

import gc

import torch


def tight_fraction(trainer, cfg: dict, need_gib: float, prompt: int, group: int) -> tuple[float | None, str]:
    """The per-process memory fraction for the memory-tight row: what is allocated now, the default's margin, the
    optimizer's state to come and 0.9x what ``one_backward``'s smallest chunk would need (its predicted peak times
    the default's safety factor), so that it cannot fit; ``None`` and why where that would not hold ``need_gib``
    (GRPO's measured peak from the build, plus 5%), since GRPO must still run."""
    from oblr_trl import cost_model, path_choice

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    shape = one_backward_shape(trainer, cfg, prompt, group)
    chunks = path_choice.chunk_sizes(cfg["batch"], group)
    smallest = min(cost_model.peak_bytes(shape, "one_backward", c) for c in chunks)
    limit = (torch.cuda.memory_allocated() + path_choice.margin_bytes(total)
             + path_choice.optimizer_state_pending(trainer.model, trainer.optimizer)
             + 0.9 * path_choice.MEMORY_SAFETY * smallest)
    if limit < 1.05 * need_gib * 2**30:
        return None, (f"a fraction that refuses one_backward ({limit / 2**30:.1f} GiB) would not hold GRPO's measured "
                      f"peak ({need_gib:.1f} GiB): not forced")
    return min(1.0, limit / total), f"fraction {limit / total:.3f} ({limit / 2**30:.1f} GiB of {total / 2**30:.0f})"


def one_backward_shape(trainer, cfg: dict, prompt: int, group: int):
    """The cost model's shape of ``trainer``'s model and a ``cfg`` micro-batch, in bf16 (the GPU's autocast)."""
    from oblr_trl import path_choice

    return path_choice.describe(trainer.model, cfg["batch"], prompt, cfg["completion"], 2, cfg["ckpt"], group)


def release(device: str) -> None:
    """Frees what the trainers just dropped held, the allocator's cache included, before the next row's builds."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


class Meter:
    """One trainer's memory on a GPU, each figure relative to what was allocated just before its build, so that it
    means the same whether other trainers are alive (a paired row) or not: ``resident`` (allocated after its build
    and warm-up step: weights, the optimizer's state), ``build_peak`` (the most allocated from its build through the
    warm-up step) and, per timed step, ``increments``: the peak above the allocation at the step's start
    (``reset_peak_memory_stats`` before it). Off a GPU every figure is NaN."""

    def __init__(self, cuda: bool):
        self.cuda, self.increments = cuda, []
        self.resident = self.build_peak = float("nan")
        self.before = self._reset()

    def _reset(self) -> float:
        if not self.cuda:
            return float("nan")
        torch.cuda.reset_peak_memory_stats()
        return float(torch.cuda.memory_allocated())

    def built(self) -> None:
        """Called after the warm-up step: what the trainer holds, and its peak so far."""
        if self.cuda:
            self.resident = torch.cuda.memory_allocated() - self.before
            self.build_peak = torch.cuda.max_memory_allocated() - self.before

    def step(self, fn):
        """``fn()`` (one timed step; its result returned), with the peak it rose to above its start recorded."""
        start = self._reset()
        out = fn()
        if self.cuda:
            self.increments.append(torch.cuda.max_memory_allocated() - start)
        return out

    def gib(self) -> dict:
        """The table's figures in GiB: ``peak_gib`` (from build), ``resident_gib``, ``step_peak_gib``."""
        return dict(peak_gib=self.build_peak / 2**30, resident_gib=self.resident / 2**30,
                    step_peak_gib=step_peak(self.resident, self.increments) / 2**30)


def step_peak(resident: float, increments: list[float]) -> float:
    """A trainer's peak over its timed steps as if it ran alone: what it holds plus the largest rise of a step
    (NaN without a step)."""
    return resident + max(increments) if increments else float("nan")


def twin_peak(rows: list[dict], cfg: dict) -> float | None:
    """GRPO's measured peak from the build in the row with ``cfg``'s shape already measured (the memory-tight row's
    unconstrained twin), else ``None``."""
    key = ("width", "batch", "completion", "lora", "ckpt")
    return next((r["modes"]["grpo"].get("peak_gib") for r in rows if all(r.get(k) == cfg[k] for k in key)
                 and r.get("kind", "plain") == "plain" and "seconds" in r.get("modes", {}).get("grpo", {})), None)
