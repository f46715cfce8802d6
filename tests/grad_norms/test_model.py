"""The model resolved once (oblr_trl/grad_norms/model.py, ``view_of``): a pass looks up the model's parts under its
wrappers at most 3 times once its view is built, and the view is built again whenever what it holds changes: the
trainable set, an adapter added or switched, PEFT's ``modules_to_save`` head, another wrapper, a copy of the model."""

import collections
import copy
import gc
import sys
import weakref

import peft
import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

import oblr_trl.grad_norms.model as model_module
from oblr_trl.grad_norms.model import output_head
from oblr_trl.grad_norms import per_sequence_grads
from oblr_trl.grad_norms.model import plan_of, view_of

CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
FIELDS = ("outer", "lm", "backbone", "head", "head_wrapper", "config", "prompted")


def _qwen3(seed=0):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**CONFIG)).float().train()


def _lora(seed=0, **kwargs):
    return peft.get_peft_model(_qwen3(seed), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], **kwargs))


def _batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, CONFIG["vocab_size"], (4, 12), generator=generator)
    return ids, torch.ones_like(ids), torch.ones(4, 6, dtype=torch.long)


LM_PARTS = {"unwrap_distributed", "unwrap_causal_lm", "under_peft", "output_head", "text_config", "backbone_of"}


def lm_calls(model) -> collections.Counter:
    """The calls of model.py's functions that find a part of the model under its wrappers (:data:`LM_PARTS`) during
    one pass (api.per_sequence_grads: coverage check and engine), by function name, counted with sys.setprofile."""
    counts = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == model_module.__file__ and frame.f_code.co_name in LM_PARTS:
            counts[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        per_sequence_grads(model, *_batch())
    finally:
        sys.setprofile(None)
    return counts


def _fresh(model):
    """The view resolved from scratch (the kept one dropped)."""
    plan_of(model).view = None
    return view_of(model)


def _same(view, other) -> bool:
    return all(getattr(view, f) is getattr(other, f) for f in FIELDS) and view.trainable == other.trainable


@pytest.mark.parametrize("build", [_qwen3, _lora], ids=["full", "lora"])
def test_a_warm_pass_looks_the_model_up_at_most_3_times_in_lm(build):
    model = build()
    cold = lm_calls(model)  # the first pass builds the view (and checks coverage)
    warm = lm_calls(model)
    assert sum(warm.values()) <= 3, warm
    assert sum(cold.values()) > sum(warm.values())  # the counter sees those calls


def test_a_ddp_like_wrapper_reads_the_same_view():
    class Wrapper(nn.Module):  # as DistributedDataParallel: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = _lora()
    lm_calls(model)
    wrapped = Wrapper(model)
    assert view_of(wrapped) is view_of(model)
    assert sum(lm_calls(wrapped).values()) <= 3


def test_the_trainable_set_changed_is_resolved_again():
    model = _qwen3()
    before = view_of(model)
    model.model.layers[0].mlp.requires_grad_(False)
    after = view_of(model)
    assert after is not before and after.trainable == _fresh(model).trainable
    assert not any(".layers.0.mlp." in n for n in after.trainable)


def test_the_view_says_whether_a_parameter_holds_quantized_codes():
    model = _qwen3()
    assert not view_of(model).quantized
    codes = nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)  # 4-bit weights' packed bytes
    model.model.layers[0].mlp.down_proj.register_parameter("codes", codes)
    assert view_of(model).quantized and _fresh(model).quantized


def test_an_adapter_added_and_switched_is_resolved_again():
    model = _lora()
    first = view_of(model)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    added = view_of(model)
    assert added is not first and added.module_ids != first.module_ids
    model.set_adapter("second")
    switched = view_of(model)
    assert switched is not added and any("second" in n for n in switched.trainable)
    assert _same(switched, _fresh(model))


def test_the_modules_to_save_head_follows_the_active_adapter_and_its_switch():
    model = _lora(modules_to_save=["lm_head"])
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    wrapper = model.base_model.model.lm_head
    assert view_of(model).head is wrapper.modules_to_save["default"]
    model.set_adapter("second")
    assert view_of(model).head is wrapper.modules_to_save["second"]
    with model.disable_adapter():  # the wrapper then runs its original head: what output_head gives, as before
        assert view_of(model).head is output_head(model.get_base_model()) is not wrapper.modules_to_save["second"]
    assert view_of(model).head is wrapper.modules_to_save["second"]


def test_a_copy_of_the_model_gets_its_own_view():
    model = _lora()
    view = view_of(model)
    twin = copy.deepcopy(model)
    twin_view = view_of(twin)
    assert twin_view is not view and twin_view.lm is twin.get_base_model() and twin_view.outer is twin
    assert set(twin_view.module_ids).isdisjoint(view.module_ids)


def test_norms_are_the_same_from_a_kept_view_and_a_fresh_one():
    model = _lora(modules_to_save=["lm_head"])
    lm_calls(model)
    kept = per_sequence_grads(model, *_batch()).inner_products(1)
    plan_of(model).view = None
    fresh = per_sequence_grads(model, *_batch()).inner_products(1)
    assert torch.equal(kept, fresh)


@pytest.mark.parametrize("build", [_qwen3, _lora], ids=["full", "lora"])
def test_a_deleted_model_is_freed_without_the_garbage_collector(build):
    """The view is kept on the model's own plan: it holds the model by weak references, or the model, its plan and
    its view would be a cycle that keeps the weights until the collector runs."""
    model = build()
    lm_calls(model)
    lm_calls(model)
    gc.collect()
    gc.disable()
    try:
        ref = weakref.ref(model)
        del model
        assert ref() is None
    finally:
        gc.enable()
