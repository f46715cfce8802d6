"""step_cost.py's measured calls: the model and batch of a configuration, every measured function (GRPO's loss pass,
the exact norms, the group form, the naive loop, each mode's update; the same under gradient checkpointing), timed
interleaved, and their accuracy against the naive loop."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from trl.trainer.utils import add_fused_lm_head

from harness import time_interleaved
from oblr_trl.demo.tiny import build_model, build_tokenizer
from oblr_trl.grad_norms import per_sequence_grad_inner_products, per_sequence_grad_sq_norms, per_sequence_grads

from .design import GROUP, SHAPES, SIZES, TINY


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
