"""`oblr_trl.precision.frozen_fraction` against applying the update in the parameter's dtype."""

import pytest
import torch

from oblr_trl.precision import frozen_fraction


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lr", [1e-7, 1e-6, 1e-5, 1e-3])
def test_frozen_fraction_is_the_fraction_an_update_of_lr_leaves_unchanged(dtype, lr):
    torch.manual_seed(0)
    w = (torch.randn(4096) * 0.02).to(dtype)
    p = torch.nn.Parameter(w.clone())
    moved = (w.float() + lr).to(dtype) != w  # the update, rounded to the parameter's dtype (round to nearest)
    assert frozen_fraction([p], lr) == pytest.approx(1.0 - moved.float().mean().item(), abs=0.01)


def test_fp32_and_frozen_parameters_do_not_count():
    assert frozen_fraction([torch.nn.Parameter(torch.randn(10))], 1e-9) == 0.0
    frozen = torch.nn.Parameter(torch.randn(10).bfloat16(), requires_grad=False)
    assert frozen_fraction([frozen], 1e-9) == 0.0
