"""Fused MoE expert banks by their routed tokens (oblr_trl/grad_norms/rules/experts.py), one bank at a time against
per-sequence autograd: squared norms, within-group inner products and the weighted sum one_backward forms."""

import pytest
import torch

from oblr_trl.grad_norms import engine, hooks
from oblr_trl.grad_norms.rules.experts import PerExpert, RoutedCaptures, recognise_bank
from oblr_trl.grad_norms.rules.registry import call_usages
from oblr_trl.grad_norms.coverage import how_handled

B, T, D, K = 4, 6, 12, 2


def _bank(name: str, experts: int = 5):
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    common = dict(hidden_size=D, num_experts_per_tok=K)
    if name == "Qwen3MoeExperts":
        bank = Qwen3MoeExperts(transformers.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=7, **common))
    elif name == "MixtralExperts":
        bank = MixtralExperts(transformers.MixtralConfig(num_local_experts=experts, intermediate_size=7, **common))
    else:
        bank = GptOssExperts(transformers.GptOssConfig(num_local_experts=experts, intermediate_size=7, **common))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(0, 0.5)
    return bank


def _routing(experts: int, skewed: bool = False, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B * T, D, generator=g).requires_grad_(True)  # as in a model: the bank's input carries a gradient
    idx = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(B * T)])
    if skewed:  # sequence 0 sends every token to experts 0 and 1; the others avoid expert 0
        idx[:T] = torch.tensor([0, 1])
        idx[T:][idx[T:] == 0] = experts - 1
        idx[T:, 1] = torch.where(idx[T:, 0] == experts - 1, 2, idx[T:, 1])
    w = torch.rand(B * T, K, generator=g)
    return x, idx, w


def _ours(bank, x, idx, w, r, captured=True):
    """Captured: the bank's routed forward keeps its pairs' factors (as in the norms pass); else they are recomputed
    from the recorded call (as inside checkpointed layers)."""
    handoff = RoutedCaptures()
    with handoff.routed_forwards([bank] if captured else []), hooks.capture([bank], B, calls_of={bank}) as (records, _):
        y = bank(x, idx, w)
        (y * r).sum().backward(inputs=[p for p in bank.parameters() if p.requires_grad])
    bank.zero_grad(set_to_none=True)
    if captured and x.requires_grad and recognise_bank(bank) is not None:
        assert len(handoff.entries.get(bank, [])) == 1
    usages = {}
    for record in records:
        for name, usage in call_usages(bank, record.activation, record.output_grad, B, handoff).items():
            usages.setdefault((bank, name), []).append(usage)
    return engine.PerSequenceGradients(usages, B, x.device,
                                       slots=[(bank, n) for n, p in bank.named_parameters() if p.requires_grad])


def _per_row_grads(bank, x, idx, w, r):
    rows = []
    for b in range(B):
        s = slice(b * T, (b + 1) * T)
        grads = torch.autograd.grad((bank(x[s], idx[s], w[s]) * r[s]).sum(), list(bank.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]).double())
    return torch.stack(rows)


@pytest.mark.parametrize("captured", [True, False], ids=["captured", "recomputed"])
@pytest.mark.parametrize("skewed", [False, True], ids=["random", "skewed"])
@pytest.mark.parametrize("name", ["Qwen3MoeExperts", "MixtralExperts", "GptOssExperts"])
def test_bank_by_routed_tokens_equals_per_row_autograd(name, skewed, captured):
    bank = _bank(name)
    assert how_handled(bank) == "routed"
    x, idx, w = _routing(5, skewed)
    r = torch.randn(B * T, D, generator=torch.Generator().manual_seed(4))
    grads = _ours(bank, x, idx, w, r, captured)
    assert any(isinstance(u, PerExpert) for us in grads.usages.values() for u in us)
    assert "forward" not in vars(bank)  # the routed forward is gone after the pass
    reference = _per_row_grads(bank, x, idx, w, r)
    for k in (1, 2):  # squared norms, and the inner products within groups of 2 (cross terms)
        blocks = reference.reshape(B // k, k, -1)
        torch.testing.assert_close(grads.inner_products(k).double(), blocks @ blocks.transpose(1, 2),
                                   rtol=1e-4, atol=1e-8)
    scale = torch.tensor([0.5, -1.0, 2.0, 0.0])
    sq = grads.accumulate_grad(scale, group_size=2)  # what one_backward forms: sum_i s_i u_i, and ||H_q||^2
    formed = torch.cat([p.grad.flatten() for p in bank.parameters()]).double()
    torch.testing.assert_close(formed, (scale.double()[:, None] * reference).sum(0), rtol=1e-4, atol=1e-6)
    halves = (scale.double()[:, None] * reference).reshape(2, 2, -1).sum(1)
    torch.testing.assert_close(sq.double(), halves.pow(2).sum(-1), rtol=1e-4, atol=1e-8)


def test_a_frozen_gate_up_leaves_only_the_down_projection():
    bank = _bank("Qwen3MoeExperts")
    bank.gate_up_proj.requires_grad_(False)
    x, idx, w = _routing(5)
    r = torch.randn(B * T, D, generator=torch.Generator().manual_seed(4))
    norms = _ours(bank, x, idx, w, r).inner_products(1).reshape(-1).double()
    rows = []
    for b in range(B):
        s = slice(b * T, (b + 1) * T)
        (g,) = torch.autograd.grad((bank(x[s], idx[s], w[s]) * r[s]).sum(), [bank.down_proj])
        rows.append(g.double().pow(2).sum())
    torch.testing.assert_close(norms, torch.stack(rows), rtol=1e-4, atol=1e-8)


def test_a_bank_computing_something_else_is_not_taken_by_the_rule():
    """Shaped like a bank, but the routing weight scales the input of the gate: the probe tells it apart, and the
    bank stays on the exact per-row path (whose norms are exact)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class WeightedBeforeGate(Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for j in range(top_k_index.shape[1]):
                for n in range(hidden_states.shape[0]):
                    e = int(top_k_index[n, j])
                    u = top_k_weights[n, j] * (hidden_states[n] @ self.gate_up_proj[e].T)
                    gate, up = u.chunk(2, dim=-1)
                    out[n] = out[n] + (self.act_fn(gate) * up) @ self.down_proj[e].T
            return out

    reference_bank = _bank("Qwen3MoeExperts")
    bank = WeightedBeforeGate(reference_bank.config)
    bank.load_state_dict(reference_bank.state_dict())
    assert recognise_bank(bank) is None and how_handled(bank) == "per-row"
    x, idx, w = _routing(5)
    r = torch.randn(B * T, D, generator=torch.Generator().manual_seed(4))
    norms = _ours(bank, x, idx, w, r).inner_products(1).reshape(-1).double()
    torch.testing.assert_close(norms, _per_row_grads(bank, x, idx, w, r).pow(2).sum(-1), rtol=1e-4, atol=1e-8)


def test_a_bank_with_all_zero_weights_is_not_recognised():
    """A probe of a degenerate bank (every output zero) proves nothing: the per-row path takes it."""
    bank = _bank("Qwen3MoeExperts")
    with torch.no_grad():
        bank.down_proj.zero_()
    assert recognise_bank(bank) is None and how_handled(bank) == "per-row"
