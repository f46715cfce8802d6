"""Every tuner type PEFT registers, on tiny Llama and Qwen3 models (tied and untied embeddings): exact against
per-row autograd, refused by name, or not applicable to a causal LM trained by GRPOTrainer (with the reason), never
silently wrong; and LoRA on the expert banks of tiny MoE models (:func:`moe_sweep`: ``target_parameters`` and
``all-linear`` on Qwen3-MoE, GPT-OSS and Mixtral). ``tests/grad_norms/test_peft_sweep.py`` runs it and checks the
committed table against it; ``python -m oblr_trl.grad_norms.peft_sweep`` writes that table (``benchmarks/results/peft_sweep.{md,json}``).

The types come from PEFT's own registry (``peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING``), so a new PEFT release shows up
here as a new row, tried with its defaults, rather than as a user's bug. :data:`SIZED` holds the arguments a type needs
to fit a model of hidden size 32 (its defaults assume a real model's widths), and :data:`NOT_FOR_GRPO` the types whose
forward needs inputs GRPOTrainer never passes.
"""

from __future__ import annotations

import argparse
import json
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
    from . import UnsupportedModulesError, per_sequence_grad_sq_norms, validate
    from .oracle import per_row_sq_norms

    if peft_type in NOT_FOR_GRPO:
        return Verdict("not applicable", NOT_FOR_GRPO[peft_type])
    ids, attention, completion_mask = _batch()
    try:
        model = _adapted(peft_type, family, tie) if make is None else make()
        model.eval()
        reference = per_row_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    except Exception as error:  # PEFT cannot build it for this model, or its own forward fails
        return Verdict("not applicable", f"PEFT fails on it: {type(error).__name__}: {_short(error)}")
    try:
        validate(model)
    except UnsupportedModulesError as error:
        return Verdict("refused", ", ".join(sorted({m.type for m in error.modules})) + " ("
                       + "; ".join(m.name or "the model" for m in error.modules[:2]) + ")")
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7).double()
    if not torch.allclose(ours, reference, rtol=RTOL, atol=1e-9):
        worst = float(((ours - reference).abs() / reference.abs().clamp_min(1e-12)).max())
        return Verdict("WRONG", f"validate passed, norms off by {worst:.2g} (relative)")
    if not float(reference.max()) > 0:
        return Verdict("WRONG", "every row's gradient is 0: nothing was checked")
    return Verdict("exact", "")


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
             "2 layers), tied and untied embeddings; exact = per-sequence squared norms within "
             f"{RTOL:g} of per-row autograd after `validate()` passed. Generated by "
             "`python -m oblr_trl.grad_norms.peft_sweep` and checked by `tests/grad_norms/test_peft_sweep.py`.", "",
             f"Cases: {counts['exact']} exact, {counts['refused']} refused by name, {counts['not applicable']} not "
             f"applicable, {counts['WRONG']} silently wrong.", "",
             "| PEFT type | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for peft_type, row in results.items():
        cells = [row[c].cell() for c in columns]
        if len(set(cells)) == 1 and cells[0] != "exact":  # one reason for every model: said once
            cells = [cells[0]] + ["same"] * (len(cells) - 1)
        lines.append(f"| {peft_type} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def to_json(results: dict[str, dict[str, Verdict]], moe: dict[str, dict[str, Verdict]] | None = None) -> dict:
    import peft

    out = {"peft_version": peft.__version__,
           "types": {t: {c: asdict(v) for c, v in row.items()} for t, row in results.items()}}
    if moe is not None:
        out["moe_experts"] = {t: {c: asdict(v) for c, v in row.items()} for t, row in moe.items()}
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
             f"untied embeddings, with PEFT {peft.__version__}: `target_parameters` on both banks, and "
             "`target_modules='all-linear'`, which PEFT turns into the same bank targets plus LoRA on the router for "
             "Qwen3-MoE and Mixtral; on GPT-OSS it reaches the attention projections only. Exact as above.", "",
             "| setup | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {setup} | " + " | ".join(row[c].cell().replace("|", "/") for c in columns) + " |"
              for setup, row in moe.items()]
    return "\n".join(lines) + "\n"


def document(results: dict[str, dict[str, Verdict]], moe: dict[str, dict[str, Verdict]]) -> str:
    """The committed page: every registered type's table, then LoRA on MoE expert banks."""
    return table(results) + "\n" + moe_table(moe)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "peft_sweep"))
    args = parser.parse_args(argv)
    results, moe = sweep(), moe_sweep()
    with open(args.out + ".json", "w") as f:
        json.dump(to_json(results, moe), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(document(results, moe))
    print(document(results, moe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
