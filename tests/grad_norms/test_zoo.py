"""Every family of oblr_trl/grad_norms/zoo.py, tiny and random, tied and untied, on a padded batch: exact against
per-row autograd, or refused by validate() with advice that is applied here and works."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms import UnsupportedModulesError
from oblr_trl.grad_norms.zoo import FAMILIES, VOCAB, build
from reference import padded_batch, per_sample_sq_norms

REFUSED = {"Gemma2": "final_logit_softcapping"}  # refused by validate, with the reason


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_is_exact_or_refused(family, tie):
    model = build(family, tie)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    if family in REFUSED:
        with pytest.raises(UnsupportedModulesError, match=REFUSED[family]):
            validate(model)
        with pytest.raises(UnsupportedModulesError, match=REFUSED[family]):
            per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
        return
    assert validate(model) == []
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("family", ["GPT-Neo", "GPTBigCode"])
def test_position_embeddings_on_shared_ids_are_per_row(family):
    """Before: (1, T) position ids made the hook see one row, and every row got ||sum_b g_b||^2 (rel. error 1.4-3.3)."""
    model = build(family).requires_grad_(False)
    wpe = model.transformer.wpe.requires_grad_(True)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask),
                               rtol=1e-4, atol=1e-9)
    assert wpe.weight.grad is None


def test_peft_lora_and_dora():
    peft = pytest.importorskip("peft")
    for use_dora in (False, True):
        model = peft.get_peft_model(build("Llama", tie=True), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
            use_dora=use_dora))
        ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
        ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
        torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask),
                                   rtol=1e-4, atol=1e-9)
