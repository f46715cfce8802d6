"""one_backward's pass (``materialize=True``) forms the LM head's own products with its output gradient, from the same
softmax chunks: the norms then cost no further logits product, and stay exact."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from oblr_trl.grad_norms import per_sequence_grads
from oblr_trl.demo.tiny import build_model, build_tokenizer
from reference import padded_batch, per_sample_sq_norms


@pytest.mark.parametrize("tied", [True, False])
def test_one_backward_norms_need_no_further_logits_product(tied):
    torch.manual_seed(0)
    model = build_model(build_tokenizer()).double()
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    vocab, d = model.lm_head.weight.shape
    ids, attention, completion_mask = padded_batch(vocab)
    grads = per_sequence_grads(model, ids, attention, completion_mask, materialize=True)
    flops = []
    for formed_with_output_gradient in (True, False):
        if not formed_with_output_gradient:  # as before: the head's products formed again from the delta
            grads.presummed, grads.self_done = None, set()
        counter = FlopCounterMode(display=False)
        with counter:
            sq = grads.inner_products(1).reshape(-1)
        flops.append(counter.get_total_flops())
        torch.testing.assert_close(sq.double(), per_sample_sq_norms(model, ids, attention, completion_mask),
                                   rtol=1e-5, atol=1e-9)
    batch, completion = completion_mask.shape
    assert flops[0] + 2 * batch * completion * d * vocab <= flops[1]  # one logits product fewer, at least


def test_other_block_sizes_form_the_head_products_again():
    torch.manual_seed(0)
    model = build_model(build_tokenizer()).double()
    ids, attention, completion_mask = padded_batch(model.lm_head.weight.shape[0])
    grads = per_sequence_grads(model, ids, attention, completion_mask, materialize=True)
    one, two = grads.inner_products(1).reshape(-1), grads.inner_products(2)
    torch.testing.assert_close(torch.diagonal(two, dim1=1, dim2=2).reshape(-1), one, rtol=1e-5, atol=1e-9)
