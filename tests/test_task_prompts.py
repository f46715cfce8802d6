"""oblr_trl.demo.tasks: question templates, held-out questions kept out of training, the bare-number format reward."""

from __future__ import annotations

import json

import pytest

from oblr_trl.demo.tasks import (
    PROMPT_TEMPLATES,
    make_dataset,
    make_format_reward,
    make_reward_func,
    without_questions_of,
)


def test_prompt_template_rewrites_the_question_and_keeps_the_verifier_entry():
    plain = make_dataset("chain_sum", size=4, seed=3)
    templated = make_dataset("chain_sum", size=4, seed=3, prompt_template=PROMPT_TEMPLATES["chain_sum"])
    for a, b in zip(plain, templated, strict=True):
        expression = json.loads(a["entry"])["metadata"]["expression"]
        assert b["prompt"] == [{"role": "user", "content": f"What is {expression}? Reply with only the number."}]
        assert a["entry"] == b["entry"] and a["answer"] == b["answer"]
    wrapped = make_dataset("chain_sum", size=1, seed=3, prompt_template="Q: {question}")
    assert wrapped[0]["prompt"][0]["content"] == "Q: " + plain[0]["prompt"][0]["content"]
    with pytest.raises(KeyError, match="nope.*expression"):
        make_dataset("chain_sum", size=1, seed=3, prompt_template="{nope}")


def test_without_questions_of_removes_every_held_out_question():
    held_out = make_dataset("chain_sum", size=50, seed=1)
    train = make_dataset("chain_sum", size=400, seed=0)
    kept = without_questions_of(train, held_out)
    held = {p[-1]["content"] for p in held_out["prompt"]}
    assert 0 < len(kept) < len(train)  # 200 distinct problems: some overlap is certain, not all
    assert not held & {p[-1]["content"] for p in kept["prompt"]}
    assert len(kept) == sum(p[-1]["content"] not in held for p in train["prompt"])


def test_format_reward_scores_the_form_only():
    reward = make_format_reward(0.25)
    completions = ["12", " -3\n", "4.5", "7.", "7 - 5 is 2.", "The answer is 9.", "", "12 apples",
                   [{"role": "assistant", "content": "9"}]]
    assert reward(None, completions) == [0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0, 0.25]
    with pytest.raises(ValueError, match="weight"):
        make_format_reward(-1.0)
    # beside the verifier: a wrong bare number earns the format part only, a right one both
    verifier = make_reward_func("chain_sum")
    entry = [json.dumps({"question": "", "answer": "2", "metadata": {}})] * 3
    replies = ["2", "3", "7 - 5 is 2."]
    scores = verifier(None, replies, entry=entry)
    total = [v + f for v, f in zip(scores, reward(None, replies), strict=True)]
    assert total == [1.25, 0.25, 1.0]  # the sentence's final number is right: full credit, no format part
