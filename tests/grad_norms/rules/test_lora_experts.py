"""LoRA on fused MoE expert banks (PEFT's ``ParamWrapper``, oblr_trl/grad_norms/rules/lora_experts.py): through
``target_parameters`` (the gpt-oss recipe) and ``target_modules="all-linear"`` (which PEFT turns into expert-bank
targets on Qwen3-MoE and Mixtral), on tiny Qwen3-MoE, GPT-OSS and Mixtral models, tied and untied: the norms, the
within-group products and one_backward's weighted sum equal per-sequence autograd on a freshly built copy.

Before: every wrapped bank was refused (the inner wrapper, re-run row by row without the outer one's LoRA delta,
"does not treat the sequences independently")."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms.rules import per_row
from oblr_trl.grad_norms.api import per_sequence_grads
from oblr_trl.grad_norms.coverage import coverage_plan
from studies.zoo import VOCAB, build
from reference import padded_batch, per_sample_grads

peft = pytest.importorskip("peft")

BANK = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def adapted(family: str, tie: bool, how: str, seed: int = 0, **lora):
    """The family's tiny model with LoRA on its expert banks (``how``: 'target_parameters' or 'all-linear'), every
    factor random (PEFT's ``init_lora_weights=False``: A and B both drawn, so every factor has a gradient)."""
    targets = dict(target_modules=[], target_parameters=BANK) if how == "target_parameters" else \
        dict(target_modules="all-linear")
    torch.manual_seed(seed + 1)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **targets, **lora)
    return peft.get_peft_model(build(family, tie, seed=seed), config).eval()


def fresh_copy(model, family: str, tie: bool, how: str, **lora):
    """Another model built the same way, its weights loaded from ``model``'s state (what a user's reload gives),
    before any of our code ran on ``model``."""
    copy = adapted(family, tie, how, seed=7, **lora)
    copy.load_state_dict(model.state_dict())
    return copy


def wrappers(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"]


CASES = [(f, tie, how) for f in ("Qwen3-MoE", "GPT-OSS", "Mixtral") for tie in (True, False)
         for how in ("target_parameters", "all-linear")]


@pytest.mark.parametrize("family,tie,how", CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}-{h}" for f, t, h in CASES])
def test_lora_on_expert_banks_is_exact_against_a_fresh_copy(family, tie, how):
    model = adapted(family, tie, how)
    reference_model = fresh_copy(model, family, tie, how)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=5)
    reference = torch.stack([g.double().pow(2).sum() for g in per_sample_grads(
        reference_model, ids, attention, completion_mask, temperature=0.7)])
    banks = [n for n in wrappers(model) if n.endswith("mlp.experts")]
    if how == "target_parameters" or family != "GPT-OSS":
        assert banks  # PEFT put LoRA on the expert banks
    else:
        assert not banks  # GPT-OSS's all-linear: its attention's nn.Linear only (no bank, no router is nn.Linear)
    assert validate(model) == []
    names = {m: n for n, m in model.base_model.model.named_modules()}
    by_rule = {names[c.module]: c.rule.name if c.how == "routed" else c.how for c in coverage_plan(model).covered}
    for bank in banks:  # the bank's factors by their rule, not the per-row path (all-linear's router: per row)
        assert by_rule[bank.removeprefix("base_model.model.")] == "lora_expert_bank", by_rule
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3, 4]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)
    for a, b in zip(model.state_dict().values(), reference_model.state_dict().values()):
        assert torch.equal(a, b)  # our pass left the model as it was


@pytest.mark.parametrize("checkpointing", [False, True], ids=["captured", "recomputed"])
@pytest.mark.parametrize("family", ["Qwen3-MoE", "GPT-OSS"])
def test_group_products_and_weighted_sum_of_expert_factors(family, checkpointing):
    """The factors' rows in PEFT's layout (A ``(E r, in)`` expert-major, B ``(out, r E)`` expert-minor): one_backward's
    weighted sum equals autograd's, and the within-group products too; under gradient checkpointing the bank's pairs
    are recomputed with the adapted weights, else kept from the forward."""
    model = adapted(family, False, "target_parameters")
    reference_model = fresh_copy(model, family, False, "target_parameters")
    if checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    rows = torch.stack([g.double() for g in per_sample_grads(reference_model, ids, attention, completion_mask)])
    grads = per_sequence_grads(model, ids, attention, completion_mask, materialize=True)
    blocks = rows.reshape(2, 2, -1)
    torch.testing.assert_close(grads.inner_products(2).double(), blocks @ blocks.transpose(1, 2), rtol=1e-5,
                               atol=1e-9)
    scale = torch.tensor([0.5, -1.0, 2.0, 0.3])
    sq = grads.accumulate_grad(scale, group_size=2)
    params = [p for p in model.parameters() if p.requires_grad]
    formed = torch.cat([p.grad.flatten() for p in params]).double()
    expected = (scale.double()[:, None] * rows).sum(0)
    torch.testing.assert_close(formed, expected, rtol=1e-5, atol=1e-6)
    halves = (scale.double()[:, None] * rows).reshape(2, 2, -1).sum(1)
    torch.testing.assert_close(sq.double(), halves.pow(2).sum(-1), rtol=1e-5, atol=1e-9)


def test_rank_stabilised_scaling_and_one_bank_parameter():
    """use_rslora (scaling alpha / sqrt(r)) and LoRA on the down projection alone."""
    model = peft.get_peft_model(build("Qwen3-MoE"), peft.LoraConfig(
        r=3, lora_alpha=5, use_rslora=True, init_lora_weights=False, target_modules=[],
        target_parameters=["mlp.experts.down_proj"])).eval()
    reference_model = peft.get_peft_model(build("Qwen3-MoE", seed=5), peft.LoraConfig(
        r=3, lora_alpha=5, use_rslora=True, init_lora_weights=False, target_modules=[],
        target_parameters=["mlp.experts.down_proj"])).eval()
    reference_model.load_state_dict(model.state_dict())
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    reference = torch.stack([g.double().pow(2).sum() for g in per_sample_grads(
        reference_model, ids, attention, completion_mask)])
    assert validate(model) == []
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)


def test_switched_off_the_chain_takes_the_per_row_path_whole():
    """Without the rule, the chain of wrappers is re-run row by row as one call (its outermost wrapper borrows every
    factor, so the inner wrapper runs inside the outer one's delta): exact too, where it fits the per-row limit."""
    from oblr_trl.grad_norms.rules import registry

    model = adapted("Qwen3-MoE", False, "target_parameters")
    reference_model = fresh_copy(model, "Qwen3-MoE", False, "target_parameters")
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    reference = torch.stack([g.double().pow(2).sum() for g in per_sample_grads(
        reference_model, ids, attention, completion_mask)])
    with registry.switched_off("lora_expert_bank"):
        plan = coverage_plan(model)
        wrapped = [c for c in plan.covered if type(c.module).__name__ == "ParamWrapper"]
        assert len(wrapped) == 2 and all(c.how == "per-row" and len(c.borrowed) == 4 for c in wrapped)
        ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)


def test_a_wrapper_whose_forward_is_not_the_formula_is_not_taken_by_the_rule():
    """A ParamWrapper whose forward computes something else (here, its output scaled by 1.01): the probe (random
    factors, the formula's output) tells it apart, and the rule does not take it."""
    from oblr_trl.grad_norms.rules.lora_experts import recognise_lora_bank

    model = adapted("Qwen3-MoE", False, "target_parameters")
    outer = model.base_model.model.model.layers[0].mlp.experts
    assert recognise_lora_bank(outer) is not None
    inner = outer.base_layer

    base = type(inner)

    def forward(self, x, *args, **kwargs):
        return base.forward(self, x, *args, **kwargs) * 1.01

    inner.__class__ = type("ParamWrapper", (base,), {"forward": forward})  # the same name: only the probe can tell
    assert recognise_lora_bank(outer) is None
    inner.__class__ = base
    assert recognise_lora_bank(outer) is not None


@pytest.mark.parametrize("case", ["bank bias", "bank unfrozen"])
def test_a_chain_the_rule_cannot_take_is_refused_by_name_and_the_advice_works(case):
    """Where the per-row path cannot take a chain either (its limit, set to 0 here, stands for a real model's size):
    LoRA on a bank's bias (GPT-OSS), or on a bank whose own weights are trained too, is refused naming the wrapped
    parameters and why; the advice (LoRA on the bank's two weights, the bank frozen) is exact."""
    family = "GPT-OSS" if case == "bank bias" else "Qwen3-MoE"
    torch.manual_seed(0)
    targets = ["mlp.experts.gate_up_proj_bias"] if case == "bank bias" else BANK
    model = peft.get_peft_model(build(family), peft.LoraConfig(
        r=4, init_lora_weights=False, target_modules=[], target_parameters=targets)).eval()
    if case == "bank unfrozen":
        for layer in model.base_model.model.model.layers:
            layer.mlp.experts.base_layer.base_layer.gate_up_proj.requires_grad_(True)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    limit = per_row.MAX_NUMEL
    per_row.MAX_NUMEL = 0
    try:
        found = validate(model, strict=False)
        assert [f.name for f in found] == ["layers.0.mlp.experts", "layers.1.mlp.experts"], found
        reason = found[0].reason
        assert "ParamWrapper" in reason and "target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']" \
            in reason
        assert ("gate_up_proj_bias" in reason) if case == "bank bias" else ("trainable too" in reason)
        advised = adapted(family, False, "target_parameters")  # the advice: the bank's weights, the bank frozen
        reference = torch.stack([g.double().pow(2).sum() for g in per_sample_grads(
            fresh_copy(advised, family, False, "target_parameters"), ids, attention, completion_mask)])
        assert validate(advised) == []
        ours = per_sequence_grad_sq_norms(advised, ids, attention, completion_mask)
    finally:
        per_row.MAX_NUMEL = limit
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("double", [False, True], ids=["single-quant", "double-quant"])
def test_qlora_base_with_lora_on_the_expert_banks_is_exact_against_a_fresh_load(tmp_path, double):
    """A 4-bit (nf4) base loaded from a folder: bitsandbytes quantizes the attention's nn.Linear layers, not the
    3-D expert banks, which stay in the compute dtype under their LoRA. Judged against per-row autograd on a second
    load of the same folder (its factors copied), which our code never touched."""
    pytest.importorskip("bitsandbytes")
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
        pad_token_id=0, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)

    def load():
        quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_use_double_quant=double, bnb_4bit_compute_dtype=torch.float32)
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant,
                                                                 dtype=torch.float32)
        for module in base.modules():  # the reference's layers never take bitsandbytes' CPU inference kernel
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
        return peft.get_peft_model(base, peft.LoraConfig(r=4, init_lora_weights=False,
                                                         target_modules=["q_proj", "v_proj"],
                                                         target_parameters=BANK)).eval()

    model, reference_model = load(), load()
    theirs = dict(reference_model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                theirs[name].copy_(p)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    reference = torch.stack([g.double().pow(2).sum() for g in per_sample_grads(
        reference_model, ids, attention, completion_mask)])
    assert any("4bit" in type(m).__name__ for m in model.modules()) and wrappers(model)
    assert validate(model) == []
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    assert reference[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)
