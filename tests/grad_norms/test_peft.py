"""PEFT adapters (oblr_trl/grad_norms: hooks, ledger, engine): LoRA (on the embedding too), DoRA at any batch size,
VeRA, LoHa, LoKr and IA3 on several layers, tied and untied, on a left-padded batch: exact against per-row autograd."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms.zoo import ADAPTERS, VOCAB, build_adapted
from reference import padded_batch, per_sample_sq_norms

pytest.importorskip("peft")

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
