"""oblr_trl.demo.testbed: the task's verifier, the held-out split (disjoint from training, warm-up included), and the
policy's deterministic rebuild and cache."""

from __future__ import annotations

import pytest
import torch

from oblr_trl.demo import testbed as tb

SMALL = tb.TestbedSpec(hidden_size=32, sft_steps=3, sft_batch=4, num_examples=40)


def test_the_verifier_accepts_exactly_the_reversed_digits():
    assert tb.score_reply("1284", "4821") == 1.0
    assert tb.score_reply(" 1284\n", "4821") == 1.0  # surrounding whitespace stripped
    for wrong in ("4821", "1284.", "128", "12845", "", "1 284"):
        assert tb.score_reply(wrong, "4821") == 0.0, wrong


def test_the_reward_function_scores_rows_and_needs_the_digits_column():
    completions = [[{"role": "assistant", "content": "321"}], [{"role": "assistant", "content": "123"}]]
    assert tb.reward_func(None, completions, digits=["123", "123"]) == [1.0, 0.0]
    assert tb.reward_func(None, ["54", "45"], digits=["45", "45"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="digits"):
        tb.reward_func(None, ["1"])


def test_the_held_out_split_is_disjoint_from_training_and_from_the_warm_up():
    held = set(tb.draw_problems("held_out", 2000, seed=1, distinct=True))
    train = set(tb.draw_problems("train", 20000, seed=5))
    assert len(held) == 2000 and not held & train
    assert all(tb.split_of(d) == "held_out" for d in held) and all(tb.split_of(d) == "train" for d in train)
    warm = {row[-1]["content"].split()[-1] for row in tb.warmup_examples(tb.TestbedSpec(num_examples=5000))["prompt"]}
    assert not warm & held
    share = sum(tb.split_of(str(i).zfill(4)) == "held_out" for i in range(10000)) / 10000  # about one in ten
    assert 0.08 < share < 0.12


def test_draws_are_reproducible_and_a_bad_split_is_refused():
    assert tb.draw_problems("train", 50, seed=3) == tb.draw_problems("train", 50, seed=3)
    assert tb.draw_problems("train", 50, seed=3) != tb.draw_problems("train", 50, seed=4)
    assert all(tb.MIN_DIGITS <= len(d) <= tb.MAX_DIGITS for d in tb.draw_problems("held_out", 200, seed=0))
    with pytest.raises(ValueError, match="split"):
        tb.draw_problems("test", 1, seed=0)


def test_warm_up_answers_mix_right_and_wrong_at_the_spec_share():
    for wrong in ("copy", "period"):
        data = tb.warmup_examples(tb.TestbedSpec(num_examples=4000, p_reverse=0.3, wrong=wrong))
        digits = [p[-1]["content"].split()[-1] for p in data["prompt"]]
        right = [tb.score_reply(a, d) for a, d in zip(data["answer"], digits)]
        assert 0.27 < sum(right) / len(right) < 0.33
        wrong_answers = {a for a, d, r in zip(data["answer"], digits, right) if not r}
        assert wrong_answers == {tb.WRONG_ANSWERS[wrong](d) for d, r in zip(digits, right) if not r}
    with pytest.raises(ValueError, match="wrong"):
        tb.warmup_examples(tb.TestbedSpec(wrong="shout"))


def test_the_policy_rebuilds_identically_and_is_cached(tmp_path):
    a, tok = tb.build_testbed(SMALL)
    b, _ = tb.build_testbed(SMALL)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    c, _ = tb.load_or_build_testbed(SMALL, cache_dir=tmp_path)
    assert (tmp_path / SMALL.key() / "config.json").exists()
    d, _ = tb.load_or_build_testbed(SMALL, cache_dir=tmp_path)  # loaded from the cache
    for (name, x), (_, y) in zip(a.state_dict().items(), d.state_dict().items()):
        assert torch.equal(x, y), name
    assert SMALL.key() != tb.TestbedSpec(hidden_size=32, sft_steps=4, sft_batch=4, num_examples=40).key()
    scores = tb.evaluate(d, tok, ["123", "4567"], temperature=1.0, num_samples=3)
    assert len(scores) == 6 and set(scores) <= {0.0, 1.0}
