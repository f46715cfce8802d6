"""reasoning-gym tasks as TRL datasets, reward functions and a held-out accuracy metric.

Every example keeps reasoning-gym's own entry (JSON-serialised in the `entry` column) so that rewards and accuracy
are scored by the task's own verifier, `dataset.score_answer(answer, entry)`, never by a re-implementation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset

from ..extras import require

# Easy defaults so a tiny CPU model can learn something in minutes: two one-digit terms ("4 - 1 =").
DEFAULT_TASK_KWARGS: dict[str, dict[str, Any]] = {
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
}

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _task_config(task: str, task_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Task defaults from `DEFAULT_TASK_KWARGS`, overridden by explicit kwargs."""
    return {**DEFAULT_TASK_KWARGS.get(task, {}), **task_kwargs}


# Question wordings for a pretrained chat model (`make_dataset(prompt_template=...)`), measured on SmolLM2-135M-Instruct
# (benchmarks/demo_seeds.md, "Question wording"): reasoning-gym's own wording gets 2% greedy accuracy there, this 7%.
PROMPT_TEMPLATES: dict[str, str] = {
    "chain_sum": "What is {expression}? Reply with only the number.",
}


def make_dataset(
    task: str = "chain_sum", size: int = 512, seed: int = 0, prompt_template: str | None = None, **task_kwargs
) -> Dataset:
    """A `datasets.Dataset` of `size` reasoning-gym problems.

    Columns: `prompt` (conversational, `[{"role": "user", "content": question}]`, no system prompt), `answer`
    (the reference string) and `entry` (the reasoning-gym entry as JSON, what the verifier scores against).
    `prompt_template` rewrites the question: a `str.format` template over `question` (reasoning-gym's wording) and the
    entry's metadata fields (for chain_sum: `expression`), e.g. `PROMPT_TEMPLATES["chain_sum"]`; a field the task
    does not have raises `KeyError` naming it. Extra kwargs configure the task (for chain_sum: min_terms, max_terms,
    min_digits, max_digits).
    """
    rg = require("reasoning_gym", "reasoning-gym", "oblr_trl.demo.make_dataset")  # where used: it imports pyplot

    source = rg.create_dataset(task, size=size, seed=seed, **_task_config(task, task_kwargs))

    def question(entry):
        if prompt_template is None:
            return entry["question"]
        fields = {**entry.get("metadata", {}), "question": entry["question"]}
        try:
            return prompt_template.format(**fields)
        except KeyError as missing:
            raise KeyError(f"make_dataset: prompt_template field {missing} is not among {task}'s fields "
                           f"{sorted(fields)}.") from None

    rows = [
        {
            "prompt": [{"role": "user", "content": question(entry)}],
            "answer": str(entry["answer"]),
            "entry": json.dumps(entry, default=str),
        }
        for entry in source
    ]
    return Dataset.from_list(rows)


def without_questions_of(dataset: Dataset, held_out: Dataset) -> Dataset:
    """`dataset` without the rows whose question (last prompt message) also appears in `held_out`.

    Small tasks repeat problems (chain_sum with two one-digit terms has 200 distinct ones): this keeps the held-out
    problems unseen in training.
    """
    seen = {row[-1]["content"] for row in held_out["prompt"]}
    return dataset.filter(lambda row: row["prompt"][-1]["content"] not in seen)


_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
EXTRACTORS = ("final_number", "first_line")


def extract_answer(completion: str | list[dict[str, str]], extractor: str = "final_number") -> str:
    """The answer in a completion, as the verifier is given it.

    The text inside `<answer>...</answer>` if present. Otherwise, with `extractor="final_number"` (the default, as
    math RL setups score a reply): the last number in the reply (`-3`, `1,000`, `4.5`; a final period dropped), so
    "6 + 1 = 7" answers 7 and "7 - 5 is 2." answers 2; a reply without a number gives its first line. Its known
    weakness: a reply that only restates the question ("3 + 4") answers with its last operand. With
    `extractor="first_line"` (the rule before the final-number default): the first line, whatever it holds.

    Accepts a plain string (standard prompts) or a list of messages (conversational prompts; the last
    message's content is used).
    """
    if extractor not in EXTRACTORS:
        raise ValueError(f"extract_answer: extractor={extractor!r} is not allowed; allowed values: {list(EXTRACTORS)}.")
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    tagged = _ANSWER_TAG.search(text)
    if tagged:
        return tagged.group(1).strip()
    text = text.strip()
    if extractor == "final_number":
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1]
    return text.splitlines()[0].strip() if text else ""


def make_reward_func(task: str = "chain_sum", extractor: str = "final_number", **task_kwargs):
    """A TRL reward function scoring each completion with the task's reasoning-gym verifier.

    The verifier is given `extract_answer(completion, extractor)` (by default the reply's final number).

    Signature `f(prompts, completions, entry=None, answer=None, **kwargs) -> list[float]`; TRL passes the dataset's
    columns as keywords. The verifier scores against `entry` (JSON, from `make_dataset`), or, for datasets without
    one, against a minimal entry built from the `answer` column. The reward is the verifier's score (1.0 for a correct answer for chain_sum); a wrong, empty or
    unparseable answer scores 0.0 (never None, so every completion contributes to the group baseline).
    """
    rg = require("reasoning_gym", "reasoning-gym", "oblr_trl.demo.make_reward_func")

    if extractor not in EXTRACTORS:
        raise ValueError(f"make_reward_func: extractor={extractor!r} is not allowed; allowed values: {list(EXTRACTORS)}.")
    verifier = rg.create_dataset(task, size=1, seed=0, **_task_config(task, task_kwargs))

    def reward_func(prompts, completions, entry=None, answer=None, **kwargs) -> list[float]:
        if entry is not None:
            entries = [json.loads(e) if isinstance(e, str) else e for e in entry]
        elif answer is not None:
            entries = [{"question": "", "answer": str(a), "metadata": {}} for a in answer]
        else:
            raise ValueError(f"{task} reward needs an `entry` or `answer` column in the dataset.")
        rewards = []
        for completion, target in zip(completions, entries, strict=True):
            predicted = extract_answer(completion, extractor)
            rewards.append(float(verifier.score_answer(predicted, target)) if predicted else 0.0)
        return rewards

    reward_func.__name__ = f"{task}_accuracy"
    reward_func.__qualname__ = reward_func.__name__
    return reward_func


_BARE_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?\.?")


def make_format_reward(weight: float = 0.2):
    """A TRL reward function for the reply's form only: `weight` when the whole completion (stripped) is a bare number
    (`12`, `-3`, `4.5`, an optional final period), else 0.0, whether the number is right or wrong.

    Meant to sit beside `make_reward_func` (TRL sums reward functions): a pretrained chat model answers arithmetic in
    sentences ("7 - 5 is 2."), which the verifier scores 0 on the first line; this component rewards answering as
    asked, so the verifier's reward becomes reachable. Held-out accuracy never includes it.
    """
    if not weight >= 0:
        raise ValueError(f"make_format_reward: weight must be >= 0, got {weight}.")

    def reward_func(prompts, completions, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [weight if _BARE_NUMBER.fullmatch(text.strip()) else 0.0 for text in texts]

    reward_func.__name__ = reward_func.__qualname__ = "bare_number_format"
    return reward_func


FULL_CREDIT = 1.0  # a verifier score this high is an exact answer


def exact_answer_rate(scores: list[float]) -> float:
    """Accuracy: the fraction of `scores` (verifier scores in [0, 1]) with full credit, i.e. exact answers. Partial
    credit (reasoning-gym gives a reply containing the answer `len(answer) / len(reply)`) counts as wrong. NaN for
    no scores."""
    return sum(s >= FULL_CREDIT for s in scores) / len(scores) if scores else float("nan")


def mean_score(scores: list[float]) -> float:
    """Mean score: the mean verifier score, partial credit included (what the reward averages). NaN for no scores."""
    return sum(scores) / len(scores) if scores else float("nan")


@dataclass(frozen=True)
class HeldOut:
    """Held-out results: `scores` and `replies` per completion (problem-major, `num_samples` each), `questions` per
    problem, and the two summaries of the scores."""

    scores: list[float]
    replies: list[str]
    questions: list[str]
    answers: list[str]

    @property
    def accuracy(self) -> float:
        return exact_answer_rate(self.scores)

    @property
    def mean_score(self) -> float:
        return mean_score(self.scores)


@torch.no_grad()
def evaluate_held_out(
    model,
    tokenizer,
    dataset: Dataset,
    max_new_tokens: int = 8,
    batch_size: int = 64,
    task: str | None = None,
    temperature: float | None = None,
    num_samples: int = 1,
    extractor: str = "final_number",
) -> HeldOut:
    """Held-out replies and their verifier scores on `dataset`, with the same extraction and verifier as the reward.

    Greedy decoding by default. With `temperature`, `num_samples` completions sampled per problem at that temperature
    (pure sampling, no top-k/top-p): what the policy itself earns, which is what RL trains. `task` defaults to the
    entry's `metadata.source_dataset` (set by reasoning-gym). `.accuracy` is the exact-answer rate, `.mean_score`
    the mean verifier score.
    """
    if num_samples < 1 or (temperature is None and num_samples != 1):
        raise ValueError("num_samples must be >= 1, and 1 for greedy decoding (temperature=None).")
    if len(dataset) == 0:
        return HeldOut([], [], [], [])
    if task is None:
        task = json.loads(dataset[0]["entry"])["metadata"]["source_dataset"]
    reward_func = make_reward_func(task, extractor=extractor)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    scores, replies = [], []
    try:
        for start in range(0, len(dataset), batch_size):
            batch = dataset[start : start + batch_size]
            inputs = tokenizer.apply_chat_template(
                batch["prompt"],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                padding=True,
                return_tensors="pt",
            ).to(device)
            sampling = dict(do_sample=False) if temperature is None else dict(
                do_sample=True, temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=num_samples
            )
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
            texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            repeat = [x for x in batch["entry"] for _ in range(num_samples)]
            prompts = [x for x in batch["prompt"] for _ in range(num_samples)]
            scores += reward_func(prompts=prompts, completions=texts, entry=repeat)
            replies += texts
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return HeldOut(scores, replies, [p[-1]["content"] for p in dataset["prompt"]], list(dataset["answer"]))


def evaluate_accuracy(model, tokenizer, dataset: Dataset, **kwargs) -> float:
    """Held-out accuracy: the exact-answer rate (verifier full credit) of `evaluate_held_out(...)` (same arguments);
    0.0 for an empty dataset."""
    result = evaluate_held_out(model, tokenizer, dataset, **kwargs)
    return result.accuracy if result.scores else 0.0
