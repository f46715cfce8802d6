"""`loss_terms` pinned to TRL's own loss: d(TRL's `_compute_loss`) / d(log pi_t) = -c_i A_i at ratio 1, per loss type.

If TRL changes how a loss type normalizes, this fails, instead of the SNR silently using wrong coefficients.
"""

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from helpers import DATASET, TOKENIZER, common_args, length_reward
from oblr_trl.demo.tiny import build_model
from oblr_trl.loss_terms import LOSS_TYPES, loss_coefficients, sequence_shape


def trl_loss_gradient(loss_type, mask, advantages, accumulation=2, steps_per_generation=2, **config):
    """d loss / d per_token_logps of TRL's `_compute_loss` at ratio 1, per token, for a fake micro-batch."""
    args = GRPOConfig(**common_args(loss_type=loss_type, gradient_accumulation_steps=accumulation,
                                    steps_per_generation=steps_per_generation, **config))
    trainer = GRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[length_reward],
                          args=args, train_dataset=DATASET)
    trainer.current_gradient_accumulation_steps = accumulation
    batch, length = mask.shape
    logps = (-torch.rand(batch, length, dtype=torch.float64) - 0.1).requires_grad_()

    def fake_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return logps, torch.ones_like(logps), None

    trainer._get_per_token_logps_and_entropies = fake_logps
    inputs = {
        "prompt_ids": torch.ones(batch, 2, dtype=torch.long), "prompt_mask": torch.ones(batch, 2, dtype=torch.long),
        "completion_ids": torch.ones(batch, length, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "num_items_in_batch": mask.sum() * 3,  # a generation batch larger than this one
    }
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs)
    (grad,) = torch.autograd.grad(loss, logps)
    return grad, trainer


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_coefficients_are_trl_loss_gradients_at_ratio_one(loss_type):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    advantages = torch.tensor([0.7, -1.3, 0.4, 2.0], dtype=torch.float64)
    config = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    grad, trainer = trl_loss_gradient(loss_type, mask, advantages, **config)
    c = loss_coefficients(
        loss_type, mask, accumulation_steps=2, num_processes=1, steps_per_generation=2,
        max_completion_length=trainer.max_completion_length, num_items_in_batch=mask.sum() * 3,
        epsilon_high=trainer.epsilon_high,
    )
    expected = -(c.double() * advantages)[:, None] * mask
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_level_importance_sampling_has_the_same_gradient_at_ratio_one(loss_type):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    advantages = torch.tensor([0.5, -1.0], dtype=torch.float64)
    token, _ = trl_loss_gradient(loss_type, mask, advantages)
    sequence, _ = trl_loss_gradient(loss_type, mask, advantages, importance_sampling_level="sequence")
    torch.testing.assert_close(token, sequence)


def test_sequence_shape_and_refusal():
    lengths = torch.tensor([4, 1, 0])
    torch.testing.assert_close(sequence_shape("grpo", lengths), torch.tensor([0.25, 1.0, 1.0]))
    torch.testing.assert_close(sequence_shape("dapo", lengths), torch.ones(3))
    with pytest.raises(ValueError, match="loss_type='ppo'.*dapo"):
        sequence_shape("ppo", lengths)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        loss_coefficients("dapo", torch.ones(2, 2), accumulation_steps=1, num_processes=1, steps_per_generation=1,
                          max_completion_length=2)


@pytest.mark.parametrize("override,key", [(dict(num_iterations=2), "num_iterations"), (dict(beta=0.1), "beta"),
                                          (dict(top_entropy_quantile=0.5), "token_masks"),
                                          (dict(entropy_coef=0.01), "entropy")])
def test_one_list_of_terms_beyond_ratio_one_drives_the_warning_and_the_refusal(tmp_path, override, key):
    """Each option OBLR-PO's gradient does not cover is warned by the config (SNR approximate) and refuses
    one_backward, from the same entry of `terms_beyond_ratio_one`."""
    from helpers import common_args
    from oblr_trl import OBLRPOConfig
    from oblr_trl.loss_terms import terms_beyond_ratio_one
    from oblr_trl.path_choice import blockers

    with pytest.warns(UserWarning):
        args = OBLRPOConfig(**common_args(**override))
    found = terms_beyond_ratio_one(args)
    assert list(found) == [key] and found[key] in blockers(args)
    assert terms_beyond_ratio_one(OBLRPOConfig(**common_args())) == {}
