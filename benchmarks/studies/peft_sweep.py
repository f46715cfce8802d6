"""Every tuner type PEFT registers, on tiny Llama and Qwen3 models (tied and untied embeddings): exact against
per-row autograd, refused by name, or not applicable to a causal LM trained by GRPOTrainer (with the reason), never
silently wrong; and LoRA on the expert banks of tiny MoE models (:func:`moe_sweep`: ``target_parameters`` and
``all-linear`` on Qwen3-MoE, GPT-OSS and Mixtral). ``tests/grad_norms/test_peft_sweep.py`` runs it and checks the
committed table against it; ``python benchmarks/peft_sweep.py`` writes that table (``benchmarks/results/peft_sweep.{md,json}``).

The types come from PEFT's own registry (``peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING``), so a new PEFT release shows up
here as a new row, tried with its defaults, rather than as a user's bug. :data:`SIZED` holds the arguments a type needs
to fit a model of hidden size 32 (its defaults assume a real model's widths), and :data:`NOT_FOR_GRPO` the types whose
forward needs inputs GRPOTrainer never passes. Whether ``validate`` left a model as it was is judged by
``tests/fingerprint.py`` (test apparatus, on the tests' import path; ``benchmarks/peft_sweep.py`` puts it there).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

import torch

FAMILIES = ("Llama", "Qwen3")
TIES = (True, False)
RTOL = 1e-5

# arguments sized for the zoo's hidden size 32 (the defaults assume real widths: rank 64, block 256, 1,000 frequencies)
SIZED: Mapping[str, dict] = MappingProxyType({
    "ADALORA": dict(total_step=10, init_r=4, target_r=2),
    "ADAPTION_PROMPT": dict(adapter_len=4, adapter_layers=1),
    "C3A": dict(block_size=8),
    "CARTRIDGE": dict(num_virtual_tokens=4),
    "FOURIERFT": dict(n_frequency=100),
    "MISS": dict(r=8),
    "PREFIX_TUNING": dict(num_virtual_tokens=4),
    "PROMPT_TUNING": dict(num_virtual_tokens=4),
    "P_TUNING": dict(num_virtual_tokens=4, encoder_hidden_size=16),
    "PSOFT": dict(r=8),
    "ROAD": dict(group_size=8),
    "SHIRA": dict(r=4),
    "TRAINABLE_TOKENS": dict(token_indices=[1, 2, 3]),
    "VBLORA": dict(vector_length=8, num_vectors=16),
    "WAVEFT": dict(n_frequency=100),
})

# their forward needs what GRPOTrainer's forward never passes (task ids per row; trained LoRA adapters on disk)
NOT_FOR_GRPO: Mapping[str, str] = MappingProxyType({
    "MULTITASK_PROMPT_TUNING": "its forward needs task_ids for every row, which GRPOTrainer does not pass",
    "POLY": "its forward needs task_ids for every row, which GRPOTrainer does not pass",
    "XLORA": "X-LoRA mixes LoRA adapters trained beforehand (their folders in XLoraConfig.adapters)",
})


# quantized bases under LoRA (all-linear), judged against a fresh load of the same checkpoint; "generate first": a
# generate() before validate (bitsandbytes repacks for its CPU kernel), with oblr_trl imported, or before it was
BF16 = torch.bfloat16
QUANTIZED: Mapping[str, dict] = MappingProxyType({
    "QLoRA nf4": dict(),
    "QLoRA fp4": dict(quant="fp4"),
    "QLoRA nf4, double quant": dict(double=True),
    "QLoRA fp4, double quant": dict(quant="fp4", double=True),
    "QLoRA nf4, bf16 compute (within 2e-2)": dict(compute=BF16),
    "QLoRA nf4, bf16 storage (FSDP-QLoRA)": dict(storage=BF16),
    "QLoRA fp4, double quant, bf16 storage": dict(quant="fp4", double=True, storage=BF16),
    "QLoRA nf4, generate first": dict(generate="after import"),
    "QLoRA fp4, double quant, generate first": dict(quant="fp4", double=True, generate="after import"),
    "QLoRA nf4, bf16 storage, generate first": dict(storage=BF16, generate="after import"),
    "QLoRA nf4, generate first, before import oblr_trl": dict(generate="before import"),
    "LoRA on an 8-bit base": dict(bits=8),
    "QLoRA nf4, prepare_model_for_kbit_training defaults (reentrant checkpointing)": dict(prepare=True),
})
QUANTIZED_WIDTH = 128  # hidden size: layers wider than bitsandbytes' 64-value blocks, as real models'


@dataclass(frozen=True)
class Verdict:
    status: str  # 'exact', 'refused', 'not applicable', or 'WRONG' (a bug: norms off while validate passed)
    detail: str  # the refused modules, the reason it does not apply, or how far off

    def cell(self) -> str:
        return self.status if self.status == "exact" else f"{self.status}: {self.detail}"


def peft_types() -> list[str]:
    """The tuner types PEFT registers a config for, by name, sorted."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return sorted(str(getattr(t, "value", t)) for t in PEFT_TYPE_TO_CONFIG_MAPPING)


def _adapted(peft_type: str, family: str, tie: bool):
    import peft
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from .zoo import build

    config_cls = next(c for t, c in PEFT_TYPE_TO_CONFIG_MAPPING.items() if str(getattr(t, "value", t)) == peft_type)
    torch.manual_seed(0)
    model = peft.get_peft_model(build(family, tie), config_cls(task_type="CAUSAL_LM", **SIZED.get(peft_type, {})))
    for p in model.parameters():  # adapters that start at 0 (LoRA's B) would give every row a gradient of 0 there
        if p.requires_grad:
            with torch.no_grad():
                p.add_(torch.randn_like(p) * 0.05)
    return model


def _batch():
    from .zoo import VOCAB

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 8), generator=g)
    attention = torch.ones_like(ids)
    completion_mask = torch.ones(3, 4, dtype=torch.long)
    ids[0, :2], attention[0, :2] = 0, 0  # a left-padded prompt
    completion_mask[1, 2:] = 0  # a completion that ends early
    return ids, attention, completion_mask


def verdict(peft_type: str, family: str, tie: bool, make=None) -> Verdict:
    """One case: build the adapter (or say why it does not apply; ``make()``: the adapted model, in place of the
    type's defaults), validate it, and compare its norms with per-row autograd's when validate passes."""
    from oblr_trl.grad_norms import UnsupportedModulesError, per_sequence_grad_sq_norms, validate
    from fingerprint import fingerprint
    from oblr_trl.grad_norms.coverage import per_row_sq_norms

    if peft_type in NOT_FOR_GRPO:
        return Verdict("not applicable", NOT_FOR_GRPO[peft_type])
    ids, attention, completion_mask = _batch()
    try:
        model = _adapted(peft_type, family, tie) if make is None else make()
        model.eval()
        reference = per_row_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    except Exception as error:  # PEFT cannot build it for this model, or its own forward fails
        return Verdict("not applicable", f"PEFT fails on it: {type(error).__name__}: {_short(error)}")
    before = fingerprint(model)
    try:
        validate(model)
    except UnsupportedModulesError as error:
        return _unchanged(before, model, passed=False) or _refused(error)
    changed = _unchanged(before, model, passed=True)
    if changed:
        return changed
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7).double()
    return _compared(ours, reference, RTOL)


def _compared(ours: torch.Tensor, reference: torch.Tensor, rtol: float) -> Verdict:
    if not torch.allclose(ours, reference, rtol=rtol, atol=1e-9):
        worst = float(((ours - reference).abs() / reference.abs().clamp_min(1e-12)).max())
        return Verdict("WRONG", f"validate passed, norms off by {worst:.2g} (relative)")
    if not float(reference.max()) > 0:
        return Verdict("WRONG", "every row's gradient is 0: nothing was checked")
    return Verdict("exact", "")


def _refused(error) -> Verdict:
    return Verdict("refused", ", ".join(sorted({m.type for m in error.modules})) + " ("
                   + "; ".join(m.name or "the model" for m in error.modules[:2]) + ")")


def _unchanged(before: dict, model, passed: bool) -> Verdict | None:
    """A WRONG verdict where ``validate`` changed the model, else None. Nothing may change, but on a model that
    passes bitsandbytes' CPU repacking switch, turned off (documented: :func:`~.quantized.restore`)."""
    from fingerprint import differences, fingerprint

    after = fingerprint(model)
    changed = [k for k in differences(before, after)
               if not (passed and k.endswith("support_avx512bf16_for_cpu") and after.get(k) is False)]
    if not changed:
        return None
    return Verdict("WRONG", f"validate changed the model: {', '.join(changed[:2])}" + (", ..." if changed[2:] else ""))


def _checkpoint(family: str, tie: bool, folder: str) -> str:
    """A tiny random checkpoint of the family (hidden :data:`QUANTIZED_WIDTH`, 2 layers) saved in ``folder``."""
    import transformers

    from .zoo import FAMILIES

    path = os.path.join(folder, f"{family}-{'tied' if tie else 'untied'}")
    if not os.path.exists(path):
        config_cls, model_cls, _ = FAMILIES[family]
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(
            tie_word_embeddings=tie, vocab_size=256, hidden_size=QUANTIZED_WIDTH, intermediate_size=2 * QUANTIZED_WIDTH,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=QUANTIZED_WIDTH // 4,
            max_position_embeddings=64)
        getattr(transformers, model_cls)(config).save_pretrained(path)
    return path


def load_quantized(path: str, quant="nf4", double=False, compute=torch.float32, storage=torch.uint8, bits=4,
               repacking=True, prepare=False):
    """The checkpoint loaded as a user loads it for QLoRA, LoRA on every linear layer (seeded, non-zero); with
    ``repacking=False`` bitsandbytes' CPU repacking is off from the start: the reference, a fresh load. ``prepare``:
    through ``peft.prepare_model_for_kbit_training`` with its defaults first (reentrant gradient checkpointing)."""
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=storage))
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=compute)
    if prepare:
        base = peft.prepare_model_for_kbit_training(base)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0,
                                                      init_lora_weights="gaussian"))
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu") and not repacking:
            module.support_avx512bf16_for_cpu = False
    return model.eval()


def _generate(model, ids: torch.Tensor, attention: torch.Tensor, when: str) -> None:
    """A look at a few answers before training; ``when="before import"``: with bitsandbytes' repacking as it is
    before oblr_trl is imported (nothing recorded)."""
    import bitsandbytes.nn.modules as bnb_modules

    recording = bnb_modules._convert_weight_packed_for_cpu
    if when == "before import":
        bnb_modules._convert_weight_packed_for_cpu = recording.__wrapped__
    try:
        with torch.no_grad():
            model.generate(input_ids=ids[1:], attention_mask=attention[1:], max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    finally:
        bnb_modules._convert_weight_packed_for_cpu = recording


def quantized_verdict(setting: str, family: str, tie: bool, folder: str) -> Verdict:
    """One quantized case (:data:`QUANTIZED`): validate on the model as the user has it, which must leave a refused
    model bit for bit as it was, and an accepted one bit for bit a fresh load of the checkpoint (every tensor,
    buffer and quantization state field); then its norms against per-row autograd on that fresh load."""
    from oblr_trl.grad_norms import UnsupportedModulesError, per_sequence_grad_sq_norms, validate
    from fingerprint import differences, fingerprint
    from oblr_trl.grad_norms.coverage import per_row_sq_norms

    kwargs = dict(QUANTIZED[setting])
    when = kwargs.pop("generate", None)
    path = _checkpoint(family, tie, folder)
    ids, attention, completion_mask = _batch()
    model = load_quantized(path, **kwargs)
    if when:
        _generate(model, ids, attention, when)
    before = fingerprint(model)
    try:
        validate(model)
    except UnsupportedModulesError as error:
        return _unchanged(before, model, passed=False) or _refused(error)
    reference = load_quantized(path, **kwargs, repacking=False)
    changed = differences(fingerprint(reference), fingerprint(model))
    if changed:
        return Verdict("WRONG", f"validate passed on a model that is not the one loaded: {', '.join(changed[:2])}")
    expected = per_row_sq_norms(reference, ids, attention, completion_mask, temperature=0.7)
    if kwargs.get("prepare"):  # in train mode, where its (reentrant) gradient checkpointing runs
        model.train()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7).double()
    return _compared(ours, expected, 2e-2 if kwargs.get("compute") == BF16 else RTOL)


def quantized_sweep(settings: list[str] | None = None) -> dict[str, dict[str, Verdict]]:
    """``{setting: {'Llama, tied': verdict, ...}}`` for every :data:`QUANTIZED` setting (or ``settings``); empty
    without bitsandbytes."""
    import tempfile

    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return {}
    with tempfile.TemporaryDirectory() as folder:
        return {s: {_column(f, tie): quantized_verdict(s, f, tie, folder) for f in FAMILIES for tie in TIES}
                for s in settings or list(QUANTIZED)}


def _short(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return text if len(text) <= 120 else text[:117] + "..."


def sweep(types: list[str] | None = None) -> dict[str, dict[str, Verdict]]:
    """``{peft type: {'Llama, tied': verdict, ...}}`` for every registered type (or ``types``)."""
    return {t: {_column(f, tie): verdict(t, f, tie) for f in FAMILIES for tie in TIES} for t in types or peft_types()}


def _column(family: str, tie: bool) -> str:
    return f"{family}, {'tied' if tie else 'untied'}"


def table(results: dict[str, dict[str, Verdict]]) -> str:
    """The markdown table: one row per type, one column per model."""
    import peft

    columns = [_column(f, tie) for f in FAMILIES for tie in TIES]
    counts = {s: sum(v.status == s for row in results.values() for v in row.values())
              for s in ("exact", "refused", "not applicable", "WRONG")}
    lines = ["# Every PEFT tuner type", "",
             f"Every tuner type of PEFT {peft.__version__}'s registry on tiny random Llama and Qwen3 models (hidden 32, "
             "2 layers), tied and untied embeddings. Exact: per-sequence squared norms within "
             f"{RTOL:g} of per-row autograd after `validate()` passed. In every case `validate()` changed nothing of "
             "the model, refused or passed (every tensor, buffer and quantization state, bit for bit). Generated by "
             "`python benchmarks/peft_sweep.py` and checked by `tests/grad_norms/test_peft_sweep.py`.", "",
             f"Cases: {counts['exact']} exact, {counts['refused']} refused by name, {counts['not applicable']} not "
             f"applicable, {counts['WRONG']} silently wrong.", "",
             "| PEFT type | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [_line(peft_type, row, columns) for peft_type, row in results.items()]
    return "\n".join(lines) + "\n"


def _line(name: str, row: dict[str, Verdict], columns: list[str]) -> str:
    """A table row; one reason for every model is said once."""
    cells = [row[c].cell() for c in columns]
    if len(set(cells)) == 1 and cells[0] != "exact":
        cells = [cells[0]] + ["same"] * (len(cells) - 1)
    return f"| {name} | " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def to_json(results: dict[str, dict[str, Verdict]], moe: dict[str, dict[str, Verdict]] | None = None,
            quantized: dict[str, dict[str, Verdict]] | None = None) -> dict:
    import peft

    out = {"peft_version": peft.__version__,
           "types": {t: {c: asdict(v) for c, v in row.items()} for t, row in results.items()}}
    if moe is not None:
        out["moe_experts"] = {t: {c: asdict(v) for c, v in row.items()} for t, row in moe.items()}
    if quantized:
        out.update(bitsandbytes_version=_bnb_version(), avx512bf16=_avx512bf16(),
                   quantized={t: {c: asdict(v) for c, v in row.items()} for t, row in quantized.items()})
    return out


# LoRA on the fused MoE expert banks (3-D parameters, which PEFT adapts with its ParamWrapper), on tiny MoE models
MOE_FAMILIES = ("Qwen3-MoE", "GPT-OSS", "Mixtral")
MOE_TARGETS: Mapping[str, dict] = MappingProxyType({
    "LORA, target_parameters (expert banks)": dict(
        target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "LORA, target_modules='all-linear'": dict(target_modules="all-linear"),
})


def _moe_adapted(setup: str, family: str, tie: bool):
    import peft

    from .zoo import build

    torch.manual_seed(0)  # init_lora_weights=False: A and B both drawn, so every factor has a gradient
    return peft.get_peft_model(build(family, tie), peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                                                   init_lora_weights=False, **MOE_TARGETS[setup]))


def moe_sweep() -> dict[str, dict[str, Verdict]]:
    """``{setup: {'Qwen3-MoE, tied': verdict, ...}}`` for LoRA on the MoE models' expert banks (:data:`MOE_TARGETS`)."""
    return {setup: {_column(f, tie): verdict("LORA", f, tie, make=lambda s=setup, f=f, t=tie: _moe_adapted(s, f, t))
                    for f in MOE_FAMILIES for tie in TIES} for setup in MOE_TARGETS}


def moe_table(moe: dict[str, dict[str, Verdict]]) -> str:
    """The markdown section of :func:`moe_sweep`: one row per setup, one column per model."""
    import peft

    columns = [_column(f, tie) for f in MOE_FAMILIES for tie in TIES]
    lines = ["## LoRA on MoE expert banks", "",
             "LoRA on the fused expert banks (3-D `gate_up_proj` and `down_proj`, adapted by PEFT's `ParamWrapper`) of "
             "tiny random Qwen3-MoE, GPT-OSS and Mixtral models (hidden 32, 2 layers, 4 experts, 2 per token), tied and "
             f"untied embeddings, with PEFT {peft.__version__}. Two setups: `target_parameters` on both banks, and "
             "`target_modules='all-linear'`. PEFT turns the second into the same bank targets plus LoRA on the router "
             "for Qwen3-MoE and Mixtral; on GPT-OSS it reaches the attention projections only. Exact as above.", "",
             "| setup | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {setup} | " + " | ".join(row[c].cell().replace("|", "/") for c in columns) + " |"
              for setup, row in moe.items()]
    return "\n".join(lines) + "\n"


def quantized_table(quantized: dict[str, dict[str, Verdict]]) -> str:
    """The markdown section of :func:`quantized_sweep`: one row per setting, one column per model."""
    columns = [_column(f, tie) for f in FAMILIES for tie in TIES]
    lines = ["## Quantized bases", "",
             f"LoRA on every linear layer of a bitsandbytes base (bitsandbytes {_bnb_version()}), tiny random Llama "
             f"and Qwen3 checkpoints (hidden {QUANTIZED_WIDTH}, 2 layers) saved, then loaded as a user loads them. Each "
             "is judged against a fresh load of the same checkpoint. Exact: after `validate()` the model is that fresh "
             "load bit for bit (every tensor, buffer and quantization state), and its per-sequence squared norms are "
             f"within {RTOL:g} of per-row autograd on it (bf16 compute: 2e-2, bf16's own rounding). Refused: by "
             "name, the model left bit for bit as it was. \"generate first\": a `generate()` before `validate()` "
             "(or the trainer). On a CPU with AVX512-BF16 that repacks the 4-bit weights for bitsandbytes' "
             f"inference kernel (the machine that wrote this table {'has' if _avx512bf16() else 'lacks'} it). "
             "\"before import oblr_trl\": that generation ran before oblr_trl was imported.", "",
             "| base | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [_line(setting, row, columns) for setting, row in quantized.items()]
    return "\n".join(lines) + "\n"


def _bnb_version() -> str:
    import bitsandbytes

    return bitsandbytes.__version__


def _avx512bf16() -> bool:
    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16())


def document(results: dict[str, dict[str, Verdict]], moe: dict[str, dict[str, Verdict]],
             quantized: dict[str, dict[str, Verdict]] | None = None) -> str:
    """The committed page: every registered type's table, then LoRA on MoE expert banks, then quantized bases."""
    return table(results) + "\n" + moe_table(moe) + ("\n" + quantized_table(quantized) if quantized else "")
