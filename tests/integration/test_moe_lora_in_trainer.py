"""LoRA on MoE expert banks the TRL way (oblr_trl/grad_norms/rules/lora_experts.py): OBLRPOTrainer with
``peft_config=LoraConfig(target_parameters=[...experts.gate_up_proj, ...experts.down_proj])`` (the gpt-oss recipe)
on tiny GPT-OSS and Qwen3-MoE models trains the banks' factors one step (one_backward, the default, and two
passes), and the first batch's norms (``oblr_gram``'s diagonal) equal per-row autograd's at the parameters they were taken at.
Before: the trainer refused the model at construction (the experts' ParamWrapper)."""

import pytest
import torch

from helpers import TOKENIZER, common_args, train
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from studies.zoo import build
from reference import per_sample_sq_norms

peft = pytest.importorskip("peft")


class Snapshot(OBLRPOTrainer):
    """Keeps the trainable parameters as training starts (those the first batch is scored at)."""

    def train(self, *a, **k):
        self.initial = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return super().train(*a, **k)


def first_batch_norms(trainer):
    """The first batch's norms (with snr_lr off, ``oblr_gram`` holds each row's product with itself alone), and
    per-row autograd's with the trainable parameters put back to those the batch was scored at."""
    gen = trainer.generations[0]
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if name in trainer.initial:
                p.copy_(trainer.initial[name])
    ids = torch.cat([gen["prompt_ids"], gen["completion_ids"]], 1)
    attention = torch.cat([gen["prompt_mask"], gen["completion_mask"]], 1)
    trainer.model.eval()
    expected = per_sample_sq_norms(trainer.model, ids, attention, gen["completion_mask"],
                                   temperature=trainer.args.temperature)
    assert gen["oblr_gram"].shape[1] == 1
    return gen["oblr_gram"][:, 0].double(), expected


@pytest.mark.parametrize("one_backward", [True, False], ids=["one_backward", "two_passes"])
@pytest.mark.parametrize("family", ["GPT-OSS", "Qwen3-MoE"])
def test_lora_on_expert_banks_trains_on_exact_norms(family, one_backward):
    model = build(family, vocab_size=len(TOKENIZER))
    model.config.pad_token_id = TOKENIZER.pad_token_id
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], task_type="CAUSAL_LM", init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    # snr_lr off: at this tiny batch the SNR step would skip the update (its factor 0), and the test wants one taken
    args = OBLRPOConfig(**common_args(max_steps=1, bf16=False), one_backward=one_backward, snr_lr=False)
    trainer, _ = train(Snapshot, args, model=model, peft_config=lora)
    assert any(type(m).__name__ == "ParamWrapper" for m in trainer.model.modules())
    assert trainer.state.global_step == 1
    moved = [n for n, p in trainer.model.named_parameters() if n in trainer.initial and not torch.equal(
        p, trainer.initial[n])]
    assert any("experts" in n and "lora_" in n for n in moved)  # the banks' factors were trained
    ours, expected = first_batch_norms(trainer)
    assert expected.max() > 0
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-10)
