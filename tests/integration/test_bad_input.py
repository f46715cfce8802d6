"""Input a new user gets wrong, through the real trainer (issue 46): each is refused naming the culprit and the fix,
or trained with a warning that says what happened, never taken silently.

Fully frozen model, a reward function returning strings, a `prompt` column of ints (at construction, and in a batch of
a streamed dataset), a step of identical groups after an informative one, and a step that has stayed tiny for
`STALL_STEPS` steps. (Configuration types: tests/test_config.py; state files and crashes: test_resume.py,
test_save_crash.py.)
"""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset, IterableDataset

from helpers import DATASET, TOKENIZER, common_args, length_reward, logged
from helpers import train as train_trainer
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model
from oblr_trl.setup_checks import check_prompts, check_reward_output
from oblr_trl.snr_formulas import STALL_STEPS


def build(model=None, reward=length_reward, dataset=DATASET, **overrides):
    return OBLRPOTrainer(model=model or build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[reward],
                         args=OBLRPOConfig(**common_args(**overrides)), train_dataset=dataset)


def test_a_fully_frozen_model_is_refused_at_construction():
    model = build_model(TOKENIZER).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters.*requires_grad_\\(True\\).*peft_config"):
        build(model)


def test_a_reward_function_returning_strings_fails_naming_it():
    def say_yes(completions, **kwargs):
        return ["yes"] * len(completions)

    trainer = build(reward=say_yes)
    assert trainer.reward_func_names == ["say_yes"]  # TRL's name for its logs is kept
    with pytest.raises(TypeError, match="Reward function 'say_yes' returned str 'yes' for completion 0.*float"):
        trainer.train()


def test_reward_outputs_that_torch_takes_are_accepted():
    import numpy as np
    import torch

    check_reward_output("f", [1.0, 2, None, True, np.float32(0.5), np.int64(3), torch.tensor(1.5)])
    for bad in (["1.0"], [[1.0, 2.0]], [{"score": 1.0}], [torch.ones(2)]):
        with pytest.raises(TypeError, match="Reward function 'f' returned"):
            check_reward_output("f", bad)


def test_a_prompt_column_of_ints_fails_naming_the_column():
    with pytest.raises(TypeError, match="`prompt` column holds int 0 \\(row 0.*string or a list of chat messages"):
        build(dataset=Dataset.from_list([{"prompt": i} for i in range(16)]))


def test_a_streamed_prompt_column_of_ints_fails_at_its_first_batch_naming_it():
    def rows():
        for i in range(64):
            yield {"prompt": i}

    trainer = build(dataset=IterableDataset.from_generator(rows))
    with pytest.raises(TypeError, match="`prompt` column holds int"):
        trainer.train()
    check_prompts([{"prompt": "2 + 2"}, {"prompt": [{"role": "user", "content": "2 + 2"}]}])  # what is accepted


def test_identical_groups_after_an_informative_step_scale_to_zero_and_warn(caplog):
    """The default ema_soft: the informative first step sets a positive scale; the next steps' groups are all
    identical. Their advantages are exactly 0 (not ulps), so their gradient is 0: scale 0 and warned, counted as
    skipped (before: ~0.25, silently, carried over from the first step)."""
    calls = []

    def informative_then_flat(completions, **kwargs):
        calls.append(1)
        return length_reward(completions) if len(calls) == 1 else [0.3] * len(completions)  # not a power of 2

    args = OBLRPOConfig(**common_args(max_steps=3, gradient_accumulation_steps=2))
    with caplog.at_level(logging.WARNING):
        trainer, _ = train_trainer(OBLRPOTrainer, args, reward=informative_then_flat)
    scales = logged(trainer, "oblr/lr_scale")
    assert scales[0] > 0.05 and scales[1:] == [0.0, 0.0], scales
    assert logged(trainer, "oblr/skipped_fraction")[-1] == pytest.approx(2 / 3)
    assert all(g["advantages"].abs().max() == 0 for g in trainer.generations[1:])
    assert "gradient was exactly 0" in caplog.text


@pytest.mark.parametrize("lr_scale_min", [0.0, 0.05])
def test_a_step_that_stays_tiny_is_warned_after_stall_steps(lr_scale_min, caplog):
    """Every step's scale below 1% (here 0: constant rewards) for STALL_STEPS steps: warned once, saying why and what
    to change; a floor of lr_scale_min=0.05 keeps the step above it, and nothing is said."""
    constant = lambda completions, **kwargs: [0.5] * len(completions)  # noqa: E731
    with caplog.at_level(logging.WARNING):
        trainer, _ = train_trainer(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=STALL_STEPS,
                                                                             lr_scale_min=lr_scale_min)),
                                   reward=constant)
    assert logged(trainer, "oblr/lr_scale") == [lr_scale_min] * STALL_STEPS
    stalled = f"below 1% of the scheduled one (learning_rate) for {STALL_STEPS} steps in a row"
    assert (stalled in caplog.text) == (lr_scale_min == 0.0)
    if lr_scale_min == 0.0:
        assert caplog.text.count(stalled) == 1 and "lr_scale_min" in caplog.text and "more prompts" in caplog.text
