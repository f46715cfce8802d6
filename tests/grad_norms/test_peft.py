"""PEFT adapters (oblr_trl/grad_norms: hooks, ledger, engine): LoRA (on the embedding too), DoRA at any batch size,
VeRA, LoHa, LoKr and IA3 on several layers, tied and untied, on a left-padded batch: exact against per-row autograd."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms.zoo import VOCAB, build
from reference import padded_batch, per_sample_sq_norms

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj"]
ADAPTERS = {
    # before: refused, "'Embedding' object has no attribute 'num_embeddings'" (the probe batch read it off PEFT's
    # wrapper)
    "LoRA on embed_tokens": lambda: peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj", "down_proj"],
                                                    init_lora_weights=False),
    # before: the first layer's adapters (in ParameterDicts their layer uses functionally) got a gradient of 0 when
    # later layers had adapters too (the backward stopped at the later layers' inputs), and were refused
    "VeRA": lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False),
    "LoHa": lambda: peft.LoHaConfig(r=4, target_modules=ATTENTION, init_weights=False),
    "LoKr": lambda: peft.LoKrConfig(r=4, target_modules=ATTENTION, init_weights=False),
    "IA3": lambda: peft.IA3Config(target_modules=[*ATTENTION, "down_proj"], feedforward_modules=["down_proj"],
                                  init_ia3_weights=False),
    # before: 5 sequences raised a bare NotImplementedError (PEFT forms DoRA's weight norm by calling lora_A on an
    # identity matrix, 32 rows that are not the batch's; that call is detached, so no gradient comes from it)
    "DoRA all-linear": lambda: peft.LoraConfig(r=4, target_modules="all-linear", use_dora=True,
                                               init_lora_weights=False),
}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_adapter_is_exact(adapter, tie):
    model = peft.get_peft_model(build("Qwen3", tie), ADAPTERS[adapter]())
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=5)  # 5 divides no width of the model
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3, 4]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)
