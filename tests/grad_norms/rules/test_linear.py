"""Linear maps (oblr_trl/grad_norms/rules/linear.py: ``nn.Linear``, Falcon's ``FalconLinear``, GPT-2's ``Conv1D``),
one layer at a time against per-sample autograd (Opacus's ``run_test``: tests/reference.py ``module_sq_norms``)."""

import pytest
from torch import nn

from reference import D, hidden, assert_rule_matches_per_sample_autograd


def _transformers_layers():
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.pytorch_utils import Conv1D

    return {
        "Conv1D": (lambda: Conv1D(7, D), hidden),
        "FalconLinear": (lambda: FalconLinear(D, 7, bias=True), hidden),
    }


LAYERS = {
    "Linear": (lambda: nn.Linear(D, 7), hidden),
    **_transformers_layers(),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_matches_per_sample_autograd(name):
    assert_rule_matches_per_sample_autograd(*LAYERS[name])
