"""What OBLR-PO's exact per-sequence gradient norms cost, next to GRPO's own work.

One run, same batch and model for every measurement of a configuration (model size x completion length):

1. ``norms_vs_fwdbwd``: ``per_sequence_grad_sq_norms`` vs one plain forward+backward of the batch (the sum of the
   completion log-probs through TRL's fused LM head, ``.backward()``: GRPO's policy-loss pass). Also the group form
   ``per_sequence_grad_inner_products(group_size=8)``, which is what ``OBLRPOTrainer`` runs by default
   (``snr_sample_unit="group"``).
   ``norms_vs_loop``: speed-up of the exact norms over the naive loop (one forward+backward per sequence).
2. ``update_vs_grpo``: (norms pass + GRPO's forward/backward) / GRPO's forward/backward, timed as one call.
3. ``peak_mem_vs_grpo``: peak memory of the norms pass / that of the forward+backward (each in a fresh subprocess;
   see ``--help`` and the output for the method).
4. ``step_vs_grpo``: a whole RL step (generation, scoring, norms, loss, optimizer): default ``OBLRPOConfig`` +
   ``OBLRPOTrainer`` vs plain ``GRPOConfig`` + ``trl.GRPOTrainer``, same arguments otherwise.
5. ``update_one_backward_vs_grpo`` and ``step_one_backward_vs_grpo``: the same with ``OBLRPOConfig(one_backward=True)``
   (norms and update from one forward/backward).

Timings are medians of repeats that interleave the measured functions (so slow drifts of a shared machine hit all of
them alike), after a warm-up round. Nothing is asserted. The last line printed is a JSON object with the headline
ratios. ``python benchmarks/step_cost.py --quick`` takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from oblr_trl.grad_norms import (  # noqa: E402
    per_sequence_grad_inner_products,
    per_sequence_grad_sq_norms,
    per_sequence_grads,
)
from oblr_trl.tiny import build_model, build_tokenizer  # noqa: E402

GROUP = 8
warnings.filterwarnings("ignore", category=FutureWarning)
SIZES = ("tiny", "small", "medium")


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


def make_model(size: str, tokenizer, device, fused: bool = True) -> nn.Module:
    """'tiny'/'small' from oblr_trl.tiny; 'medium': Qwen3 hidden 256, 4 layers, 32k vocab (tied), built inline."""
    if size in ("tiny", "small"):
        model = build_model(tokenizer, size=size, seed=0)
    elif size == "medium":
        config = Qwen3Config(vocab_size=32768, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                             tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    else:
        raise ValueError(size)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, 4096)
    model.train()  # dropout is 0 in these configs; train mode as in the trainer
    if fused:  # as GRPOTrainer patches it (the trainers below patch their own model)
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    return model.to(device)


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


# --------------------------------------------------------------------------------------------- measured functions
def completion_logp_sum(model, input_ids, attention_mask, completion_mask):
    """Sum of completion log-probs through TRL's fused LM head (what GRPO's loss pass runs)."""
    c = completion_mask.shape[1]
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-c] = -100
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return (out.log_probs[:, -c:] * completion_mask).sum()


def make_fns(model, batch, device, dtype):
    input_ids, attention_mask, completion_mask = batch
    params = [p for p in model.parameters() if p.requires_grad]

    def fwdbwd():
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
            if len(grads) == GROUP:
                stacked = torch.stack(grads)
                out.append(stacked @ stacked.T)
                grads = []
        return torch.stack(out)

    def update():  # OBLR-PO: the norms pass (sq form), then GRPO's loss forward/backward
        norms()
        fwdbwd()

    def update_group():  # OBLR-PO as OBLRPOTrainer runs it by default: group inner products, then the loss pass
        group()
        fwdbwd()

    scale = torch.linspace(-1.0, 1.0, input_ids.shape[0], device=device)

    def update_one_backward():  # OBLRPOConfig(one_backward=True), as the trainer runs it
        with autocast(device, dtype):  # one pass; layers narrower than their sequences keep per-sample gradients
            grads = per_sequence_grads(model, input_ids, attention_mask, completion_mask, materialize=True)
        grads.inner_products(1)  # the baseline's weights
        grads.accumulate_grad(scale, group_size=GROUP)  # weight gradients, and each group's ||H_q||^2 for the SNR
        model.zero_grad(set_to_none=True)

    return dict(fwdbwd=fwdbwd, norms=norms, group=group, loop=loop, update=update, update_group=update_group,
                update_one_backward=update_one_backward)


def time_interleaved(fns: dict, names: list[str], repeats: int, device, budget_s: float, log) -> dict:
    """Median seconds of each function; round 0 is a warm-up. Rounds stop early (>= 1 timed) past ``budget_s``."""
    times, warm = defaultdict(list), {}
    outputs = {}
    start = time.perf_counter()
    for rnd in range(repeats + 1):
        if rnd == 1 and time.perf_counter() - start > budget_s:
            log(f"    (warm-up round alone took {time.perf_counter() - start:.0f}s: its times are the measurement)")
            return warm, outputs
        for name in names:
            sync(device)
            t0 = time.perf_counter()
            result = fns[name]()
            sync(device)
            dt = time.perf_counter() - t0
            if rnd == 0:
                outputs[name] = result
                warm[name] = dt
            else:
                times[name].append(dt)
        if rnd >= 1 and time.perf_counter() - start > budget_s and rnd < repeats:
            log(f"    (time budget reached after {rnd} timed round(s))")
            break
    return {name: statistics.median(v) for name, v in times.items()}, outputs


# ------------------------------------------------------------------------------------------------ flop estimates
def flop_estimates(model, batch: int, length: int, completion: int, group: int) -> dict:
    """Rough GFLOP of one forward+backward and of the ghost-norm Gram products (bmm only), from the shapes."""
    lm = model
    cfg = lm.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    linears = [m for n, m in lm.model.named_modules() if isinstance(m, nn.Linear)]
    lin_params = sum(m.in_features * m.out_features for m in linears)
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
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
@contextmanager
def engine_profile(model):
    """Time the parts of the norms pass by wrapping the engine's module-level helpers (this process only)."""
    import oblr_trl.grad_norms.engine as E
    from oblr_trl.grad_norms.factors import Materialized, OneHot, SoftmaxDelta

    acc = defaultdict(float)
    saved = (E._lm_head_terms, E.block_inner_products, E.find_rule, torch.autograd.grad)

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            acc[name] += time.perf_counter() - t0
            return r
        return wrapper

    def classify(u, v):
        if isinstance(u, Materialized):
            return "Grams: materialized small params (norm weights)"
        kinds = {type(u.left), type(v.left)}
        if kinds == {SoftmaxDelta}:
            return "Grams: LM head (softmax-delta x softmax-delta, vocab chunks)"
        if SoftmaxDelta in kinds:
            return "Grams: LM head x embedding cross (tied)"
        if OneHot in kinds:
            return "Grams: input embedding"
        return "Grams: linear layers (T^2 x (d_in + d_out))"

    def bip(u, v, k):
        t0 = time.perf_counter()
        r = saved[1](u, v, k)
        acc[classify(u, v)] += time.perf_counter() - t0
        return r

    def find_rule(module):
        rule = saved[2](module)
        return None if rule is None else timed("rules (per-module factors)", rule)

    fwd_t0 = {}
    h1 = model.model.register_forward_pre_hook(lambda m, a, k: fwd_t0.__setitem__("t", time.perf_counter()),
                                               with_kwargs=True)
    h2 = model.model.register_forward_hook(
        lambda m, a, o: acc.__setitem__("backbone forward (with capture hooks)",
                                        acc["backbone forward (with capture hooks)"]
                                        + time.perf_counter() - fwd_t0["t"]))
    E._lm_head_terms = timed("LM head terms (lse, dlogp/dh; 2 vocab passes)", saved[0])
    E.block_inner_products = bip
    E.find_rule = find_rule
    torch.autograd.grad = timed("backbone backward (autograd.grad, with grad hooks)", saved[3])
    try:
        yield acc
    finally:
        E._lm_head_terms, E.block_inner_products, E.find_rule, torch.autograd.grad = saved
        h1.remove()
        h2.remove()


def profile_norms(model, batch, device, dtype, fns, forms=("norms", "group")) -> dict:
    """Breakdown (seconds) of one sq-form and one group-form norms pass, plus a plain backbone forward/backward."""
    input_ids, attention_mask, _ = batch
    result = {}
    for name in forms:
        fns[name]()  # warm
        with engine_profile(model) as acc:
            t0 = time.perf_counter()
            fns[name]()
            total = time.perf_counter() - t0
        parts = dict(acc)
        parts["other (Python, masks, allocation)"] = total - sum(parts.values())
        result[name] = dict(total=total, parts=parts)
    # the same backbone forward and backward without hooks, for the hooks' overhead
    with autocast(device, dtype):
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        t0 = time.perf_counter()
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        t1 = time.perf_counter()
    params = [p for p in model.model.parameters() if p.requires_grad]
    torch.autograd.grad(hidden, params, grad_outputs=torch.ones_like(hidden), allow_unused=True)
    t2 = time.perf_counter()
    # backward to the embedding output only: every module's output gradient, no weight gradient
    with autocast(device, dtype):
        embeds = model.model.embed_tokens(input_ids).detach().requires_grad_()
        hidden = model.model(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False).last_hidden_state
    t3 = time.perf_counter()
    torch.autograd.grad(hidden, [embeds], grad_outputs=torch.ones_like(hidden))
    t4 = time.perf_counter()
    result["plain_backbone"] = dict(forward=t1 - t0, backward=t2 - t1, backward_inputs_only=t4 - t3)
    result["linear_alternatives"] = linear_alternatives(model, input_ids.shape[0], input_ids.shape[1], device)
    return result


def linear_alternatives(model, batch: int, length: int, device) -> dict:
    """Seconds, summed over the backbone's nn.Linear layers, of their share of the per-sequence (G=1) and group (G=8)
    inner products by token Grams (what the engine does) vs by materializing each sequence's weight gradient
    ``sum_t g_t x_t^T`` (``(B, d_out, d_in)``, then the G x G Gram of the flattened gradients). Random factors of
    the layers' shapes; one warm-up call per shape."""
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


def mem_worker(size: str, completion: int, batch: int, prompt: int, mode: str, threads: int) -> None:
    """Run in a fresh process: peak memory of one call of ``mode`` above the baseline after building everything."""
    torch.set_num_threads(threads)
    device, dtype = device_and_dtype()
    tokenizer = build_tokenizer()
    model = make_model(size, tokenizer, device)
    if mode.endswith("_ckpt"):  # under TRL's default gradient checkpointing (non-reentrant)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mode = mode[: -len("_ckpt")]
    data = make_batch(model.config.vocab_size, batch, prompt, completion, device)
    fns = make_fns(model, data, device, dtype)
    # load kernels/libraries on a short batch first, so one-time initialisation does not count
    make_fns(model, make_batch(model.config.vocab_size, GROUP, 8, 8, device), device, dtype)[mode]()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fns[mode]()
        torch.cuda.synchronize()
        peak, method = torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated above allocated"
    else:
        import gc
        import resource

        gc.collect()
        try:  # reset the process's peak RSS (VmHWM) to its current RSS
            Path("/proc/self/clear_refs").write_text("5")
            base = _status_kb("VmRSS") * 1024
            fns[mode]()
            peak, method = _status_kb("VmHWM") * 1024 - base, "peak RSS (VmHWM, reset via clear_refs) above RSS"
        except OSError:
            base = _status_kb("VmRSS") * 1024
            fns[mode]()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            method = "ru_maxrss above RSS"
    print(json.dumps(dict(peak_bytes=int(peak), method=method)))


def measure_memory(size, completion, batch, prompt, mode, threads) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mem-worker", size, str(completion), str(batch),
           str(prompt), mode, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return dict(peak_bytes=float("nan"), method=f"failed: {proc.stderr.strip()[-300:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------------- RL step
def reward_ones(completions, **kwargs):
    return [float(c[0]["content"].count("1")) for c in completions]


def run_trainer(kind: str, size: str, completion: int, steps: int, batch: int, device) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    tokenizer = build_tokenizer()
    model = make_model(size, tokenizer, device, fused=False) if size != "medium" else None
    if model is None:
        raise ValueError("the RL step needs the character tokenizer's vocabulary: use size tiny or small")
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Count the ones in {i:012d} + {3 * i:012d}"}]} for i in range(256)]
    )
    common = dict(output_dir=f"/tmp/oblr-step-cost-{kind}", per_device_train_batch_size=batch,
                  num_generations=GROUP, max_completion_length=completion, max_steps=steps + 1, logging_steps=1,
                  learning_rate=1e-5, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                  use_cpu=device.type != "cuda", bf16=device.type == "cuda",
                  generation_kwargs={"min_new_tokens": completion})  # every completion is exactly max length
    sections = defaultdict(float)

    def timed_method(cls, name, label):
        original = getattr(cls, name)

        def wrapper(self, *a, **k):
            t0 = time.perf_counter()
            r = original(self, *a, **k)
            sections[label] += time.perf_counter() - t0
            return r
        return wrapper

    if kind == "grpo":
        class Trainer(GRPOTrainer):
            _generate_and_score_completions = timed_method(GRPOTrainer, "_generate_and_score_completions",
                                                           "generate+score (incl. norms)")
        args = GRPOConfig(**common)
    else:
        class Trainer(OBLRPOTrainer):
            _generate_and_score_completions = timed_method(OBLRPOTrainer, "_generate_and_score_completions",
                                                           "generate+score (incl. norms)")
            _local_grad_products = timed_method(OBLRPOTrainer, "_local_grad_products", "norms pass")
        args = OBLRPOConfig(**common, one_backward=kind == "oblr_one_backward")

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
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # keep the benchmark's output to one line per configuration
    trainer.train()
    timed = step_times[1:]  # step 0 is the warm-up
    med = {k: statistics.median(s.get(k, 0.0) for s in step_sections[1:]) for k in step_sections[-1]}
    return dict(step_s=statistics.median(timed), steps=len(timed), sections=med,
                gradient_checkpointing=bool(args.gradient_checkpointing))


# ---------------------------------------------------------------------------------------------------------- main
def fmt(x, spec=".2f"):
    return "n/a" if x is None or x != x else format(x, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes tiny+small, lengths 64 and 256 (a few minutes)")
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=None)
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (a multiple of 8, the group)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds after the warm-up round")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per configuration, soft cap")
    parser.add_argument("--max-gram-gflop", type=float, default=None,
                        help="skip the group form (and its update) when its estimated Gram GFLOP exceed this")
    parser.add_argument("--step-configs", nargs="*", default=None, help="size:length pairs for the RL step")
    parser.add_argument("--step-steps", type=int, default=None, help="timed RL steps per trainer (after 1 warm-up)")
    parser.add_argument("--mem", choices=("all", "largest", "none"), default=None)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; default: the CPUs this process may use, less those the 1-minute load "
                        "average says other processes keep busy (at least 1): oversubscribed OpenMP threads that "
                        "spin-wait for a descheduled sibling make small ops 10-50x slower on a shared machine")
    parser.add_argument("--step-batch", type=int, default=16,
                        help="per_device_train_batch_size of the RL step (16 = 2 prompts x 8, so the SNR has 2 samples)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--tag", default=None, help="output file stem (default step_cost, or step_cost_full)")
    parser.add_argument("--mem-worker", nargs=5, metavar=("SIZE", "LEN", "BATCH", "PROMPT", "MODE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.mem_worker:
        size, c, b, p, mode = args.mem_worker
        args.threads = args.threads or 1
        mem_worker(size, int(c), int(b), int(p), mode, args.threads)
        return

    quick = args.quick
    sizes = args.sizes or (["tiny", "small"] if quick else ["tiny", "small", "medium"])
    lengths = args.lengths or ([64, 256] if quick else [64, 256, 1024, 2048])
    repeats = args.repeats or (3 if quick else 3)
    budget = args.budget or (25.0 if quick else 60.0)
    max_gram = args.max_gram_gflop or (2000.0 if quick else 1500.0)
    mem_mode = args.mem or "all"
    step_steps = args.step_steps or (3 if quick else 3)
    if args.step_configs is None:
        step_configs = ["tiny:256", "small:256"] if quick else ["tiny:64", "tiny:256", "tiny:1024", "small:64",
                                                                "small:256"]
    else:
        step_configs = args.step_configs
    tag = args.tag or ("step_cost" if quick or args.out_dir != HERE / "results" else "step_cost_full")
    if args.batch % GROUP:
        parser.error(f"--batch must be a multiple of {GROUP}")

    cpus = len(os.sched_getaffinity(0))
    if args.threads is None:
        args.threads = max(1, min(cpus, round(cpus - max(0.0, os.getloadavg()[0] - 0.5))))
    torch.set_num_threads(args.threads)
    device, dtype = device_and_dtype()
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    machine = dict(
        cpus=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
        python=platform.python_version(), platform=platform.platform(),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        precision="bf16 autocast" if dtype is not None else "float32",
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )
    import transformers
    import trl
    machine.update(transformers=transformers.__version__, trl=trl.__version__)
    log(f"machine: {machine}")
    log(f"batch {args.batch} sequences (group {GROUP}), prompt {args.prompt_len} tokens; sizes {sizes}; "
        f"completion lengths {lengths}; {repeats} timed rounds after 1 warm-up")

    tokenizer = build_tokenizer()
    rows, profiles = [], {}
    max_len = {"medium": 1024} if args.lengths is None else {}  # the 32k-vocab model's Grams grow too slow past 1024
    configs = [(s, c) for s in sizes for c in lengths if c <= max_len.get(s, c)]
    largest = configs[-1]
    for size, completion in configs:
        model = make_model(size, tokenizer, device)
        total_params, nonhead = param_counts(model)
        batch = make_batch(model.config.vocab_size, args.batch, args.prompt_len, completion, device)
        length = args.prompt_len + completion
        est1 = flop_estimates(model, args.batch, length, completion, 1)
        est8 = flop_estimates(model, args.batch, length, completion, GROUP)
        fns = make_fns(model, batch, device, dtype)
        names = ["fwdbwd", "norms", "update", "loop", "update_one_backward"]  # one_backward: no group Grams
        skipped = []
        if est8["gram_total"] <= max_gram:
            names += ["group", "update_group"]
        else:
            skipped.append(f"group form skipped (est. {est8['gram_total']:.0f} GFLOP of Gram products)")
        times, outputs = time_interleaved(fns, names, repeats, device, budget, log)
        ref = outputs["loop"]
        exact = outputs["norms"]
        diag = torch.diagonal(ref, dim1=1, dim2=2).reshape(-1)
        err = ((exact.double() - diag.double()).abs() / diag.double().abs().clamp_min(1e-30)).max().item()
        if "group" in outputs:
            gerr = ((outputs["group"].double() - ref.double()).abs().max() / ref.double().abs().max()).item()
        else:
            gerr = float("nan")
        row = dict(size=size, params=total_params, vocab=model.config.vocab_size, hidden=model.config.hidden_size,
                   layers=model.config.num_hidden_layers, completion=completion, length=length, batch=args.batch,
                   times=times, max_rel_err_norms=err, max_rel_err_group=gerr, est_gflop_sq=est1,
                   est_gflop_group=est8, skipped=skipped)
        t = times
        row["ratios"] = dict(
            norms_vs_fwdbwd=t["norms"] / t["fwdbwd"],
            group_vs_fwdbwd=t["group"] / t["fwdbwd"] if "group" in t else float("nan"),
            norms_vs_loop=t["loop"] / t["norms"],
            group_vs_loop=t["loop"] / t["group"] if "group" in t else float("nan"),
            update_vs_grpo=t["update"] / t["fwdbwd"],
            update_group_vs_grpo=t["update_group"] / t["fwdbwd"] if "update_group" in t else float("nan"),
            update_one_backward_vs_grpo=(t["update_one_backward"] / t["fwdbwd"] if "update_one_backward" in t
                                         else float("nan")),
        )
        if mem_mode == "all" or (mem_mode == "largest" and (size, completion) == largest):
            mem = {}
            for mode in ("fwdbwd", "norms", "update_one_backward") + (("group",) if "group" in t else ()):
                mem[mode] = measure_memory(size, completion, args.batch, args.prompt_len, mode, args.threads)
            row["memory"] = mem
            base = mem["fwdbwd"]["peak_bytes"]
            row["ratios"]["peak_mem_vs_grpo"] = mem["norms"]["peak_bytes"] / base
            row["ratios"]["peak_mem_group_vs_grpo"] = (mem["group"]["peak_bytes"] / base) if "group" in mem \
                else float("nan")
            row["ratios"]["peak_mem_one_backward_vs_grpo"] = (
                mem["update_one_backward"]["peak_bytes"] / base if "update_one_backward" in mem else float("nan"))
            # under gradient checkpointing, as the trainer runs by default (TRL's gradient_checkpointing=True)
            for mode in ("fwdbwd_ckpt", "update_one_backward_ckpt") + (("group_ckpt",) if "group" in t else ()):
                mem[mode] = measure_memory(size, completion, args.batch, args.prompt_len, mode, args.threads)
            base_ckpt = mem["fwdbwd_ckpt"]["peak_bytes"]
            row["ratios"]["peak_mem_ckpt_vs_grpo_ckpt"] = (
                mem["group_ckpt"]["peak_bytes"] / base_ckpt if "group_ckpt" in mem else float("nan"))
            row["ratios"]["peak_mem_one_backward_ckpt_vs_grpo_ckpt"] = (
                mem["update_one_backward_ckpt"]["peak_bytes"] / base_ckpt)
        r = row["ratios"]
        log(f"{size:6s} C={completion:5d}: fwdbwd {t['fwdbwd']:.3f}s norms {t['norms']:.3f}s "
            f"group {t.get('group', float('nan')):.3f}s loop {t['loop']:.3f}s | norms/fwdbwd "
            f"{r['norms_vs_fwdbwd']:.2f} group/fwdbwd {fmt(r['group_vs_fwdbwd'])} loop/norms {r['norms_vs_loop']:.2f} "
            f"update/grpo {r['update_vs_grpo']:.2f} (group {fmt(r['update_group_vs_grpo'])})"
            + (f" peak mem norms/fwdbwd {r['peak_mem_vs_grpo']:.2f} (group {fmt(r['peak_mem_group_vs_grpo'])})"
               if "peak_mem_vs_grpo" in r else "")
            + f" | rel err {err:.1e}" + ("; " + "; ".join(skipped) if skipped else ""))
        if not args.no_profile and ((size, completion) == largest or (not quick and completion == max(c for s2, c in configs if s2 == size))):
            prof = profile_norms(model, batch, device, dtype, fns, forms=("norms", "group") if "group" in t
                                 else ("norms",))
            profiles[f"{size}:{completion}"] = prof
            form = "group" if "group" in prof else "norms"
            top = sorted(prof[form]["parts"].items(), key=lambda kv: -kv[1])[:3]
            log(f"    profile ({form} form, {prof[form]['total']:.2f}s): "
                + ", ".join(f"{k} {v:.2f}s" for k, v in top))
        rows.append(row)
        del model, fns, batch, outputs

    steps = []
    for spec in step_configs:
        size, completion = spec.split(":")
        completion = int(completion)
        res = {}
        for kind in ("grpo", "oblr", "oblr_one_backward"):
            res[kind] = run_trainer(kind, size, completion, step_steps, args.step_batch, device)
        ratio = res["oblr"]["step_s"] / res["grpo"]["step_s"]
        ratio_one = res["oblr_one_backward"]["step_s"] / res["grpo"]["step_s"]
        steps.append(dict(size=size, completion=completion, grpo=res["grpo"], oblr=res["oblr"],
                          oblr_one_backward=res["oblr_one_backward"], step_vs_grpo=ratio,
                          step_one_backward_vs_grpo=ratio_one))
        norms_s = res["oblr"]["sections"].get("norms pass", float("nan"))
        log(f"RL step {size} C={completion}: GRPOTrainer {res['grpo']['step_s']:.2f}s, OBLRPOTrainer "
            f"{res['oblr']['step_s']:.2f}s (norms pass {norms_s:.2f}s) -> {ratio:.2f}x; one_backward "
            f"{res['oblr_one_backward']['step_s']:.2f}s -> {ratio_one:.2f}x")

    head_row = next(r for r in rows if (r["size"], r["completion"]) == largest)
    head_step = steps[-1] if steps else None
    headline = dict(
        norms_vs_fwdbwd=round(head_row["ratios"]["norms_vs_fwdbwd"], 3),
        norms_vs_loop=round(head_row["ratios"]["norms_vs_loop"], 3),
        update_vs_grpo=round(head_row["ratios"]["update_group_vs_grpo"]
                             if head_row["ratios"]["update_group_vs_grpo"] == head_row["ratios"]["update_group_vs_grpo"]
                             else head_row["ratios"]["update_vs_grpo"], 3),
        peak_mem_vs_grpo=round(head_row["ratios"].get("peak_mem_vs_grpo", float("nan")), 3),
        step_vs_grpo=round(head_step["step_vs_grpo"], 3) if head_step else float("nan"),
        update_one_backward_vs_grpo=round(head_row["ratios"]["update_one_backward_vs_grpo"], 3),
        peak_mem_one_backward_vs_grpo=round(head_row["ratios"].get("peak_mem_one_backward_vs_grpo", float("nan")), 3),
        peak_mem_ckpt_vs_grpo_ckpt=round(head_row["ratios"].get("peak_mem_ckpt_vs_grpo_ckpt", float("nan")), 3),
        peak_mem_one_backward_ckpt_vs_grpo_ckpt=round(
            head_row["ratios"].get("peak_mem_one_backward_ckpt_vs_grpo_ckpt", float("nan")), 3),
        step_one_backward_vs_grpo=round(head_step["step_one_backward_vs_grpo"], 3) if head_step else float("nan"),
    )
    where = dict(
        norms_vs_fwdbwd=f"{largest[0]}, C={largest[1]}, per_sequence_grad_sq_norms",
        norms_vs_loop=f"{largest[0]}, C={largest[1]}",
        update_vs_grpo=f"{largest[0]}, C={largest[1]}, group form (group_size={GROUP}, the trainer's default)",
        peak_mem_vs_grpo=f"{largest[0]}, C={largest[1]}, per_sequence_grad_sq_norms",
        step_vs_grpo=(f"{head_step['size']}, C={head_step['completion']}, {step_steps} steps" if head_step else "n/a"),
        update_one_backward_vs_grpo=f"{largest[0]}, C={largest[1]}, OBLRPOConfig(one_backward=True): one pass, "
        "norms, weight gradients and group norms formed",
        peak_mem_one_backward_vs_grpo=f"{largest[0]}, C={largest[1]}, the one_backward update",
        peak_mem_ckpt_vs_grpo_ckpt=f"{largest[0]}, C={largest[1]}, group form vs fwdbwd, both under gradient "
        "checkpointing",
        peak_mem_one_backward_ckpt_vs_grpo_ckpt=f"{largest[0]}, C={largest[1]}, the one_backward update vs fwdbwd, "
        "both under gradient checkpointing (TRL's default)",
        step_one_backward_vs_grpo=(f"{head_step['size']}, C={head_step['completion']}, {step_steps} steps, "
                                   "OBLRPOConfig(one_backward=True)" if head_step else "n/a"),
    )
    elapsed = time.perf_counter() - t_start
    machine["loadavg_start"] = [round(x, 2) for x in load_start]
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = dict(machine=machine, args=dict(quick=quick, sizes=sizes, lengths=lengths, batch=args.batch,
                                             step_batch=args.step_batch, step_steps=step_steps,
                                             prompt_len=args.prompt_len, repeats=repeats, group=GROUP),
                  rows=rows, steps=steps, profiles=profiles, headline=headline, headline_where=where,
                  elapsed_s=elapsed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{tag}.json").write_text(json.dumps(result, indent=1, default=float))
    (args.out_dir / f"{tag}.md").write_text(render_markdown(result, quick))
    log(f"wrote {args.out_dir / (tag + '.md')} and {tag}.json in {elapsed:.0f}s")
    log("headline taken at: " + json.dumps(where))
    print(json.dumps(headline))


def render_markdown(res: dict, quick: bool) -> str:
    m = res["machine"]
    a = res["args"]
    out = [
        f"# OBLR-PO step cost ({'quick' if quick else 'full'} run)",
        "",
        f"Generated by `python benchmarks/step_cost.py{' --quick' if quick else ''}` on {m['date']}.",
        f"Machine: {m['platform']}, {m['cpus']} CPUs ({m['threads']} torch threads), device {m['device']}, "
        f"{m['precision']}; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"trl {m['trl']}. Load average at start {m['loadavg_start']}, at end {m['loadavg_end']} "
        "(other processes shared the CPUs if it exceeds the CPU count).",
        f"Batch {a['batch']} sequences of {a['prompt_len']} prompt + C completion tokens (random ids, 2 left-padded "
        f"prompts, 3 completions ending early), group size {a['group']}; median of {a['repeats']} interleaved rounds "
        f"after a warm-up round. Run time {res['elapsed_s']:.0f}s.",
        "",
        "## Headline",
        "",
        "| ratio | value | taken at |",
        "|---|---|---|",
    ]
    for k, v in res["headline"].items():
        out.append(f"| `{k}` | {fmt(v)} | {res['headline_where'][k]} |")
    out += [
        "",
        "## Norms pass, update and memory vs GRPO's forward+backward",
        "",
        "Times in seconds. `fwdbwd`: GRPO's loss pass (fused LM head, sum of completion log-probs, backward). "
        "`norms`: `per_sequence_grad_sq_norms`. `group`: `per_sequence_grad_inner_products(group_size=8)` (what "
        "`OBLRPOTrainer` runs by default). `loop`: one forward+backward per sequence. `update`: norms pass + fwdbwd, "
        "timed together. `one bwd`: `OBLRPOConfig(one_backward=True)`'s update: one forward/backward to the layers' "
        "inputs (layers narrower than their sequences form and keep per-sample gradients as theirs arrive), the norms, "
        "then every weight gradient formed from what was kept, with each group's gradient norm. Peak memory: " + _mem_method(res) + ".",
        "",
        "| model | params | vocab | C | fwdbwd | norms | group | loop | norms/fwdbwd | group/fwdbwd | loop/norms "
        "| loop/group | update/grpo (sq) | update/grpo (group) | update/grpo (one bwd) | peak mem fwdbwd | norms/fwdbwd mem | group/fwdbwd mem | one bwd/fwdbwd mem | group/fwdbwd mem, both ckpt | one bwd/fwdbwd mem, both ckpt "
        "| est. GFLOP fwdbwd / Gram (sq) / Gram (group) | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        t, q, mem = r["times"], r["ratios"], r.get("memory")
        base_mb = mem["fwdbwd"]["peak_bytes"] / 2**20 if mem else float("nan")
        out.append(
            f"| {r['size']} (d={r['hidden']}, {r['layers']}L) | {r['params'] / 1e6:.2f}M | {r['vocab']} | "
            f"{r['completion']} | {t['fwdbwd']:.3f} | {t['norms']:.3f} | {fmt(t.get('group'), '.3f')} | "
            f"{t['loop']:.3f} | **{q['norms_vs_fwdbwd']:.2f}** | {fmt(q['group_vs_fwdbwd'])} | "
            f"**{q['norms_vs_loop']:.2f}** | {fmt(q['group_vs_loop'])} | {q['update_vs_grpo']:.2f} | "
            f"**{fmt(q['update_group_vs_grpo'])}** | **{fmt(q.get('update_one_backward_vs_grpo'))}** | "
            f"{fmt(base_mb, '.0f')} MB | "
            f"**{fmt(q.get('peak_mem_vs_grpo'))}** | {fmt(q.get('peak_mem_group_vs_grpo'))} | "
            f"{fmt(q.get('peak_mem_one_backward_vs_grpo'))} | {fmt(q.get('peak_mem_ckpt_vs_grpo_ckpt'))} | "
            f"{fmt(q.get('peak_mem_one_backward_ckpt_vs_grpo_ckpt'))} | "
            f"{r['est_gflop_sq']['fwdbwd']:.1f} / {r['est_gflop_sq']['gram_total']:.1f} / "
            f"{r['est_gflop_group']['gram_total']:.1f} | {r['max_rel_err_norms']:.1e} |"
            + (" " + "; ".join(r["skipped"]) if r["skipped"] else "")
        )
    if res["steps"]:
        out += [
            "",
            "## Whole RL step (generation included)",
            "",
            "`trl.GRPOTrainer` + `GRPOConfig` vs `OBLRPOTrainer` + default `OBLRPOConfig`, same arguments otherwise "
            f"(per_device_train_batch_size {a['step_batch']}, num_generations {a['group']}, reward = count of '1', completions forced to exactly "
            "C tokens with `min_new_tokens`, TRL's defaults incl. gradient checkpointing, float32 on CPU). Median "
            "wall time of a step (`on_step_begin`..`on_step_end`) after one warm-up step.",
            "",
            "| model | C | steps | GRPO step s | GRPO generate+score s | OBLR-PO step s | OBLR-PO generate+score s | "
            "of which norms pass s | step_vs_grpo | OBLR-PO one_backward step s | step_one_backward_vs_grpo |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in res["steps"]:
            g, o = s["grpo"], s["oblr"]
            out.append(
                f"| {s['size']} | {s['completion']} | {o['steps']} | {g['step_s']:.2f} | "
                f"{g['sections'].get('generate+score (incl. norms)', float('nan')):.2f} | {o['step_s']:.2f} | "
                f"{o['sections'].get('generate+score (incl. norms)', float('nan')):.2f} | "
                f"{o['sections'].get('norms pass', float('nan')):.2f} | **{s['step_vs_grpo']:.2f}** | "
                f"{s['oblr_one_backward']['step_s']:.2f} | **{s['step_one_backward_vs_grpo']:.2f}** |"
            )
    if res["profiles"]:
        out += ["", "## Where the norms pass spends its time", "",
                "One call each, the engine's helpers wrapped with timers (this process only). `plain backbone`: "
                "the same backbone forward / backward without capture hooks, for the hooks' overhead. The norms are "
                "streamed: single-use layers' rules and Grams run inside the backward's gradient hooks, so they are "
                "counted in the backward's row and in their own rows; `other` (the remainder) is then negative.", ""]
        for key, prof in res["profiles"].items():
            pb, la = prof["plain_backbone"], prof["linear_alternatives"]
            out += [f"### {key.replace(':', ', C=')}", "",
                    f"Plain backbone (no hooks): forward {pb['forward']:.3f}s, backward to the weights "
                    f"{pb['backward']:.3f}s, backward to the embedding output only (all module output gradients, no "
                    f"weight gradients) {pb['backward_inputs_only']:.3f}s.",
                    f"Linear layers' share of the inner products, token Grams (the engine) vs materialized per-sequence "
                    f"weight gradients: sq form {la['gram_sq']:.3f}s vs {la['materialize_sq']:.3f}s; group form "
                    f"{la['gram_group']:.3f}s vs {la['materialize_group']:.3f}s.", "",
                    "| part | sq form s | share | group form s | share |", "|---|---|---|---|---|"]
            grp = prof.get("group", dict(total=float("nan"), parts={}))
            parts = sorted(set(prof["norms"]["parts"]) | set(grp["parts"]),
                           key=lambda k: -grp["parts"].get(k, prof["norms"]["parts"].get(k, 0.0)))
            for p in parts:
                s1, s8 = prof["norms"]["parts"].get(p, 0.0), grp["parts"].get(p, float("nan"))
                out.append(f"| {p} | {s1:.3f} | {100 * s1 / prof['norms']['total']:.0f}% | {fmt(s8, '.3f')} | "
                           f"{fmt(100 * s8 / grp['total'], '.0f')}% |")
            out.append(f"| **total** | {prof['norms']['total']:.3f} | 100% | {fmt(grp['total'], '.3f')} | 100% |")
            out.append("")
    out.append("")
    return "\n".join(out)


def _mem_method(res) -> str:
    for r in res["rows"]:
        if r.get("memory"):
            return (r["memory"]["fwdbwd"]["method"] + ", one fresh subprocess per measurement, after building the "
                    "model and batch and a short warm-up call; measured at " + ", ".join(
                        f"{x['size']} C={x['completion']}" for x in res["rows"] if x.get("memory")))
    return "not measured"


if __name__ == "__main__":
    main()
