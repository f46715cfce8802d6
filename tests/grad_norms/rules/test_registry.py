"""Where the rules register (oblr_trl/grad_norms/rules/registry.py): a type registered once, a new layer rule in a
module of its own used as it is, and the call rules' one registry, each of which can be switched off."""

import sys

import pytest
import torch
from torch import nn

from oblr_trl import per_sequence_grad_sq_norms
from oblr_trl.grad_norms import register_grad_norm_rule
from oblr_trl.grad_norms.coverage import how_handled
from studies.zoo import VOCAB, build
from reference import padded_batch, per_sample_sq_norms


def _exact(model):
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)


def test_registering_a_rule_twice_raises():
    class Mine(nn.Module):
        pass

    register_grad_norm_rule(Mine)(lambda layer, a, g: {})
    with pytest.raises(ValueError, match="already registered"):
        register_grad_norm_rule(Mine)(lambda layer, a, g: {})
    with pytest.raises(ValueError, match="already registered"):
        register_grad_norm_rule(nn.Linear)(lambda layer, a, g: {})


# ---------------------------------------------------------------------- a new layer rule is one module, used as it is
TOY_RULE = '''
"""A layer family of its own, outside the package: one module, nothing else touched."""
import torch
from torch import nn

from oblr_trl.grad_norms.factors import Dense, Factored
from oblr_trl.grad_norms.rules.registry import register_grad_norm_rule


class Mix(nn.Module):
    """``y = x M^T``, its matrix a bare parameter ``mix`` (no nn.Linear: no rule of the package knows it)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)

    def forward(self, x):
        return x @ self.mix.T


CALLS = []


@register_grad_norm_rule(Mix, cost=lambda layer: (layer.mix.shape[1], layer.mix.shape[0], layer.mix.requires_grad))
def mix_rule(layer, activation, output_grad):
    CALLS.append(layer)
    tokens = lambda t: t.reshape(t.shape[0], -1, t.shape[-1])
    return {"mix": Factored(Dense(tokens(output_grad)), Dense(tokens(activation)))}
'''


def test_a_rule_added_in_a_module_of_its_own_is_used_exactly_and_counted_by_the_cost_model(tmp_path, monkeypatch):
    """A new layer rule touches one file: a module that registers it (with its cost). The pass takes the layer by it
    (not the per-row fallback), the norms equal per-sample autograd's, and the path choice counts its map."""
    import importlib

    from oblr_trl import per_sequence_grad_sq_norms
    from oblr_trl.grad_norms.rules import registry
    from oblr_trl.path_choice import describe
    from reference import padded_batch, per_sample_sq_norms
    from studies.zoo import VOCAB, build

    (tmp_path / "toy_mix_rule.py").write_text(TOY_RULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = importlib.import_module("toy_mix_rule")
    try:
        model = build("Qwen3")
        mlp = model.model.layers[0].mlp
        mlp.down_proj = toy.Mix(mlp.down_proj.in_features, mlp.down_proj.out_features)
        assert how_handled(mlp.down_proj) == "rule"
        ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
        ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
        assert mlp.down_proj in toy.CALLS
        torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask).double(),
                                   rtol=1e-4, atol=1e-6)
        first_layer_maps = describe(model, 4, 5, 7, 2, False, 2).linears
        assert (48, 32, True) in first_layer_maps and len(first_layer_maps) == 7
    finally:
        del registry.GRAD_NORM_RULES[toy.Mix]
        registry.RULE_COSTS.pop(toy.mix_rule)
        sys.modules.pop("toy_mix_rule")


# ------------------------------------------------------------------ one registry for call rules, and switching one off
def test_call_rules_are_registered_once_and_can_be_switched_off():
    from oblr_trl.grad_norms.rules import registry
    from oblr_trl.grad_norms.coverage import how_handled

    assert list(registry.CALL_RULES) == ["expert_bank", "lora_expert_bank", "router"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register_call_rule("router", lambda m: False)(lambda *a: {})
    with pytest.raises(ValueError, match="No rule named"):
        with registry.switched_off("no_such_rule"):
            pass
    model = build("Qwen3-MoE")
    bank = model.model.layers[0].mlp.experts
    lin = model.model.layers[0].self_attn.q_proj
    assert how_handled(bank) == "routed" and how_handled(lin) == "rule"
    with registry.switched_off("expert_bank", "linear_rule"):  # a Linear then passes the router rule's probe
        assert how_handled(bank) == "per-row" and how_handled(lin) == "routed"
    with registry.switched_off("expert_bank", "linear_rule", "router"):
        assert how_handled(bank) == "per-row" and how_handled(lin) == "per-row"
        _exact(model)  # the per-row path stands in, exactly
    assert how_handled(bank) == "routed" and how_handled(lin) == "rule"
