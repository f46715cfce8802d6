"""The exact per-row path for small parameters no rule covers (oblr_trl/grad_norms/rules/per_row.py), against
per-sample autograd (tests/reference.py ``module_sq_norms``), and its refusal of a module that mixes rows."""

import pytest
import torch
from torch import nn

from oblr_trl.grad_norms.coverage import how_handled
from reference import T, D, randomised, hidden, module_sq_norms


class Sinks(nn.Module):
    """GPT-OSS-style: a small per-head parameter that enters a softmax over keys, inside a bigger computation."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(3))
        self.proj = nn.Linear(D, 3 * T)

    def forward(self, x):
        scores = self.proj(x).reshape(x.shape[0], T, 3, T).transpose(1, 2)
        sink = self.sinks.reshape(1, 3, 1, 1).expand(x.shape[0], 3, T, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        return (probs @ x.reshape(x.shape[0], 1, T, D)).sum(1)


class NotAnRMSNorm(nn.Module):
    """Shaped like an RMSNorm (a 1-D weight and an eps) but computing ``w^2 * x / rms(x)``: no norm rule applies."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight ** 2 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


@pytest.mark.parametrize("build", [Sinks, NotAnRMSNorm], ids=["sinks", "rms-shaped-but-not"])
def test_small_parameters_without_rule_take_the_exact_per_row_path(build):
    module = randomised(build())
    assert how_handled(module) == "per-row"
    ours, reference = module_sq_norms(module, hidden())
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)


def test_per_row_path_refuses_a_module_that_mixes_rows():
    class BatchCentred(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(D))

        def forward(self, x):
            return (x - x.mean(0, keepdim=True)) * self.weight

    with pytest.raises(NotImplementedError, match="BatchCentred does not treat the sequences independently"):
        module_sq_norms(BatchCentred(), hidden())
