"""`OBLRPOTrainer`: `trl.GRPOTrainer` with OBLR-PO's advantages and step size, overriding the smallest methods.

* ``_calculate_rewards``: keeps the (all-rank) rewards the parent computes.
* ``_generate_and_score_completions``: after the parent, computes the baseline weights ``w_i`` (exact per-sequence
  gradient norms of the local completions, gathered across ranks like the rewards) and replaces ``advantages`` with
  ``r_i - b_i`` (Theorem 7).
* ``compute_loss``: records each micro-batch's per-sample contributions ``h_i = c_i A_i u_i`` to the step's gradient.
* ``_get_grad_norm``: with the step's pre-clip, all-reduced gradient norm, sets ``lr = scheduled lr x N SNR / (1 + N SNR)``
  (Theorem 4) for this optimizer step; a callback restores the scheduled lr right after the step.
"""

from __future__ import annotations

import json
import logging
import os
import textwrap
from collections import defaultdict

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from .card import append_oblr_section
from .config import OBLRPOConfig
from .estimators import clip_weights, get_baseline, gradient_signal_noise, snr_from_signal_noise, snr_lr_scale
from .grad_norms import per_sequence_grad_inner_products, per_sequence_grads, validate

logger = logging.getLogger(__name__)

OBLR_STATE_NAME = "oblr_state.json"  # OBLR-PO's cross-step state, beside trainer_state.json in each checkpoint


class _RestoreScheduledLR(TrainerCallback):
    """Puts back the scheduled learning rate right after the optimizer step, so no scheduler compounds the scale."""

    def __init__(self, trainer: "OBLRPOTrainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._restore_scheduled_lr()


class OBLRPOTrainer(GRPOTrainer):
    """GRPOTrainer with OBLR-PO (arXiv 2511.23310): the gradient-weighted baseline and the SNR-governed step size.

    Same constructor as `trl.GRPOTrainer`; `args` must be an [`OBLRPOConfig`] (a `GRPOConfig` is upgraded with the
    OBLR-PO defaults that do not conflict with it). Logs under `oblr/`: `lr_scale`, `snr`, `num_samples`,
    `baseline_mean`, `reward_mean`, `weight_spread`, `fallback_samples`, `unscorable`.
    """

    _tag_names = ["trl", "oblr-po"]
    _name = "OBLR-PO"
    _paper = {
        "title": "OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning",
        "id": "2511.23310",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @misc{oblrpo2025,
                title         = {{OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning}},
                year          = 2025,
                eprint        = {2511.23310},
                archivePrefix = {arXiv},
            }"""),
    }

    _DEEPSPEED_REFUSAL = (
        "OBLRPOTrainer does not support DeepSpeed: DeepSpeed steps the optimizer inside the last backward, before the "
        "SNR step size of this step can be applied. Use DDP (accelerate launch --multi_gpu) or FSDP2 instead."
    )

    def __init__(self, *args, **kwargs):
        args_ = kwargs.get("args")
        if args_ is not None and not isinstance(args_, OBLRPOConfig):
            raise TypeError(f"OBLRPOTrainer needs args=OBLRPOConfig(...), got {type(args_).__name__}.")
        deepspeed_requested = (args_ is not None and args_.deepspeed) or os.environ.get(
            "ACCELERATE_USE_DEEPSPEED", "false"
        ).lower() == "true"
        if deepspeed_requested:  # refuse before any model or optimizer is set up
            raise NotImplementedError(self._DEEPSPEED_REFUSAL)
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            raise NotImplementedError(self._DEEPSPEED_REFUSAL)
        if self.is_fsdp_enabled and self._needs_norms and not getattr(self.accelerator, "is_fsdp2", False):
            raise NotImplementedError(
                "OBLRPOTrainer computes exact per-sequence norms under FSDP2 only (fsdp_version: 2 in the accelerate "
                "config); with FSDP1 use grad_norm_estimator='length' and snr_lr=False."
            )
        if self._needs_norms:  # every layer the exact norms cannot cover, named now, before the first generation
            validate(self.model)
        self._oblr_step_records: list[tuple] = []
        self._oblr_rows_generated = 0  # completions generated for training so far, all ranks
        self._oblr_saved_lrs: list[float] | None = None
        self._oblr_ema: tuple[float, float] | None = None
        self._oblr_warned: set[str] = set()
        self._one_backward = False
        if self.args.one_backward and self._needs_norms:
            blockers = self._one_backward_blockers()
            if blockers:
                logger.warning("one_backward=True falls back to two passes (norms pass, then the loss pass): %s.",
                               "; ".join(blockers))
            self._one_backward = not blockers
        self.add_callback(_RestoreScheduledLR(self))

    # ---------------------------------------------------------------- helpers
    @property
    def _needs_norms(self) -> bool:
        a = self.args
        return a.snr_lr or (a.baseline == "gradient_weighted" and a.grad_norm_estimator == "exact")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._oblr_warned:
            self._oblr_warned.add(key)
            logger.warning(message)

    def _group_unit(self, local_batch: int) -> int:
        """Rows per SNR sample: a whole group where every group lies on one rank, else one completion."""
        if self.args.snr_sample_unit == "group" and local_batch % self.num_generations == 0:
            return self.num_generations
        if self.args.snr_sample_unit == "group":
            self._warn_once(
                "group_span",
                f"A group of {self.num_generations} completions spans ranks (local batch {local_batch}); the SNR uses "
                "each completion as a sample. Make per_device_train_batch_size * steps_per_generation a multiple of "
                "num_generations for the group estimate.",
            )
        return 1

    # ------------------------------------------------------- advantages (Thm 7)
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._oblr_rewards_per_func = rewards_per_func
        return rewards_per_func

    @staticmethod
    def _completion_mask(batch: dict) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask * batch["tool_mask"] if "tool_mask" in batch else mask

    @staticmethod
    def _input_ids_and_attention(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        return input_ids, torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)

    def _finite_products(self, products: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero the inner products of completions whose own norm is not finite; returns them and that mask ``(n,)``."""
        finite = torch.isfinite(products)
        bad = ~torch.isfinite(torch.diagonal(products, dim1=1, dim2=2))  # (n / unit, unit)
        if bad.any():
            self._warn_once(
                "nonfinite_norms",
                "Non-finite per-sequence gradient norms: those completions are treated as unscorable (advantage 0, "
                "no part in any baseline or in the SNR).",
            )
        keep = ~bad
        products = torch.where(finite & keep[..., :, None] & keep[..., None, :], products, torch.zeros_like(products))
        return products, bad.reshape(-1)

    def _local_grad_products(self, output: dict, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Within-unit inner products ``<u_i, u_j>`` of the local completions, ``(n / unit, unit, unit)``, and the
        mask ``(n,)`` of completions whose products were not finite (zeroed). The two-pass path's norms pass."""
        input_ids, attention_mask = self._input_ids_and_attention(output)
        mask = self._completion_mask(output)
        chunk = max(unit, -(-self.args.per_device_train_batch_size // unit) * unit)
        parts = []
        with torch.enable_grad(), self.accelerator.autocast():
            for start in range(0, input_ids.shape[0], chunk):
                sl = slice(start, start + chunk)
                parts.append(
                    per_sequence_grad_inner_products(
                        self.model, input_ids[sl], attention_mask[sl], mask[sl], group_size=unit,
                        temperature=self.temperature,
                    )
                )
        return self._finite_products(torch.cat(parts))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        device = self.accelerator.device
        local_n = output["prompt_ids"].shape[0]
        rewards_per_func = self._oblr_rewards_per_func  # all ranks
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        nonfinite = ~torch.isfinite(rewards) & ~unscorable
        if nonfinite.any():
            self._warn_once("nonfinite_reward", "Rewards of +-inf were treated as unscorable (NaN): no baseline, advantage 0.")
        rewards = torch.where(unscorable | nonfinite, torch.full_like(rewards, float("nan")), rewards)
        unit = self._group_unit(local_n)
        index = torch.arange(local_n, device=device) + self.accelerator.process_index * local_n
        # SNR sample ids, unique over training: an optimizer step may span several generation batches
        first_row = self._oblr_rows_generated
        self._oblr_rows_generated += rewards.shape[0]
        output["oblr_unit"] = (first_row + index) // unit
        output["oblr_pos"] = index % unit
        if self._one_backward:  # norms, advantages and update all come from the training backward (compute_loss)
            output["oblr_index"] = index
            output["oblr_reward"] = rewards[index]
            return output
        products = bad = None
        if self._needs_norms:
            products, bad = self._local_grad_products(output, unit)
            output["oblr_gram"] = products.reshape(local_n, unit)
        output["advantages"] = self._oblr_advantages(
            self._completion_mask(output), rewards, products, bad, output["advantages"]
        )
        return output

    def _oblr_advantages(self, mask, rewards, products, bad, parent_advantages) -> torch.Tensor:
        """The local completions' advantages ``r_i - b_i`` (Theorem 7), logging the baseline's metrics.

        ``rewards``: all ranks' (NaN = unscorable); ``products``: the local within-unit inner products (or ``None``
        when no norms are computed) and ``bad`` the local completions whose norms were not finite.
        """
        args, device = self.args, self.accelerator.device
        local_n = mask.shape[0]
        lengths = mask.sum(-1).float()
        if products is not None:
            rewards = torch.where(self.accelerator.gather(bad), torch.full_like(rewards, float("nan")), rewards)
            sq_norms = torch.diagonal(products, dim1=1, dim2=2).reshape(-1)
        else:
            sq_norms = torch.zeros(local_n, device=device)
        if args.grad_norm_estimator == "length":
            local_w = lengths
        elif args.loss_type == "grpo":  # the "grpo" loss divides each sequence by its length
            local_w = sq_norms / lengths.clamp(min=1) ** 2
        else:
            local_w = sq_norms
        weights = self.accelerator.gather(local_w.float())
        self._check_weight_spread(weights)
        num_clipped = 0
        if args.weight_clip is not None:
            weights, num_clipped = clip_weights(weights, self.num_generations, args.weight_clip)

        if args.scale_rewards != "none":  # plain GRPO (baseline='mean', no leave-one-out): keep the parent's advantages
            baseline = torch.nanmean(rewards.view(-1, self.num_generations), 1).repeat_interleave(self.num_generations)
            num_fallback = 0
            advantages = parent_advantages
        else:
            baseline, num_fallback = get_baseline(args.baseline)(rewards, weights, self.num_generations, args.leave_one_out)
            all_advantages = torch.nan_to_num(rewards - baseline, nan=0.0)
            rank = self.accelerator.process_index
            advantages = all_advantages[rank * local_n : (rank + 1) * local_n]

        if num_fallback:
            self._warn_once(
                "fallback",
                "Some groups' baseline weights summed to 0 (zero gradients or all-unscorable rewards); their baseline "
                "fell back to the plain mean of rewards. Counted in oblr/fallback_samples.",
            )
        valid = ~torch.isnan(rewards)
        if not valid.all():
            self._warn_once("unscorable", "Completions with no reward (None/NaN) get advantage 0 and enter no baseline.")
        w_valid = weights[valid]
        metrics = self._metrics["train"]
        metrics["oblr/baseline_mean"].append(baseline[valid].mean().item() if valid.any() else 0.0)
        metrics["oblr/reward_mean"].append(rewards[valid].mean().item() if valid.any() else 0.0)
        spread = (w_valid.std() / w_valid.mean()).item() if w_valid.numel() > 1 and w_valid.mean() > 0 else 0.0
        metrics["oblr/weight_spread"].append(spread)
        metrics["oblr/fallback_samples"].append(float(num_fallback))
        metrics["oblr/clipped_weights"].append(float(num_clipped))
        metrics["oblr/unscorable"].append(float((~valid).sum().item()))
        return advantages

    WEIGHT_RATIO_WARNING = 100.0

    def _check_weight_spread(self, weights: torch.Tensor) -> None:
        """Warn (once) when a group's largest weight exceeds 100x its median: the baseline explosion signature."""
        if self.args.weight_clip is not None or self.args.baseline != "gradient_weighted":
            return
        w = weights.reshape(-1, self.num_generations)
        usable = torch.isfinite(w) & (w > 0)
        median = torch.nanmedian(torch.where(usable, w, torch.full_like(w, float("nan"))), dim=1).values
        largest = torch.where(usable, w, torch.zeros_like(w)).amax(dim=1)
        if bool((largest > self.WEIGHT_RATIO_WARNING * median).any()):
            self._warn_once(
                "weight_spread",
                f"Gradient norms vary by more than {self.WEIGHT_RATIO_WARNING:.0f}x within a group: the "
                "gradient-weighted baseline follows one or two completions there. Set OBLRPOConfig(weight_clip=10) "
                "to bound any one completion's weight (see oblr/weight_spread).",
            )

    # ------------------------------------------------------ step size (Thm 4)
    def _loss_coefficients(self, inputs) -> torch.Tensor:
        """``c_i``: the factor of ``A_i * grad sum_t log pi(o_i)`` in the step's all-reduced gradient (at ratio 1)."""
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        batch = mask.shape[0]
        accum, world = self.current_gradient_accumulation_steps, self.accelerator.num_processes
        loss_type = self.loss_type
        if loss_type == "grpo":
            c = 1.0 / (mask.sum(-1).clamp(min=1.0) * batch * accum)
        elif loss_type == "bnpo":
            c = torch.full((batch,), 1.0 / (mask.sum().clamp(min=1.0).item() * accum), device=mask.device)
        elif loss_type == "dr_grpo":
            c = torch.full((batch,), 1.0 / (batch * self.max_completion_length * accum), device=mask.device)
        else:  # dapo: num_items_in_batch spans the generation batch, rescaled to one accumulation window per rank
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / world * accum / self.args.steps_per_generation
            c = torch.full((batch,), 1.0, device=mask.device) / normalizer
        return c / world  # DDP/FSDP average the gradients over ranks

    def _record_step_terms(self, inputs) -> None:
        """Keep this micro-batch's per-sample coefficients ``a_i = c_i A_i`` and inner products for the step's SNR."""
        if self.args.snr_lr and "oblr_gram" in inputs:
            a = (self._loss_coefficients(inputs) * inputs["advantages"].reshape(-1)).double()
            self._oblr_step_records.append(
                (inputs["oblr_unit"].cpu(), inputs["oblr_pos"].cpu(), a.cpu(), inputs["oblr_gram"].double().cpu())
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and "oblr_index" in inputs:
            return self._one_backward_loss(inputs)
        if self.model.training:
            self._record_step_terms(inputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    # ------------------------------------------------------------ one backward
    def _one_backward_blockers(self) -> list[str]:
        """Why ``one_backward`` cannot be used with these settings (empty: it can)."""
        a, reasons = self.args, []
        if a.num_iterations != 1:
            reasons.append(f"num_iterations={a.num_iterations} (importance ratio != 1)")
        if a.beta != 0.0:
            reasons.append(f"beta={a.beta} (a KL term in the loss)")
        if a.gradient_accumulation_steps % a.steps_per_generation:
            reasons.append(
                f"steps_per_generation={a.steps_per_generation} does not divide gradient_accumulation_steps="
                f"{a.gradient_accumulation_steps} (a generation's later micro-batches would be off-policy)"
            )
        elif a.steps_per_generation > 1 and a.per_device_train_batch_size % a.num_generations:
            reasons.append(
                f"per_device_train_batch_size={a.per_device_train_batch_size} is not a multiple of num_generations="
                f"{a.num_generations} with steps_per_generation={a.steps_per_generation} (each micro-batch must hold "
                "whole groups: a group's baseline needs all its norms)"
            )
        if a.use_vllm and getattr(a, "vllm_importance_sampling_correction", False):
            reasons.append("vllm_importance_sampling_correction=True (per-token importance weights)")
        if a.top_entropy_quantile < 1.0 or a.off_policy_mask_threshold is not None:
            reasons.append("top_entropy_quantile < 1 or off_policy_mask_threshold (token masks)")
        if a.use_liger_kernel:
            reasons.append("use_liger_kernel=True (Liger computes the loss)")
        if a.fp16:
            reasons.append("fp16=True (the loss scaler would unscale gradients it never scaled; use bf16)")
        if self.is_fsdp_enabled and not getattr(self.accelerator, "is_fsdp2", False):
            reasons.append("FSDP1 (use FSDP2: fsdp_version 2)")
        return reasons

    ALL_REDUCE_BUCKET = 1 << 25  # elements per all-reduce (DDP's default bucket is 25 MiB)

    def _all_reduce_grads(self) -> None:
        """Sum the trainable parameters' ``.grad`` over ranks, in buckets, in the same order on every rank."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # e.g. a rank whose batch never reached a parameter: it still takes part
                p.grad = torch.zeros_like(p)
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for p in params:  # consecutive parameters of one gradient dtype, up to ALL_REDUCE_BUCKET elements each
            if not buckets or size + p.numel() > self.ALL_REDUCE_BUCKET or p.grad.dtype != buckets[-1][0].grad.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel()
        for bucket in buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            torch.distributed.all_reduce(flat)
            for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(part.view_as(p))

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self._buffered_inputs is not buffered  # TRL generated and split a new generation batch
        if fresh and self._one_backward and self.args.steps_per_generation > 1:
            self._buffered_inputs = self._whole_group_micro_batches(self._buffered_inputs)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _whole_group_micro_batches(self, micro_batches: list[dict]) -> list[dict]:
        """TRL's (shuffled) micro-batches of one generation batch, re-split so that each holds whole groups:
        ``one_backward`` forms a group's baseline from its norms within one micro-batch."""
        merged = {}
        for key, first in micro_batches[0].items():
            parts = [mb[key] for mb in micro_batches]
            if isinstance(first, list):
                merged[key] = [x for part in parts for x in part]
            elif torch.is_tensor(first) and first.dim() > 0:
                merged[key] = torch.cat(parts)
            else:  # None, or a scalar every micro-batch shares (num_items_in_batch)
                merged[key] = first
        # Groups in the order of their first row in TRL's shuffle (as random, and no random numbers drawn), each
        # group's rows in index order.
        index = merged["oblr_index"] - merged["oblr_index"].min()
        n, group = index.shape[0], index // self.num_generations
        first = torch.full((n // self.num_generations,), n, device=index.device)
        first.scatter_reduce_(0, group, torch.arange(n, device=index.device), "amin")
        rows = torch.argsort(first[group] * n + index)
        for key, value in merged.items():
            if torch.is_tensor(value) and value.dim() > 0:
                merged[key] = value[rows]
            elif isinstance(value, list):
                merged[key] = [value[i] for i in rows.tolist()]
        return split_tensor_dict(merged, len(micro_batches))

    def _one_backward_loss(self, batch: dict) -> torch.Tensor:
        """Norms, advantages and the policy update from one forward and one backward (``one_backward=True``).

        The backward reaches every layer's output; the norms give the baseline weights, the baseline the advantages
        ``A_i``, and each weight's gradient ``-sum_i c_i A_i u_i`` (TRL's loss at importance ratio 1) is then formed
        from what the pass kept (per-sample gradients, or activations and output gradients), with each SNR unit's
        ``||H_q||^2``. Under DDP the gradients are all-reduced at the step's last micro-batch; under FSDP2 each
        gradient is reduce-scattered into its shards as it is formed. Returns the loss value
        as a leaf: its backward is a no-op.
        """
        n = batch["oblr_index"].shape[0]
        order = torch.argsort(batch["oblr_index"])  # undo TRL's shuffle: a group's rows are consecutive again
        batch = {k: v[order] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v for k, v in batch.items()}
        unit = self._group_unit(n)
        mask = self._completion_mask(batch)
        input_ids, attention_mask = self._input_ids_and_attention(batch)
        with self.accelerator.autocast():
            grads = per_sequence_grads(
                self.model, input_ids, attention_mask, mask, temperature=self.temperature, materialize=True
            )
        products, bad = self._finite_products(grads.inner_products(1))  # the weights need ||u_i||^2 only
        rewards = self.accelerator.gather(batch["oblr_reward"])
        batch["advantages"] = self._oblr_advantages(mask, rewards, products, bad, batch["advantages"])
        coefficients = self._loss_coefficients(batch)
        a = coefficients * batch["advantages"]
        # the gradient of TRL's loss at ratio 1, and each unit's ||H_q||^2 = ||sum_{i in q} a_i u_i||^2 with it
        unit_sq = grads.accumulate_grad(-a, group_size=unit if self.args.snr_lr else None)
        if unit_sq is not None:
            self._oblr_step_records.append((batch["oblr_unit"][::unit].cpu(), unit_sq.double().cpu()))
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients and not self.is_fsdp_enabled:
            self._all_reduce_grads()  # what DDP's backward hooks would have done (c_i already has 1/world)
        loss = -(a * self.accelerator.num_processes * mask.sum(-1)).sum()
        return loss.detach().requires_grad_()

    def _step_sample_sq_norms(self) -> tuple[float, int]:
        """``sum_q ||H_q||^2`` over the step's samples (all ranks) and their number ``N``."""
        records = gather_object([self._oblr_step_records])
        self._oblr_step_records = []
        by_unit: dict[int, dict[int, tuple[float, torch.Tensor]]] = defaultdict(dict)
        formed: dict[int, float] = {}  # one_backward: ||H_q||^2 of whole units, formed with the update
        for rank_records in records:
            for record in rank_records:
                if len(record) == 2:
                    formed.update(zip(record[0].tolist(), record[1].tolist()))
                    continue
                for u, p, a, g in zip(*record):
                    by_unit[int(u)][int(p)] = (a, g)
        total = sum(formed.values())
        for members in by_unit.values():
            for a_i, gram_row in members.values():  # ||H_q||^2 = sum_ij a_i a_j <u_i, u_j>
                total += float(a_i * sum(a_j * gram_row[p] for p, (a_j, _) in members.items()))
        return total, len(by_unit) + len(formed)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.args.snr_lr and self.model.training:
            self._apply_snr_step_size(grad_norm)
        return grad_norm

    def _apply_snr_step_size(self, grad_norm) -> None:
        args = self.args
        sum_sq, n = self._step_sample_sq_norms()
        g2 = float(grad_norm) ** 2 if grad_norm is not None else float("nan")
        snr = float("nan")
        if n < 2:
            scale = 1.0
            self._warn_once("few_samples", f"An optimizer step saw {n} sample(s); the SNR needs 2: lr left unscaled.")
        elif not torch.isfinite(torch.tensor(g2)):
            scale = args.lr_scale_min
            self._warn_once("nonfinite_grad", "Non-finite gradient norm: lr scaled to lr_scale_min for this step.")
        else:
            signal, noise = gradient_signal_noise(n * sum_sq, g2, n)
            if args.snr_ema > 0 and self._oblr_ema is not None:
                signal = args.snr_ema * self._oblr_ema[0] + (1 - args.snr_ema) * signal
                noise = args.snr_ema * self._oblr_ema[1] + (1 - args.snr_ema) * noise
            self._oblr_ema = (float(signal), float(noise))
            snr_t = snr_from_signal_noise(torch.as_tensor(signal), torch.as_tensor(noise))
            snr, scale = float(snr_t), float(snr_lr_scale(snr_t, n))
            if snr == 0.0:
                self._warn_once(
                    "snr_zero",
                    "SNR estimate is 0 (noise dominates): the step size collapses to lr_scale_min. If this persists, "
                    "raise the batch (more prompts per step), set lr_scale_min, or smooth with snr_ema.",
                )
        scale = max(scale, args.lr_scale_min)
        self._oblr_saved_lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * scale
        metrics = self._metrics["train"]
        metrics["oblr/lr_scale"].append(scale)
        if snr == snr:  # undefined (fewer than 2 samples, non-finite gradient): not logged, warned above
            metrics["oblr/snr"].append(snr)
        metrics["oblr/num_samples"].append(float(n))
        metrics["oblr/lr"].append(self.optimizer.param_groups[0]["lr"])

    def _restore_scheduled_lr(self) -> None:
        if self._oblr_saved_lrs is not None:
            for group, lr in zip(self.optimizer.param_groups, self._oblr_saved_lrs):
                group["lr"] = lr
            self._oblr_saved_lrs = None

    # ------------------------------------------------------------- model card
    def create_model_card(self, *args, **kwargs):
        """TRL's card (tagged `oblr-po`, citing the paper), plus the OBLR-PO section: settings, final metrics, plots.

        TRL calls this from `_save_checkpoint` and `push_to_hub`, so the section survives every rewrite of the card.
        """
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            append_oblr_section(self.args.output_dir, self.args, self.state.log_history)

    # ------------------------------------------------------ checkpoint / resume
    # The only OBLR-PO state that outlives a step is the SNR smoothing state ``_oblr_ema`` (the last smoothed
    # (signal, noise)); the step records and saved lrs are emptied within each step, the warnings are per process.
    # Saved and loaded as TRL does its adaptive-entropy state: after the parent's checkpoint, and with the optimizer.
    def _oblr_state_dict(self) -> dict:
        return {"version": 1, "global_step": self.state.global_step, "snr_ema_state": self._oblr_ema}

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            output_dir = os.path.join(self._get_output_dir(trial=trial), checkpoint_folder)
            with open(os.path.join(output_dir, OBLR_STATE_NAME), "w") as f:
                json.dump(self._oblr_state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # called on every rank and with every backend when resuming (and only then), with the checkpoint folder
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OBLR_STATE_NAME)
        if not os.path.isfile(path):
            if self.args.snr_lr and self.args.snr_ema > 0:
                logger.warning(
                    f"{checkpoint} has no {OBLR_STATE_NAME} (saved by another trainer or an older oblr-trl): the SNR "
                    "EMA restarts from this step's samples."
                )
            return
        with open(path) as f:
            state = json.load(f)
        ema = state.get("snr_ema_state")
        self._oblr_ema = None if ema is None else (float(ema[0]), float(ema[1]))
