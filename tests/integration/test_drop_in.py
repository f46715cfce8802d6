"""The drop-in contract: for each path a GRPOTrainer user exercises, OBLRPOTrainer behaves like GRPOTrainer on the same
tiny setup (run side by side), or refuses at construction with a documented reason."""

import logging
import math
import os

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from helpers import DATASET, TOKENIZER, common_args, length_reward, logged, train
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model
from oblr_trl.loss_terms import LOSS_TYPES

BOTH = [GRPOTrainer, OBLRPOTrainer]


def side_by_side(config_kwargs, **train_kwargs):
    """Train GRPO and OBLR-PO on the same setup; returns both trainers."""
    grpo, _ = train(GRPOTrainer, GRPOConfig(**config_kwargs), **train_kwargs)
    oblr, _ = train(OBLRPOTrainer, OBLRPOConfig(**config_kwargs), **train_kwargs)
    return grpo, oblr


def assert_trained(trainer, steps):
    assert trainer.state.global_step == steps
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    for h in trainer.state.log_history:
        for k, v in h.items():
            if k.startswith("oblr/"):
                assert math.isfinite(v), (k, v)


# --------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("cls", BOTH)
def test_no_args_builds_the_trainers_own_config(cls, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the default configs ask for bf16 on a GPU; construction is what is tested here, on any machine
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    trainer = cls(model=build_model(TOKENIZER), reward_funcs=length_reward, train_dataset=DATASET,
                  processing_class=TOKENIZER)
    expected = OBLRPOConfig if cls is OBLRPOTrainer else GRPOConfig
    assert type(trainer.args) is expected
    if cls is OBLRPOTrainer:
        assert trainer.args.output_dir.endswith("-OBLR-PO") and trainer.args.scale_rewards == "none"


def test_a_grpo_config_is_upgraded_keeping_its_options(tmp_path):
    grpo_config = GRPOConfig(**common_args(output_dir=str(tmp_path), learning_rate=3e-3, loss_type="cispo",
                                           max_completion_length=5, scale_rewards="none"))
    # positional, as GRPOTrainer(model, reward_funcs, args) takes them
    trainer = OBLRPOTrainer(build_model(TOKENIZER), [length_reward], grpo_config, DATASET, processing_class=TOKENIZER)
    assert isinstance(trainer.args, OBLRPOConfig)
    assert (trainer.args.learning_rate, trainer.args.loss_type, trainer.args.max_completion_length) == (3e-3, "cispo", 5)
    assert trainer.args.baseline == "gradient_weighted" and trainer.args.snr_lr


def test_grpo_configs_std_scaling_is_replaced_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="scale_rewards='none'"):
        trainer = OBLRPOTrainer(model=build_model(TOKENIZER), reward_funcs=[length_reward], train_dataset=DATASET,
                                args=GRPOConfig(**common_args(output_dir=str(tmp_path))), processing_class=TOKENIZER)
    assert trainer.args.scale_rewards == "none"


@pytest.mark.parametrize("bad, match", [
    (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation"),
    (dict(scale_rewards="batch"), "scale_rewards"),
])
def test_documented_refusals_at_construction(bad, match):
    with pytest.raises(ValueError, match=match):
        OBLRPOConfig(**common_args(**bad))


def test_the_advice_for_plain_grpo_works():
    """The refusal of std scaling names this combination; it trains, with GRPO's own advantages."""
    config = OBLRPOConfig(**common_args(baseline="mean", leave_one_out=False, snr_lr=False, scale_rewards="group"))
    trainer, _ = train(OBLRPOTrainer, config)
    assert_trained(trainer, 2)


# ------------------------------------------------------------------------------------------------ loss types
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_trains_like_grpo(loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    grpo, oblr = side_by_side(common_args(loss_type=loss_type, **extra))
    assert_trained(grpo, 2)
    assert_trained(oblr, 2)
    assert len(logged(oblr, "oblr/lr_scale")) == 2
    assert logged(oblr, "reward") and logged(grpo, "reward")


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo", "luspo"])
def test_new_loss_types_with_one_backward_match_two_passes(loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    kwargs = common_args(loss_type=loss_type, max_grad_norm=1e9, optim="sgd", learning_rate=1.0, bf16=False, **extra)
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=False))
    one, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=True))
    assert one.uses_one_backward
    for key in ("oblr/lr_scale", "grad_norm"):
        assert logged(one, key) == pytest.approx(logged(two, key), rel=1e-4, abs=1e-6), key


# ------------------------------------------------------------------------------------------ rewards
def two_rewards(completions, **kwargs):
    return [float(len(c[0]["content"]) % 2) for c in completions]


def test_several_reward_functions_with_weights():
    grpo, oblr = side_by_side(common_args(reward_weights=[1.0, 0.5]), reward_funcs=[length_reward, two_rewards])
    assert_trained(oblr, 2)
    assert logged(oblr, "rewards/two_rewards/mean") and logged(grpo, "rewards/two_rewards/mean")


def test_rewards_none_or_nan_in_part():
    def partial(completions, **kwargs):
        return [None if i % 3 == 0 else (float("nan") if i % 5 == 0 else 1.0 * (i % 2)) for i in range(len(completions))]

    grpo, oblr = side_by_side(common_args(), reward=partial)
    assert_trained(oblr, 2)
    assert logged(oblr, "oblr/unscorable")[0] > 0


def test_every_reward_none_survives_checkpoint_and_card(tmp_path):
    """Every reward of every step is None: TRL logs `reward: None`; the checkpoint (model card, plots) still works."""
    def nothing(completions, **kwargs):
        return [None] * len(completions)

    config = common_args(output_dir=str(tmp_path / "out"), save_strategy="steps", save_steps=1)
    grpo, oblr = side_by_side(config, reward=nothing)
    assert_trained(oblr, 2)
    assert os.path.isdir(tmp_path / "out" / "checkpoint-2") and os.path.isfile(tmp_path / "out" / "README.md")
    assert logged(oblr, "oblr/unscorable")[0] == 8  # every completion of the step


# ------------------------------------------------------------------------------ PEFT, callbacks, eval, resume
def test_peft_config_argument():
    import peft  # an install requirement (setup.cfg): missing is a failure, not a skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    grpo, oblr = side_by_side(common_args(), peft_config=lora)
    assert_trained(oblr, 2)
    assert all("lora_" in n for n, p in oblr.model.named_parameters() if p.requires_grad)


class Counter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def test_user_callbacks_run():
    counters = {cls: Counter() for cls in BOTH}
    for cls, counter in counters.items():
        config = (OBLRPOConfig if cls is OBLRPOTrainer else GRPOConfig)(**common_args())
        train(cls, config, callbacks=[counter])
    assert counters[GRPOTrainer].steps == counters[OBLRPOTrainer].steps == 2


def test_evaluation_during_training():
    config = common_args(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)
    grpo, oblr = side_by_side(config, eval_dataset=DATASET.select(range(8)))
    assert logged(oblr, "eval_reward") and logged(grpo, "eval_reward")
    assert all(not k.startswith("oblr/") for h in oblr.state.log_history if "eval_reward" in h for k in h)


def test_checkpoint_and_resume(tmp_path):
    config = common_args(output_dir=str(tmp_path), max_steps=2, save_strategy="steps", save_steps=1)
    straight, _ = train(OBLRPOTrainer, OBLRPOConfig(**config))
    resumed, _ = train(OBLRPOTrainer, OBLRPOConfig(**config), resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.state.global_step == 2
    assert logged(resumed, "oblr/lr_scale")[-1] == pytest.approx(logged(straight, "oblr/lr_scale")[-1], rel=1e-5)


def test_model_card_is_tagged_and_cites_the_paper(tmp_path):
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(output_dir=str(tmp_path))))
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "oblr-po" in card and "2511.23310" in card


# ------------------------------------------------------------------------------- the step size is never skipped
def test_an_optimizer_step_without_its_step_size_is_refused():
    """If a training loop ever steps the optimizer without the SNR step size (e.g. a transformers version that calls
    no hook we override), the step is refused loudly instead of running at the unscaled lr."""
    class Skips(OBLRPOTrainer):
        def _size_step(self, grad_sq_norm):  # simulate a loop where the step size never gets set
            self.step_sizer.samples.reduce_all_ranks()

    with pytest.raises(RuntimeError, match="without its SNR step size"):
        train(Skips, OBLRPOConfig(**common_args()))


def test_bf16_weights_below_the_applied_lr_resolution_warn(caplog):
    model = build_model(TOKENIZER).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        train(OBLRPOTrainer, OBLRPOConfig(**common_args(learning_rate=1e-6, max_steps=1)), model=model)
    assert "rounds away" in caplog.text and "bf16=True" in caplog.text


def test_the_precision_advice_works(caplog):
    """fp32 weights under bf16 autocast (the advice): no warning, and the weights move at the same lr."""
    model = build_model(TOKENIZER)
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING):
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(learning_rate=1e-6, max_steps=2,
                                                                     lr_scale_min=0.5)), model=model)
    assert trainer.args.bf16  # TrainingArguments' default on a CPU with bf16 autocast
    assert "rounds away" not in caplog.text
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(trainer.model.parameters(), before))
    assert moved > 0.5 * sum(b.numel() for b in before)


def test_the_unsized_step_advice_works():
    """The refusal's advice, snr_lr=False: the same loop trains at the scheduled lr."""
    class Skips(OBLRPOTrainer):
        def _size_step(self, grad_sq_norm):
            raise AssertionError("not called with snr_lr=False")

    trainer, probe = train(Skips, OBLRPOConfig(**common_args(snr_lr=False)))
    assert probe.applied == logged(trainer, "learning_rate")


def test_the_fsdp1_advice_needs_no_norms(monkeypatch):
    """FSDP1 is refused with exact norms; its advice (grad_norm_estimator='length', snr_lr=False) computes none, so
    nothing FSDP1 cannot shard is ever asked for (checked here by making every norms entry point fail)."""
    def no_norms(*args, **kwargs):
        raise AssertionError("a norms pass ran")

    monkeypatch.setattr("oblr_trl.one_backward.per_sequence_grads", no_norms)
    monkeypatch.setattr("oblr_trl.norm_passes.per_sequence_grad_inner_products", no_norms)
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(grad_norm_estimator="length", snr_lr=False)))
    assert_trained(trainer, 2)
    assert logged(trainer, "oblr/weight_spread")  # the length-weighted baseline ran
