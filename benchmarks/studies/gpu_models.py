"""The models and trainers of ``benchmarks/bench_gpu.py`` (issues 47 and 56): random Qwen3s of the real models'
widths and depths (seeded, so that the trainers of a paired row start from identical copies), the QLoRA row's 4-bit
base and its exactness check, and GRPOTrainer's and OBLRPOTrainer's configs and construction as the rows run them."""

from __future__ import annotations

import atexit
import functools
import gc
import shutil
import tempfile

import torch

from studies.prepared import prepared_batch

GROUP, PROMPT = 8, 32
QWEN3 = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936)
WIDTHS = {
    "Qwen3-0.6B": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_hidden_layers=28),
    "Qwen3-1.7B": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_hidden_layers=28),
    "Qwen3-4B": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_hidden_layers=36),
    "small": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, num_hidden_layers=2),
}
MODES = {"grpo": None, "auto": None, "one_backward": True, "two_passes": False}  # OBLRPOConfig.one_backward


def build_model(width: str, device: str, seed: int = 0):
    """A random Qwen3 of ``width`` (tied head) on ``device``, seeded: two calls give identical copies."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**WIDTHS[width], tie_word_embeddings=True, max_position_embeddings=8192, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(config)


@functools.lru_cache(maxsize=None)
def saved_model(width: str) -> str:
    """A folder holding a random Qwen3 of ``width``, saved once a run (the QLoRA row loads it three times: its
    exactness check and each trainer) and removed at exit."""
    folder = tempfile.mkdtemp(prefix="bench_gpu_")
    atexit.register(shutil.rmtree, folder, True)
    build_model(width, "cpu").save_pretrained(folder)
    return folder


def build_qlora_base(width: str, device: str, compute_dtype=torch.bfloat16):
    """A random Qwen3 of ``width`` loaded with its linear layers in bitsandbytes 4-bit (nf4), as users load a QLoRA
    base (``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``)."""
    import bitsandbytes  # noqa: F401  (the row is skipped, with the reason, where it does not import)
    from transformers import BitsAndBytesConfig, Qwen3ForCausalLM

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    return Qwen3ForCausalLM.from_pretrained(saved_model(width), quantization_config=quant, device_map={"": device},
                                            torch_dtype=compute_dtype)


def config_args(mode: str, device: str, **kw):
    from trl import GRPOConfig

    from oblr_trl import OBLRPOConfig

    common = dict(output_dir="/tmp/bench_gpu", num_generations=GROUP, gradient_accumulation_steps=1,
                  steps_per_generation=1, report_to="none", use_cpu=device == "cpu", bf16=device != "cpu",
                  save_strategy="no", logging_steps=1, disable_tqdm=True, **kw)
    return GRPOConfig(**common) if mode == "grpo" else OBLRPOConfig(**common, one_backward=MODES[mode])


def make_trainer(mode: str, model, args, tokenizer, dataset, lora: bool, base=None):
    from trl import GRPOTrainer

    from oblr_trl import OBLRPOTrainer

    from transformers.trainer_callback import PrinterCallback

    base = base or GRPOTrainer
    cls = base if mode == "grpo" else type("Timed" + base.__name__, (OBLRPOTrainer, base), {})
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = cls(model=model, args=args, reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer,
                  peft_config=peft)
    trainer.remove_callback(PrinterCallback)  # the per-step metric dicts; the benchmark logs its own lines
    return trainer


def reward(completions, completion_ids=None, **kwargs):
    """Rewards with spread inside each group, from the completions' token ids."""
    return [float(sum(ids) % 7) / 7 for ids in completion_ids]


def qlora_exactness(model, device: str, rows: int = 4, completion: int = 48) -> dict:
    """The engine's per-sequence squared norms on a 4-bit (nf4) base with LoRA r=16, fp32 compute, against one
    autograd backward per row: the largest relative error (the target: <= 1e-5). ``model``: the base, loaded with
    float32 compute (:func:`build_qlora_base`); it is wrapped here and freed."""
    from peft import LoraConfig, get_peft_model

    from oblr_trl.grad_norms import per_sequence_grad_sq_norms

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at 0: the norms of A's gradient alone; a random B tests both
            torch.nn.init.normal_(p, std=0.02)
    batch, _ = prepared_batch(rows, completion, model.config.vocab_size, PROMPT, rows, device)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    ours = per_sequence_grad_sq_norms(model, ids, mask, batch["completion_mask"]).double()
    params = [p for p in model.parameters() if p.requires_grad]
    reference = []
    for i in range(rows):
        logits = model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).logits[:, PROMPT - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[i : i + 1, PROMPT:, None]).squeeze(-1)
        grads = torch.autograd.grad((logp * batch["completion_mask"][i : i + 1]).sum(), params, allow_unused=True)
        reference.append(sum(g.double().pow(2).sum() for g in grads if g is not None))
    reference = torch.stack(reference).to(ours.device)
    err = ((ours - reference).abs() / reference.abs().clamp(min=1e-30)).max().item()
    del model
    gc.collect()
    return dict(rows=rows, completion=completion, max_rel_err=err, ours=ours.tolist(), reference=reference.tolist())
