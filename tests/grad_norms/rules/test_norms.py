"""Normalisation layers (oblr_trl/grad_norms/rules/norms.py: ``nn.LayerNorm``, ``nn.RMSNorm``), one layer at a time
against per-sample autograd (Opacus's ``run_test``: tests/reference.py ``module_sq_norms``)."""

import pytest
import torch
from torch import nn

from oblr_trl.grad_norms.coverage import how_handled
from reference import module_sq_norms

B, T, D = 4, 5, 12


def _randomised(module):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def _hidden(seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


LAYERS = {
    "LayerNorm": (lambda: nn.LayerNorm(D), _hidden),
    "RMSNorm": (lambda: nn.RMSNorm(D, eps=1e-6), _hidden),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_matches_per_sample_autograd(name):
    build, inputs = LAYERS[name]
    module = _randomised(build())
    assert how_handled(module) == "rule"  # a rule (registered, or recognised by what the layer computes)
    ours, reference = module_sq_norms(module, inputs())
    assert reference.min() > 0
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)
