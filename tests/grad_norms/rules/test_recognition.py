"""One layer at a time against per-sample autograd (Opacus's ``run_test``: tests/reference.py ``module_sq_norms``)."""

import sys

import pytest
import torch
from torch import nn

from oblr_trl.grad_norms import register_grad_norm_rule
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


def _ids(n=20):
    return torch.randint(0, n, (B, T), generator=torch.Generator().manual_seed(2))


def _transformers_layers():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
    from transformers.pytorch_utils import Conv1D

    return {
        "Phi3RMSNorm": (lambda: Phi3RMSNorm(D), _hidden),
        "Olmo2RMSNorm": (lambda: Olmo2RMSNorm(D), _hidden),
        "GemmaRMSNorm (1 + w)": (lambda: GemmaRMSNorm(D), _hidden),
        "Gemma3RMSNorm (1 + w)": (lambda: Gemma3RMSNorm(D), _hidden),
        "CohereLayerNorm": (lambda: CohereLayerNorm(D), _hidden),
        "Conv1D": (lambda: Conv1D(7, D), _hidden),
        "FalconLinear": (lambda: FalconLinear(D, 7, bias=True), _hidden),
        "Gemma3TextScaledWordEmbedding": (lambda: Gemma3TextScaledWordEmbedding(20, D, padding_idx=0, embed_scale=3.5),
                                          _ids),
    }


LAYERS = {
    "Linear": (lambda: nn.Linear(D, 7), _hidden),
    "Embedding(padding_idx)": (lambda: nn.Embedding(20, D, padding_idx=0), _ids),
    "LayerNorm": (lambda: nn.LayerNorm(D), _hidden),
    "RMSNorm": (lambda: nn.RMSNorm(D, eps=1e-6), _hidden),
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
    module = _randomised(build())
    assert how_handled(module) == "per-row"
    ours, reference = module_sq_norms(module, _hidden())
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)


def test_per_row_path_refuses_a_module_that_mixes_rows():
    class BatchCentred(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(D))

        def forward(self, x):
            return (x - x.mean(0, keepdim=True)) * self.weight

    with pytest.raises(NotImplementedError, match="BatchCentred does not treat the sequences independently"):
        module_sq_norms(BatchCentred(), _hidden())


def test_an_input_shared_by_the_batch_is_expanded_per_row():
    """GPT-Neo's position embedding runs on (1, T) ids: each row's gradient comes from its own output gradient."""
    emb = _randomised(nn.Embedding(20, D))
    shared = torch.arange(T)[None]

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.wpe = emb

        def forward(self, x):
            return x + self.wpe(shared)

    from oblr_trl.grad_norms import hooks

    x = _hidden()
    r = torch.randn(B, T, D)
    model = Positions()
    with hooks.capture([emb], B) as (records, _):
        (model(x) * r).sum().backward(inputs=[emb.weight])
    (record,) = records
    assert record.activation.shape == (B, T) and record.output_grad.shape == (B, T, D)
    torch.testing.assert_close(record.output_grad, r)  # per row, not summed over the batch


def test_a_leading_dimension_that_is_not_the_batch_is_refused_by_name():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x.reshape(-1, 3, D))  # B*T = 20 rows regrouped by 3: no per-sequence layout

    from oblr_trl.grad_norms import hooks

    model = Odd()
    x = torch.randn(3, 4, D)  # a batch of 3 sequences of 4 tokens regrouped as 4 rows of 3: 4 is no multiple of 3
    with pytest.raises(hooks.RowsError, match="Linear's input has leading dimension 4") as refused:
        with hooks.capture([model.lin], 3) as _:
            model(x).sum().backward()
    assert refused.value.module is model.lin
    with hooks.capture([model.lin], 3) as (records, _):  # no gradient reaches it (as DoRA's detached weight norm):
        model(x).detach()  # no refusal, nothing recorded
    assert records == []


def test_registering_a_rule_twice_raises():
    class Mine(nn.Module):
        pass

    register_grad_norm_rule(Mine)(lambda layer, a, g: {})
    with pytest.raises(ValueError, match="already registered"):
        register_grad_norm_rule(Mine)(lambda layer, a, g: {})
    with pytest.raises(ValueError, match="already registered"):
        register_grad_norm_rule(nn.Linear)(lambda layer, a, g: {})


def test_a_sequence_first_layout_is_refused_not_mistaken_for_flattened_tokens():
    """(T, B, d) with T a multiple of B must not be reshaped to (B, T/B*..., d): that would pair the wrong tokens."""
    from oblr_trl.grad_norms import hooks

    lin = nn.Linear(D, D)
    with pytest.raises(hooks.RowsError, match="Linear's input has leading dimension 8"):
        with hooks.capture([lin], 4) as _:
            lin(torch.randn(8, 4, D)).sum().backward()  # sequence-first: 8 tokens of a batch of 4


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
