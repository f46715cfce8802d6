"""Exactness at a real layer width (issue 56): the tests elsewhere use layers a few dozen wide, where every product is
short. A Qwen3-0.6B-wide layer's per-sample gradients hold ~3M entries (1024 x 3072); the products over them, on
``one_backward``'s materialized path, were single float32 products accumulating ~sqrt(N) rounding errors: 9e-5 (norms)
and 3e-4 (within-group products, the SNR's) relative to float64 on this CPU, 10-30x the 1e-5 target."""

import pytest
import torch

from oblr_trl.grad_norms import per_sequence_grads
from reference import padded_batch, per_sample_grads, within_group_products


@pytest.fixture(scope="module")
def wide():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=64, vocab_size=512, num_hidden_layers=1, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    ids, attention, mask = padded_batch(512, batch=4, prompt=8, completion=1024)  # long enough that one_backward materializes (12 MiB a row)
    exact = within_group_products(per_sample_grads(model.double(), ids, attention, mask), 4)
    return model.float(), (ids, attention, mask), exact


@pytest.mark.parametrize("materialize", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_a_qwen3_06b_wide_layers_norms_and_group_products_are_exact_to_1e_6(wide, materialize, k):
    model, batch, exact = wide
    got = per_sequence_grads(model, *batch, materialize=materialize).inner_products(k).double()
    if k == 1:
        exact = torch.diagonal(exact, dim1=1, dim2=2).reshape(got.shape)
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-6
