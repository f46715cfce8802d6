"""What OBLR-PO's exact per-sequence gradient norms cost, next to GRPO's own work, in both update modes.

One run, same batch and model for every measurement of a configuration (model x completion length C):

1. ``norms_vs_fwdbwd``: ``per_sequence_grad_sq_norms`` vs one plain forward+backward of the batch (the sum of the
   completion log-probs through TRL's fused LM head, ``.backward()``: GRPO's policy-loss pass). Also the group form
   ``per_sequence_grad_inner_products(group_size=8)`` (``snr_sample_unit="group"``, the trainer's default).
   ``norms_vs_loop``: speed-up of the exact norms over the naive loop (one forward+backward per sequence).
2. The update of each mode vs GRPO's forward+backward, timed as one call: **two passes** (the group norms pass, then
   GRPO's loss pass) and **one_backward** (``OBLRPOConfig(one_backward=True)``: one forward/backward, the norms, the
   weight gradients and the group norms formed from what was kept).
3. Peak memory of each (CPU: peak RSS of a fresh subprocess per measurement; CUDA: ``torch.cuda.max_memory_allocated``
   of the timed calls), with and without gradient checkpointing.
4. A whole RL step (generation, scoring, norms, loss, optimizer), one subprocess per trainer so that its peak memory is
   its own: ``trl.GRPOTrainer`` + ``GRPOConfig`` (with and without gradient checkpointing) vs ``OBLRPOTrainer`` in
   each mode, same arguments otherwise.

The headline (the JSON object printed last) gives the DEFAULT mode's ratios under the historical keys
(``update_vs_grpo``, ``peak_mem_vs_grpo``, ``step_vs_grpo``, ...; ``--default-mode``, ``one_backward`` unless told)
and every mode's under keys that name it (``update_two_pass_vs_grpo``, ``step_one_backward_vs_grpo``, ...).
Models: ``tiny``/``small`` (``oblr_trl.demo.tiny``), ``medium`` (a 32k-vocab Qwen3), random-initialised models of real
shapes (``smollm2-135m``, ``qwen3-0.6b``, ``qwen3-1.7b``), or any Hugging Face folder or name with ``--model``.

Timings are medians of repeats that interleave the measured functions (so slow drifts of a shared machine hit all of
them alike), after a warm-up round. Nothing is asserted. ``python benchmarks/step_cost.py --quick`` takes about 10
minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from harness import Log, fmt, machine_info, machine_line, md_table, time_interleaved, write_results  # noqa: E402
from oblr_trl.grad_norms import (  # noqa: E402
    per_sequence_grad_inner_products,
    per_sequence_grad_sq_norms,
    per_sequence_grads,
)
from oblr_trl.demo.tiny import build_model, build_tokenizer  # noqa: E402

GROUP = 8
warnings.filterwarnings("ignore", category=FutureWarning)
TINY = ("tiny", "small")
# Random-initialised models of real shapes (the published configs' sizes; no weights are read).
SHAPES = {
    "medium": (Qwen3Config, Qwen3ForCausalLM, dict(vocab_size=32768, hidden_size=256, intermediate_size=1024,
                                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=64)),
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                         num_hidden_layers=30, num_attention_heads=9,
                                                         num_key_value_heads=3, head_dim=64, rope_theta=100000.0)),
    "qwen3-0.6b": (Qwen3Config, Qwen3ForCausalLM, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                                       num_hidden_layers=28, num_attention_heads=16,
                                                       num_key_value_heads=8, head_dim=128)),
    "qwen3-1.7b": (Qwen3Config, Qwen3ForCausalLM, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                                       num_hidden_layers=28, num_attention_heads=16,
                                                       num_key_value_heads=8, head_dim=128)),
}
SIZES = TINY + tuple(SHAPES)
# The measured functions. "update_*" are the two modes' updates; "*_ckpt" the same under gradient checkpointing.
FNS_CPU = ["fwdbwd", "norms", "update", "loop", "update_one_backward", "group", "update_group"]
FNS_CUDA = ["fwdbwd", "fwdbwd_ckpt", "norms", "group", "loop", "loop_sq", "update_group", "update_group_ckpt",
            "update_one_backward", "update_one_backward_ckpt"]
GRAM_FNS = ("group", "update_group", "update_group_ckpt")  # skipped past --max-gram-gflop
MEM_CPU = ["fwdbwd", "norms", "update_one_backward", "group", "fwdbwd_ckpt", "update_one_backward_ckpt",
           "group_ckpt"]
# OBLR-PO's kinds: its mode (one_backward True / False / None = the automatic default) and whether TRL's gradient
# checkpointing is on; each is compared with the GRPO kind of the same checkpointing setting.
STEP_KINDS = ("grpo", "grpo_no_ckpt", "two_pass", "one_backward", "default", "one_backward_no_ckpt",
              "default_no_ckpt")
STEP_MODE = {"two_pass": False, "one_backward": True, "default": None, "one_backward_no_ckpt": True,
             "default_no_ckpt": None}


def grpo_of(kind: str) -> str:
    """The GRPO kind with ``kind``'s checkpointing setting."""
    return "grpo_no_ckpt" if kind.endswith("no_ckpt") else "grpo"


# ------------------------------------------------------------------------------------------------------------ setup
def device_and_dtype():
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), None


def autocast(device, dtype):
    if dtype is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def load_model(spec: str, device, fused: bool = True):
    """(model, tokenizer or None) for a size name of SIZES, or a Hugging Face folder / name (its weights)."""
    tokenizer = None
    if spec in TINY:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, size=spec, seed=0)
    elif spec in SHAPES:
        config_cls, model_cls, kwargs = SHAPES[spec]
        config = config_cls(**kwargs, max_position_embeddings=8192, tie_word_embeddings=True, pad_token_id=0,
                            eos_token_id=1, bos_token_id=2)
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs (a 1.7B model's init on one CPU core takes minutes)
            model = model_cls(config).to(torch.float32)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from oblr_trl.demo import resolve_model_path

        spec = resolve_model_path(spec)  # "smollm2": the reference model, fetched and converted once (offline)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(spec)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, 4096)
    model.train()  # dropout is 0 in these configs; train mode as in the trainer
    if fused:  # as GRPOTrainer patches it (the trainers below patch their own model)
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    return model.to(device), tokenizer


def label(spec: str) -> str:
    return Path(spec).name if spec not in SIZES else spec


def make_batch(vocab: int, batch: int, prompt_len: int, completion_len: int, device, seed: int = 0):
    """Random token ids (ids >= 4 avoid the special tokens); the last ``completion_len`` positions are the completion.
    Two rows are left-padded prompts, three completions end early (right padding in completion_mask)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (batch, prompt_len + completion_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:2, : prompt_len // 4] = 0
    completion_mask = torch.ones(batch, completion_len)
    for row, keep in ((1, 0.5), (4, 0.75), (7, 0.25)):
        if row < batch:
            completion_mask[row, int(keep * completion_len):] = 0
    return input_ids.to(device), attention_mask.to(device), completion_mask.to(device)


def param_counts(model) -> tuple[int, int]:
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return total, total - head.numel()


@contextmanager
def checkpointing(model, on: bool):
    """TRL's default gradient checkpointing (non-reentrant) for the duration of the block."""
    if not on:
        yield
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        model.gradient_checkpointing_disable()


# --------------------------------------------------------------------------------------------- measured functions
def completion_logp_sum(model, input_ids, attention_mask, completion_mask):
    """Sum of completion log-probs through TRL's fused LM head (what GRPO's loss pass runs)."""
    c = completion_mask.shape[1]
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-c] = -100
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return (out.log_probs[:, -c:] * completion_mask).sum()


def make_fns(model, batch, device, dtype) -> dict:
    """Every measured function by name, each a whole call of public API on the same model and batch."""
    input_ids, attention_mask, completion_mask = batch
    params = [p for p in model.parameters() if p.requires_grad]
    scale = torch.linspace(-1.0, 1.0, input_ids.shape[0], device=device)

    def fwdbwd():  # GRPO's loss pass
        with autocast(device, dtype):
            loss = completion_logp_sum(model, input_ids, attention_mask, completion_mask)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def norms():
        with autocast(device, dtype):
            return per_sequence_grad_sq_norms(model, input_ids, attention_mask, completion_mask)

    def group():
        with autocast(device, dtype):
            return per_sequence_grad_inner_products(model, input_ids, attention_mask, completion_mask,
                                                    group_size=GROUP)

    def loop():
        """Naive: one forward+backward per sequence; flattened gradients -> within-group inner products."""
        out, grads = [], []
        for i in range(input_ids.shape[0]):
            with autocast(device, dtype):
                total = completion_logp_sum(model, input_ids[i : i + 1], attention_mask[i : i + 1],
                                            completion_mask[i : i + 1])
            g = torch.autograd.grad(total, params, allow_unused=True)
            grads.append(torch.cat([(x if x is not None else torch.zeros_like(p)).float().flatten()
                                    for x, p in zip(g, params)]))
            del g
            if len(grads) == GROUP:
                stacked = torch.stack(grads)
                grads = []
                out.append(stacked @ stacked.T)
                del stacked
        return torch.stack(out)

    def loop_sq():
        """Naive, per-sequence norms only: one forward+backward per sequence, the sum of its squared gradients (no
        flattened copy kept: the peer that fits for models whose B flattened gradients do not)."""
        out = []
        for i in range(input_ids.shape[0]):
            with autocast(device, dtype):
                total = completion_logp_sum(model, input_ids[i : i + 1], attention_mask[i : i + 1],
                                            completion_mask[i : i + 1])
            g = torch.autograd.grad(total, params, allow_unused=True)
            out.append(sum(x.float().square().sum() for x in g if x is not None))
            del g
        return torch.stack(out)

    def update():  # two passes, per-sequence form: the norms pass, then GRPO's loss pass
        norms()
        fwdbwd()

    def update_group():  # two passes as OBLRPOTrainer runs them by default: group inner products, then the loss pass
        group()
        fwdbwd()

    def update_one_backward():  # OBLRPOConfig(one_backward=True), as the trainer runs it
        with autocast(device, dtype):  # one pass; layers narrower than their sequences keep per-sample gradients
            grads = per_sequence_grads(model, input_ids, attention_mask, completion_mask, materialize=True)
        grads.inner_products(1)  # the baseline's weights
        grads.accumulate_grad(scale, group_size=GROUP)  # weight gradients, and each group's ||H_q||^2 for the SNR
        model.zero_grad(set_to_none=True)

    fns = dict(fwdbwd=fwdbwd, norms=norms, group=group, loop=loop, loop_sq=loop_sq, update=update, update_group=update_group,
               update_one_backward=update_one_backward)
    for name in list(fns):  # the same under gradient checkpointing
        fns[name + "_ckpt"] = (lambda fn: lambda: _under_ckpt(model, fn))(fns[name])
    return fns


def _under_ckpt(model, fn):
    with checkpointing(model, True):
        return fn()


class Guarded:
    """Wraps the measured functions: a CUDA out-of-memory error marks the function failed (and skipped after), and
    on CUDA each call's peak allocation above what was allocated before it is kept (the largest over calls)."""

    def __init__(self, fns: dict, model, device):
        self.fns, self.model, self.device = fns, model, device
        self.failed: dict[str, str] = {}
        self.peak: dict[str, int] = {}

    def __call__(self, name):
        def run():
            if name in self.failed:
                return None
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            try:
                result = self.fns[name]()
            except torch.OutOfMemoryError as e:
                self.failed[name] = "out of memory: " + str(e).split("\n")[0][:120]
                self.model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.empty_cache()
                return None
            if cuda:
                torch.cuda.synchronize()
                self.peak[name] = max(self.peak.get(name, 0), torch.cuda.max_memory_allocated() - base)
            return result
        return run


def time_config(model, batch, device, dtype, names, args, log):
    """Stage 1 of a configuration: interleaved medians, outputs of the warm-up round, CUDA peaks, failures."""
    fns = make_fns(model, batch, device, dtype)
    guard = Guarded(fns, model, device)
    guarded = {name: guard(name) for name in names}
    times, outputs = time_interleaved(guarded, names, args.repeats, args.budget, lambda: sync(device), log)
    times = {k: (float("nan") if k in guard.failed else v) for k, v in times.items()}
    return fns, times, outputs, guard


def accuracy(outputs) -> tuple[float, float]:
    """Max relative error of the exact norms (and group products) against the naive loop's."""
    ref = outputs.get("loop")
    if outputs.get("norms") is None or (ref is None and outputs.get("loop_sq") is None):
        return float("nan"), float("nan")
    diag = (torch.diagonal(ref, dim1=1, dim2=2).reshape(-1) if ref is not None else outputs["loop_sq"]).double()
    err = ((outputs["norms"].double() - diag).abs() / diag.abs().clamp_min(1e-30)).max().item()
    gerr = float("nan")
    if outputs.get("group") is not None and ref is not None:
        gerr = ((outputs["group"].double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    return err, gerr


# ------------------------------------------------------------------------------------------------ flop estimates
def flop_estimates(model, batch: int, length: int, completion: int, group: int) -> dict:
    """Rough GFLOP of one forward+backward and of the ghost-norm Gram products (bmm only), from the shapes."""
    cfg = model.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    linears = [m for n, m in model.model.named_modules() if isinstance(m, nn.Linear)]
    lin_params = sum(m.in_features * m.out_features for m in linears)
    head_dim = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    fwdbwd = 6 * lin_params * batch * length + 6 * batch * completion * vocab * d + 6 * batch * length ** 2 * attn
    rows = batch * group  # (B/G) blocks of G*T tokens: B*G*T^2 Gram entries
    gram_lin = sum(2 * rows * length ** 2 * (m.in_features + m.out_features) for m in linears)
    gram_emb = 2 * rows * length ** 2 * d
    # head: Gram of the softmax deltas (width V, both sides recomputed per vocab chunk) + Gram of h
    gram_head = 2 * rows * completion ** 2 * vocab + 2 * 2 * batch * group * completion * vocab * d \
        + 2 * rows * completion ** 2 * d
    materialize = 2 * batch * length * lin_params + 2 * batch * completion * vocab * d  # per-sample grads instead
    return dict(fwdbwd=fwdbwd / 1e9, gram_linear=gram_lin / 1e9, gram_embedding=gram_emb / 1e9,
                gram_head=gram_head / 1e9, gram_total=(gram_lin + gram_emb + gram_head) / 1e9,
                materialize=materialize / 1e9)


# ------------------------------------------------------------------------------------------------------ profiling
def profile_norms(model, batch, device, dtype, fns, forms=("norms", "group"), top: int = 8) -> dict:
    """Where one call of each norms form spends its time: torch.profiler's operators by self time (the whole public
    call profiled; nothing patched), plus a plain backbone forward/backward and the linear layers' alternatives."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    result = {}
    for name in forms:
        fns[name]()  # warm
        sync(device)
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            fns[name]()
            sync(device)
        total = time.perf_counter() - t0
        events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
        ops = {e.key: getattr(e, key) / 1e6 for e in events[:top]}
        result[name] = dict(total=total, ops=ops, profiled_total=sum(getattr(e, key) for e in events) / 1e6)
    result["plain_backbone"] = plain_backbone(model, batch, device, dtype)
    result["linear_alternatives"] = linear_alternatives(model, batch[0].shape[0], batch[0].shape[1], device)
    return result


def plain_backbone(model, batch, device, dtype) -> dict:
    """The backbone's forward and backward without the norms' hooks, for their overhead."""
    input_ids, attention_mask, _ = batch
    with autocast(device, dtype):
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        sync(device)
        t0 = time.perf_counter()
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        sync(device)
        t1 = time.perf_counter()
    params = [p for p in model.model.parameters() if p.requires_grad]
    torch.autograd.grad(hidden, params, grad_outputs=torch.ones_like(hidden), allow_unused=True)
    sync(device)
    t2 = time.perf_counter()
    # backward to the embedding output only: every module's output gradient, no weight gradient
    with autocast(device, dtype):
        embeds = model.model.embed_tokens(input_ids).detach().requires_grad_()
        hidden = model.model(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False).last_hidden_state
    sync(device)
    t3 = time.perf_counter()
    torch.autograd.grad(hidden, [embeds], grad_outputs=torch.ones_like(hidden))
    sync(device)
    t4 = time.perf_counter()
    return dict(forward=t1 - t0, backward=t2 - t1, backward_inputs_only=t4 - t3)


def linear_alternatives(model, batch: int, length: int, device) -> dict:
    """Seconds, summed over the backbone's nn.Linear layers, of their share of the per-sequence (G=1) and group (G=8)
    inner products by token Grams vs by materializing each sequence's weight gradient ``sum_t g_t x_t^T``
    (``(B, d_out, d_in)``, then the G x G Gram of the flattened gradients). Random factors of the layers' shapes;
    one warm-up call per shape."""
    shapes = defaultdict(int)
    for m in model.model.modules():
        if isinstance(m, nn.Linear):
            shapes[(m.in_features, m.out_features)] += 1
    totals = dict(gram_sq=0.0, gram_group=0.0, materialize_sq=0.0, materialize_group=0.0)
    for (d_in, d_out), count in shapes.items():
        x = torch.randn(batch, length, d_in, device=device)
        g = torch.randn(batch, length, d_out, device=device)

        def gram(k):
            xb, gb = x.reshape(batch // k, k * length, d_in), g.reshape(batch // k, k * length, d_out)
            prod = torch.bmm(gb, gb.transpose(1, 2)) * torch.bmm(xb, xb.transpose(1, 2))
            return prod.reshape(batch // k, k, length, k, length).sum(dim=(2, 4))

        def materialize(k):
            per_sample = torch.einsum("btl,btr->blr", g, x).reshape(batch // k, k, -1)
            return torch.bmm(per_sample, per_sample.transpose(1, 2))

        for name, fn, k in (("gram_sq", gram, 1), ("gram_group", gram, GROUP), ("materialize_sq", materialize, 1),
                            ("materialize_group", materialize, GROUP)):
            fn(k)
            sync(device)
            t0 = time.perf_counter()
            fn(k)
            sync(device)
            totals[name] += count * (time.perf_counter() - t0)
    return totals


# -------------------------------------------------------------------------------------------------------- memory
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@contextmanager
def peak_rss():
    """Peak RSS above the RSS at entry (``VmHWM`` reset through ``/proc/self/clear_refs``; fallback ``ru_maxrss``).
    Yields a dict that holds ``peak_bytes`` and ``method`` on exit."""
    import gc
    import resource

    gc.collect()
    out = {}
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    base = _status_kb("VmRSS") * 1024
    yield out
    if reset:
        out.update(peak_bytes=_status_kb("VmHWM") * 1024 - base, method="peak RSS (VmHWM, reset via clear_refs) above RSS")
    else:
        out.update(peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
                   method="ru_maxrss above RSS")


def mem_worker(spec: str, completion: int, batch: int, prompt: int, mode: str, threads: int) -> None:
    """Run in a fresh CPU process: peak RSS of one call of ``mode`` above the RSS after building everything."""
    torch.set_num_threads(threads)
    device, dtype = device_and_dtype()
    model, _ = load_model(spec, device)
    data = make_batch(model.config.vocab_size, batch, prompt, completion, device)
    fns = make_fns(model, data, device, dtype)
    # load kernels/libraries on a short batch first, so one-time initialisation does not count
    make_fns(model, make_batch(model.config.vocab_size, GROUP, 8, 8, device), device, dtype)[mode]()
    with peak_rss() as mem:
        fns[mode]()
    print(json.dumps(mem))


def _subprocess_json(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return dict(failed=proc.stderr.strip()[-400:])
    return json.loads(lines[-1])


def measure_memory_cpu(spec, completion, batch, prompt, mode, threads) -> dict:
    res = _subprocess_json([sys.executable, str(Path(__file__).resolve()), "--mem-worker", spec, str(completion),
                            str(batch), str(prompt), mode, "--threads", str(threads)])
    if "failed" in res:
        return dict(peak_bytes=float("nan"), method="failed: " + res["failed"][-300:])
    return res


def memory_config(spec, completion, args, guard, device, names) -> dict:
    """Stage 2 of a configuration: peak memory per function (CUDA: from the timed calls; CPU: subprocesses)."""
    if device.type == "cuda":
        return {n: dict(peak_bytes=guard.peak.get(n, float("nan")), method="torch.cuda.max_memory_allocated above "
                        "allocated, the largest over the timed calls") for n in names}
    modes = [m for m in MEM_CPU if m.removesuffix("_ckpt") in names]
    return {m: measure_memory_cpu(spec, completion, args.batch, args.prompt_len, m, args.threads) for m in modes}


# ---------------------------------------------------------------------------------------------------- RL step
def reward_ones(completions, **kwargs):
    return [float(c[0]["content"].count("1")) for c in completions]


def step_worker(kind: str, spec: str, completion: int, steps: int, batch: int, threads: int) -> None:
    """Run in a fresh process: ``steps`` timed RL steps (after one warm-up) of one trainer, its peak memory."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    torch.set_num_threads(threads)
    device, _ = device_and_dtype()
    model, tokenizer = load_model(spec, device, fused=False)
    if tokenizer is None:
        raise SystemExit(f"step_cost: the RL step needs a tokenizer: {spec!r} has none (use tiny, small or --model).")
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Count the ones in {i:012d} + {3 * i:012d}"}]} for i in range(256)]
    )
    common = dict(output_dir=f"/tmp/oblr-step-cost-{kind}", per_device_train_batch_size=batch,
                  num_generations=GROUP, max_completion_length=completion, max_steps=steps + 1, logging_steps=1,
                  learning_rate=1e-5, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                  use_cpu=device.type != "cuda", bf16=device.type == "cuda",
                  gradient_checkpointing=not kind.endswith("no_ckpt"),
                  generation_kwargs={"min_new_tokens": completion})  # every completion is exactly max length
    sections = defaultdict(float)
    base = GRPOTrainer if kind.startswith("grpo") else OBLRPOTrainer

    class Trainer(base):
        def _generate_and_score_completions(self, *a, **k):  # TRL's method: generation, rewards (and OBLR's norms)
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **k)
            sections["generate+score"] += time.perf_counter() - t0
            return out

    args = GRPOConfig(**common) if base is GRPOTrainer else OBLRPOConfig(**common, one_backward=STEP_MODE[kind])
    step_times, step_sections = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sections.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.t0)
            step_sections.append(dict(sections))

    trainer = Trainer(model=model, processing_class=tokenizer, reward_funcs=[reward_ones], args=args,
                      train_dataset=dataset, callbacks=[Timer()])
    trainer.remove_callback(PrinterCallback)  # keep the benchmark's output to one line per configuration
    with peak_rss() as mem:
        trainer.train()
    timed = step_times[1:]  # step 0 is the warm-up
    med = {k: statistics.median(s.get(k, 0.0) for s in step_sections[1:]) for k in step_sections[-1]}
    print(json.dumps(dict(step_s=statistics.median(timed), steps=len(timed), sections=med, peak_bytes=mem["peak_bytes"],
                          mem_method=mem["method"] + " over the whole train() call",
                          gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
                          mode=("grpo" if base is GRPOTrainer else
                                "one_backward" if trainer.uses_one_backward else "two_pass"))))


def run_steps(spec: str, completion: int, args, log) -> dict:
    """Stage 3: every trainer kind in its own subprocess, same arguments otherwise; ratios to GRPO (checkpointed)."""
    res = {}
    for kind in args.step_kinds:
        r = _subprocess_json([sys.executable, str(Path(__file__).resolve()), "--step-worker", kind, spec,
                              str(completion), str(args.step_steps), str(args.step_batch), "--threads",
                              str(args.threads)])
        res[kind] = r
        log(f"  RL step {label(spec)} C={completion} {kind}: " + (
            f"{r['step_s']:.2f}s/step, peak RSS +{r['peak_bytes'] / 2**20:.0f} MB, checkpointing "
            f"{r['gradient_checkpointing']}, mode {r.get('mode')}" if "failed" not in r
            else "FAILED " + r["failed"][-300:]))
    out = dict(size=label(spec), completion=completion, **res)
    for kind in args.step_kinds:
        g = res.get("grpo" if kind == "grpo_no_ckpt" else grpo_of(kind), {})
        if kind != "grpo" and "step_s" in res[kind] and "step_s" in g:
            out[f"step_{kind}_vs_grpo"] = res[kind]["step_s"] / g["step_s"]
            out[f"step_peak_mem_{kind}_vs_grpo"] = res[kind]["peak_bytes"] / g["peak_bytes"]
    return out


# ------------------------------------------------------------------------------------------------------ ratios
def config_ratios(t: dict, mem: dict | None) -> dict:
    """Every ratio of one configuration, from the medians ``t`` and the peaks ``mem`` (NaN where not measured)."""
    def div(a, b):
        x, y = a if isinstance(a, float) else t.get(a, float("nan")), t.get(b, float("nan"))
        return x / y if y == y and y else float("nan")

    r = dict(norms_vs_fwdbwd=div("norms", "fwdbwd"), group_vs_fwdbwd=div("group", "fwdbwd"),
             norms_vs_loop=div("loop", "norms"), group_vs_loop=div("loop", "group"),
             norms_vs_loop_sq=div("loop_sq", "norms"),
             update_vs_grpo=div("update", "fwdbwd"), update_group_vs_grpo=div("update_group", "fwdbwd"),
             update_one_backward_vs_grpo=div("update_one_backward", "fwdbwd"),
             update_group_ckpt_vs_grpo_ckpt=div("update_group_ckpt", "fwdbwd_ckpt"),
             update_one_backward_vs_grpo_ckpt=div("update_one_backward", "fwdbwd_ckpt"),
             update_one_backward_ckpt_vs_grpo_ckpt=div("update_one_backward_ckpt", "fwdbwd_ckpt"))
    if mem:
        def m(a, b):
            x, y = (mem.get(a) or {}).get("peak_bytes", float("nan")), (mem.get(b) or {}).get("peak_bytes",
                                                                                             float("nan"))
            return x / y if y == y and y else float("nan")
        two, two_ckpt = ("update_group", "update_group_ckpt") if "update_group" in mem else ("group", "group_ckpt")
        r.update(peak_mem_norms_vs_grpo=m("norms", "fwdbwd"), peak_mem_group_vs_grpo=m("group", "fwdbwd"),
                 peak_mem_two_pass_vs_grpo=m(two, "fwdbwd"),
                 peak_mem_one_backward_vs_grpo=m("update_one_backward", "fwdbwd"),
                 peak_mem_two_pass_ckpt_vs_grpo_ckpt=m(two_ckpt, "fwdbwd_ckpt"),
                 peak_mem_one_backward_ckpt_vs_grpo_ckpt=m("update_one_backward_ckpt", "fwdbwd_ckpt"),
                 peak_mem_one_backward_vs_grpo_ckpt=m("update_one_backward", "fwdbwd_ckpt"))
        if two == "group":  # CPU: the two-pass update's peak is the larger of its two passes'
            peak = max(mem.get("group", {}).get("peak_bytes", float("nan")), mem["fwdbwd"]["peak_bytes"])
            r["peak_mem_two_pass_vs_grpo"] = peak / mem["fwdbwd"]["peak_bytes"]
    return r


def headline(row: dict, step: dict | None, default: str) -> list[tuple[str, float, str]]:
    """(key, value, where) of the JSON last line: the default mode's ratios under the historical keys, then each
    mode's under its own."""
    r, at = row["ratios"], f"{row['size']}, C={row['completion']}"
    s = step or {}
    st = f"{s.get('size')}, C={s.get('completion')}, whole RL step" if step else "n/a"
    two = dict(update=r["update_group_vs_grpo"] if r["update_group_vs_grpo"] == r["update_group_vs_grpo"]
               else r["update_vs_grpo"], mem=r.get("peak_mem_two_pass_vs_grpo", float("nan")),
               mem_ckpt=r.get("peak_mem_two_pass_ckpt_vs_grpo_ckpt", float("nan")),
               step=s.get("step_two_pass_vs_grpo", float("nan")))
    one = dict(update=r["update_one_backward_vs_grpo"], mem=r.get("peak_mem_one_backward_vs_grpo", float("nan")),
               mem_ckpt=r.get("peak_mem_one_backward_ckpt_vs_grpo_ckpt", float("nan")),
               step=s.get("step_one_backward_vs_grpo", float("nan")))
    d = one if default == "one_backward" else two
    auto = s.get("default", {})  # the trainer as users get it (one_backward=None), where measured
    auto_st = f"{s.get('size')}, C={s.get('completion')}, whole RL step, OBLRPOConfig defaults (one_backward=None)"
    return [
        ("default_mode", default, "the mode the historical keys below report (--default-mode)"),
        ("norms_vs_fwdbwd", r["norms_vs_fwdbwd"], at + ", per_sequence_grad_sq_norms / GRPO's forward+backward"),
        ("norms_vs_loop", r["norms_vs_loop"], at + ", naive per-sequence loop / per_sequence_grad_sq_norms"),
        ("update_vs_grpo", d["update"], at + f", the {default} update / GRPO's forward+backward"),
        ("peak_mem_vs_grpo", d["mem"], at + f", the {default} update vs GRPO's forward+backward, no checkpointing"),
        ("peak_mem_ckpt_vs_grpo_ckpt", d["mem_ckpt"], at + f", the {default} update vs GRPO's forward+backward, "
         "both under gradient checkpointing"),
        ("step_vs_grpo", d["step"], st + f", OBLRPOTrainer ({default}) / GRPOTrainer, TRL defaults"),
        ("update_two_pass_vs_grpo", two["update"], at + ", group norms pass + loss pass (two passes)"),
        ("update_one_backward_vs_grpo", one["update"], at + ", OBLRPOConfig(one_backward=True)'s update"),
        ("peak_mem_two_pass_vs_grpo", two["mem"], at + ", two passes, no checkpointing"),
        ("peak_mem_one_backward_vs_grpo", one["mem"], at + ", one_backward, no checkpointing"),
        ("peak_mem_two_pass_ckpt_vs_grpo_ckpt", two["mem_ckpt"], at + ", two passes, both checkpointed"),
        ("peak_mem_one_backward_ckpt_vs_grpo_ckpt", one["mem_ckpt"], at + ", one_backward, both checkpointed"),
        ("step_two_pass_vs_grpo", two["step"], st + ", two passes"),
        ("step_one_backward_vs_grpo", one["step"], st + ", one_backward"),
        ("step_peak_mem_vs_grpo", s.get(f"step_peak_mem_{default}_vs_grpo", float("nan")),
         st + f", peak RSS of the {default} trainer's process / GRPOTrainer's (checkpointed)"),
        ("step_default_vs_grpo", s.get("step_default_vs_grpo", float("nan")),
         auto_st + f" / GRPOTrainer, both checkpointed; it took {auto.get('mode', 'n/a')}"),
        ("step_peak_mem_default_vs_grpo", s.get("step_peak_mem_default_vs_grpo", float("nan")),
         auto_st + ", peak RSS / GRPOTrainer's, both checkpointed"),
        ("step_default_no_ckpt_vs_grpo_no_ckpt", s.get("step_default_no_ckpt_vs_grpo", float("nan")),
         auto_st.replace("defaults", "defaults without checkpointing") + " / GRPOTrainer without checkpointing; it took "
         + s.get("default_no_ckpt", {}).get("mode", "n/a")),
        ("step_peak_mem_default_no_ckpt_vs_grpo_no_ckpt", s.get("step_peak_mem_default_no_ckpt_vs_grpo", float("nan")),
         auto_st.replace("defaults", "defaults without checkpointing") + ", peak RSS / GRPOTrainer's, neither "
         "checkpointed"),
    ]


# ---------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes tiny+small, lengths 64 and 256 (~10 minutes)")
    parser.add_argument("--sizes", nargs="*", choices=SIZES, default=None,
                        help="built-in models (default: tiny small [medium]; none when --model is given)")
    parser.add_argument("--model", nargs="+", default=[], metavar="PATH_OR_NAME",
                        help="Hugging Face folder(s) or name(s) to measure as well (their weights)")
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (a multiple of 8, the group)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up round")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per configuration, soft cap")
    parser.add_argument("--fns", nargs="+", default=None, help="measured functions (default: by device)")
    parser.add_argument("--max-gram-gflop", type=float, default=None,
                        help="skip the group form (and its update) when its estimated Gram GFLOP exceed this")
    parser.add_argument("--step-configs", nargs="*", default=None,
                        help="size:length pairs for the RL step (a --model's PATH:length too)")
    parser.add_argument("--step-steps", type=int, default=3, help="timed RL steps per trainer (after 1 warm-up)")
    parser.add_argument("--step-kinds", nargs="+", choices=STEP_KINDS, default=None)
    parser.add_argument("--step-batch", type=int, default=16,
                        help="per_device_train_batch_size of the RL step (16 = 2 prompts x 8, so the SNR has 2 samples)")
    parser.add_argument("--default-mode", choices=("one_backward", "two_pass"), default="one_backward",
                        help="the mode whose ratios the historical headline keys report")
    parser.add_argument("--mem", choices=("all", "largest", "none"), default="all")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; default: the CPUs this process may use, less those the 1-minute load "
                        "average says other processes keep busy (at least 1): oversubscribed OpenMP threads that "
                        "spin-wait for a descheduled sibling make small ops 10-50x slower on a shared machine")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--tag", default=None, help="output file stem (default step_cost, or step_cost_full)")
    parser.add_argument("--mem-worker", nargs=5, metavar=("SIZE", "LEN", "BATCH", "PROMPT", "MODE"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--step-worker", nargs=5, metavar=("KIND", "SIZE", "LEN", "STEPS", "BATCH"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch % GROUP:
        parser.error(f"--batch must be a multiple of {GROUP}")
    quick = args.quick
    if args.sizes is None:
        args.sizes = [] if args.model else (["tiny", "small"] if quick else ["tiny", "small", "medium"])
    args.specs = list(args.sizes) + list(args.model)
    args.cap_medium = args.lengths is None  # the 32k-vocab model's Grams grow too slow past 1024 tokens
    args.lengths = args.lengths or ([64, 256] if quick else [64, 256, 1024, 2048])
    args.budget = args.budget or (25.0 if quick else 60.0)
    args.max_gram_gflop = args.max_gram_gflop or (2000.0 if quick else 1500.0)
    if args.step_configs is None:
        args.step_configs = ["tiny:256", "small:256"] if quick else ["tiny:64", "tiny:256", "tiny:1024", "small:64",
                                                                     "small:256"]
    args.step_kinds = args.step_kinds or (["grpo", "two_pass", "one_backward", "default"] if quick else list(STEP_KINDS))
    args.tag = args.tag or ("step_cost" if quick or args.out_dir != HERE / "results" else "step_cost_full")
    if args.threads is None:
        cpus = len(os.sched_getaffinity(0))
        args.threads = max(1, min(cpus, round(cpus - max(0.0, os.getloadavg()[0] - 0.5))))
    return args


def measure_config(spec, completion, args, device, dtype, largest, log, jsonl) -> dict:
    """One configuration: times (stage 1), accuracy, memory (stage 2), a profile of the largest."""
    model, _ = load_model(spec, device)
    total_params, _ = param_counts(model)
    batch = make_batch(model.config.vocab_size, args.batch, args.prompt_len, completion, device)
    length = args.prompt_len + completion
    est1 = flop_estimates(model, args.batch, length, completion, 1)
    est8 = flop_estimates(model, args.batch, length, completion, GROUP)
    names = list(args.fns or (FNS_CUDA if device.type == "cuda" else FNS_CPU))
    skipped = []
    if est8["gram_total"] > args.max_gram_gflop:
        names = [n for n in names if n not in GRAM_FNS]
        skipped.append(f"group form skipped (est. {est8['gram_total']:.0f} GFLOP of Gram products)")
    fns, times, outputs, guard = time_config(model, batch, device, dtype, names, args, log)
    guard.fns = guard.model = None
    skipped += [f"{k}: {v}" for k, v in guard.failed.items()]
    err, gerr = accuracy(outputs)
    finite = {k: bool(torch.isfinite(v).all()) for k, v in outputs.items() if isinstance(v, torch.Tensor)}
    if not all(finite.values()):
        skipped.append("non-finite outputs: " + ", ".join(k for k, ok in finite.items() if not ok))
    row = dict(size=label(spec), params=total_params, vocab=model.config.vocab_size, hidden=model.config.hidden_size,
               layers=model.config.num_hidden_layers, completion=completion, length=length, batch=args.batch,
               times=times, max_rel_err_norms=err, max_rel_err_group=gerr, est_gflop_sq=est1, est_gflop_group=est8,
               skipped=skipped)
    if not args.no_profile and (spec, completion) == largest:
        forms = [f for f in ("norms", "group") if f in times and times[f] == times[f]]
        row["profile"] = profile_norms(model, batch, device, dtype, fns, forms=forms)
    del model, fns, batch, outputs  # CPU: the memory subprocesses below must not share the machine with them
    if args.mem == "all" or (args.mem == "largest" and (spec, completion) == largest):
        row["memory"] = memory_config(spec, completion, args, guard, device, names)
    row["ratios"] = config_ratios(times, row.get("memory"))
    log_row(row, log)
    jsonl.write(json.dumps(row, default=float) + "\n")
    jsonl.flush()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def log_row(row, log):
    t, r = row["times"], row["ratios"]
    mb = lambda k: fmt((row.get("memory", {}).get(k) or {}).get("peak_bytes", float("nan")) / 2**20, ".0f")  # noqa
    log(f"{row['size']:12s} C={row['completion']:5d}: " + " ".join(f"{k} {fmt(v, '.3f')}s" for k, v in t.items())
        + f" | norms/fwdbwd {fmt(r['norms_vs_fwdbwd'])} loop/norms {fmt(r['norms_vs_loop'])} loop_sq/norms "
        f"{fmt(r['norms_vs_loop_sq'])} | update/GRPO: two-pass "
        f"{fmt(r['update_group_vs_grpo'])} one_backward {fmt(r['update_one_backward_vs_grpo'])}"
        + (f" | peak MB fwdbwd {mb('fwdbwd')} (ckpt {mb('fwdbwd_ckpt')}); mem/GRPO two-pass "
           f"{fmt(r.get('peak_mem_two_pass_vs_grpo'))} (ckpt {fmt(r.get('peak_mem_two_pass_ckpt_vs_grpo_ckpt'))}) "
           f"one_backward {fmt(r.get('peak_mem_one_backward_vs_grpo'))} "
           f"(ckpt {fmt(r.get('peak_mem_one_backward_ckpt_vs_grpo_ckpt'))})" if "memory" in row else "")
        + f" | rel err {fmt(row['max_rel_err_norms'], '.1e')}" + ("; " + "; ".join(row["skipped"]) if row["skipped"]
                                                                   else ""))


def main(argv=None):
    args = parse_args(argv)
    if args.mem_worker:
        spec, c, b, p, mode = args.mem_worker
        return mem_worker(spec, int(c), int(b), int(p), mode, args.threads)
    if args.step_worker:
        kind, spec, c, steps, b = args.step_worker
        return step_worker(kind, spec, int(c), int(steps), int(b), args.threads)

    # stage 0: machine and plan
    torch.set_num_threads(args.threads)
    device, dtype = device_and_dtype()
    log = Log()
    machine = machine_info(args.threads, torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "bf16 autocast" if dtype is not None else "float32")
    log(f"machine: {machine}")
    configs = [(s, c) for s in args.specs for c in args.lengths
               if not (s == "medium" and c > 1024 and args.cap_medium)]
    largest = configs[-1]
    log(f"batch {args.batch} sequences (group {GROUP}), prompt {args.prompt_len} tokens; configurations {configs}; "
        f"{args.repeats} timed rounds after 1 warm-up; default mode {args.default_mode}")

    # stage 1-2: the update's parts, memory, profile, per configuration (streamed to <tag>.jsonl as they finish)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / f"{args.tag}.jsonl", "w") as jsonl:
        rows = [measure_config(s, c, args, device, dtype, largest, log, jsonl) for s, c in configs]

    # stage 3: whole RL steps
    steps = []
    for spec_len in args.step_configs:
        spec, c = spec_len.rsplit(":", 1)
        steps.append(run_steps(spec, int(c), args, log))

    # stage 4: headline and files
    lines = headline(rows[-1], steps[-1] if steps else None, args.default_mode)
    head = {k: (round(v, 3) if isinstance(v, float) else v) for k, v, _ in lines}
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = dict(machine=machine, command="python benchmarks/step_cost.py " + " ".join((argv or sys.argv[1:])),
                  args=dict(quick=args.quick, specs=args.specs, lengths=args.lengths, batch=args.batch,
                            step_batch=args.step_batch, step_steps=args.step_steps, prompt_len=args.prompt_len,
                            repeats=args.repeats, group=GROUP, default_mode=args.default_mode),
                  rows=rows, steps=steps, headline=head, headline_where={k: w for k, _, w in lines},
                  elapsed_s=log.elapsed())
    js, md = write_results(args.out_dir, args.tag, result, render_markdown(result))
    log(f"wrote {md} and {js.name} in {log.elapsed():.0f}s")
    print(json.dumps(head))


# ------------------------------------------------------------------------------------------------------ markdown
def render_markdown(res: dict) -> str:
    m, a = res["machine"], res["args"]
    out = [f"# OBLR-PO step cost ({'quick' if a['quick'] else 'full'} run)", "",
           f"Generated by `{res['command'].strip()}` on {m['date']}.", machine_line(m),
           f"Batch {a['batch']} sequences of {a['prompt_len']} prompt + C completion tokens (random ids, 2 left-padded "
           f"prompts, 3 completions ending early), group size {a['group']}; median of {a['repeats']} interleaved "
           f"rounds after a warm-up round. Run time {res['elapsed_s']:.0f}s. Default mode (the historical keys): "
           f"**{a['default_mode']}**.", "", "## Headline", ""]
    out += md_table(["ratio", "value", "taken at"],
                    [[f"`{k}`", v if isinstance(v, str) else fmt(v), res["headline_where"][k]]
                     for k, v in res["headline"].items()])
    out += ["", "## Update: GRPO vs two passes vs one_backward, per configuration", "",
            "Times in seconds. `GRPO`: its loss pass (fused LM head, sum of completion log-probs, backward). "
            "`norms`: `per_sequence_grad_sq_norms`; `group`: `per_sequence_grad_inner_products(group_size=8)`; "
            "`loop`: one forward+backward per sequence (the naive peer). `two-pass`: the group norms pass then GRPO's "
            "loss pass, timed together; `one_backward`: `OBLRPOConfig(one_backward=True)`'s update. `ckpt`: under "
            "gradient checkpointing (TRL's default). Ratios are to GRPO's pass under the same checkpointing setting "
            "unless marked. Peak memory: " + _mem_method(res) + ".", ""]
    rows = []
    for r in res["rows"]:
        t, q, mem = r["times"], r["ratios"], r.get("memory") or {}
        mb = lambda k: fmt((mem.get(k) or {}).get("peak_bytes", float("nan")) / 2**20, ".0f")  # noqa: E731
        rows.append([f"{r['size']} (d={r['hidden']}, {r['layers']}L, V={r['vocab']})", f"{r['params'] / 1e6:.1f}M",
                     r["completion"], fmt(t.get("fwdbwd"), ".3f"), fmt(t.get("fwdbwd_ckpt"), ".3f"),
                     fmt(t.get("norms"), ".3f"), fmt(t.get("group"), ".3f"), fmt(t.get("loop"), ".3f"),
                     f"**{fmt(q['norms_vs_fwdbwd'])}**", f"**{fmt(q['norms_vs_loop'])}**",
                     fmt(q["update_group_vs_grpo"]), fmt(q["update_one_backward_vs_grpo"]),
                     fmt(q["update_group_ckpt_vs_grpo_ckpt"]), fmt(q["update_one_backward_ckpt_vs_grpo_ckpt"]),
                     mb("fwdbwd"), mb("fwdbwd_ckpt"), fmt(q.get("peak_mem_two_pass_vs_grpo")),
                     fmt(q.get("peak_mem_one_backward_vs_grpo")), fmt(q.get("peak_mem_two_pass_ckpt_vs_grpo_ckpt")),
                     fmt(q.get("peak_mem_one_backward_ckpt_vs_grpo_ckpt")),
                     fmt(r["max_rel_err_norms"], ".1e") + (" " + "; ".join(r["skipped"]) if r["skipped"] else "")])
    out += md_table(["model", "params", "C", "GRPO s", "GRPO ckpt s", "norms s", "group s", "loop s", "norms/GRPO",
                     "loop/norms", "time two-pass/GRPO", "time one_backward/GRPO", "time two-pass/GRPO, ckpt",
                     "time one_backward/GRPO, ckpt", "GRPO peak MB", "GRPO ckpt peak MB", "mem two-pass/GRPO",
                     "mem one_backward/GRPO", "mem two-pass/GRPO, ckpt", "mem one_backward/GRPO, ckpt",
                     "max rel err (norms vs loop); notes"], rows)
    if res["steps"]:
        out += ["", "## Whole RL step (generation included)", "",
                "`trl.GRPOTrainer` + `GRPOConfig` vs `OBLRPOTrainer` + `OBLRPOConfig` in each mode, same arguments "
                f"otherwise (per_device_train_batch_size {a['step_batch']}, num_generations {a['group']}, reward = "
                "count of '1', completions forced to exactly C tokens with `min_new_tokens`, TRL's defaults incl. "
                "gradient checkpointing unless `no_ckpt`). `default` is `OBLRPOConfig`'s `one_backward=None` (the "
                "automatic choice; 'mode taken' says which path it chose); ratios are to the GRPO step with the same "
                "checkpointing setting (`grpo_no_ckpt`'s to `grpo`'s). Each trainer runs in its own process, one after the "
                "other; median wall time of a step (`on_step_begin`..`on_step_end`) after one warm-up step; peak "
                "memory: peak RSS of the process above its RSS before `train()` (CPU).", ""]
        rows = []
        for s in res["steps"]:
            for kind in STEP_KINDS:
                k = s.get(kind)
                if not k:
                    continue
                if "failed" in k:
                    rows.append([s["size"], s["completion"], kind, "failed", "", "", "", "", "", ""])
                    continue
                rows.append([s["size"], s["completion"], kind, k.get("mode", ""), k["gradient_checkpointing"],
                             f"{k['step_s']:.2f}",
                             fmt(k["sections"].get("generate+score"), ".2f"), f"{k['peak_bytes'] / 2**20:.0f}",
                             "1.00" if kind == "grpo" else f"**{fmt(s.get(f'step_{kind}_vs_grpo'))}**",
                             "1.00" if kind == "grpo" else fmt(s.get(f"step_peak_mem_{kind}_vs_grpo"))])
        out += md_table(["model", "C", "trainer", "mode taken", "checkpointing", "step s", "generate+score s",
                         "peak MB", "step / GRPO", "peak mem / GRPO"], rows)
    profiled = [r for r in res["rows"] if r.get("profile")]
    for r in profiled:
        prof = r["profile"]
        pb, la = prof["plain_backbone"], prof["linear_alternatives"]
        out += ["", f"## Where the norms pass spends its time: {r['size']}, C={r['completion']}", "",
                "One call of each form under `torch.profiler` (operators by self time; the call's wall time "
                "includes the profiler's overhead). Plain backbone (no hooks): forward "
                f"{pb['forward']:.3f}s, backward to the weights {pb['backward']:.3f}s, backward to the embedding "
                f"output only {pb['backward_inputs_only']:.3f}s. Linear layers' share of the inner products, token "
                f"Grams vs materialized per-sequence gradients: sq form {la['gram_sq']:.3f}s vs "
                f"{la['materialize_sq']:.3f}s; group form {la['gram_group']:.3f}s vs {la['materialize_group']:.3f}s.",
                ""]
        for form in ("norms", "group"):
            if form in prof:
                p = prof[form]
                out += [f"`{form}` ({p['total']:.3f}s wall):", ""]
                out += md_table(["operator", "self s", "share of profiled"],
                                [[f"`{k}`", f"{v:.3f}", f"{100 * v / p['profiled_total']:.0f}%"]
                                 for k, v in p["ops"].items()]) + [""]
    out.append("")
    return "\n".join(out)


def _mem_method(res) -> str:
    for r in res["rows"]:
        for v in (r.get("memory") or {}).values():
            if "method" in v and not v["method"].startswith("failed"):
                where = ", ".join(f"{x['size']} C={x['completion']}" for x in res["rows"] if x.get("memory"))
                extra = (", one fresh subprocess per measurement, after building the model and batch and a short "
                         "warm-up call" if "RSS" in v["method"] else "")
                return v["method"] + extra + "; measured at " + where
    return "not measured"


if __name__ == "__main__":
    main()
