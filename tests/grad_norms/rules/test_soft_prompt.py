"""Soft prompts (oblr_trl/grad_norms/rules/soft_prompt.py): PEFT's prompt tuning and P-tuning on a left-padded
batch, tied and untied, exact against per-row autograd; prefix tuning refused by name; an encoder the pass
cannot see refused by the probe."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from studies.zoo import VOCAB
from reference import padded_batch, per_sample_sq_norms

peft = pytest.importorskip("peft")


# Soft prompts (soft_prompt.py). Before: the pass ran the *ForCausalLM under the PeftModel, so the prompt encoder's
# virtual tokens never entered it: every norm was exactly 0, and the probe, which enumerated the *ForCausalLM's
# parameters only and scored sequences through it, saw nothing to check and passed.
SOFT_PROMPTS = {
    "prompt tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8),
    "P-tuning (MLP)": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=8,
                                                       encoder_hidden_size=16),
}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
@pytest.mark.parametrize("kind", list(SOFT_PROMPTS))
def test_soft_prompts_are_exact(kind, family, tie):
    from studies.zoo import build

    model = peft.get_peft_model(build(family, tie), SOFT_PROMPTS[kind]())
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=5)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3, 4]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-12)


def test_prefix_tuning_is_refused_by_name():
    from studies.zoo import build

    model = peft.get_peft_model(build("Llama", True),
                                peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    found = validate(model, strict=False)
    assert [f.name for f in found] == ["prompt_encoder.default.embedding"]
    assert "prefix tuning" in found[0].reason and "LoRA" in found[0].reason


def test_a_trainable_parameter_outside_the_causal_lm_is_checked_not_skipped():
    """The class of hole soft prompts fell through: the probe's parameters are the model's as the trainer calls it.
    A prompt-tuning encoder the pass cannot see (its soft-prompt path switched off here) is refused, by the probe."""
    from oblr_trl.grad_norms import coverage
    from oblr_trl.grad_norms import model as soft_prompt
    from studies.zoo import build

    model = peft.get_peft_model(build("Llama", True), SOFT_PROMPTS["prompt tuning"]())
    params, shown, _ = coverage.trained_parameters(model)
    assert [shown[n] for n in params] == ["prompt_encoder.default.embedding.weight"]
    original = soft_prompt.soft_prompt_model
    try:
        soft_prompt.soft_prompt_model = lambda m: None
        found = coverage.probe(model)
    finally:
        soft_prompt.soft_prompt_model = original
    assert [f.name for f in found] == ["prompt_encoder.default.embedding"]
