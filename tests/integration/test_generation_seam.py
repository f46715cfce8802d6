"""vLLM cannot be installed here: generation is replaced at TRL's narrowest seam (`rollout_func`, what a vLLM server
rollout plugs into) and OBLR-PO's overrides must see exactly what it produced, after generation, without touching the
step counter (which TRL's vLLM weight sync keys on)."""


from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model
from helpers import DATASET, TOKENIZER, common_args, length_reward

PRODUCED = []


def fixed_rollout(prompts, trainer):
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        text = TOKENIZER.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids.append(TOKENIZER(text, add_special_tokens=False)["input_ids"])
        completion_ids.append(TOKENIZER(str(12 * i + len(text)), add_special_tokens=False)["input_ids"]
                              + [TOKENIZER.eos_token_id])
    PRODUCED.append((trainer.state.global_step, completion_ids))
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": [[0.0] * len(c) for c in completion_ids]}


class Seen(OBLRPOTrainer):
    seen = []

    def _generate_and_score_completions(self, inputs):
        before = self.state.global_step
        out = super()._generate_and_score_completions(inputs)
        self.seen.append((before, self.state.global_step, out["completion_ids"].clone(), out["completion_mask"].clone()))
        return out


def test_overrides_see_the_rollout_and_leave_step_and_sync_alone():
    trainer = Seen(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[length_reward],
                   args=OBLRPOConfig(**common_args(max_steps=2)), train_dataset=DATASET, rollout_func=fixed_rollout)
    trainer.train()
    assert len(PRODUCED) == len(trainer.seen) == 2
    for (step, produced), (before, after, ids, mask) in zip(PRODUCED, trainer.seen):
        assert before == after == step  # generation and our overrides leave the step counter alone
        for row, row_mask, expected in zip(ids, mask, produced):
            assert row[: len(expected)].tolist() == expected  # our norms pass scored exactly the rollout's tokens
            assert row_mask.sum() == len(expected)
    assert trainer.state.global_step == 2
