"""Token embeddings (oblr_trl/grad_norms/rules/embeddings.py), one layer at a time against per-sample autograd
(Opacus's ``run_test``: tests/reference.py ``module_sq_norms``)."""

import pytest
from torch import nn

from reference import D, token_ids, assert_rule_matches_per_sample_autograd


LAYERS = {
    "Embedding(padding_idx)": (lambda: nn.Embedding(20, D, padding_idx=0), token_ids),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_matches_per_sample_autograd(name):
    assert_rule_matches_per_sample_autograd(*LAYERS[name])
