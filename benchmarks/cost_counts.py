"""The update's cost counted, device-independent: FLOPs, peak live bytes and ATen operator calls of one
``training_step`` of TRL's ``GRPOTrainer`` and of ``OBLRPOTrainer`` (``one_backward``, two passes, and the default,
``auto``), with the prediction of ``oblr_trl/cost_model.py`` (the model the default, ``oblr_trl/path_choice.py``,
chooses by) beside each count.

Design:
* Models: random Qwen3s of Qwen3-0.6B's and Qwen3-1.7B's widths with their real 151,936-token heads, tied (as they
  ship) and untied, float32, full fine-tuning or LoRA r=16 on all linear layers, TRL's gradient checkpointing on/off.
* Path: the trainers' own ``training_step`` (TRL's ``_prepare_inputs``, OBLR-PO's norms, advantages and update, the
  loss, the backward), on a prepared batch: generation is replaced by a fixed batch of ``B`` completions of ``C``
  tokens after ``P`` prompt tokens (``_generate_and_score_completions`` of GRPOTrainer returns it; OBLR-PO's own
  override runs on top, so its two-pass norms are counted). One group of 8 completions per 8 rows.
* Counting (``studies/counting.py``): ``FlopCounterMode`` (with the CPU flash-attention kernels added), peak live bytes of
  operator outputs (weights not included; gradients are), ATen operator calls. Under ``counting.Shapes`` every large
  tensor is a shape without data, so the full shapes cost nothing; values are not computed (see counting.py).
* Depth: each configuration is counted at 1 and 2 layers; the cost at 28 layers is ``c1 + 27 (c2 - c1)`` (per layer
  ``c2 - c1``, the rest ``2 c1 - c2``: the head, the embedding, the loss). Peak bytes are extrapolated the same way
  (the activations kept per layer grow linearly; the head's transient sits at the end of the forward).
* Where TRL's fused head scores every position on a CPU (all ``P + C`` of them; on a GPU only the ``C`` completion
  positions), GRPO's head is counted as it runs here: keep ``P`` short (32) so that the difference is small.

Run: ``python benchmarks/cost_counts.py --quick`` (Qwen3-0.6B width, B=8, C=256, a few minutes) or without ``--quick``
(both widths, 8 x 512, 64 x 512 and 8 x 4096; ``--stem cost_counts_full``). Writes
``benchmarks/results/<stem>.{json,md}`` (default stem ``cost_counts``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from unittest import mock

import torch

import harness  # noqa: E402
from studies.prepared import prepared_batch  # noqa: E402
from studies.counting import HostSyncs, LiveBytes, OpCounter, Shapes  # noqa: E402

HERE = Path(__file__).resolve().parent
DEPTH = 28
GROUP = 8
PROMPT = 32
WIDTHS = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936),
}
# auto: OBLR-PO's default on a device with no free-memory figure (the ratio targets; the CPU's default reads the host's
# memory, which would make the table depend on this machine); auto_gpu: the default as on a GPU
# with GPU_GIB free (the memory-aware choice, issue 56); replay: one_backward with its update replayed by a second
# backward (checkpointing only)
MODES = {"grpo": None, "one_backward": True, "two_passes": False, "replay": None, "auto": None, "auto_gpu": None}
GPU_GIB = 80  # the simulated device of auto_gpu: an H100's memory, free


class _NoModules:
    """In place of FlopCounterMode's module tracker, whose gradient hooks on module inputs refuse the engine's
    ``autograd.grad`` when a leaf enters a module (LoRA under checkpointing: the embedding's output made to require
    grad): totals only, no per-module breakdown."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def flop_counter():
    """``FlopCounterMode`` with :func:`extra_flops`, without its module tracker (:class:`_NoModules`)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=extra_flops())
    counter.mod_tracker = _NoModules()
    return counter


def extra_flops() -> dict:
    """FlopCounterMode's formulas for what it misses: the in-place ``addmm_`` (TRL's fused head forms its output and
    weight gradients with it on a CPU) and ``baddbmm_`` (Grams accumulated in place), and the CPU flash-attention
    kernels (it counts the CUDA ones only)."""
    from torch.utils.flop_counter import addmm_flop, baddbmm_flop, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(q, k, v, *a, out_val=None, **kw):
        return sdpa_flop_count(q, k, v)  # shapes (FlopCounterMode passes them)

    def bwd(g, q, k, v, *a, out_val=None, **kw):
        return sdpa_backward_flop_count(g, q, k, v)

    def addmm_(acc, a, b, *args, out_val=None, **kw):
        return addmm_flop(acc, a, b)

    def baddbmm_(acc, a, b, *args, out_val=None, **kw):  # the norms' Grams accumulated in place (issue 56: counted)
        return baddbmm_flop(acc, a, b)

    return {aten.addmm_: addmm_, aten.baddbmm_: baddbmm_, aten._scaled_dot_product_flash_attention_for_cpu: fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd}


def build_model(width: str, layers: int, tied: bool, shapes: Shapes):
    """A Qwen3 of ``width`` with ``layers`` layers: built on meta, then each large weight a Phantom, the rest real."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**WIDTHS[width], num_hidden_layers=layers, tie_word_embeddings=tied,
                         max_position_embeddings=8192, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.numel() >= shapes.big:
                new = torch.nn.Parameter(shapes.phantom(p))
            else:
                new = torch.nn.Parameter(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape) * 0.02)
            setattr(module, name, new)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)  # its inv_freq on the CPU
    return model


def trainer_for(mode: str, model, batch: int, completion: int, lora: bool, ckpt: bool):
    """A GRPOTrainer or OBLRPOTrainer whose generation returns the prepared batch."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.demo.tiny import build_tokenizer
    from oblr_trl.grad_norms import coverage, head as head_transform, model as plan
    from oblr_trl.grad_norms.model import unwrap_causal_lm
    from oblr_trl.grad_norms.coverage import coverage_plan

    prepared, rewards = prepared_batch(batch, completion, model.config.vocab_size, PROMPT, GROUP)
    # The head's transform is observed on real logits at construction; a counted model has no values: its
    # config's transform (Qwen3: none) stands in, as for sharded heads
    plan.plan_of(model).head_transform = head_transform.from_config(plan.text_config(model))

    class PreparedGRPO(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            self._rewards_per_func = rewards  # what _calculate_rewards would have kept (OBLR-PO reads it)
            return dict(prepared)

    common = dict(output_dir="/tmp/cost_counts", per_device_train_batch_size=batch, num_generations=GROUP,
                  max_completion_length=completion, gradient_accumulation_steps=1, steps_per_generation=1,
                  report_to="none", use_cpu=True, bf16=False, save_strategy="no", logging_steps=1,
                  gradient_checkpointing=ckpt, disable_tqdm=True)
    if mode == "grpo":
        cls, args = PreparedGRPO, GRPOConfig(**common)
    else:
        cls = type("PreparedOBLRPO", (OBLRPOTrainer, PreparedGRPO), {})
        args = OBLRPOConfig(**common, one_backward=MODES[mode])
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = Dataset.from_list([{"prompt": "x"}] * batch)
    # The construction-time probe (per-sequence gradients against autograd's on 2 sequences) needs values, which a
    # counted model has not: the type checks run, the probe is skipped; the update itself runs unchanged.
    with mock.patch("oblr_trl.trainer.validate", lambda m: coverage.validate(m, run_probe=False)):
        trainer = cls(model=model, args=args, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                      train_dataset=dataset, processing_class=build_tokenizer(), peft_config=peft)
    lm = unwrap_causal_lm(trainer.model)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # as train() sets it, and its checkpointing:
    if ckpt:
        kwargs = {k: v for k, v in (args.activation_checkpointing_kwargs or {}).items()
                  if k not in ("every_n_layers", "offload")}
        enable = getattr(trainer.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs or None)
        else:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    # what the pass remembers, found for the model as the step runs it (plan.state_key), so nothing is found again
    # inside the counted step: the coverage, the config's head transform (see above), the probe taken as passed
    view = plan.view_of(trainer.model)
    coverage_plan(view)
    view.plan.head_transform = head_transform.from_config(plan.text_config(lm))
    view.plan.probed = view.key
    return trainer


def count_step(width: str, layers: int, tied: bool, mode: str, batch: int, completion: int, lora: bool,
               ckpt: bool) -> dict:
    """FLOPs, peak live bytes and operator calls of one training_step."""
    from oblr_trl import path_choice

    shapes = Shapes()
    with shapes:
        model = build_model(width, layers, tied, shapes)
        trainer = trainer_for(mode, model, batch, completion, lora, ckpt)
        trainer.model.train()
        flops, live, ops, syncs = flop_counter(), LiveBytes(), OpCounter(), HostSyncs()
        gc.collect()
        gc.disable()  # garbage in reference cycles stays counted until the end, the same in every run
        try:
            # the default's choice is made for the model at its real depth (DEPTH layers), then counted at this one
            with flops, live, ops, syncs, \
                    mock.patch.object(path_choice, "describe", at_real_depth(path_choice.describe)), \
                    forced_replay(mode == "replay"), default_budget(mode):
                trainer.training_step(trainer.model, [{"prompt": "x"}] * batch, torch.tensor(batch * completion))
        finally:
            gc.enable()
        plan = getattr(trainer, "route", None)
        row = dict(flops=flops.get_total_flops(), peak_bytes=live.peak, ops=ops.total, syncs=syncs.total,
                   mm_calls=sum(ops.calls[k] for k in ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm")),
                   ran=("grpo" if plan is None else
                        f"{'replay' if plan.replay else 'one_backward'}/{plan.chunk_rows or batch}" if plan.on
                        else f"two_passes/{plan.norms_chunk or batch}"))
    del trainer, model
    gc.collect()
    return row


def forced_replay(on: bool):
    """For the ``replay`` mode: the default's choice replaced by ``one_backward`` replayed, in the largest chunk the
    model says fits (one group where none does)."""
    from contextlib import nullcontext

    from oblr_trl import path_choice

    if not on:
        return nullcontext()
    real = path_choice.choose

    def choose(shape, replay=True):
        chunk, ratio = path_choice.replay_chunk(shape)
        choice = real(shape, replay)
        return path_choice.Choice(True, chunk or path_choice.chunk_sizes(shape.rows, shape.group)[-1],
                                  choice.flops_ratio, ratio, replay=True)

    return mock.patch.object(path_choice, "choose", choose)


def default_budget(mode: str):
    """The default's budget: for ``auto_gpu`` as on a GPU of :data:`GPU_GIB` GiB with nothing else on it
    (``path_choice.device_budget`` finds that room on a real one); for ``auto`` and ``replay`` none (a device with no
    free-memory figure: ``path_choice.choose``, the ratio targets, which :func:`forced_replay` replaces)."""
    from contextlib import nullcontext

    from oblr_trl import path_choice

    total = GPU_GIB * 2**30

    def budget(device, cap, pending=0.0):
        room = path_choice.memory_room(total, total, 0, 0, 1.0, path_choice.margin_bytes(total), pending)
        return path_choice.Budget(room, None if cap is None else cap * 2**30)

    patch = {"auto_gpu": budget, "auto": lambda *args, **kwargs: None, "replay": lambda *args, **kwargs: None}.get(mode)
    return nullcontext() if patch is None else mock.patch.object(path_choice, "device_budget", patch)


def at_real_depth(describe):
    """``describe`` (``oblr_trl.path_choice.describe``) with the layer count set to :data:`DEPTH`: the default
    chooses for the model whose cost the table reports."""
    import dataclasses

    return lambda *args, **kwargs: dataclasses.replace(describe(*args, **kwargs), layers=DEPTH)


def linear_shapes(c: dict) -> list[tuple[int, int]]:
    """``(in, out)`` of a layer's linear maps."""
    d, f, q, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"]
    return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


def shape_of(width: str, layers: int, batch: int, completion: int, lora: bool, ckpt: bool, tied: bool = True):
    """The :class:`oblr_trl.cost_model.Shape` of a counted configuration."""
    from oblr_trl.cost_model import Shape

    c, lin = WIDTHS[width], linear_shapes(WIDTHS[width])
    adapters = tuple((i, 16) for i, _ in lin) + tuple((16, o) for _, o in lin) if lora else ()
    return Shape(layers=layers, hidden=c["hidden_size"], vocab=c["vocab_size"], heads=c["num_attention_heads"],
                 head_dim=c["head_dim"], linears=tuple((i, o, not lora) for i, o in lin), adapters=adapters,
                 head_trainable=not lora, tied=tied, rows=batch, prompt=PROMPT, completion=completion, itemsize=4,
                 checkpointing=ckpt, group=GROUP)


def predict(width: str, layers: int, mode: str, batch: int, completion: int, lora: bool, ckpt: bool,
            tied: bool = True, what: str = "flops", chunk: int = 0) -> float:
    """The model's prediction (``oblr_trl/cost_model.py``, the one the trainer's default runs): FLOPs or, with
    ``what="bytes"``, peak bytes (``one_backward`` in chunks of ``chunk`` rows; 0: all)."""
    from oblr_trl import cost_model

    shape = shape_of(width, layers, batch, completion, lora, ckpt, tied)
    return cost_model.flops(shape, mode) if what == "flops" else cost_model.peak_bytes(shape, mode, chunk)


def at_depth(c1: float, c2: float, depth: int = DEPTH) -> float:
    """The count at ``depth`` layers from those at 1 and 2 layers: ``c1 + (depth - 1) (c2 - c1)``."""
    return c1 + (depth - 1) * (c2 - c1)


def configurations(quick: bool) -> list[dict]:
    if quick:
        sizes = [("Qwen3-0.6B", 8, 256)]
    else:
        sizes = [(w, b, c) for w in WIDTHS for b, c in ((8, 512), (64, 512), (8, 4096))]
    return [dict(width=w, batch=b, completion=c, tied=t, lora=lo, ckpt=ck) for w, b, c in sizes
            for t in (True, False) for lo in (False, True) for ck in (False, True)]


def measure(cfg: dict, log) -> dict:
    row = dict(cfg, modes={})
    for mode in MODES:
        if mode == "replay" and not cfg["ckpt"]:
            continue
        try:
            counts = [count_step(cfg["width"], n, cfg["tied"], mode, cfg["batch"], cfg["completion"], cfg["lora"],
                                 cfg["ckpt"]) for n in (1, 2)]
        except RuntimeError as error:  # said in the table, row by row
            row["modes"][mode] = dict(error=str(error).splitlines()[0][:160])
            log(f"{cfg} {mode}: counting failed: {error}")
            continue
        ran = counts[0].pop("ran")
        assert counts[1].pop("ran") == ran, "the choice is made at the real depth: the same at 1 and 2 layers"
        deep = {k: at_depth(counts[0][k], counts[1][k]) for k in counts[0]}
        deep["ran"] = ran
        deep.update(predictions(cfg, ran))
        for k in ("flops", "ops", "peak_bytes"):  # syncs: per step, not per layer
            deep[f"per_layer_{k}"], deep[f"rest_{k}"] = counts[1][k] - counts[0][k], 2 * counts[0][k] - counts[1][k]
        row["modes"][mode] = deep
    g = row["modes"]["grpo"]
    log(f"{cfg}: " + ", ".join(
        f"{m} flops {v['flops'] / g['flops']:.2f}x (model {v['predicted_flops'] / g['predicted_flops']:.2f}x) "
        f"bytes {v['peak_bytes'] / g['peak_bytes']:.2f}x ops {v['ops'] / g['ops']:.2f}x "
        f"syncs {v.get('syncs', 0) - g.get('syncs', 0):+.0f}"
        for m, v in row["modes"].items() if m != "grpo" and "error" not in v))
    return row


def predictions(cfg: dict, ran: str) -> dict:
    """The model's FLOPs and peak bytes for the path that ran (``ran``: ``mode/rows per chunk``) at :data:`DEPTH`."""
    run, chunk = (ran.split("/") + ["0"])[:2]
    return {f"predicted_{what}": at_depth(*(predict(cfg["width"], n, run, cfg["batch"], cfg["completion"], cfg["lora"],
                                                    cfg["ckpt"], cfg["tied"], what, int(chunk)) for n in (1, 2)))
            for what in ("flops", "bytes")}


def repredict(res: dict) -> dict:
    """``res`` (a written result) with the model's columns computed again from ``oblr_trl/cost_model.py`` as it is
    now; the counts (and the paths that ran) stay as counted."""
    for row in res["rows"]:
        cfg = {k: v for k, v in row.items() if k != "modes"}
        for v in row["modes"].values():
            if "error" not in v:
                v.update(predictions(cfg, v["ran"]))
    res["repredicted"] = harness.utc_now()
    return res


TARGETS = dict(flops_full=1.3, flops_lora=1.05, bytes_ckpt=1.1, bytes=1.2, ops=1.25, syncs=2)  # syncs: GRPO's + 2


def verdict(row: dict, mode: str, ran: str, flops: float, bytes_: float, ops: float, syncs: float = 0) -> str:
    """``yes``, or ``no:`` with each target missed and what in the path that ran costs it (the reason it is not lower:
    an exact update either keeps each row's per-layer factors from the backward to the update, or forms them again)."""
    missed = [f"{what} {ratio:.2f}x" for what, ratio, limit in (
        ("FLOPs", flops, TARGETS["flops_lora" if row["lora"] else "flops_full"]),
        ("bytes", bytes_, TARGETS["bytes_ckpt" if row["ckpt"] else "bytes"]), ("calls", ops, TARGETS["ops"]))
        if ratio > limit] + ([f"host syncs GRPO's {syncs:+.0f}"] if syncs > TARGETS["syncs"] else [])
    if not missed:
        return "yes"
    path, _, chunk = ran.partition("/")
    path, chunk = path.strip(), int(chunk or 0)
    if path == "two_passes":
        why = "the norms pass is a second forward and backward" + (
            "; no one_backward chunk fits the byte target" if mode == "auto" else "")
    elif path == "replay":
        why = "the update replayed by a second backward of the graph, no per-layer factors kept"
    elif row["ckpt"] and bytes_ > TARGETS["bytes_ckpt"]:
        why = "each row's per-layer factors kept from the backward to the update, which checkpointing frees in GRPO"
    elif 0 < chunk < row["batch"]:
        why = f"chunks of {chunk} rows, each its own forward, backward and head pass"
    else:
        why = "the norms' Grams and the update's weighted sums beside autograd's backward"
    return f"no: {', '.join(missed)}; {why}"


def ratios(r: dict, mode: str) -> tuple[float, float, float, float] | None:
    """A configuration's FLOPs, bytes and calls against GRPO's, and its host syncs beyond GRPO's (None: not counted)."""
    g, v = r["modes"]["grpo"], r["modes"].get(mode)
    if v is None or "error" in v or "error" in g:
        return None
    extra = v["syncs"] - g["syncs"] if "syncs" in v and "syncs" in g else 0
    return v["flops"] / g["flops"], v["peak_bytes"] / g["peak_bytes"], v["ops"] / g["ops"], extra


def summary(res: dict) -> list[str]:
    """Per mode: how many configurations meet every target, each ratio's range, and how many miss each target."""
    head = ["mode", "meets every target", "FLOPs / GRPO", "bytes / GRPO", "calls / GRPO", "host syncs vs GRPO's",
            "configurations missing: FLOPs, bytes, calls, syncs"]
    rows = []
    for mode in [m for m in MODES if m != "grpo"]:
        found = [(r, x) for r in res["rows"] if (x := ratios(r, mode)) is not None]
        if not found:
            continue
        verdicts = [verdict(r, mode, r["modes"][mode]["ran"], *x) for r, x in found]
        def span(i: int, fmt: str, unit: str = "") -> str:
            low, high = (f"{f(x[i] for _, x in found):{fmt}}{unit}" for f in (min, max))
            return low if low == high else f"{low} to {high}"

        misses = [sum(f"{what} " in v.split(";")[0] for v in verdicts) for what in ("FLOPs", "bytes", "calls")]
        misses.append(sum("host syncs" in v for v in verdicts))
        rows.append([mode, f"{verdicts.count('yes')} of {len(found)}", span(0, ".2f", "x"), span(1, ".2f", "x"),
                     span(2, ".2f", "x"), span(3, "+.0f"), ", ".join(map(str, misses))])
    return harness.md_table(head, rows)


def render(res: dict) -> str:
    head = ["width", "B x C", "head", "tuning", "ckpt", "mode", "ran (rows per chunk)", "FLOPs (T)", "model (T)",
            "FLOPs / GRPO", "model / GRPO", "per layer / GRPO", "head+rest / GRPO", "peak GiB", "model GiB",
            "bytes / GRPO", "model bytes / GRPO", "ops", "ops / GRPO", "host syncs", "meets targets"]
    rows = []
    for r in res["rows"]:
        g = r["modes"]["grpo"]
        for mode, v in r["modes"].items():
            where = [r["width"], f"{r['batch']} x {r['completion']}", "tied" if r["tied"] else "untied",
                     "LoRA r=16" if r["lora"] else "full", "on" if r["ckpt"] else "off", mode]
            if "error" in v:
                rows.append(where + [f"counting failed: {v['error']}"] + [""] * (len(head) - 7))
                continue
            f, b, o = v["flops"] / g["flops"], v["peak_bytes"] / g["peak_bytes"], v["ops"] / g["ops"]
            counted = "syncs" in v and "syncs" in g  # tables counted before issue 56 have no syncs
            extra = v["syncs"] - g["syncs"] if counted else 0
            ok = "" if mode == "grpo" else verdict(r, mode, v["ran"], f, b, o, extra)
            syncs = "" if not counted else f"{v['syncs']:.0f}" + ("" if mode == "grpo" else f" ({extra:+.0f})")
            rows.append(where + [
                v["ran"].replace("/", " / "), f"{v['flops'] / 1e12:.2f}", f"{v['predicted_flops'] / 1e12:.2f}",
                f"{f:.2f}x", f"{v['predicted_flops'] / g['predicted_flops']:.2f}x",
                f"{v['per_layer_flops'] / g['per_layer_flops']:.2f}x", f"{v['rest_flops'] / g['rest_flops']:.2f}x",
                f"{v['peak_bytes'] / 2**30:.2f}", f"{v['predicted_bytes'] / 2**30:.2f}", f"{b:.2f}x",
                f"{v['predicted_bytes'] / g['predicted_bytes']:.2f}x", f"{v['ops']:,.0f}", f"{o:.2f}x", syncs, ok])
    m = res["machine"]
    return "\n".join([
        "# The update's cost, counted (FLOPs, peak live bytes, operator calls)", "",
        f"Counted {m['date']} with `{res['command']}` (torch {m['torch']}, transformers {m['transformers']}, trl "
        f"{m['trl']}); device-independent: nothing is timed. One `training_step` of TRL's GRPOTrainer and of "
        "OBLRPOTrainer on a prepared batch (generation excluded), float32, one group per 8 completions, "
        f"{PROMPT} prompt tokens. Counts at 1 and 2 layers, extrapolated to {DEPTH} layers as c1 + 27 (c2 - c1); "
        "`per layer` and `head+rest` are the two parts. `model`: the prediction of `oblr_trl/cost_model.py` (the "
        "model OBLR-PO's default chooses by), at 1 and 2 layers combined the same way, for the path that ran. "
        f"`auto`: OBLR-PO's default (`one_backward=None`) on a device with no free-memory figure (the ratio targets), "
        f"its choice made for the {DEPTH}-layer model; `auto_gpu`: the default as on a GPU with {GPU_GIB} GiB free "
        "(the memory-aware choice: `one_backward` wherever its predicted peak fits); `ran`: the "
        "path and rows per chunk each mode took (`one_backward`'s chunks, or the two-pass path's norms-pass chunks; "
        "`one_backward=True` under checkpointing: the largest chunk the model says fits, else one group; `replay`, "
        "checkpointing only: `one_backward` with its update from a second backward of the pass's graph, no "
        "per-layer factors kept). Peak bytes: live operator outputs (weights and their views not included). "
        + (f"Model columns computed again on {res['repredicted']} (`--repredict`; counts unchanged). "
           if res.get("repredicted") else "") +
        f"Targets: FLOPs <= {TARGETS['flops_full']}x GRPO (full), <= {TARGETS['flops_lora']}x (LoRA); peak bytes "
        f"<= {TARGETS['bytes_ckpt']}x with checkpointing, <= {TARGETS['bytes']}x without; operator calls <= "
        f"{TARGETS['ops']}x; host syncs (scalar reads, value-sized outputs, `.tolist()`/`.cpu()`: "
        f"`counting.HostSyncs`) <= GRPO's + {TARGETS['syncs']} (the column: count, and against GRPO's).", "",
        "Per mode, over the configurations below:", "", *summary(res), "", *harness.md_table(head, rows), ""])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="Qwen3-0.6B width, 8 x 256 only (a few minutes)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--stem", default="cost_counts")
    p.add_argument("--rerender", action="store_true", help="no counting: the table of the written STEM.json again")
    p.add_argument("--repredict", action="store_true",
                   help="no counting: the model's columns of the written STEM.json computed again, the table rewritten")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rerender or args.repredict:  # no counting: the written result, its table rendered again
        res = json.loads((args.out / f"{args.stem}.json").read_text())
        res = repredict(res) if args.repredict else res
        harness.write_results(args.out, args.stem, res, render(res))
        return 0
    torch.set_num_threads(1)
    log = harness.Log()
    with harness.quiet():
        rows = [measure(cfg, log) for cfg in configurations(args.quick)]
    res = dict(machine=harness.machine_info(), rows=rows,
               command=" ".join(["python benchmarks/cost_counts.py", *(sys.argv[1:] if argv is None else argv)]))
    js, md = harness.write_results(args.out, args.stem, res, render(res))
    log(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
