"""`OBLRPOTrainer`: `trl.GRPOTrainer` with OBLR-PO's advantages and step size, overriding the smallest methods.

Every formula is a pure function elsewhere (:mod:`.estimators`, :mod:`.loss_terms`, :mod:`.one_backward`,
:mod:`.grad_norms`); the overrides only move TRL's data to them and back:

* ``__init__``: builds or upgrades the config (no ``args``, or a ``GRPOConfig``), refuses what cannot work
  (DeepSpeed without ZeRO, FSDP1 with exact norms), and picks ``one_backward`` where it is valid.
* ``_calculate_rewards``: keeps the all-rank rewards TRL computes.
* ``_generate_and_score_completions``: after TRL, gives each row an id and replaces ``advantages`` with ``r_i - b_i``
  (Theorem 7), the weights from a norms pass (two-pass path) — or leaves that to the loss (``one_backward``).
* ``_prepare_inputs``: with ``one_backward`` and accumulation, micro-batches of whole groups.
* ``compute_loss``: records each micro-batch's SNR terms (two passes), or runs ``one_backward``'s pass.
* ``training_step``: after the step's last micro-batch, sets ``lr = scheduled lr x N SNR / (1 + N SNR)`` (Theorem 4);
  a callback restores the scheduled lr after the optimizer step, and an optimizer pre-step hook refuses any step whose
  size was not set, so the SNR step can never be skipped silently. Under DeepSpeed the engine steps inside the
  backward: the step is sized there instead, by a hook in ZeRO's optimizer step (:mod:`.deepspeed_step`).
* ``create_model_card``, ``_save_checkpoint``, ``_load_optimizer_and_scheduler``: the card section, the SNR state.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trl import GRPOTrainer

from . import deepspeed_step, multimodal, one_backward
from .card import PAPER, append_oblr_section
from .config import OBLRPOConfig, upgrade_config
from .estimators import (
    aggregate_rewards,
    baseline_metrics,
    baseline_weights,
    clip_weights,
    get_baseline,
    logit_proxy_weights,
    mask_nonfinite_products,
    token_log_sum_sq_probs,
    max_weight_ratio,
    unit_sq_norms,
    weight_estimator,
)
from .grad_norms import per_sequence_grad_inner_products, per_sequence_grads, validate
from .loss_terms import loss_coefficients
from .precision import frozen_fraction
from .trl_logs import install_all_none_reward_filter
from .step_size import LrStats, SNRState, snr_step_size

logger = logging.getLogger(__name__)

OBLR_STATE_NAME = "oblr_state.json"  # OBLR-PO's cross-step state, beside trainer_state.json in each checkpoint
WEIGHT_RATIO_WARNING = 100.0  # a group's max/median baseline weight above this warns (baseline explosion)
FROZEN_WARNING = 0.5  # warn when an update of the applied lr rounds away for this fraction of low-precision weights

WARNINGS = {
    "nonfinite_norms": "Non-finite per-sequence gradient norms: those completions are treated as unscorable "
    "(advantage 0, no part in any baseline or in the SNR).",
    "nonfinite_reward": "Rewards of +-inf were treated as unscorable (NaN): no baseline, advantage 0.",
    "fallback": "Some groups' baseline weights summed to 0 (zero gradients or all-unscorable rewards); their baseline "
    "fell back to the plain mean of rewards. Counted in oblr/fallback_samples.",
    "unscorable": "Completions with no reward (None/NaN) get advantage 0 and enter no baseline.",
    "no_rewards": "Every completion of a generation batch went unscored: each reward function returned None (or NaN) "
    "for all of them, so their steps cannot move (advantage 0, lr scale 0). This is the reward, not noise: check that "
    "the reward functions apply to this dataset (their names, the columns they read) and return floats.",
    "weight_spread": f"Gradient norms vary by more than {WEIGHT_RATIO_WARNING:.0f}x within a group: the "
    "gradient-weighted baseline follows one or two completions there. Set OBLRPOConfig(weight_clip=10) to bound any "
    "one completion's weight (see oblr/weight_spread).",
    "few_samples": "An optimizer step saw {n} sample(s); the SNR needs 2: lr left unscaled.",
    "nonfinite_grad": "Non-finite gradient norm: lr scaled to lr_scale_min for this step.",
    "deepspeed_skipped": "DeepSpeed skipped an optimizer step (gradient overflow): its SNR samples were dropped with "
    "it; the next step is sized from its own samples.",
    "zero_snr": "SNR estimate is 0 (noise dominates): the step size collapses to lr_scale_min. If this persists, raise "
    "the batch (more prompts per step), set lr_scale_min, or pool steps with snr_estimator='ema' or 'window'.",
}


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


@dataclass
class StepSamples:
    """The SNR samples of the optimizer step in progress, on this rank: per-row terms recorded by the two-pass path
    (unit, position, ``a_i = c_i A_i``, within-unit Gram row) and whole-unit ``||H_q||^2`` formed by ``one_backward``."""

    rows: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    formed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def reduce_all_ranks(self) -> tuple[float, int]:
        """``(sum_q ||H_q||^2, N)`` over every rank's samples of the step (a collective call); empties the record."""
        everyone = gather_object([(self.rows, self.formed)])
        self.rows, self.formed = [], []
        rows = [r for rank_rows, _ in everyone for r in rank_rows]
        formed = [f for _, rank_formed in everyone for f in rank_formed]
        total, n = 0.0, 0
        if rows:
            _, sq = unit_sq_norms(*(torch.cat(part) for part in zip(*rows)))
            total, n = total + float(sq.sum()), n + sq.numel()
        for units, sq in formed:
            total, n = total + float(sq.sum()), n + units.numel()
        return total, n


class _RestoreScheduledLR(TrainerCallback):
    """Puts back the scheduled learning rate right after the optimizer step, so no scheduler compounds the scale."""

    def __init__(self, trainer: "OBLRPOTrainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._restore_scheduled_lr()


class OBLRPOTrainer(GRPOTrainer):
    """GRPOTrainer with OBLR-PO (arXiv 2511.23310): the gradient-weighted baseline and the SNR-governed step size.

    Same constructor as `trl.GRPOTrainer`. `args` is an [`OBLRPOConfig`]; with no `args` one is built (output
    directory `<model name>-OBLR-PO`), and a `GRPOConfig` is upgraded to one with the same options (see
    `oblr_trl.config.upgrade_config`). Logs under `oblr/`: `lr_scale`, `snr`, `lr`, `num_samples`, `baseline_mean`,
    `reward_mean`, `weight_spread`, `fallback_samples`, `clipped_weights`, `unscorable`.
    """

    _tag_names = ["trl", "oblr-po"]
    _name = "OBLR-PO"
    _paper = PAPER  # title, arXiv id and BibTeX (with authors) for the model card

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if config is None:  # as TRL does, named after the model
            model = bound.arguments["model"]
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            config = OBLRPOConfig(f"{name.rstrip('/').split('/')[-1]}-OBLR-PO")
        bound.arguments["args"] = config = upgrade_config(config)
        check_inputs(bound.arguments.get("model"), bound.arguments.get("train_dataset"))
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._oblr_ds_sizer = None  # under DeepSpeed: the hook that sizes each ZeRO step (deepspeed_step.StepSizer)
        if self.is_deepspeed_enabled:
            refusal = deepspeed_step.config_refusal(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            if refusal:
                raise NotImplementedError(refusal)
        fsdp1 = self.is_fsdp_enabled and not getattr(self.accelerator, "is_fsdp2", False)
        if fsdp1 and self._needs_norms:
            raise NotImplementedError(
                "OBLRPOTrainer computes exact per-sequence norms under FSDP2 only (fsdp_version: 2 in the accelerate "
                "config); with FSDP1 use grad_norm_estimator='length' and snr_lr=False."
            )
        if self._needs_norms:  # every layer the exact norms cannot cover, named now, before the first generation
            validate(self.model)
            multimodal.refuse_trainable_vision(self.model, self.train_dataset)
        if self.args.snr_lr and self.aux_loss_enabled:
            logger.warning(
                "The model's router auxiliary loss (router_aux_loss_coef != 0) adds a gradient term the SNR estimate "
                "does not include: the step size is approximate. Set the model config's router_aux_loss_coef=0 for the "
                "exact estimate."
            )
        self._oblr_samples = StepSamples()
        self._oblr_rows_generated = 0  # completions generated for training so far, all ranks: the next row id
        self._oblr_saved_lrs: list[float] | None = None
        self._oblr_lr_groups: list[dict] = []  # the param groups whose lr was scaled (restored after the step)
        # the SNR estimator's state and the running step-size statistics (both checkpointed)
        self._oblr_snr_state = SNRState()
        self._oblr_lr_stats = LrStats()
        self._oblr_warned: set[str] = set()
        self._oblr_unscored_batch = False  # the last generation batch had no reward at all (no_rewards)
        self._oblr_precision_checked_lr = float("inf")
        # one_backward: True / False once decided; None until the first generation decides it by memory (auto).
        # Its rows per chunk: 0 = the whole micro-batch; None = decided at the first generation (under checkpointing)
        self._one_backward: bool | None = False
        self._oblr_chunk_rows: int | None = None if self.args.gradient_checkpointing else 0
        if self.args.one_backward is not False and self._needs_norms:
            reasons = one_backward.blockers(self.args, fsdp1=fsdp1, aux_loss=self.aux_loss_enabled,
                                            deepspeed=self.is_deepspeed_enabled)
            self._one_backward, why = one_backward.initial_choice(
                self.args.one_backward, reasons, self.accelerator.device.type, self.args.gradient_checkpointing
            )
            if why:  # DeepSpeed switches off even the automatic choice: said once, as a warning
                loud = reasons and (self.args.one_backward or self.is_deepspeed_enabled)
                logger.log(logging.WARNING if loud else logging.INFO, why)
        self.add_callback(_RestoreScheduledLR(self))
        install_all_none_reward_filter()  # TRL's data-row dump for all-None rewards: shown once, not every step

    # ---------------------------------------------------------------- helpers
    @property
    def uses_one_backward(self) -> bool:
        """Whether norms and update come from one forward/backward (see ``OBLRPOConfig.one_backward``)."""
        return bool(self._one_backward)

    def _decide_one_backward(self, batch: dict) -> None:
        """Under gradient checkpointing, ``one_backward``'s chunks: whole groups keeping at most what GRPO's
        checkpointed loss pass holds for the micro-batch, plus a tenth of a lower bound on GRPO's peak memory (the
        margin the memory goal allows; :func:`one_backward.chunk_budget`), the same on every rank. The automatic
        choice takes the two-pass path where not even one group fits; ``one_backward=True`` then runs one group at a
        time. Logged once."""
        rows = min(batch["prompt_ids"].shape[0], self.args.per_device_train_batch_size)
        tokens = batch["prompt_ids"].shape[1] + self.max_completion_length
        itemsize = 2 if (self.args.bf16 or self.args.fp16) else 4
        kept = one_backward.kept_bytes(self.model, 1, tokens, itemsize)
        budget = one_backward.chunk_budget(self.model, rows, tokens, self.max_completion_length, itemsize,
                                           one_backward.process_peak_bytes(self.accelerator.device))
        chunk = one_backward.chunk_rows(rows, self.num_generations, kept, budget)
        chunk = int(self.accelerator.gather(torch.tensor([chunk], device=self.accelerator.device)).min())
        if self._one_backward is None:
            self._one_backward = chunk > 0
        elif chunk == 0:  # one_backward=True: as little at a time as whole groups allow
            chunk = self.num_generations if rows % self.num_generations == 0 else rows
        self._oblr_chunk_rows = chunk if self._one_backward else 0
        if self._one_backward:
            how = ("one forward/backward per micro-batch." if chunk >= rows else
                   f"one forward/backward per chunk of {chunk} rows ({chunk // self.num_generations} groups).")
        else:
            how = "two passes, keeping checkpointing's savings."
        logger.info(
            f"OBLR-PO (one_backward={self.args.one_backward}, gradient checkpointing on): one_backward keeps "
            f"~{rows * kept / 2**30:.2f} GiB per micro-batch of {rows} x {tokens} tokens against a budget of "
            f"~{budget / 2**30:.2f} GiB (what GRPO's checkpointed pass holds, plus a tenth of a lower bound on GRPO's "
            f"peak memory): " + how
        )

    @property
    def _needs_norms(self) -> bool:
        a = self.args
        weighted = a.baseline == "gradient_weighted"
        return a.snr_lr or (weighted and weight_estimator(a.grad_norm_estimator).needs == "norms")

    def _warn_once(self, key: str, **fmt) -> None:
        if key not in self._oblr_warned:
            self._oblr_warned.add(key)
            logger.warning(WARNINGS[key].format(**fmt))

    def _log(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._metrics["train"][f"oblr/{name}"].append(value)

    def _unit(self, local_batch: int) -> int:
        """Rows per SNR sample: a whole group where every group lies on one rank, else one completion."""
        if self.args.snr_sample_unit == "group" and local_batch % self.num_generations == 0:
            return self.num_generations
        if self.args.snr_sample_unit == "group" and "group_span" not in self._oblr_warned:
            self._oblr_warned.add("group_span")
            logger.warning(
                f"A group of {self.num_generations} completions spans ranks (local batch {local_batch}); the SNR uses "
                "each completion as a sample. Make per_device_train_batch_size * steps_per_generation a multiple of "
                "num_generations for the group estimate."
            )
        return 1

    @staticmethod
    def _sequence_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids``, ``attention_mask`` and the mask of completion tokens that enter the loss."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
        return input_ids, attention_mask, mask

    def _loss_coefficients(self, batch: dict) -> torch.Tensor:
        return loss_coefficients(
            self.loss_type, self._sequence_inputs(batch)[2], accumulation_steps=self.current_gradient_accumulation_steps,
            num_processes=self.accelerator.num_processes, steps_per_generation=self.args.steps_per_generation,
            max_completion_length=self.max_completion_length, num_items_in_batch=batch.get("num_items_in_batch"),
            epsilon_high=self.epsilon_high,
        )

    # ------------------------------------------------------- advantages (Thm 7)
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._oblr_rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._oblr_rewards_per_func

    def _finite(self, products: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Products of completions with a non-finite norm zeroed (warned); returns them and those completions."""
        products, bad = mask_nonfinite_products(products)
        if bad.any():
            self._warn_once("nonfinite_norms")
        return products, bad

    def _norms_pass(self, batch: dict, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The two-pass path's within-unit inner products ``<u_i, u_j>``, ``(n / unit, unit, unit)`` (non-finite
        ones zeroed), and the mask of completions whose norm was not finite."""
        input_ids, attention_mask, mask = self._sequence_inputs(batch)
        chunk = max(unit, -(-self.args.per_device_train_batch_size // unit) * unit)
        with torch.enable_grad(), self.accelerator.autocast():
            return self._finite(torch.cat([
                per_sequence_grad_inner_products(
                    self.model, input_ids[s : s + chunk], attention_mask[s : s + chunk], mask[s : s + chunk],
                    group_size=unit, temperature=self.temperature,
                    model_inputs=multimodal.row_inputs(batch, s, s + chunk),  # a VLM's images, if any
                )
                for s in range(0, input_ids.shape[0], chunk)
            ]))

    @torch.no_grad()
    def _logit_proxy(self, batch: dict) -> torch.Tensor:
        """``grad_norm_estimator="logit"``: each completion's proxy weight from one forward without backward."""
        input_ids, attention_mask, mask = self._sequence_inputs(batch)
        length = batch["completion_ids"].shape[1]
        parts = []
        chunk = self.args.per_device_train_batch_size
        with self.accelerator.autocast():
            for s in range(0, input_ids.shape[0], chunk):
                logits = self.model(input_ids=input_ids[s : s + chunk], attention_mask=attention_mask[s : s + chunk],
                                    logits_to_keep=length + 1, **multimodal.row_inputs(batch, s, s + chunk),
                                    ).logits[:, :-1].float() / self.temperature
                token_logps = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][s : s + chunk, :, None])
                parts.append(logit_proxy_weights(token_logps[..., 0], token_log_sum_sq_probs(logits), mask[s : s + chunk]))
        return torch.cat(parts)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        rewards, num_infinite = aggregate_rewards(self._oblr_rewards_per_func, self.reward_weights)  # all ranks
        if num_infinite:
            self._warn_once("nonfinite_reward")
        self._oblr_unscored_batch = bool(torch.isnan(rewards).all())
        if self._oblr_unscored_batch:
            self._warn_once("no_rewards")
        local_n = output["prompt_ids"].shape[0]
        rank_slice = slice(self.accelerator.process_index * local_n, (self.accelerator.process_index + 1) * local_n)
        # one id per row, unique over training (an optimizer step may span several generation batches)
        output["oblr_row"] = self._oblr_rows_generated + torch.arange(rank_slice.start, rank_slice.stop,
                                                                      device=rewards.device)
        self._oblr_rows_generated += rewards.shape[0]
        if multimodal.has_images(output) and self._one_backward is not False:
            if self._one_backward:  # it reorders rows; a VLM's patch rows are not rows of the batch
                raise NotImplementedError("one_backward=True does not take image inputs: set one_backward=False.")
            self._one_backward = False
        if self._one_backward is not False and self._oblr_chunk_rows is None:
            self._decide_one_backward(output)
        needs = weight_estimator(self.args.grad_norm_estimator).needs
        if needs == "logit_proxy" and self.args.baseline == "gradient_weighted":
            output["oblr_proxy"] = self._logit_proxy(output)
        if self._one_backward:  # norms, advantages and update all come from the training backward (compute_loss)
            output["oblr_reward"] = rewards[rank_slice]
            return output
        products = bad = None
        if self._needs_norms:
            unit = self._unit(local_n)
            products, bad = self._norms_pass(output, unit)
            output["oblr_gram"] = products.reshape(local_n, unit)  # products with the unit's members, by position
        output["advantages"] = self._advantages(output, rewards, products, bad)
        return output

    def _advantages(self, batch: dict, rewards: torch.Tensor, products: torch.Tensor | None,
                    bad: torch.Tensor | None, metrics_of: list | None = None) -> torch.Tensor:
        """The local completions' ``r_i - b_i`` (Theorem 7) from all ranks' ``rewards`` (NaN: unscorable), the local
        within-unit inner ``products`` (``None`` without norms) and ``bad``, the local completions whose norm was not
        finite (unscorable too); logs the baseline's metrics, or appends their inputs to ``metrics_of`` (chunks of one
        micro-batch log once, over the whole micro-batch)."""
        args, gather = self.args, self.accelerator.gather
        mask = self._sequence_inputs(batch)[2]
        sq_norms = None
        if products is not None:
            rewards = torch.where(gather(bad), torch.full_like(rewards, float("nan")), rewards)
            sq_norms = torch.diagonal(products, dim1=1, dim2=2).reshape(-1)
        needs = weight_estimator(args.grad_norm_estimator).needs  # what the weights are formed from (registry)
        if needs == "logit_proxy" and "oblr_proxy" in batch:
            sq_norms = batch["oblr_proxy"]
        if sq_norms is None and needs is not None:  # no norms needed (mean baseline, no SNR)
            sq_norms = torch.zeros(mask.shape[0], device=mask.device)
        weights = gather(baseline_weights(args.grad_norm_estimator, self.loss_type, mask.sum(-1), sq_norms))
        if args.weight_clip is None and args.baseline == "gradient_weighted":
            if bool((max_weight_ratio(weights, self.num_generations) > WEIGHT_RATIO_WARNING).any()):
                self._warn_once("weight_spread")
        num_clipped = 0
        if args.weight_clip is not None:
            weights, num_clipped = clip_weights(weights, self.num_generations, args.weight_clip)
        local = slice(self.accelerator.process_index * mask.shape[0], (self.accelerator.process_index + 1) * mask.shape[0])
        if args.scale_rewards != "none":  # plain GRPO (baseline='mean', no leave-one-out): TRL's advantages stand
            baseline, num_fallback = get_baseline("mean")(rewards, weights, self.num_generations, False)
            advantages = batch["advantages"]
        else:
            baseline, num_fallback = get_baseline(args.baseline)(rewards, weights, self.num_generations,
                                                                 args.leave_one_out)
            advantages = torch.nan_to_num(rewards - baseline, nan=0.0)[local]
        if num_fallback:
            self._warn_once("fallback")
        if torch.isnan(rewards).any():
            self._warn_once("unscorable")
        if metrics_of is None:
            self._log(baseline_metrics(rewards, baseline, weights, num_fallback, num_clipped))
        else:
            metrics_of.append((rewards, baseline, weights, num_fallback, num_clipped))
        return advantages

    # --------------------------------------------------------- training loss
    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self._buffered_inputs is not buffered  # TRL generated and split a new generation batch
        if fresh and self._one_backward and self.args.steps_per_generation > 1:
            self._buffered_inputs = one_backward.whole_group_micro_batches(self._buffered_inputs, self.num_generations)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and "oblr_reward" in inputs:
            return self._one_backward_loss(inputs)
        if self.model.training and self.args.snr_lr and "oblr_gram" in inputs:
            unit = inputs["oblr_gram"].shape[1]
            a = self._loss_coefficients(inputs) * inputs["advantages"].reshape(-1)
            row = inputs["oblr_row"]
            self._oblr_samples.rows.append(
                (row.div(unit, rounding_mode="floor").cpu(), (row % unit).cpu(), a.double().cpu(),
                 inputs["oblr_gram"].double().cpu())
            )
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _one_backward_loss(self, batch: dict) -> torch.Tensor:
        """Norms, advantages and the policy update from one forward and one backward (``one_backward=True``).

        The backward reaches every layer's output; the norms give the baseline weights, the baseline the advantages
        ``A_i``, and each weight's gradient ``-sum_i c_i A_i u_i`` (TRL's loss at importance ratio 1) is then formed
        from what the pass kept, with each SNR unit's ``||H_q||^2``. Under DDP the gradients are all-reduced at the
        step's last micro-batch; under FSDP2 each is reduce-scattered into its shards as it is formed. Returns the
        loss value as a leaf: its backward is a no-op.
        """
        n = batch["oblr_row"].shape[0]

        def rows(batch: dict, index) -> dict:  # the batch's per-row tensors at ``index``, the rest as they are
            return {k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v
                    for k, v in batch.items()}

        batch = rows(batch, torch.argsort(batch["oblr_row"]))  # undo TRL's shuffle: a group's rows are consecutive
        unit = self._unit(n)
        coefficients = self._loss_coefficients(batch)  # of the whole micro-batch (a token-mean spans it)
        chunk = self._oblr_chunk_rows or n  # whole groups (see _decide_one_backward), the same on every rank
        metrics_of = []
        loss = sum(
            self._one_backward_chunk(rows(batch, slice(s, s + chunk)), coefficients[s : s + chunk], unit, metrics_of)
            for s in range(0, n, chunk)
        )
        rewards, baseline, weights, num_fallback, num_clipped = zip(*metrics_of)
        self._log(baseline_metrics(torch.cat(rewards), torch.cat(baseline), torch.cat(weights), sum(num_fallback),
                                   sum(num_clipped)))
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients and not self.is_fsdp_enabled:
            one_backward.all_reduce_grads(self.model.parameters())  # DDP's job (c_i already has 1/world)
        return loss.detach().requires_grad_()

    def _one_backward_chunk(self, batch: dict, coefficients: torch.Tensor, unit: int, metrics_of: list) -> torch.Tensor:
        """One chunk of whole units: its forward/backward, norms, advantages, gradient (added to ``.grad``) and each
        unit's ``||H_q||^2``; appends its baseline metrics' inputs to ``metrics_of``; returns its part of the loss."""
        input_ids, attention_mask, mask = self._sequence_inputs(batch)
        with self.accelerator.autocast():
            grads = per_sequence_grads(
                self.model, input_ids, attention_mask, mask, temperature=self.temperature, materialize=True
            )
        products, bad = self._finite(grads.inner_products(1))  # the weights need ||u_i||^2 only
        advantages = self._advantages(batch, self.accelerator.gather(batch["oblr_reward"]), products, bad, metrics_of)
        a = coefficients * advantages
        # the gradient of TRL's loss at ratio 1, and each unit's ||H_q||^2 = ||sum_{i in q} a_i u_i||^2 with it
        unit_sq = grads.accumulate_grad(-a, group_size=unit if self.args.snr_lr else None)
        if unit_sq is not None:
            self._oblr_samples.formed.append((batch["oblr_row"][::unit].cpu() // unit, unit_sq.double().cpu()))
        return -(a * self.accelerator.num_processes * mask.sum(-1)).sum()

    # ------------------------------------------------------ step size (Thm 4)
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.is_deepspeed_enabled:  # the engine steps inside the backward: the step is sized there
            sizer = self._oblr_ds_sizer
            if self.args.snr_lr and (sizer is None or sizer.zero is not self.model_wrapped.optimizer):
                if sizer is not None:  # a new engine (train() again): the old one's hook goes
                    sizer.remove()
                self._install_deepspeed_sizer()
            return super().training_step(model, inputs, num_items_in_batch)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.snr_lr and self.accelerator.sync_gradients:  # the step's gradient is complete: size the step
            self._apply_snr_step_size(self._grad_sq_norm())
        return loss

    def _install_deepspeed_sizer(self) -> None:
        """Under DeepSpeed: size each step inside the ZeRO optimizer's step, after the gradients are reduced and
        DeepSpeed's global (pre-clip) norm is taken, before the parameters move (:mod:`.deepspeed_step`)."""
        zero, base = deepspeed_step.zero_optimizer(self.model_wrapped)
        self._oblr_ds_sizer = deepspeed_step.StepSizer(
            zero, base, size=lambda sq: self._apply_snr_step_size(sq, groups=self._oblr_ds_sizer.groups),
            restore=self._restore_scheduled_lr, skipped=self._drop_step_samples,
        )

    def _drop_step_samples(self) -> None:
        """DeepSpeed skipped the optimizer step (an overflow): its SNR samples go with it (on every rank alike)."""
        self._oblr_samples.reduce_all_ranks()
        self._warn_once("deepspeed_skipped")

    def _grad_sq_norm(self) -> float:
        """``||G||^2`` of the step's (all-reduced, pre-clip) gradient, on every rank."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # FSDP2: a norm of DTensor shards
            norm = norm.full_tensor()
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and scaler.is_enabled():  # fp16: gradients are still scaled here
            norm = norm / scaler.get_scale()
        return float(norm) ** 2

    def _apply_snr_step_size(self, grad_sq_norm: float, groups: list[dict] | None = None) -> None:
        """Scales the lr of ``groups`` (default: the optimizer's param groups) by this step's SNR factor."""
        groups = self.optimizer.param_groups if groups is None else groups
        sum_sq, n = self._oblr_samples.reduce_all_ranks()
        # the SNR estimator (oblr_trl/step_size.py) and running statistics of the applied lr
        a = self.args
        step, self._oblr_snr_state = snr_step_size(
            a.snr_estimator, sum_sq, grad_sq_norm, n, self._oblr_snr_state, beta=a.snr_ema, window=a.snr_window,
            lr_scale_min=a.lr_scale_min,
        )
        if step.status != "ok" and not (step.status == "zero_snr" and self._oblr_unscored_batch):
            self._warn_once(step.status, n=n)  # (an SNR of 0 from unscored rewards is no_rewards', not noise)
        self._oblr_saved_lrs = [group["lr"] for group in groups]
        self._oblr_lr_groups = groups
        for group in groups:
            group["lr"] = group["lr"] * step.scale
        applied = groups[0]["lr"]
        self._oblr_lr_stats = self._oblr_lr_stats.record(step.scale, applied)
        self._log({"lr_scale": step.scale, "num_samples": float(n), "lr": applied, **self._oblr_lr_stats.metrics()})
        if step.snr == step.snr:  # undefined (fewer than 2 samples, non-finite gradient): not logged, warned
            self._log({"snr": step.snr})
        if not self.is_deepspeed_enabled:  # DeepSpeed's optimizer steps fp32 master weights, not the model's
            self._check_precision(applied)

    def _check_precision(self, lr: float) -> None:
        """Warn once if updates of the applied lr round away for most low-precision trainable weights."""
        if not 0 < lr < self._oblr_precision_checked_lr / 2 or "precision" in self._oblr_warned:
            return
        self._oblr_precision_checked_lr = lr
        frozen = frozen_fraction(self.model.parameters(), lr)
        if frozen > FROZEN_WARNING:
            self._oblr_warned.add("precision")
            logger.warning(
                f"At the applied learning rate {lr:.3g}, an update rounds away for {frozen:.0%} of the trainable "
                "bf16/fp16 weights (below half their spacing): those weights cannot change. Load the model in float32 "
                "and train with bf16=True (autocast keeps fp32 master weights), or raise learning_rate."
            )

    def _restore_scheduled_lr(self) -> None:
        if self._oblr_saved_lrs is not None:
            for group, lr in zip(self._oblr_lr_groups, self._oblr_saved_lrs):
                group["lr"] = lr
            self._oblr_saved_lrs = None

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        # under DeepSpeed the StepSizer's pre-hook on this optimizer sizes every step itself (training_step)
        if self.args.snr_lr and not self.is_deepspeed_enabled and not getattr(optimizer, "_oblr_guarded", False):
            optimizer.register_step_pre_hook(self._refuse_unsized_step)
            optimizer._oblr_guarded = True
        return optimizer

    def _refuse_unsized_step(self, optimizer, args, kwargs) -> None:
        if self.model.training and self._oblr_saved_lrs is None:
            raise RuntimeError(
                "OBLRPOTrainer: an optimizer step is about to run without its SNR step size (snr_lr=True). The "
                "step size is set in training_step at the step's last micro-batch; this training loop stepped the "
                "optimizer elsewhere. Report your transformers/accelerate versions, or set snr_lr=False."
            )

    # ------------------------------------------------------------- model card
    def create_model_card(self, *args, **kwargs):
        """TRL's card (tagged `oblr-po`, citing the paper), plus the OBLR-PO section: settings, final metrics, plots.

        TRL calls this from `_save_checkpoint` and `push_to_hub`, so the section survives every rewrite of the card.
        """
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            append_oblr_section(self.args.output_dir, self.args, self.state.log_history)

    # ------------------------------------------------------ checkpoint / resume
    # The only OBLR-PO state that outlives a step is the SNR smoothing state (the last smoothed (signal, noise)); the
    # step samples and saved lrs are emptied within each step, the warnings are per process. Saved and loaded as TRL
    # does its adaptive-entropy state: after the parent's checkpoint, and with the optimizer.
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, OBLR_STATE_NAME), "w") as f:  # the SNR estimator's state, lr statistics
                json.dump({"version": 2, "global_step": self.state.global_step,
                           "snr_state": self._oblr_snr_state.to_dict(), "lr_stats": self._oblr_lr_stats.to_dict()}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # called on every rank and with every backend when resuming (and only then), with the checkpoint folder
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OBLR_STATE_NAME)
        if not os.path.isfile(path):
            if self.args.snr_lr and self.args.snr_estimator != "per_step":
                logger.warning(
                    f"{checkpoint} has no {OBLR_STATE_NAME} (saved by another trainer or an older oblr-trl): the SNR "
                    "EMA restarts from this step's samples."
                )
            return
        with open(path) as f:
            saved = json.load(f)
        if "snr_state" in saved:
            self._oblr_snr_state = SNRState.from_dict(saved["snr_state"])
            self._oblr_lr_stats = LrStats.from_dict(saved.get("lr_stats", {}))
        else:
            logger.warning(f"{path} predates the SNR estimator's state (an older oblr-trl): the estimate restarts.")
