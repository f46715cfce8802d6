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


# The LM head under an adapter (head_adapters.py). Before: LoRA on lm_head was refused ("the LM head must be an
# nn.Linear"), and trainable_token_indices on tied embeddings (the trained rows sit in the head too) as well.
HEAD_ADAPTERS = {
    "LoRA on lm_head and q_proj": dict(target_modules=["q_proj", "lm_head"], init_lora_weights="gaussian"),
    "LoRA on lm_head alone": dict(target_modules=["lm_head"], init_lora_weights="gaussian"),
    "trainable_token_indices": dict(target_modules=["q_proj"], trainable_token_indices=[1, 2, 3]),
}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", list(HEAD_ADAPTERS))
def test_head_adapters_are_exact(kind, tie):
    """Squared norms and within-group inner products (streamed, as the two-pass path takes them) against per-row
    autograd; with tied embeddings the trained token rows are one parameter with the embedding's."""
    from oblr_trl import per_sequence_grad_inner_products
    from reference import per_sample_grads, within_group_products
    from studies.zoo import build

    torch.manual_seed(0)
    model = peft.get_peft_model(build("Llama", tie), peft.LoraConfig(r=4, **HEAD_ADAPTERS[kind]))
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7).double()
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-9)
    products = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=2)
    expected = within_group_products(per_sample_grads(model, ids, attention, completion_mask), 2)
    torch.testing.assert_close(products.double(), expected, rtol=1e-5, atol=1e-8)


def test_dora_on_the_head_is_refused_by_name_and_the_advice_works():
    """DoRA on lm_head: refused naming the head; the advice (plain LoRA on it) is exact on the same model."""
    from oblr_trl.grad_norms.coverage import UnsupportedModulesError
    from studies.zoo import build

    torch.manual_seed(0)
    model = peft.get_peft_model(build("Llama", True), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                                    use_dora=True))
    with pytest.raises(UnsupportedModulesError, match="'lm_head'.*DoRA") as refused:
        validate(model)
    assert "LoRA on it with one active adapter, no DoRA" in str(refused.value)
    torch.manual_seed(0)
    model = peft.get_peft_model(build("Llama", True), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                                    init_lora_weights="gaussian"))
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask).double()
    torch.testing.assert_close(ours, per_sample_sq_norms(model, ids, attention, completion_mask), rtol=1e-5, atol=1e-9)
