"""TRL's schedule knobs: gradient accumulation, one generation spanning several optimizer steps, num_iterations > 1."""

import math

import pytest
import torch

from oblr_trl import OBLRPOConfig
from helpers import TOKENIZER, common_args, logged, train
from oblr_trl import OBLRPOTrainer


def test_each_step_uses_exactly_its_own_samples():
    """steps_per_generation=2 > gradient_accumulation_steps=1: one generation of 16 is shuffled and split over two
    optimizer steps; each step's N counts the groups among its own 8 completions, no more."""
    with pytest.warns(UserWarning, match="steps_per_generation"):
        config = OBLRPOConfig(**common_args(max_steps=2, steps_per_generation=2))
    trainer, probe = train(OBLRPOTrainer, config)
    assert len(trainer.generations) == 1 and len(trainer.micro_batches) == 2
    units = [set((mb["oblr_row"] // 4).tolist()) for mb in trainer.micro_batches]
    assert logged(trainer, "oblr/num_samples") == [float(len(u)) for u in units]
    assert sum(len(mb["oblr_row"]) for mb in trainer.micro_batches) == 16  # every completion used once
    assert all(0.0 <= s <= 1.0 for s in logged(trainer, "oblr/lr_scale"))
    assert units[0] | units[1] == set(range(4))


def test_accumulation_spans_micro_batches():
    """gradient_accumulation_steps=2: one optimizer step gathers the contributions of both micro-batches."""
    trainer, probe = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1, gradient_accumulation_steps=2)))
    assert len(trainer.micro_batches) == 2
    assert logged(trainer, "oblr/num_samples") == [4.0]  # 16 completions = 4 groups of 4, all in the one step


def test_num_iterations_reuses_samples_with_a_warning():
    with pytest.warns(UserWarning, match="num_iterations"):
        config = OBLRPOConfig(**common_args(max_steps=2, num_iterations=2))
    trainer, probe = train(OBLRPOTrainer, config)
    assert len(trainer.generations) == 1  # the second step re-uses the first generation (off-policy)
    assert logged(trainer, "oblr/num_samples") == [2.0, 2.0]  # 8 completions per step = 2 groups of 4
    for value in logged(trainer, "oblr/lr_scale"):
        assert 0.0 <= value <= 1.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_peft_lora_trains_with_exact_adapter_norms():
    """A LoRA model through the trainer: the norms pass covers the adapters only, everything finite, lr scaled."""
    import peft  # an install requirement (setup.cfg): missing is a failure, not a skip
    from oblr_trl.demo.tiny import build_model

    model = build_model(TOKENIZER)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, probe = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=2), one_backward=False),
                           model=peft.get_peft_model(model, config))
    assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    gram = trainer.generations[0]["oblr_gram"]
    assert torch.isfinite(gram).all() and gram.abs().max() > 0
    for applied, scale, lr in zip(probe.applied, logged(trainer, "oblr/lr_scale"), logged(trainer, "learning_rate")):
        assert applied == pytest.approx(lr * scale)
