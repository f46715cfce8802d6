"""A TrainerCallback that changes the model between two steps (unfreezing a layer under TRL's default bf16 autocast,
with and without gradient checkpointing; an MLP patched to use a weight functionally): every step's exact norms equal
per-row autograd's on the model as it is at that step, and the one_backward update equals the two-pass update (GRPO's
own backward). A hook on the LM head, which TRL's loss (its fused head) never calls, is refused by name at the step
that first meets it, with the model as that step found it; removing the hook, as the refusal advises, trains on."""

import pytest
import torch
from transformers import TrainerCallback

from oblr_trl import OBLRPOConfig, OBLRPOTrainer, norm_passes
from oblr_trl.demo.tiny import build_model
from oblr_trl.grad_norms import UnsupportedModulesError
from helpers import DATASET, GROUP, TOKENIZER, common_args, recording, train
from reference import per_sample_grads, within_group_products


class ChangeAtStep(TrainerCallback):
    """Calls ``change(model)`` before step ``step`` (1-based) begins."""

    def __init__(self, change, step=2):
        self.change, self.step, self.model = change, step, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            self.change(model)


class GradientRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]))


def token_reward(completion_ids, **kwargs):
    """The mean token id of the completion: distinct completions score differently (the default reward, a count of
    '1' and '2', was 0 for every completion at steps 2-3 of the head-hook runs, so the update was exactly 0 on both
    paths and the comparison 0/0)."""
    return [sum(ids) / max(len(ids), 1) for ids in completion_ids]


def assert_rewards_vary_within_groups(trainer):
    """Every step's every group has rewards that differ: each step's update is a real one to compare."""
    for step, gen in enumerate(trainer.generations, 1):
        rewards = gen["rewards"].sum(1).reshape(-1, GROUP)
        assert (rewards.max(1).values > rewards.min(1).values).all(), (step, rewards)


def unfreeze_attention(model):
    model.model.layers[0].self_attn.requires_grad_(True)


def functional_mlp(model):
    """Layer 1's MLP patched to apply its down projection's weight itself (that projection's forward never runs)."""
    import torch.nn.functional as F

    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: F.linear(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight)


def judged_norms(monkeypatch):
    """The two-pass norms pass recorded: each call's products next to per-row autograd's on the model at that
    moment, under the same autocast (relative error of each call's products)."""
    errors = []
    real = norm_passes.per_sequence_grad_inner_products

    def judged(model, input_ids, attention_mask, completion_mask, *, group_size=1, temperature=1.0, **kwargs):
        products = real(model, input_ids, attention_mask, completion_mask, group_size=group_size,
                        temperature=temperature, **kwargs)
        rows = per_sample_grads(model, input_ids, attention_mask, completion_mask, temperature)
        expected = within_group_products(rows, group_size)
        errors.append(float((products.double() - expected).norm() / expected.norm()))
        return products

    monkeypatch.setattr(norm_passes, "per_sequence_grad_inner_products", judged)
    return errors


def counted_probes(monkeypatch):
    """How many times the coverage probe runs (construction, then each model state first seen in a step)."""
    from oblr_trl.grad_norms import coverage

    calls = []
    real = coverage.probe
    monkeypatch.setattr(coverage, "probe", lambda model: calls.append(1) or real(model))
    return calls


def run(change, one_backward, ckpt, monkeypatch=None):
    model = build_model(TOKENIZER)
    model.model.layers[0].self_attn.requires_grad_(False)
    errors = judged_norms(monkeypatch) if monkeypatch is not None else None
    grads = GradientRecorder()
    args = OBLRPOConfig(**common_args(max_steps=3, bf16=True, gradient_checkpointing=ckpt, max_grad_norm=1e9,
                                      optim="sgd", learning_rate=1e-3), one_backward=one_backward)
    trainer, _ = train(OBLRPOTrainer, args, reward=token_reward, model=model, callbacks=[ChangeAtStep(change), grads])
    return trainer, grads.grads, errors


@pytest.mark.parametrize("change, ckpt", [(unfreeze_attention, False), (unfreeze_attention, True),
                                          (functional_mlp, False)],
                         ids=["unfreeze", "unfreeze-checkpointing", "functional-mlp"])
def test_a_change_mid_run_keeps_the_norms_and_the_update_exact(change, ckpt, monkeypatch):
    probes = counted_probes(monkeypatch)
    two, two_grads, errors = run(change, False, ckpt, monkeypatch)
    assert len(probes) <= 3, len(probes)  # construction, the trainer's preparation, the change
    assert len(errors) == 3 and max(errors) <= 3e-2, errors  # bf16 autocast: per-row autograd in bf16 alike
    one, one_grads, _ = run(change, True, ckpt)
    assert one.uses_one_backward and not two.uses_one_backward
    assert_rewards_vary_within_groups(two)
    assert_rewards_vary_within_groups(one)
    assert len(one_grads) == len(two_grads) == 3
    for step, (a, b) in enumerate(zip(one_grads, two_grads), 1):
        assert a.shape == b.shape, step
        assert float(b.norm()) > 0, step  # a step whose update is 0 would judge nothing
        error = float((a - b).norm()) / float(b.norm())
        assert error <= 3e-2, (step, error)


class HookHeadOnce(TrainerCallback):
    """Before step 2 of the first ``train()`` only: a forward hook doubling the LM head's output (the model's own
    logits, and so generation, see it; TRL's fused head, its loss, does not), and a copy of every tensor of the model
    as the step finds it."""

    def __init__(self):
        self.handle, self.before = None, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.handle is None and state.global_step + 1 == 2:
            self.handle = model.lm_head.register_forward_hook(lambda module, args, output: 2 * output)
            self.before = {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("one_backward, ckpt", [(False, False), (True, True)],
                         ids=["two-pass", "one_backward-checkpointing"])
def test_a_head_hook_mid_run_is_refused_by_name_and_removing_it_trains_on(one_backward, ckpt, monkeypatch):
    """TRL's loss scores completions from lm_head.weight (its fused head) and never calls the head's forward: with a
    x2 hook on the head, the norms of the model's own logits are not those of the loss GRPO differentiates (the
    one_backward update came out about 2x GRPO's). The step that first meets the hook refuses it, naming lm_head and
    the fix, before any update: the model is as that step found it. With the hook removed, training goes on, and every
    step's norms equal per-row autograd's."""
    model = build_model(TOKENIZER)
    hook = HookHeadOnce()
    errors = judged_norms(monkeypatch)
    args = OBLRPOConfig(**common_args(max_steps=3, bf16=True, gradient_checkpointing=ckpt, max_grad_norm=1e9,
                                      optim="sgd", learning_rate=1e-3), one_backward=one_backward)
    trainer = recording(OBLRPOTrainer)(model=model, processing_class=TOKENIZER, reward_funcs=[token_reward], args=args,
                                       train_dataset=DATASET, callbacks=[hook])
    assert trainer.uses_one_backward == one_backward
    with pytest.raises(UnsupportedModulesError) as refused:
        trainer.train()
    assert [m.name for m in refused.value.modules] == ["lm_head"], str(refused.value)
    assert "fused LM head" in str(refused.value) and ".remove()" in str(refused.value), str(refused.value)
    assert trainer.state.global_step == 1
    after = model.state_dict()
    assert after.keys() == hook.before.keys()
    for name, value in hook.before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
    assert len(model.lm_head._forward_hooks) == 1  # the user's hook, left where it was
    hook.handle.remove()  # the advice
    errors.clear()
    trainer.train()
    assert trainer.state.global_step == 3
    if not one_backward:  # the two-pass norms pass, judged at every step
        assert len(errors) == 3 and max(errors) <= 3e-2, errors


def test_an_unchanged_model_is_probed_once_more_after_the_trainers_preparation(monkeypatch):
    """The probe runs at construction and once more where the trainer prepares the model for training (Accelerate's
    wrapped forward, checkpointing's hooks): a model state first seen; never again while the model stays as it is."""
    probes = counted_probes(monkeypatch)
    run(lambda model: None, False, True)
    assert len(probes) <= 2, len(probes)

