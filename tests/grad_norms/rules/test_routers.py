"""MoE routers by their logits (oblr_trl/grad_norms/rules/routers.py): alone trainable, against per-row autograd;
a router that mixes tokens or reuses its weight stays on the per-row path."""

import pytest
import torch

from oblr_trl.grad_norms.coverage import how_handled

D = 12


@pytest.mark.parametrize("family", ["Qwen3-MoE", "Mixtral", "DeepSeek-V3", "GLM-4-MoE", "GPT-OSS"])
def test_routers_alone_by_their_logits_equal_per_row_autograd(family):
    """Only the routers trainable, so that their share is the whole norm (in the full model it is a small part)."""
    from oblr_trl import per_sequence_grad_sq_norms
    from oblr_trl.grad_norms.rules import per_row
    from oblr_trl.grad_norms.rules.routers import recognise_router
    from studies.zoo import VOCAB, build
    from reference import padded_batch, per_sample_sq_norms

    model = build(family).requires_grad_(False)
    routers = [m for m in model.modules() if type(m).__name__.endswith(("Router", "TopkRouter"))]
    assert routers and all(recognise_router(r) and how_handled(r) == "routed" for r in routers)
    for router in routers:
        router.requires_grad_(True)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    limit = per_row.MAX_NUMEL
    per_row.MAX_NUMEL = 0  # no per-row fallback: the routers must take their rule
    try:
        ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    finally:
        per_row.MAX_NUMEL = limit
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-9)


def test_routers_that_mix_tokens_or_reuse_their_weight_are_left_to_the_per_row_path():
    class BatchNormalisedRouter(torch.nn.Module):  # logits centred over all tokens: not token by token
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, D))

        def forward(self, x):
            z = torch.nn.functional.linear(x, self.weight)
            z = z - z.mean(0, keepdim=True)
            return z, torch.softmax(z, -1).topk(2, -1).values

    class WeightTwice(BatchNormalisedRouter):  # the weight also enters elsewhere
        def forward(self, x):
            z = torch.nn.functional.linear(x, self.weight) * self.weight.norm()
            return z, torch.softmax(z, -1).topk(2, -1).values

    class RunningSum(BatchNormalisedRouter):  # each token's logits add the earlier tokens' (a prefix alone agrees)
        def forward(self, x):
            z = torch.nn.functional.linear(x, self.weight).cumsum(0)
            return z, torch.softmax(z, -1).topk(2, -1).values

    from oblr_trl.grad_norms.rules.routers import recognise_router

    for router in (BatchNormalisedRouter(), WeightTwice(), RunningSum()):
        assert not recognise_router(router) and how_handled(router) == "per-row"
