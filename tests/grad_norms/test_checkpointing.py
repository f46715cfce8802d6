"""Reentrant gradient checkpointing (oblr_trl/grad_norms/hooks.py): the pass runs each reentrant layer under
its own checkpoint and gives per-row autograd's norms (taken on a fresh copy without checkpointing); the model's own
checkpointing is put back exactly, also when the pass fails; no ``.grad`` is written.

Before: refused ("it runs under reentrant gradient checkpointing"), with advice to set ``use_reentrant=False`` that
TRL overrides for PEFT under DeepSpeed ZeRO-3."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from oblr_trl import per_sequence_grad_inner_products, per_sequence_grad_sq_norms
from oblr_trl.grad_norms import engine, hooks as checkpointing, per_sequence_grads
from reference import padded_batch, per_sample_grads, per_sample_sq_norms, within_group_products

VOCAB = 40
REENTRANT = {"use_reentrant": True}


def qwen3(tie: bool = True, layers: int = 2):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tie, pad_token_id=0)
    return Qwen3ForCausalLM(cfg).train()


def functions(model):
    return [vars(layer).get("_gradient_checkpointing_func") for layer in model.model.layers]


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_full_fine_tuning_under_reentrant_checkpointing_is_exact(tie):
    model = qwen3(tie)
    ids, attention, completion_mask = padded_batch(VOCAB)
    fresh = copy.deepcopy(model)  # no checkpointing: per-row autograd there
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=REENTRANT)
    before = functions(model)
    assert all(checkpointing.is_reentrant(f) for f in before) and checkpointing.runs_reentrant(model)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(fresh, ids, attention, completion_mask, 0.7),
                               rtol=1e-5, atol=1e-9)
    products = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=2)  # streamed
    expected = within_group_products(per_sample_grads(fresh, ids, attention, completion_mask), 2)
    torch.testing.assert_close(products.double(), expected, rtol=1e-5, atol=1e-6)
    assert functions(model) == before  # the model's own checkpointing, put back
    assert all(p.grad is None for p in model.parameters())


def test_lora_under_reentrant_checkpointing_is_exact_and_dropout_replays_its_masks():
    """LoRA with its input gradients on (as TRL enables them for PEFT under checkpointing). With LoRA dropout the
    recomputation must draw the forward's masks again: the reentrant pass then gives the non-reentrant pass's norms
    from the same seed (and without dropout, per-row autograd's)."""
    peft = pytest.importorskip("peft")

    def adapted(dropout, reentrant):
        model = peft.get_peft_model(qwen3(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                             lora_dropout=dropout, init_lora_weights="gaussian"))
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.base_model.model.enable_input_require_grads()
        return model.train()

    ids, attention, completion_mask = padded_batch(VOCAB, batch=5)
    model = adapted(0.0, True)
    fresh = copy.deepcopy(model)
    fresh.base_model.model.gradient_checkpointing_disable()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    expected = per_sample_sq_norms(fresh, ids, attention, completion_mask)
    assert expected[[0, 1, 3, 4]].min() > 0
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-9)
    norms = {}
    for reentrant in (True, False):
        model = adapted(0.3, reentrant)
        torch.manual_seed(7)
        norms[reentrant] = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    assert norms[True][[0, 1, 3, 4]].min() > 0
    torch.testing.assert_close(norms[True], norms[False], rtol=1e-5, atol=1e-6)


def test_the_models_checkpointing_is_put_back_when_the_pass_fails(monkeypatch):
    model = qwen3()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=REENTRANT)
    before = functions(model)
    ids, attention, completion_mask = padded_batch(VOCAB)

    real = engine._head_terms

    def failing(*args, **kwargs):
        if not model.training:  # the coverage probe's own pass (eval mode: no checkpointing)
            return real(*args, **kwargs)
        assert all(f is checkpointing.norms_checkpoint for f in functions(model))  # switched inside the pass
        raise RuntimeError("the head failed")

    monkeypatch.setattr(engine, "_head_terms", failing)
    with pytest.raises(RuntimeError, match="the head failed"):
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    assert functions(model) == before


def test_non_reentrant_layers_are_left_as_they_are():
    model = qwen3()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not checkpointing.runs_reentrant(model)
    with checkpointing.norms_checkpointing(list(model.model.layers)) as switched:
        assert switched == []


def test_one_backward_replayed_is_refused_under_reentrant_checkpointing():
    """A second backward of a reentrant checkpoint's graph writes no parameter's .grad: keep_graph is refused (the
    automatic path choice never replays there, tests/test_one_backward.py), never silently wrong."""
    model = qwen3()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=REENTRANT)
    ids, attention, completion_mask = padded_batch(VOCAB)
    with pytest.raises(NotImplementedError, match="non-reentrant"):
        per_sequence_grads(model, ids, attention, completion_mask, stream_group_size=2, keep_graph=True)


class SelfCheckpointed(torch.nn.Module):
    """A module that calls torch's checkpoint in its own forward (not transformers' gradient checkpointing)."""

    def __init__(self, inner, use_reentrant):
        super().__init__()
        self.inner, self.use_reentrant = inner, use_reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.use_reentrant)


def test_a_module_calling_reentrant_checkpoint_itself_is_refused_and_the_advice_works():
    """What the pass's own checkpoint cannot reach: refused naming the model and the call; the advice
    (use_reentrant=False in that call) is exact against per-row autograd."""
    from oblr_trl.grad_norms import UnsupportedModulesError

    ids, attention, completion_mask = padded_batch(VOCAB)
    model = qwen3()
    fresh = copy.deepcopy(model)
    model.model.layers[1].mlp = SelfCheckpointed(model.model.layers[1].mlp, use_reentrant=True)
    with pytest.raises(UnsupportedModulesError, match="use_reentrant=False in that call"):
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    model.model.layers[1].mlp.use_reentrant = False  # the advice
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(fresh, ids, attention, completion_mask),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "LoRA on the banks"])
def test_moe_expert_banks_and_one_backwards_kept_factors_under_reentrant_checkpointing(lora):
    """Qwen3-MoE's expert banks (routed tokens, taken from the recomputation) and the factors one_backward keeps
    (materialize=True): per-row autograd's norms and within-group products."""
    peft = pytest.importorskip("peft")
    from studies.zoo import VOCAB as ZOO_VOCAB, build

    model = build("Qwen3-MoE", False)
    if lora:
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=[], init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model.train()
    fresh = copy.deepcopy(model)
    lm = model.get_base_model() if lora else model
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=REENTRANT)
    lm.enable_input_require_grads()
    ids, attention, completion_mask = padded_batch(ZOO_VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(fresh, ids, attention, completion_mask),
                               rtol=1e-5, atol=1e-9)
    kept = per_sequence_grads(model, ids, attention, completion_mask, materialize=True)
    expected = within_group_products(per_sample_grads(fresh, ids, attention, completion_mask), 2)
    torch.testing.assert_close(kept.inner_products(2).double(), expected, rtol=1e-5, atol=1e-6)
