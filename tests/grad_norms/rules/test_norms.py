"""Normalisation layers (oblr_trl/grad_norms/rules/norms.py: ``nn.LayerNorm``, ``nn.RMSNorm``), one layer at a time
against per-sample autograd (Opacus's ``run_test``: tests/reference.py ``module_sq_norms``)."""

import pytest
from torch import nn

from reference import D, hidden, assert_rule_matches_per_sample_autograd


LAYERS = {
    "LayerNorm": (lambda: nn.LayerNorm(D), hidden),
    "RMSNorm": (lambda: nn.RMSNorm(D, eps=1e-6), hidden),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_matches_per_sample_autograd(name):
    assert_rule_matches_per_sample_autograd(*LAYERS[name])
