"""Every family of benchmarks/studies/zoo.py, tiny and random, tied and untied, on a padded batch: exact against
per-row autograd, or refused by validate() with advice that is applied here and works."""

import pytest
import torch

from helpers import zoo_trainer as _trainer
from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms import UnsupportedModulesError
from studies.zoo import FAMILIES, VOCAB, build
from reference import padded_batch, per_sample_sq_norms

REFUSED: dict[str, str] = {  # family -> the reason validate() gives
    # before: a bare "RuntimeError: split_with_sizes ..." naming no module
    "JetMoe": r"'model.layers.0.mlp.input_linear' \(JetMoeParallelExperts\): forming its per-sequence gradients "
              r"fails: RuntimeError: split_with_sizes",
}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_is_exact_or_refused(family, tie):
    model = build(family, tie)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    if family in REFUSED:
        with pytest.raises(UnsupportedModulesError, match=REFUSED[family]):
            validate(model)
        with pytest.raises(UnsupportedModulesError, match=REFUSED[family]):
            per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
        return
    assert validate(model) == []
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_refused_familys_advice_works(family):
    """The refusal lists every module at once; freezing them (the advice) leaves a model that is exact."""
    model = build(family)
    found = validate(model, strict=False)
    assert found and all(f.name for f in found)
    for f in found:
        model.get_submodule(f.name).requires_grad_(False)
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("family", ["GPT-Neo", "GPTBigCode"])
def test_position_embeddings_on_shared_ids_are_per_row(family):
    """Before: (1, T) position ids made the hook see one row, and every row got ||sum_b g_b||^2 (rel. error 1.4-3.3)."""
    model = build(family).requires_grad_(False)
    wpe = model.transformer.wpe.requires_grad_(True)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask),
                               rtol=1e-4, atol=1e-9)
    assert wpe.weight.grad is None


def test_peft_lora_and_dora():
    peft = pytest.importorskip("peft")
    for use_dora in (False, True):
        model = peft.get_peft_model(build("Llama", tie=True), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
            use_dora=use_dora))
        ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
        ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
        torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask),
                                   rtol=1e-4, atol=1e-9)


# ------------------------------------------------------------------ the trainer: validate at construction, and advice
class Gain(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.gain


def _with_unsupported_gains(monkeypatch):
    from oblr_trl.demo.tiny import build_model, build_tokenizer
    from oblr_trl.grad_norms.rules import per_row

    monkeypatch.setattr(per_row, "MAX_NUMEL", 0)  # no per-row path: a module without a rule is unsupported
    model = build_model(build_tokenizer())
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), Gain(layer.mlp.up_proj.out_features))
    return model


def test_trainer_construction_names_every_unsupported_module(monkeypatch):
    model = _with_unsupported_gains(monkeypatch)
    with pytest.raises(UnsupportedModulesError) as refused:
        _trainer(model)
    names = [m.name for m in refused.value.modules]
    assert names == [f"layers.{i}.mlp.act_fn.1" for i in range(len(model.model.layers))]
    assert "requires_grad_(False)" in str(refused.value) and "snr_lr=False" in str(refused.value)


@pytest.mark.parametrize("advice", ["freeze", "length-without-snr"])
def test_the_advice_works(monkeypatch, advice):
    model = _with_unsupported_gains(monkeypatch)
    if advice == "freeze":
        for m in model.modules():
            if isinstance(m, Gain):
                m.requires_grad_(False)
        trainer = _trainer(model)
    else:
        trainer = _trainer(model, grad_norm_estimator="length", snr_lr=False)
    trainer.train()
    assert trainer.state.global_step == 2


def test_the_length_proxy_alone_still_needs_norms(monkeypatch):
    """The old advice, grad_norm_estimator='length' with the SNR step still on, does not work: refused at once."""
    with pytest.raises(UnsupportedModulesError):
        _trainer(_with_unsupported_gains(monkeypatch), grad_norm_estimator="length")


@pytest.mark.parametrize("family", ["GPT-Neo", "Qwen3-MoE"])
def test_two_trainer_steps(family):
    from oblr_trl.demo.tiny import build_tokenizer

    model = build(family, tie=True, vocab_size=len(build_tokenizer()))
    trainer = _trainer(model)
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gemma2_softcapped_head_with_a_cap_that_bites(tie):
    """final_logit_softcapping=0.5 puts the tiny model's logits deep in tanh's curve (at the default 30 it is nearly
    linear), so a head that ignored the cap's derivative would be far off."""
    model = build("Gemma2", tie)
    model.config.final_logit_softcapping = 0.5
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-9)
    uncapped = build("Gemma2", tie)  # the same weights scored without the cap (observed): a different answer
    uncapped.config.final_logit_softcapping = None
    uncapped = per_sequence_grad_sq_norms(uncapped, ids, attention, completion_mask, temperature=0.7)
    assert ((uncapped.double() - reference).abs() / reference.clamp_min(1e-12)).max() > 0.1


@pytest.mark.parametrize("family", ["Qwen3-MoE", "GPT-OSS", "GPT-Neo"])
def test_one_backward_equals_two_passes_through_the_per_row_path(family):
    """Families whose small parameters take the exact per-row path (expert banks, attention sinks) or whose position
    embedding runs on (1, T) ids: the update one_backward forms equals the two-pass path's (fp32, SGD)."""
    from oblr_trl.demo.tiny import build_tokenizer

    def spread(completions, **kwargs):  # rewards that differ within a group
        return [float(sum(map(ord, c[0]["content"])) % 5) for c in completions]

    results = []
    for one_backward in (False, True):
        model = build(family, tie=True, vocab_size=len(build_tokenizer()))
        if hasattr(model.config, "router_aux_loss_coef"):
            model.config.router_aux_loss_coef = 0.0  # the router's auxiliary loss blocks one_backward (tested elsewhere)
        trainer = _trainer(model, one_backward=one_backward, bf16=False, optim="sgd", learning_rate=1.0,
                           max_grad_norm=1e9, max_completion_length=6)
        trainer.reward_funcs = [spread]
        trainer.train()
        assert trainer.uses_one_backward is one_backward
        history = [(h["grad_norm"], h["oblr/lr_scale"]) for h in trainer.state.log_history if "oblr/lr_scale" in h]
        results.append((history, [p.detach().clone() for p in model.parameters()]))
    (two, two_params), (one, one_params) = results
    assert any(g > 0 for g, _ in two)
    for (g1, s1), (g2, s2) in zip(one, two, strict=True):
        assert g1 == pytest.approx(g2, rel=1e-4) and s1 == pytest.approx(s2, rel=1e-3, abs=1e-6)
    for p, q in zip(one_params, two_params):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
