"""A CPU testbed in the paper's regime: a small policy whose per-prompt gradients agree (a small noise scale B).

The embedded tiny policy (:mod:`.tiny`) on chain_sum has a noise scale B of hundreds of prompts or more: at any N
a CPU affords, its SNR factor ``N / (N + B)`` is small, far from the paper's runs (f near 1). This module builds a
policy with a small B:

* **The task** (``reverse``): a string of 3 to 5 digits; the answer is the string reversed (``"4821"`` ->
  ``"1284"``). Binary reward from :func:`score_reply`, the task's verifier: 1.0 for exactly the reversed digits (the
  reply stripped of surrounding whitespace), else 0.0.
* **The split** (:func:`split_of`): each distinct digit string belongs to the train or the held-out split by a hash
  of the string itself, one in ten held out. The two splits are disjoint whatever the seeds or sizes drawn, so a
  held-out problem is never trained on, by the warm-up or by RL.
* **The policy**: a randomly initialised Qwen3 (hidden 96, 2 layers: 0.29M parameters) with the character
  tokenizer of :mod:`.tiny`, warmed up by supervised fine-tuning (:func:`.tiny.warmup_sft`) on training-split
  problems whose answers are right (the reversed string) with probability ``p_reverse`` and otherwise wrong as
  ``wrong`` says: the string copied unchanged, the right string followed by a period, or half each (the default).
  The warm policy can do all of them; which one it does is a behaviour shared by every prompt, so RL's per-prompt
  gradients agree: the regime where the SNR factor is near 1 at a modest N (B about 3.6 prompts at the start with
  the default warm-up; ``benchmarks/testbed.md``). What RL has to learn is the choice, not a new skill: the way RL
  on a pretrained model mostly sharpens what the model can already do.

:func:`load_or_build_testbed` builds it once (deterministic from its seed: a rebuild gives the same weights) and
caches it under :func:`.tiny.default_cache_dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .tiny import build_tokenizer, default_cache_dir, publish_cached, warmup_sft

HELD_OUT_EVERY = 10  # one distinct problem in this many is held out
MIN_DIGITS, MAX_DIGITS = 3, 5


@dataclass(frozen=True)
class TestbedSpec:
    """What the warm policy is built from; the cache key."""

    p_reverse: float = 0.3  # the warm-up's share of right answers
    # the warm-up's other answers: "copy" (the string unchanged), "period" (right, then "."), "mixed" (half each)
    wrong: str = "mixed"
    hidden_size: int = 96
    num_hidden_layers: int = 2
    sft_steps: int = 1200
    sft_batch: int = 32
    sft_lr: float = 3e-3
    num_examples: int = 4000
    seed: int = 0

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return "testbed-reverse-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def split_of(digits: str) -> str:
    """``"held_out"`` or ``"train"``: a fixed function of the problem (a hash of the digit string), one in
    `HELD_OUT_EVERY` held out."""
    bucket = int(hashlib.sha256(digits.encode()).hexdigest(), 16) % HELD_OUT_EVERY
    return "held_out" if bucket == 0 else "train"


def reverse_answer(digits: str) -> str:
    return digits[::-1]


def score_reply(reply: str, digits: str) -> float:
    """The verifier: 1.0 when the reply, stripped, is exactly the digits reversed; else 0.0."""
    return 1.0 if reply.strip() == reverse_answer(digits) else 0.0


def question(digits: str) -> str:
    return f"rev {digits}"


def draw_problems(split: str, size: int, seed: int, distinct: bool = False) -> list[str]:
    """`size` digit strings of `MIN_DIGITS`..`MAX_DIGITS` digits from `split` (``"train"`` or ``"held_out"``), drawn
    from `seed` (lengths uniform); ``distinct=True`` draws without repetition."""
    if split not in ("train", "held_out"):
        raise ValueError(f"oblr_trl.demo.testbed.draw_problems: split={split!r}; allowed: 'train', 'held_out'.")
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < size:
        length = rng.randint(MIN_DIGITS, MAX_DIGITS)
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        if split_of(digits) != split or (distinct and digits in seen):
            continue
        seen.add(digits)
        out.append(digits)
    return out


def make_dataset(split: str, size: int, seed: int, distinct: bool = False):
    """A `datasets.Dataset` of the task: conversational `prompt`, `answer` (the reversed digits), `digits`."""
    from datasets import Dataset

    problems = draw_problems(split, size, seed, distinct=distinct)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": question(d)}], "answer": reverse_answer(d),
                               "digits": d} for d in problems])


def reward_func(prompts, completions, digits=None, **kwargs) -> list[float]:
    """TRL reward function: `score_reply` of each completion against its row's `digits` column."""
    if digits is None:
        raise ValueError("oblr_trl.demo.testbed.reward_func needs the dataset's `digits` column "
                         "(build the dataset with oblr_trl.demo.testbed.make_dataset).")
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score_reply(t, d) for t, d in zip(texts, digits, strict=True)]


reward_func.__name__ = reward_func.__qualname__ = "reverse_accuracy"


WRONG_ANSWERS = {"copy": lambda d: d, "period": lambda d: reverse_answer(d) + ".", "mixed": None}


def warmup_examples(spec: TestbedSpec):
    """The warm-up's (prompt, answer) pairs: training-split problems, reversed with probability `p_reverse`, else
    copied."""
    from datasets import Dataset

    rng = random.Random(spec.seed + 1)
    problems = draw_problems("train", spec.num_examples, spec.seed + 10_000)
    if spec.wrong not in WRONG_ANSWERS:
        raise ValueError(f"oblr_trl.demo.testbed: wrong={spec.wrong!r}; allowed: {sorted(WRONG_ANSWERS)}.")
    answers = []
    for d in problems:
        u = rng.random()
        kind = spec.wrong if spec.wrong != "mixed" else ("copy" if u < spec.p_reverse + (1 - spec.p_reverse) / 2
                                                         else "period")
        answers.append(reverse_answer(d) if u < spec.p_reverse else WRONG_ANSWERS[kind](d))
    return Dataset.from_list([{"prompt": [{"role": "user", "content": question(d)}], "answer": a}
                              for d, a in zip(problems, answers)])


def build_testbed(spec: TestbedSpec = TestbedSpec(), log_every: int = 0):
    """The warm policy and its tokenizer, built from `spec` (no cache): deterministic from ``spec.seed``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=4 * spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=spec.hidden_size // 4, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    torch.manual_seed(spec.seed)
    warmup_sft(model, tokenizer, warmup_examples(spec), steps=spec.sft_steps, batch_size=spec.sft_batch,
               learning_rate=spec.sft_lr, seed=spec.seed, log_every=log_every)
    return model, tokenizer


def load_or_build_testbed(spec: TestbedSpec = TestbedSpec(), cache_dir: str | os.PathLike | None = None):
    """`build_testbed(spec)` once, cached (``save_pretrained``) under `cache_dir` (default
    :func:`.tiny.default_cache_dir`) by `spec`'s key; later calls load it."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / spec.key()
    if not (path / "config.json").exists():
        start = time.time()
        model, tokenizer = build_testbed(spec, log_every=100)
        seconds = time.time() - start

        def write(folder):
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            (folder / "testbed_spec.json").write_text(json.dumps(dict(asdict(spec), build_seconds=seconds)))

        publish_cached(path, write)
        return model, tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, tokenizer


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[str], temperature: float | None = None, num_samples: int = 1,
             max_new_tokens: int = 8, batch_size: int = 256) -> list[float]:
    """Verifier scores of the policy's replies to `problems` (problem-major, `num_samples` each): greedy, or sampled
    at `temperature` (pure sampling)."""
    if temperature is None and num_samples != 1:
        raise ValueError("oblr_trl.demo.testbed.evaluate: greedy decoding takes num_samples=1.")
    was_training = model.training
    model.eval()
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    scores = []
    try:
        for start in range(0, len(problems), batch_size):
            batch = problems[start : start + batch_size]
            inputs = tokenizer.apply_chat_template([[{"role": "user", "content": question(d)}] for d in batch],
                                                   add_generation_prompt=True, tokenize=True, return_dict=True,
                                                   padding=True, return_tensors="pt")
            sampling = dict(do_sample=False) if temperature is None else dict(
                do_sample=True, temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=num_samples)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **sampling)
            texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            scores += [score_reply(t, d) for t, d in zip(texts, [d for d in batch for _ in range(num_samples)])]
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return scores
