"""An embedded tiny Qwen3 model and character-level tokenizer, built offline.

The demo and the tests must run without the Hugging Face Hub, so this module builds everything locally:

1. `build_tokenizer()`: a character-level `PreTrainedTokenizerFast` with a two-line chat template
   (``Q: {question}\\nA: {answer}<eos>``), so TRL's conversational prompts work unchanged.
2. `build_model()`: a randomly initialised `Qwen3ForCausalLM` small enough to train on two CPU cores.
3. `warmup_sft()`: a short supervised warm-up on (prompt, answer) pairs, so the policy already emits the answer
   format and gets *some* answers right. RL then has signal (rewards neither all zero nor all one) and room to improve.
4. `load_or_build_warm_model()`: steps 1-3 once, cached with `save_pretrained` and reloaded on later runs.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import string
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from .defaults import TINY_WARMUP_STEPS

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN]

# Character vocabulary: digits, letters, punctuation, space and newline (every printable ASCII character).
CHARACTERS = list(string.digits + string.ascii_letters + string.punctuation + " \n")

# User turns render as "Q: ...\nA: "; assistant turns as their content followed by eos. No system prompt, no bos:
# sequences stay short, and the generation prompt ends exactly where the answer starts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ 'Q: ' + message['content'] + '\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'A: ' + message['content'] + eos_token + '\n' }}"
    "{%- else -%}"
    "{{ message['content'] + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'A: ' }}{%- endif -%}"
)

MODEL_SIZES = {
    # hidden, layers, heads, kv heads, head_dim
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Character-level tokenizer (one token per printable ASCII character) with pad/eos/bos and a chat template.

    ``vocab_size``: the vocabulary filled up to that size with placeholder tokens ``<t0>``, ``<t1>``, ... that no text
    encodes to, so that every id a random model of a real vocabulary samples decodes (the benchmarks' real shapes)."""
    names = SPECIAL_TOKENS + CHARACTERS
    if vocab_size is not None:
        if vocab_size < len(names):
            raise ValueError(f"build_tokenizer: vocab_size={vocab_size} is below the {len(names)} tokens it needs.")
        names = names + [f"<t{i}>" for i in range(vocab_size - len(names))]
    vocab = {token: i for i, token in enumerate(names)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    backend.decoder = decoders.Fuse()  # join characters back without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",  # decoder-only generation pads on the left
        model_max_length=512,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids (transformers 4.x generate refuses them)
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, size: str = "tiny", seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised float32 Qwen3 causal LM sized for CPU (see `MODEL_SIZES`), tied embeddings."""
    dims = MODEL_SIZES[size]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        intermediate_size=4 * dims["hidden_size"],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
        **dims,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    generation_config = model.generation_config
    generation_config.pad_token_id = tokenizer.pad_token_id
    generation_config.eos_token_id = tokenizer.eos_token_id
    generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def _encode_pair(tokenizer, prompt: list[dict], answer: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt+answer+eos and labels that are -100 on the prompt (loss on the answer only)."""
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def warmup_sft(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    dataset,
    steps: int = 300,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
    log_every: int = 50,
) -> list[float]:
    """Supervised warm-up: next-token cross-entropy on the answer tokens of (prompt, answer) pairs.

    `dataset` has a conversational `prompt` column and a string `answer` column (see
    `oblr_trl.demo.tasks.make_dataset`).
    Plain AdamW with linear warm-up and cosine decay, right-padded batches. Returns the per-step losses.
    """
    pairs = [_encode_pair(tokenizer, p, str(a)) for p, a in zip(dataset["prompt"], dataset["answer"], strict=True)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    rng = random.Random(seed)
    model.train()
    losses = []
    for step in range(steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        length = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((batch_size, length), -100, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
        for row, (ids, lab) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(lab)] = torch.tensor(lab)
            attention_mask[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"  warm-up step {step + 1}/{steps}: loss {sum(losses[-log_every:]) / log_every:.3f}")
    model.eval()
    return losses


def default_cache_dir() -> Path:
    """Where warmed-up models live: `$OBLR_TRL_CACHE` or `~/.cache/oblr_trl`."""
    return Path(os.environ.get("OBLR_TRL_CACHE", Path.home() / ".cache" / "oblr_trl"))


def publish_cached(path: Path, write) -> None:
    """`write(folder)` into a fresh folder beside `path`, then renamed to `path` in one step, so that a process loading
    the same cache entry at that moment (two demos, two test workers) never finds it half-written (a ``config.json``
    without its weights). Where two processes build the same entry, the first to finish wins and the other's copy
    is dropped; a half-written folder that an interrupted build left at `path` is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        write(work)
        if path.exists() and not (path / "config.json").exists():
            shutil.rmtree(path, ignore_errors=True)
        try:
            work.rename(path)
        except OSError:  # another process published the same entry first: keep theirs
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_or_build_warm_model(
    task: str = "chain_sum",
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    size: str = "tiny",
    steps: int = TINY_WARMUP_STEPS,
    num_examples: int = 2000,
    **task_kwargs,
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """Return a warmed-up tiny model and its tokenizer, from the cache if present, else built and cached.

    The cache key is task/size/seed/steps (plus task kwargs). Warm-up examples use a seed disjoint from the
    train and evaluation splits the demo draws (`seed + 10_000`).
    """
    from oblr_trl.demo.tasks import make_dataset  # local import: tasks depends on reasoning-gym only

    key = "-".join([task, size, f"seed{seed}", f"steps{steps}", f"n{num_examples}"])
    key += "".join(f"-{k}{v}" for k, v in sorted(task_kwargs.items()))
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / key
    if (path / "config.json").exists():
        print(f"Loading warmed-up model from {path}")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        return model, tokenizer

    print(f"Building a tiny Qwen3 ({size}) and warming it up for {steps} steps on {task} ...")
    start = time.time()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, size=size, seed=seed)
    warm_data = make_dataset(task, size=num_examples, seed=seed + 10_000, **task_kwargs)
    torch.manual_seed(seed)
    warmup_sft(model, tokenizer, warm_data, steps=steps, seed=seed)
    publish_cached(path, lambda folder: (model.save_pretrained(folder), tokenizer.save_pretrained(folder)))
    print(f"Warm-up done in {time.time() - start:.0f}s; cached at {path}")
    return model, tokenizer
