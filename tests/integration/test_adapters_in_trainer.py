"""Adapters the TRL way, end to end (issue 55): OBLRPOTrainer built from a model folder with
``model_init_kwargs={"quantization_config": ...}`` and ``peft_config`` (QLoRA), or with a soft prompt's
``peft_config``; the baseline weights of a real training batch (its per-sequence squared norms, ``oblr_gram``'s
diagonal) checked against per-row autograd at the parameters they were taken at."""

import pytest
import torch

from helpers import DATASET, TOKENIZER, common_args, length_reward, train
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model
from reference import per_sample_sq_norms

peft = pytest.importorskip("peft")


def batch_norms_against_autograd(trainer, initial):
    """The first generation batch's norms, and per-row autograd's on the trainer's model with its trainable
    parameters put back to ``initial`` (those the batch was scored at)."""
    gen = trainer.generations[0]
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if name in initial:
                p.copy_(initial[name])
    ids = torch.cat([gen["prompt_ids"], gen["completion_ids"]], 1)
    attention = torch.cat([gen["prompt_mask"], gen["completion_mask"]], 1)
    trainer.model.eval()
    expected = per_sample_sq_norms(trainer.model, ids, attention, gen["completion_mask"],
                                   temperature=trainer.args.temperature)
    group = trainer.args.num_generations
    gram = gen["oblr_gram"].reshape(-1, group, group)
    return torch.diagonal(gram, dim1=1, dim2=2).reshape(-1).double(), expected


class Snapshot(OBLRPOTrainer):
    def train(self, *a, **k):
        self.initial = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return super().train(*a, **k)


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
def test_qlora_the_trl_way_trains_on_exact_norms(tmp_path, quant):
    """TRL casts a QLoRA model's adapters to bf16 (grpo_trainer.py, "converted to bf16 to follow the recommendations
    from the original paper"): the batch's norms are those of bf16 weights, against per-row autograd's of the same
    bf16 weights within bf16's rounding; and the same batch with the model upcast to float32 (the probe's reference,
    model.float32_mode) is exact to 1e-5."""
    from oblr_trl import per_sequence_grad_sq_norms
    from oblr_trl.grad_norms.model import float32_mode

    bnb_config = pytest.importorskip("transformers").BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)
    pytest.importorskip("bitsandbytes")
    folder = tmp_path / "tiny"
    build_model(TOKENIZER).save_pretrained(folder)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM",
                           init_lora_weights="gaussian")
    args = OBLRPOConfig(**common_args(max_steps=1, bf16=False), one_backward=False,
                        model_init_kwargs={"quantization_config": bnb_config, "dtype": torch.float32})
    trainer, _ = train(Snapshot, args, model=str(folder), peft_config=lora)
    assert any("Linear4bit" in type(m).__name__ for m in trainer.model.modules())
    assert {p.dtype for p in trainer.initial.values()} == {torch.bfloat16}
    ours, expected = batch_norms_against_autograd(trainer, trainer.initial)
    assert expected.max() > 0
    torch.testing.assert_close(ours, expected, rtol=1e-2, atol=1e-10)
    gen = trainer.generations[0]
    ids = torch.cat([gen["prompt_ids"], gen["completion_ids"]], 1)
    attention = torch.cat([gen["prompt_mask"], gen["completion_mask"]], 1)
    lm = trainer.model.get_base_model()
    with float32_mode(lm) as upcast:
        assert upcast
        wide = per_sequence_grad_sq_norms(trainer.model, ids, attention, gen["completion_mask"],
                                          temperature=args.temperature).double()
        reference = per_sample_sq_norms(trainer.model, ids, attention, gen["completion_mask"],
                                        temperature=args.temperature)
    torch.testing.assert_close(wide, reference, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("kind", ["prompt", "p-tuning"])
def test_soft_prompts_train_on_exact_norms(kind):
    config = (peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4) if kind == "prompt" else
              peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16))
    args = OBLRPOConfig(**common_args(max_steps=1, bf16=False), one_backward=False)
    trainer, _ = train(Snapshot, args, model=build_model(TOKENIZER), peft_config=config)
    ours, expected = batch_norms_against_autograd(trainer, trainer.initial)
    assert expected.max() > 0
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-10)


def test_prefix_tuning_fails_in_grpo_trainer_itself():
    """Why prefix tuning is refused rather than covered: TRL 1.16's GRPOTrainer fails on it in its first forward.
    When this test fails, GRPOTrainer has learned to train it, and OBLR-PO should cover it too."""
    from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[length_reward],
                          args=GRPOConfig(**common_args(max_steps=1)), train_dataset=DATASET,
                          peft_config=peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(RuntimeError, match="must match the size"):
        trainer.train()


def test_the_soft_prompt_advice_without_exact_norms_works():
    """The refusal's other advice for a soft prompt the pass does not cover: no exact norms, no SNR step."""
    args = OBLRPOConfig(**common_args(max_steps=1), grad_norm_estimator="length", snr_lr=False)
    trainer, _ = train(OBLRPOTrainer, args, model=build_model(TOKENIZER),
                       peft_config=peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert trainer.state.global_step == 1


@pytest.mark.parametrize("config", [dict(gradient_checkpointing=False),
                                    dict(gradient_checkpointing_kwargs={"use_reentrant": True})],
                         ids=["model's own checkpointing", "use_reentrant=True in the config"])
def test_qlora_prepared_with_its_defaults_trains_on_exact_norms(tmp_path, config, monkeypatch):
    """PEFT's QLoRA recipe, `prepare_model_for_kbit_training(model)` with its defaults, turns on reentrant gradient
    checkpointing. Asked for in the config too (as TRL forces it for PEFT under DeepSpeed ZeRO-3), the norms pass
    runs every layer under its own reentrant checkpoint, each step, and the model still runs reentrant after; with
    checkpointing left to the model, TRL's generation turns it back on with the config's kwargs (non-reentrant) from
    the first step. Either way it trains, on norms that are per-row autograd's (of TRL's bf16 adapters, within bf16's
    rounding). (Before: refused wherever the norms pass met reentrant checkpointing.)"""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from oblr_trl.grad_norms import hooks as checkpointing
    from oblr_trl.grad_norms.hooks import runs_reentrant

    pytest.importorskip("bitsandbytes")
    layers_run = []  # each layer run under the norms pass's own reentrant checkpoint
    monkeypatch.setattr(checkpointing, "norms_checkpoint",
                        lambda *a, real=checkpointing.norms_checkpoint: layers_run.append(1) or real(*a))
    folder = tmp_path / "tiny"
    build_model(TOKENIZER).save_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    base = peft.prepare_model_for_kbit_training(base)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      lora_dropout=0.0, init_lora_weights="gaussian"))
    assert runs_reentrant(model)
    args = OBLRPOConfig(**common_args(max_steps=2, bf16=False), one_backward=False, **config)
    trainer, _ = train(Snapshot, args, model=model)
    assert trainer.state.global_step == 2
    if config.get("gradient_checkpointing_kwargs"):
        assert runs_reentrant(trainer.model)
        assert len(layers_run) >= 2 * len(trainer.model.get_base_model().model.layers)  # each step's norms pass
    ours, expected = batch_norms_against_autograd(trainer, trainer.initial)
    assert expected.max() > 0
    torch.testing.assert_close(ours, expected, rtol=1e-2, atol=1e-10)


def test_trainable_tokens_on_tied_embeddings_fail_in_grpo_trainers_loss_and_train_on_one_backward():
    """trainable_token_indices on tied embeddings (exact norms: tests/grad_norms/test_peft.py). TRL 1.16's
    GRPOTrainer fails on it in its first loss forward (its fused head reads ``lm_head.bias``, which PEFT's
    TrainableTokensWrapper lacks), and so does OBLRPOTrainer's two-pass path, which runs TRL's loss; one_backward
    (the CPU's automatic choice here) forms the update from the norms pass itself (per-row autograd's update:
    tests/test_one_backward.py) and trains. When the GRPOTrainer case fails, TRL has learned to train it: OBLR-PO's
    two-pass path should then be tested training it."""
    from trl import GRPOConfig, GRPOTrainer

    def trainer(cls, config, **kwargs):
        torch.manual_seed(0)
        model = peft.get_peft_model(build_model(TOKENIZER), peft.LoraConfig(
            r=4, target_modules=["q_proj"], trainable_token_indices=[5, 6, 7], task_type="CAUSAL_LM"))
        return cls(model=model, processing_class=TOKENIZER, reward_funcs=[length_reward], train_dataset=DATASET,
                   args=config(**common_args(max_steps=1, bf16=False), **kwargs))

    for failing in (trainer(GRPOTrainer, GRPOConfig), trainer(OBLRPOTrainer, OBLRPOConfig, one_backward=False)):
        with pytest.raises(AttributeError, match="'TrainableTokensWrapper' object has no attribute 'bias'"):
            failing.train()
    one = trainer(OBLRPOTrainer, OBLRPOConfig, lr_scale_min=0.5)  # the rows move even where the SNR is ~0
    rows = one.model.get_base_model().model.embed_tokens.token_adapter.trainable_tokens_delta["default"]
    before = rows.detach().clone()
    one.train()
    assert one.uses_one_backward and one.state.global_step == 1
    assert not torch.equal(rows.detach(), before) and torch.isfinite(rows).all()
