"""Linear maps (oblr_trl/grad_norms/rules/linear.py: ``nn.Linear``, Falcon's ``FalconLinear``, GPT-2's ``Conv1D``),
one layer at a time against per-sample autograd (Opacus's ``run_test``: tests/reference.py ``module_sq_norms``)."""

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


def _transformers_layers():
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.pytorch_utils import Conv1D

    return {
        "Conv1D": (lambda: Conv1D(7, D), _hidden),
        "FalconLinear": (lambda: FalconLinear(D, 7, bias=True), _hidden),
    }


LAYERS = {
    "Linear": (lambda: nn.Linear(D, 7), _hidden),
    **_transformers_layers(),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_matches_per_sample_autograd(name):
    build, inputs = LAYERS[name]
    module = _randomised(build())
    assert how_handled(module) == "rule"  # a rule (registered, or recognised by what the layer computes)
    ours, reference = module_sq_norms(module, inputs())
    assert reference.min() > 0
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)
