"""Tests for the embedded tiny model/tokenizer, the reasoning-gym tasks and rewards, and the plots."""

import json
import math

import pytest
import torch

from oblr_trl.demo.tasks import evaluate_accuracy, extract_answer, make_dataset, make_reward_func
from oblr_trl.demo.tiny import build_model, build_tokenizer, load_or_build_warm_model, publish_cached, warmup_sft
from oblr_trl.plotting import plot_training


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return make_dataset("chain_sum", size=16, seed=3)


def test_tokenizer_round_trips_characters(tokenizer):
    text = "State the answer: 12 + 7 - 3 = ?\nA: -16, {ok}!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert tokenizer.pad_token is not None and tokenizer.eos_token is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    messages = [{"role": "user", "content": "4 - 1 ="}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "Q: 4 - 1 =\nA: "
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "3"}], tokenize=False)
    assert full.startswith(prompt) and f"3{tokenizer.eos_token}" in full
    # A batch pads on the left, so every prompt ends where generation starts.
    batch = tokenizer.apply_chat_template(
        [messages, [{"role": "user", "content": "10 + 10 ="}]],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        padding=True,
        return_tensors="pt",
    )
    assert batch["input_ids"][0, 0].item() == tokenizer.pad_token_id
    assert batch["attention_mask"][0, 0].item() == 0
    assert tokenizer.decode(batch["input_ids"][0, -3:]) == "A: "


def test_model_is_tied_qwen3_with_tokenizer_vocab(tokenizer):
    model = build_model(tokenizer, seed=0)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        assert getattr(model.config, key) == getattr(tokenizer, key)
        assert getattr(model.generation_config, key) == getattr(tokenizer, key)
    logits = model(**tokenizer(["Q: 1 + 1 =\nA: "], return_tensors="pt")).logits
    assert logits.shape[-1] == len(tokenizer)
    # Same seed, same weights.
    again = build_model(tokenizer, seed=0)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_dataset_is_conversational_with_verifier_entry(dataset):
    assert {"prompt", "answer", "entry"} <= set(dataset.column_names)
    prompt = dataset[0]["prompt"]
    assert isinstance(prompt, list) and prompt[0]["role"] == "user" and len(prompt) == 1
    entry = json.loads(dataset[0]["entry"])
    assert entry["question"] == prompt[0]["content"]
    assert entry["answer"] == dataset[0]["answer"]
    assert entry["metadata"]["num_terms"] == 2 and entry["metadata"]["num_digits"] == 1  # easy defaults
    harder = make_dataset("chain_sum", size=4, seed=3, min_terms=3, max_terms=3)
    assert json.loads(harder[0]["entry"])["metadata"]["num_terms"] == 3


def test_reward_scores_with_the_verifier_in_both_completion_formats(dataset):
    reward = make_reward_func("chain_sum")
    assert reward.__name__ == "chain_sum_accuracy"
    answers = dataset["answer"]
    wrong = [str(int(a) + 1) for a in answers]
    n = len(dataset)
    for right_c, wrong_c in [
        (answers, wrong),  # standard (string) completions
        ([[{"role": "assistant", "content": a}] for a in answers], [[{"role": "assistant", "content": w}] for w in wrong]),
    ]:
        assert reward(dataset["prompt"], right_c, entry=dataset["entry"]) == [1.0] * n
        assert reward(dataset["prompt"], wrong_c, entry=dataset["entry"]) == [0.0] * n
    # Unparseable or empty answers score 0.0, never None; the first line is the answer.
    assert reward(None, ["", "banana", f"{answers[2]}\nmore"], entry=dataset["entry"][:3]) == [0.0, 0.0, 1.0]
    # Datasets without an `entry` column are scored against `answer`.
    assert reward(None, answers[:2], answer=answers[:2]) == [1.0, 1.0]


def test_extract_answer_takes_the_final_number_of_a_reply():
    assert extract_answer("6 + 1 = 7") == "7"
    assert extract_answer("7 - 5 is 2.") == "2"
    assert extract_answer("The answer is -12.") == "-12"
    assert extract_answer("It is 1,000") == "1,000" and extract_answer("x = 4.5\nso 4.5") == "4.5"
    assert extract_answer("no number here\nat all") == "no number here"  # no number: the first line
    assert extract_answer("6 + 1 = 7", extractor="first_line") == "6 + 1 = 7"
    with pytest.raises(ValueError, match="extractor='last'.*allowed values"):
        extract_answer("7", extractor="last")


def test_a_reply_with_the_sum_done_right_scores_full_credit():
    reward = make_reward_func("chain_sum")
    entry = json.dumps({"question": "", "answer": "7", "metadata": {}})
    assert reward(None, ["6 + 1 = 7", "7", "6 + 1 = 8", "The answer is 6."], entry=[entry] * 4) == [1.0, 1.0, 0.0, 0.0]
    first_line = make_reward_func("chain_sum", extractor="first_line")
    assert first_line(None, ["6 + 1 = 7"], entry=[entry])[0] < 1.0  # partial credit only, the old rule


def test_accuracy_counts_exact_answers_and_mean_score_averages():
    from oblr_trl.demo.tasks import exact_answer_rate, mean_score

    scores = [1.0, 0.2, 0.11, 0.0]
    assert exact_answer_rate(scores) == 0.25 and mean_score(scores) == pytest.approx(0.3275)
    assert exact_answer_rate([0.11] * 48 + [0.2] * 22 + [0.0] * 30) == 0.0  # the 9.9% "accuracy"
    assert math.isnan(exact_answer_rate([])) and math.isnan(mean_score([]))


def test_extract_answer_prefers_answer_tags():
    assert extract_answer("I think <answer> 42 </answer> done") == "42"
    assert extract_answer([{"role": "assistant", "content": "  -7\n\nbecause"}]) == "-7"


def test_warmup_lowers_loss_and_accuracy_is_a_fraction(tokenizer, dataset):
    model = build_model(tokenizer, seed=0)
    losses = warmup_sft(model, tokenizer, dataset, steps=30, batch_size=16, log_every=0)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    accuracy = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=4, batch_size=8)
    assert 0.0 <= accuracy <= 1.0


def test_warm_model_is_cached_and_reloaded(tmp_path):
    model, tokenizer = load_or_build_warm_model("chain_sum", cache_dir=tmp_path, seed=0, steps=2, num_examples=8)
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1 and (cached[0] / "config.json").exists()
    again, tokenizer_again = load_or_build_warm_model("chain_sum", cache_dir=tmp_path, seed=0, steps=2, num_examples=8)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert tokenizer_again.chat_template == tokenizer.chat_template
    assert tokenizer_again.padding_side == "left"


def test_a_cache_entry_appears_whole_and_the_first_of_two_builds_wins(tmp_path):
    """Two processes building the same entry (two demos, two test workers): neither ever sees the entry half-written,
    the first to finish is kept, and no work folder is left behind."""
    entry = tmp_path / "chain_sum-tiny"

    def write(text):
        def into(folder):
            (folder / "config.json").write_text("{}")
            # never visible half-written: a config.json under the entry's name comes with its weights
            assert not (entry / "config.json").exists() or (entry / "model.safetensors").exists()
            (folder / "model.safetensors").write_text(text)
        return into

    publish_cached(entry, write("first"))
    publish_cached(entry, write("second"))  # the same entry built again, finished after the first: dropped
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "model.safetensors"]
    assert (entry / "model.safetensors").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["chain_sum-tiny"]
    # a folder an interrupted build left without its config (builds wrote in place before) is replaced
    entry = tmp_path / "broken"
    entry.mkdir()
    (entry / "tokenizer.json").write_text("partial")
    publish_cached(entry, write("rebuilt"))
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "model.safetensors"]
    assert (entry / "model.safetensors").read_text() == "rebuilt"


def test_plot_training_writes_png(tmp_path):
    history = [
        {"step": s, "reward": 0.1 * s, "oblr/lr_scale": 0.5, "oblr/snr": 0.2, "oblr/reward_mean": 0.1 * s}
        for s in range(1, 6)
    ] + [{"step": 5, "train_runtime": 1.0}]  # final entry without metrics; oblr/baseline_mean never logged
    paths = plot_training(history, tmp_path / "plots")
    assert len(paths) == 1 and paths[0].endswith("training_curves.png")
    with open(paths[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_sampled_accuracy_at_near_zero_temperature_is_the_greedy_accuracy(tokenizer, dataset):
    """The sampled mode scores each of the num_samples completions against its own problem: at T -> 0 sampling is
    argmax, so it must reproduce the greedy accuracy exactly (a misaligned problem/completion pairing would not)."""
    model = build_model(tokenizer, seed=0)
    # memorize the 16 problems, partly: how many steps that takes depends on the CPU's float arithmetic (150 steps
    # memorized all 16 on an AMX machine), so train in rounds until some, not all, are answered
    for _ in range(12):
        warmup_sft(model, tokenizer, dataset, steps=25, batch_size=16, log_every=0)
        greedy = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=4, batch_size=8)
        if 0.0 < greedy < 1.0:
            break
    assert 0.0 < greedy < 1.0
    near_greedy = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=4, batch_size=8, temperature=1e-4,
                                    num_samples=3)
    assert near_greedy == pytest.approx(greedy)
    sampled = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=4, batch_size=8, temperature=1.0,
                                num_samples=4)
    assert 0.0 <= sampled <= 1.0
    with pytest.raises(ValueError, match="num_samples"):
        evaluate_accuracy(model, tokenizer, dataset, num_samples=2)


def test_build_tokenizer_fills_a_vocabulary_with_placeholders():
    from oblr_trl.demo.tiny import build_tokenizer

    base = build_tokenizer()
    big = build_tokenizer(vocab_size=len(base) + 50)
    assert len(big) == len(base) + 50
    assert big("12 + 3")["input_ids"] == base("12 + 3")["input_ids"]  # text encodes as before
    assert big.decode([len(base) + 49]) == "<t49>"  # every id of the vocabulary decodes
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=len(base) - 1)
