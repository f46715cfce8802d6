"""`OBLRPOTrainer`: `trl.GRPOTrainer` with OBLR-PO's advantages and step size, overriding the smallest methods.

Each override hands TRL's data to one function or object and back; none holds a formula. Data flows one way, each
stage a value: TRL's batch -> norms (:mod:`.norm_passes`; :func:`.one_backward.chunk_norms` in ``compute_loss``) ->
advantages ``r_i - b_i`` (Theorem 7: :func:`.advantages.compute_advantages`) -> ``a_i = c_i A_i`` (``_policy_weights``)
-> loss and update (TRL's; :meth:`.one_backward.ChunkNorms.update`) and SNR samples -> the step size ``eta_max x N SNR
/ (1 + N SNR)`` (Theorem 4, ``eta_max`` calibrated or ``learning_rate``: :class:`.step_sizer.StepSizer`, at the step's last micro-batch, or in ZeRO's optimizer step
via :class:`.deepspeed_step.ZeroStepHook`); an optimizer pre-step hook refuses any step whose size was not set.

* the path (``one_backward`` whole, in chunks or replayed, or two passes): :class:`.path_choice.Route`, asked once per
  generation; refusals at construction: :mod:`.setup_checks`; warnings, once each: :class:`.advice.Advice`; the model
  card and the checkpointed SNR state (:mod:`.state_file`): ``create_model_card``, ``_save_checkpoint``, ``train``, ...

Every TRL internal used here is a seam listed, with a hash of its source, in ``tests/seam_table.py``.
"""

from __future__ import annotations

import inspect
import logging

import torch

from trl import GRPOTrainer

from . import construction_undo, deepspeed_step, multimodal, norm_passes, one_backward, path_choice, state_file
from .advantages import BaselineStats, compute_advantages, raised
from .advice import Advice
from .card import PAPER, append_oblr_section
from .config import config_for, needs_norms
from .estimators import aggregate_rewards, weights_need
from .grad_norms import validate
from .loss_terms import loss_coefficients
from .metrics import key as metric_key
from .precision import PrecisionWatch
from .setup_checks import AUX_LOSS_WARNING, check_inputs, check_prompts, check_trainable, checked_reward_funcs
from .setup_checks import fsdp1_refusal
from .step_sizer import UNSIZED_STEP, RestoreScheduledLR, StepSizer, guard_optimizer, parameters_grad_sq_norm
from .trl_logs import install_all_none_reward_filter
from .trl_seam import sequence_inputs

logger = logging.getLogger(__name__)


class OBLRPOTrainer(GRPOTrainer):
    """GRPOTrainer with OBLR-PO (arXiv 2511.23310): the gradient-weighted baseline and the SNR-governed step size.

    Same constructor as `trl.GRPOTrainer`. `args` is an [`OBLRPOConfig`]; with no `args` one is built (output
    directory `<model name>-OBLR-PO`), and a `GRPOConfig` is upgraded to one with the same options (see
    `oblr_trl.config.upgrade_config`). Logs under `oblr/` the metrics of `oblr_trl.metrics.CATALOGUE`, each with
    what it is and what a healthy run shows (the Logged metrics page), and no other.
    """

    _tag_names = ["trl", "oblr-po"]
    _name = "OBLR-PO"
    _paper = PAPER  # title, arXiv id and BibTeX (with authors) for the model card

    @construction_undo.undone_on_refusal  # a refused construction leaves the model it was given as it was
    def __init__(self, *args, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        bound.arguments["args"] = config_for(bound.arguments.get("args"), bound.arguments["model"])
        check_inputs(bound.arguments.get("model"), bound.arguments.get("train_dataset"))
        super().__init__(*bound.args[1:], **bound.kwargs)
        check_trainable(self.model)
        self.reward_funcs = checked_reward_funcs(self.reward_funcs, self.reward_func_names)  # each names itself
        fsdp1 = self.is_fsdp_enabled and not getattr(self.accelerator, "is_fsdp2", False)
        refusal = fsdp1_refusal(fsdp1, self._needs_norms) or (
            deepspeed_step.config_refusal(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            if self.is_deepspeed_enabled else None)
        if refusal:
            raise NotImplementedError(refusal)
        if self._needs_norms:  # every layer the exact norms cannot cover, named now, before the first generation
            validate(self.model)
            multimodal.refuse_trainable_vision(self.model, self.train_dataset)
        if self.args.snr_lr and self.aux_loss_enabled:
            logger.warning(AUX_LOSS_WARNING)
        self.advice = Advice()
        self.step_sizer = StepSizer(self.args)
        self._zero_hook = None  # under DeepSpeed: has each ZeRO step sized (deepspeed_step.ZeroStepHook)
        self._precision = PrecisionWatch()
        self._rows_generated = 0  # completions generated for training so far, all ranks: the next row id
        self._unscored_batch = False  # the last generation batch had no reward at all (no_rewards)
        self.route, why, loud = path_choice.Route.for_trainer(
            self.args, needs_norms=self._needs_norms, fsdp1=fsdp1, aux_loss=self.aux_loss_enabled,
            deepspeed=self.is_deepspeed_enabled)
        if why:  # DeepSpeed switches off even the automatic choice: said once, as a warning
            logger.log(logging.WARNING if loud else logging.INFO, why)
        self.add_callback(RestoreScheduledLR(self.step_sizer))
        install_all_none_reward_filter()  # TRL's data-row dump for all-None rewards: shown once, not every step

    # ---------------------------------------------------------------- helpers
    @property
    def uses_one_backward(self) -> bool:
        """Whether norms and update come from one forward/backward (see ``OBLRPOConfig.one_backward``)."""
        return self.route.on

    @property
    def _needs_norms(self) -> bool:
        return needs_norms(self.args)

    def _log(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._metrics["train"][metric_key(name)].append(value)  # a name missing from the catalogue raises

    def _unit(self, local_batch: int) -> int:
        """Rows per SNR sample: a whole group where every group lies on one rank, else one completion."""
        whole = local_batch % self.num_generations == 0
        if self.args.snr_sample_unit == "group" and not whole:
            self.advice("group_span", group=self.num_generations, local=local_batch)
        return self.num_generations if self.args.snr_sample_unit == "group" and whole else 1

    def _policy_weights(self, batch: dict, advantages: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """``a_i = c_i A_i`` of the rows ``rows`` of the micro-batch ``batch`` (``c_i`` spans all of it): each row's
        weight in TRL's loss at ratio 1, whose gradient is ``-sum_i a_i u_i``; the SNR's samples are ``a_i u_i``."""
        return loss_coefficients(
            self.loss_type, sequence_inputs(batch)[2], accumulation_steps=self.current_gradient_accumulation_steps,
            num_processes=self.accelerator.num_processes, steps_per_generation=self.args.steps_per_generation,
            max_completion_length=self.max_completion_length, num_items_in_batch=batch.get("num_items_in_batch"),
            epsilon_high=self.epsilon_high)[rows] * advantages.reshape(-1)

    # ------------------------------------------------------- advantages (Thm 7)
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        check_prompts(inputs)  # before the tokenizer fails on them, naming neither column nor row
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        rewards, num_infinite = aggregate_rewards(self._rewards_per_func, self.reward_weights, count_on_device=True)
        num_infinite, self._unscored_batch = map(bool, torch.stack([num_infinite, torch.isnan(rewards).all()]).tolist())
        if num_infinite:
            self.advice("nonfinite_reward")
        if self._unscored_batch:
            self.advice("no_rewards")
        local_n, rank = output["prompt_ids"].shape[0], self.accelerator.process_index
        # one id per row, unique over training (an optimizer step may span several generation batches)
        output["oblr_row"] = self._rows_generated + torch.arange(rank * local_n, (rank + 1) * local_n,
                                                                 device=rewards.device)
        self._rows_generated += rewards.shape[0]
        route = self.route
        said = route.at_generation(self.model, output, self.args, self.num_generations, self.max_completion_length,
                                   self.accelerator.device, self.accelerator.gather, self.optimizer)
        if said:
            logger.info(said)
        output["oblr_reward"] = rewards[rank * local_n : (rank + 1) * local_n]
        if weights_need(self.args.baseline, self.args.grad_norm_estimator) == "logit_proxy":  # they stand in for norms
            output["oblr_proxy"] = norm_passes.logit_proxy(
                self.model, output, chunk=self.args.per_device_train_batch_size, temperature=self.temperature,
                autocast=self.accelerator.autocast)
        if route.on:  # norms, advantages and update all come from the training backward (compute_loss)
            return output
        sq_norms = bad = None
        if self._needs_norms:
            unit = self._unit(local_n)
            chunk = route.norms_rows(unit, self.args.per_device_train_batch_size)
            products, bad = norm_passes.norm_products(self.model, output, unit=unit, chunk=chunk,
                                                      temperature=self.temperature, autocast=self.accelerator.autocast)
            output["oblr_gram"] = products.reshape(local_n, unit)  # products with the unit's members, by position
            sq_norms = torch.diagonal(products, dim1=1, dim2=2).reshape(-1)
        result = self._advantages(output, sq_norms, bad)
        self.advice(*raised({} if bad is None else {"nonfinite_norms": bad.any()}, result.found))  # one read
        self._log(result.stats.metrics())
        output["advantages"] = result.values
        return output

    def _advantages(self, batch: dict, sq_norms: torch.Tensor | None, bad: torch.Tensor | None):
        """:func:`.advantages.compute_advantages` of the local rows of ``batch``, over every rank's rewards, lengths
        and norms (gathered here; the logit proxy's weights in place of the norms where the batch has them). Its
        checks are left to the caller to read (``result.found``: one host read for all of them)."""
        gather, n = self.accelerator.gather, batch["oblr_row"].shape[0]
        sq_norms = batch.get("oblr_proxy", sq_norms)
        local = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        result = compute_advantages(
            gather(batch["oblr_reward"]), gather(sequence_inputs(batch)[2].sum(-1)),
            None if sq_norms is None else gather(sq_norms), args=self.args, loss_type=self.loss_type,
            group_size=self.num_generations, local=local, unscorable=None if bad is None else gather(bad),
            trl_advantages=batch.get("advantages"),
        )
        return result

    # --------------------------------------------------------- training loss
    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self._buffered_inputs is not buffered  # TRL generated and split a new generation batch
        if fresh and self.uses_one_backward and self.args.steps_per_generation > 1:
            self._buffered_inputs = one_backward.whole_group_micro_batches(self._buffered_inputs, self.num_generations)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and self.uses_one_backward:
            return self._one_backward_loss(inputs)
        if self.model.training and self.args.snr_lr:
            a = self._policy_weights(inputs, inputs["advantages"])
            self.step_sizer.record_rows(inputs["oblr_row"], inputs["oblr_gram"].shape[1], a, inputs["oblr_gram"])
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _one_backward_loss(self, batch: dict) -> torch.Tensor:
        """``one_backward`` by chunks (rows in generation order): norms, advantages (as two passes form them), update;
        DDP's all-reduce at the step's last micro-batch. Returns the loss as a leaf (its backward is a no-op)."""
        n = batch["oblr_row"].shape[0]
        batch = one_backward.rows_of(batch, torch.argsort(batch["oblr_row"]), n)  # undo TRL's shuffle
        unit, loss, stats, found = self._unit(n), 0.0, [], []
        for norms in one_backward.chunk_norms(self.model, batch, chunk=self.route.chunk_rows or n,
                                              temperature=self.temperature, autocast=self.accelerator.autocast,
                                              replay_unit=unit if self.route.replay else None):
            result = self._advantages(norms.batch, norms.sq_norms, norms.unscorable)
            update = norms.update(self._policy_weights(batch, result.values, norms.rows),
                                  snr_unit=unit if self.args.snr_lr else None)
            found += [result.found, norms.found]  # read once, after the last chunk
            if update.unit_sq is not None:
                self.step_sizer.record_formed(update.units, update.unit_sq)
            loss, stats = loss + update.loss, stats + [result.stats]
        self.advice(*raised(*found))
        self._log(BaselineStats.merge(stats).metrics())
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients and not self.is_fsdp_enabled:
            one_backward.all_reduce_grads(self.model.parameters())  # DDP's job (c_i already has 1/world)
        return (loss * self.accelerator.num_processes).detach().requires_grad_()

    # ------------------------------------------------------ step size (Thm 4)
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.is_deepspeed_enabled:  # the engine steps inside the backward: the step is sized there
            hook = self._zero_hook
            if self.args.snr_lr and (hook is None or hook.zero is not self.model_wrapped.optimizer):
                if hook is not None:  # a new engine (train() again): the old one's hook goes
                    hook.remove()
                self._install_zero_hook()
            return super().training_step(model, inputs, num_items_in_batch)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.snr_lr and self.accelerator.sync_gradients:  # the step's gradient is complete: size the step
            self._size_step(parameters_grad_sq_norm(self.model.parameters(), getattr(self.accelerator, "scaler", None)))
        return loss

    def _install_zero_hook(self) -> None:
        """Under DeepSpeed: size each step inside the ZeRO optimizer's step (:mod:`.deepspeed_step`)."""
        zero, base = deepspeed_step.zero_optimizer(self.model_wrapped)
        self._zero_hook = deepspeed_step.ZeroStepHook(
            zero, base, size=lambda sq: self._size_step(sq, groups=self._zero_hook.groups),
            restore=self.step_sizer.restore, skipped=lambda: self.advice(*self.step_sizer.drop_samples()))

    def _size_step(self, grad_sq_norm: float, groups: list[dict] | None = None) -> None:
        """Scales the lr of ``groups`` (default: the optimizer's param groups) by this step's SNR factor."""
        groups = self.optimizer.param_groups if groups is None else groups
        metrics, warnings = self.step_sizer.size(groups, grad_sq_norm, unscored=self._unscored_batch)
        self.advice(*warnings, n=int(metrics["num_samples"]))
        self._log(metrics)
        if not self.is_deepspeed_enabled:  # DeepSpeed's optimizer steps fp32 master weights, not the model's
            found = self._precision.check(self.model.parameters(), metrics["lr"])
            if found:
                self.advice(found[0], **found[1])

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        # under DeepSpeed the ZeroStepHook's pre-hook on this optimizer sizes every step itself (training_step)
        if self.args.snr_lr and not self.is_deepspeed_enabled:
            guard_optimizer(optimizer, self._refuse_unsized_step)  # once, also when train() runs again
        return optimizer

    def _refuse_unsized_step(self, optimizer, args, kwargs) -> None:
        if self.model.training and not self.step_sizer.sized:
            raise RuntimeError(UNSIZED_STEP)

    # ------------------------------------------------------------- model card
    def create_model_card(self, *args, **kwargs):
        """TRL's card (tagged `oblr-po`, citing the paper), plus the OBLR-PO section: settings, final metrics, plots.

        TRL calls this from `_save_checkpoint` and `push_to_hub`, so the section survives every rewrite of the card.
        """
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            append_oblr_section(self.args.output_dir, self.args, self.state.log_history)

    # ------------------------------------------------------ checkpoint / resume
    # The only OBLR-PO state that outlives a step is the step sizer's (the SNR smoothing state, lr statistics, the
    # calibrated eta_max).
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """TRL's, resuming from the latest *complete* checkpoint (:func:`.state_file.resume_point`); each call a fresh
        run of the step sizer (or the checkpoint's), whose scaled lr no exception leaves in the optimizer."""
        resume_from_checkpoint = state_file.resume_point(resume_from_checkpoint, self.args.output_dir, logger.warning)
        self.step_sizer.reset()
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.step_sizer.abandon()  # after an exception between sizing a step and taking it: the scheduled lr

    def _save_checkpoint(self, model, trial):
        if self.args.should_save:  # first, atomically: a checkpoint complete for transformers holds the whole file
            self.step_sizer.save(self._get_output_dir(trial=trial), self.state.global_step)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # called on every rank and with every backend when resuming (and only then), with the checkpoint folder
        super()._load_optimizer_and_scheduler(checkpoint)
        problem = checkpoint and self.step_sizer.load(checkpoint)  # against the checkpoint's own step
        if problem:
            logger.warning(problem)
