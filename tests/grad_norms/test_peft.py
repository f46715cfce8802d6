"""PEFT adapters (oblr_trl/grad_norms: hooks, ledger, engine): LoRA (on the embedding too), DoRA at any batch size,
VeRA, LoHa, LoKr and IA3 on several layers, tied and untied, on a left-padded batch: exact against per-row autograd."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from studies.zoo import ADAPTERS, VOCAB, build_adapted
from reference import padded_batch, per_sample_sq_norms

peft = pytest.importorskip("peft")

# Before this pass: LoRA on embed_tokens was refused ("'Embedding' object has no attribute 'num_embeddings'": the probe
# batch read it off PEFT's wrapper); VeRA, LoHa, LoKr, IA3 (and LoRA's embedding adapter), whose parameters sit in
# ParameterDicts their layer uses functionally, got a gradient of 0 in the first layer whenever later layers had
# adapters too (the backward stopped at the later layers' inputs), and were refused; DoRA with 5 sequences raised a
# bare NotImplementedError (PEFT forms DoRA's weight norm by calling lora_A on an identity matrix, rows that are not
# the batch's; that call is detached, so no gradient comes from it).


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_adapter_is_exact(adapter, tie):
    model = build_adapted(adapter, tie)
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=5)  # 5 divides no width of the model
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3, 4]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)


# Soft prompts (soft_prompt.py). Before: the pass ran the *ForCausalLM under the PeftModel, so the prompt encoder's
# virtual tokens never entered it: every norm was exactly 0, and the probe, which enumerated the *ForCausalLM's
# parameters only and scored sequences through it, saw nothing to check and passed.
SOFT_PROMPTS = {
    "prompt tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8),
    "P-tuning (MLP)": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=8,
                                                       encoder_hidden_size=16),
}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
@pytest.mark.parametrize("kind", list(SOFT_PROMPTS))
def test_soft_prompts_are_exact(kind, family, tie):
    from studies.zoo import build

    model = peft.get_peft_model(build(family, tie), SOFT_PROMPTS[kind]())
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=5)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3, 4]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-12)


def test_prefix_tuning_is_refused_by_name():
    from studies.zoo import build

    model = peft.get_peft_model(build("Llama", True),
                                peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    found = validate(model, strict=False)
    assert [f.name for f in found] == ["prompt_encoder.default.embedding"]
    assert "prefix tuning" in found[0].reason and "LoRA" in found[0].reason


def test_a_trainable_parameter_outside_the_causal_lm_is_checked_not_skipped():
    """The class of hole soft prompts fell through: the probe's parameters are the model's as the trainer calls it.
    A prompt-tuning encoder the pass cannot see (its soft-prompt path switched off here) is refused, by the probe."""
    from oblr_trl.grad_norms import coverage, soft_prompt
    from studies.zoo import build

    model = peft.get_peft_model(build("Llama", True), SOFT_PROMPTS["prompt tuning"]())
    params, shown, _ = coverage.trained_parameters(model)
    assert [shown[n] for n in params] == ["prompt_encoder.default.embedding.weight"]
    original = soft_prompt.soft_prompt_model
    try:
        soft_prompt.soft_prompt_model = lambda m: None
        found = coverage.probe(model)
    finally:
        soft_prompt.soft_prompt_model = original
    assert [f.name for f in found] == ["prompt_encoder.default.embedding"]


def test_trainable_tokens_on_tied_embeddings_are_refused_with_the_reason_and_the_advice_works():
    """trainable_token_indices with tied embeddings puts the trained rows in the LM head too, which the pass forms
    only for an nn.Linear head: refused saying so (it said "the LM head must be an nn.Linear"), the model unchanged;
    the advice (LoRA on the embedding) is exact on the same tied model."""
    from fingerprint import differences, fingerprint
    from oblr_trl.grad_norms.support import UnsupportedModulesError
    from studies.zoo import build

    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    torch.manual_seed(0)
    model = peft.get_peft_model(build("Llama", True), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                    trainable_token_indices=[1, 2, 3]))
    before = fingerprint(model)
    with pytest.raises(UnsupportedModulesError, match="trainable_token_indices on a model with tied embeddings"):
        validate(model)
    assert differences(before, fingerprint(model)) == []
    torch.manual_seed(0)
    model = peft.get_peft_model(build("Llama", True), peft.LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"],
                                                                    init_lora_weights="gaussian"))
    assert validate(model) == []
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask).double()
    torch.testing.assert_close(ours, per_sample_sq_norms(model, ids, attention, completion_mask), rtol=1e-5, atol=1e-9)
