"""one_backward's cost cuts (issue 47), each exact: per-completion SNR units take ||a_i u_i||^2 = a_i^2 ||u_i||^2 from
the norms already formed, instead of forming each row's gradient in blocks of one."""

import pytest
import torch

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.grad_norms.result import PerSequenceGradients
from helpers import common_args, logged, train


def test_completion_units_need_no_per_row_blocks_and_match_two_passes(monkeypatch):
    kwargs = common_args(max_steps=2, max_grad_norm=1e9, bf16=False, optim="sgd", learning_rate=1.0,
                         snr_sample_unit="completion")
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=False))
    block_sizes = []
    accumulate = PerSequenceGradients.accumulate_grad

    def spy(self, scale, group_size=None):
        block_sizes.append(group_size)
        return accumulate(self, scale, group_size)

    monkeypatch.setattr(PerSequenceGradients, "accumulate_grad", spy)
    one, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=True))
    assert one.uses_one_backward and block_sizes and set(block_sizes) == {None}
    assert logged(one, "oblr/num_samples") == logged(two, "oblr/num_samples") == [8.0, 8.0]
    for key in ("oblr/lr_scale", "oblr/snr", "grad_norm", "loss"):
        assert logged(one, key) == pytest.approx(logged(two, key), rel=1e-4, abs=1e-6), key
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
