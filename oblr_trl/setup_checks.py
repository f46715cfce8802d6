"""What `OBLRPOTrainer` refuses or warns about when it is built, before the first generation: pure checks of the
inputs and of the distributed setup, each naming the option and what works instead."""

from __future__ import annotations

import functools
import numbers
import os

import torch
from datasets import Dataset
from trl.trainer.utils import is_async_callable

AUX_LOSS_WARNING = (
    "The model's router auxiliary loss (router_aux_loss_coef != 0) adds a gradient term the SNR estimate does not "
    "include: the step size is approximate. Set the model config's router_aux_loss_coef=0 for the exact estimate."
)


def check_inputs(model, train_dataset) -> None:
    """Refuse, before anything is loaded, what would otherwise fail late or misleadingly: a `model` path that does not
    exist (TRL would say "Repo id must be in the form...") and a `train_dataset` without the `prompt` column (a bare
    KeyError at the first step)."""
    if isinstance(model, str) and not os.path.exists(model) and (
        os.path.isabs(model) or model.startswith(".") or model.count("/") > 1 or os.sep + os.sep in model
    ):
        raise ValueError(f"OBLRPOTrainer: model {model} does not exist (a local folder was meant: a Hub id is "
                         "`owner/name`).")
    columns = getattr(train_dataset, "column_names", None)
    if isinstance(columns, dict):  # a DatasetDict: the caller meant one split
        raise ValueError(f"OBLRPOTrainer: train_dataset is a DatasetDict (splits {sorted(columns)}); pass one split, "
                         "e.g. dataset['train'].")
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"OBLRPOTrainer: train_dataset needs a `prompt` column (a string, or a list of chat messages); "
                         f"its columns are {list(columns)}. Rename the question column, e.g. "
                         "dataset.rename_column('question', 'prompt').")
    if isinstance(train_dataset, Dataset) and len(train_dataset):
        check_prompts([train_dataset[0]])  # the first row now; each batch's rows before their generation


def check_prompts(rows) -> None:
    """Refuse a batch whose `prompt` column holds anything but strings or lists of chat messages (an int would fail
    inside the tokenizer, naming neither the column nor the row)."""
    for i, row in enumerate(rows):
        prompt = row["prompt"]
        if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            raise TypeError(
                f"OBLRPOTrainer: the dataset's `prompt` column holds {type(prompt).__name__} {prompt!r:.60} (row {i} "
                "of a batch): each prompt must be a string or a list of chat messages ({'role': ..., 'content': ...}). "
                "Convert the column, e.g. dataset.map(lambda x: {'prompt': str(x['prompt'])}).")


def check_trainable(model) -> None:
    """Refuse a model none of whose parameters requires a gradient: no step could change it (and its zero gradient
    would read as a zero SNR)."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("OBLRPOTrainer: the model has no trainable parameters (every parameter has "
                         "requires_grad=False), so no step can change it. Unfreeze what should train (e.g. "
                         "model.requires_grad_(True)), or pass a peft_config to train LoRA adapters.")


def check_reward_output(name: str, rewards) -> None:
    """Refuse rewards that are not one number (or None) per completion, naming the reward function."""
    for i, r in enumerate(rewards):
        if r is not None and (isinstance(r, str) or not isinstance(r, (numbers.Real, torch.Tensor))
                              or isinstance(r, torch.Tensor) and r.numel() != 1):
            raise TypeError(
                f"Reward function '{name}' returned {type(r).__name__} {r!r:.60} for completion {i}: a reward function "
                "returns one float per completion (None for a completion it cannot score). Convert it, e.g. "
                "float(...).")


def checked_reward_funcs(funcs: list, names: list[str]) -> list:
    """``funcs`` with each plain (synchronous, not a model) reward function wrapped so that its output is checked by
    :func:`check_reward_output` before TRL turns it into a tensor."""

    def checked(func, name):
        @functools.wraps(func)
        def call(*args, **kwargs):
            rewards = func(*args, **kwargs)
            check_reward_output(name, rewards)
            return rewards

        return call

    return [f if isinstance(f, torch.nn.Module) or is_async_callable(f) else checked(f, name)
            for f, name in zip(funcs, names, strict=True)]


def fsdp1_refusal(fsdp1: bool, needs_norms: bool) -> str | None:
    """Exact per-sequence norms run under FSDP2 only."""
    if fsdp1 and needs_norms:
        return ("OBLRPOTrainer computes exact per-sequence norms under FSDP2 only (fsdp_version: 2 in the accelerate "
                "config); with FSDP1 use grad_norm_estimator='length' and snr_lr=False.")
    return None
