"""What `OBLRPOTrainer` refuses or warns about when it is built, before the first generation: pure checks of the
inputs and of the distributed setup, each naming the option and what works instead."""

from __future__ import annotations

import os

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


def fsdp1_refusal(fsdp1: bool, needs_norms: bool) -> str | None:
    """Exact per-sequence norms run under FSDP2 only."""
    if fsdp1 and needs_norms:
        return ("OBLRPOTrainer computes exact per-sequence norms under FSDP2 only (fsdp_version: 2 in the accelerate "
                "config); with FSDP1 use grad_norm_estimator='length' and snr_lr=False.")
    return None
