"""Every place OBLR-PO depends on TRL's internals (its "seams"), with why, and a hash of each one's source.

`OBLRPOTrainer` overrides private methods of `trl.GRPOTrainer` and reproduces the logic of others (the loss's
coefficients in :mod:`oblr_trl.loss_terms`, the VLM's row slicing in :mod:`oblr_trl.multimodal`). A TRL release can
change any of them without changing a public API. `SEAMS` lists them; for each method TRL defines, `sha` is a hash of
its source as the pinned TRL (``trl>=1.16,<1.17``) has it (:func:`source_hash`: ``inspect.getsource``, dedented).
`tests/test_trl_seam.py` fails on a TRL whose source differs, naming the method and what to re-check
(:func:`drift`); after re-checking, refresh the hashes (``python tests/seam_table.py`` prints them). Test apparatus:
not installed with the package, which keeps only what training needs (``oblr_trl/trl_seam.py``'s
``sequence_inputs``).

Methods TRL inherits from ``transformers.Trainer`` (``owner`` in ``transformers``) are checked for their owner only:
transformers is not pinned (``make test`` and ``make test-floors`` run different versions), and its methods are pinned
by behaviour tests instead (``tests/integration``). A TRL that starts overriding one of them changes its owner, and
that fails the check too.

TRL's proposed advantage hook (huggingface/trl PR 7298, open): ``GRPOTrainer._transform_advantages(advantages)``,
called inside ``_generate_and_score_completions`` on the all-process advantages before TRL logs and slices them. Where
it would plug in: OBLR-PO's ``r_i - b_i`` (``OBLRPOTrainer._advantages``, today written over TRL's advantages after
``super()._generate_and_score_completions``) would move into that hook, and TRL's logged ``advantages`` statistics
would then be OBLR-PO's. As proposed the hook receives only the advantages, while the gradient-weighted baseline
needs the rewards (today kept by the ``_calculate_rewards`` override) and the per-sequence norms of the generated
batch (a norms pass over it, or ``one_backward``'s deferral to the loss), so ``_generate_and_score_completions`` and
``_calculate_rewards`` would stay overridden for those; the ``_transform_advantages`` row below would then join the
seams, and ``"needs"`` a TRL with the hook. Not in TRL 1.16: ``getattr(GRPOTrainer, "_transform_advantages")`` fails.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from dataclasses import dataclass

from trl import GRPOTrainer


@dataclass(frozen=True)
class Seam:
    """One TRL method we override or whose logic we reproduce: ``name`` on ``GRPOTrainer``; ``owner``, the module and
    qualified name that define it in the pinned TRL; ``sha``, its :func:`source_hash` (``None``: owner only, see the
    module's docstring); ``why``: what OBLR-PO depends on; ``recheck``: what to verify when it changes."""

    name: str
    owner: str
    sha: str | None
    why: str
    recheck: str


GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"

SEAMS: tuple[Seam, ...] = (
    Seam("__init__", f"{GRPO}.__init__", "08b825a073b699ff",
         "overridden: bound to its signature (args by name or position), builds or upgrades the config before it",
         "the signature and the position of `args`; that DeepSpeed is still set up inside it (its ZeRO stage is "
         "checked right after it: oblr_trl/deepspeed_step.py)"),
    Seam("_calculate_rewards", f"{GRPO}._calculate_rewards", "5017fb893c0ca9dd",
         "overridden: keeps the all-rank rewards_per_func it returns; trl_logs filters its all-None warning; it "
         "calls self.reward_funcs, which __init__ wraps to check each function's output (setup_checks)",
         "its return value is still every rank's (n, functions) rewards with NaN for None; the warning's wording "
         "(oblr_trl/trl_logs.py ALL_NONE_MESSAGE); that it still calls self.reward_funcs (names from "
         "reward_func_names, read at construction)"),
    Seam("_generate_and_score_completions", f"{GRPO}._generate_and_score_completions", "3d5cec813b83b396",
         "overridden: replaces output['advantages'] with r_i - b_i, adds oblr_* rows; relies on its output keys, "
         "the process slice of the rows and scale_rewards='none' giving rewards - group mean",
         "the keys of its output (prompt_ids, completion_ids, completion_mask, tool_mask, advantages, "
         "num_items_in_batch), that the rows stay in generation order (groups consecutive), how rewards_per_func are "
         "aggregated (estimators.aggregate_rewards), and whether _transform_advantages (PR 7298) now exists"),
    Seam("_prepare_inputs", f"{GRPO}._prepare_inputs", "40caff99c2cf1292",
         "overridden: detects a fresh generation batch by _buffered_inputs and re-splits it into whole groups "
         "(one_backward.whole_group_micro_batches)",
         "_buffered_inputs, _step and steps_per_generation are still how micro-batches are buffered and indexed"),
    Seam("compute_loss", f"{GRPO}.compute_loss", "adf7308e034ac6c4",
         "overridden: records each micro-batch's SNR terms, or runs one_backward's pass instead of TRL's loss",
         "that it still only dispatches to _compute_loss (no extra loss term the SNR would miss)"),
    Seam("_compute_loss", f"{GRPO}._compute_loss", "16c4f3917b9fd264",
         "reproduced: oblr_trl/loss_terms.py derives each completion's coefficient c_i of this loss at ratio 1 "
         "(every loss type's normalizer), oblr_trl/trl_seam.py's sequence_inputs forms its input ids and masks as "
         "it does, and one_backward forms the same gradient",
         "tests/test_loss_terms.py (pins loss_coefficients to this loss by autograd) and LOSS_TYPES; any new term "
         "(path_choice.blockers)"),
    Seam("_get_per_token_logps_and_entropies", f"{GRPO}._get_per_token_logps_and_entropies", "fecf708797b16e29",
         "reproduced: the norms pass runs the same forward (temperature, logits_to_keep) and slices a VLM's image "
         "inputs per row as this does (oblr_trl/multimodal.py)",
         "the temperature scaling, the model inputs it passes, multimodal.py's fields and row slicing"),
    Seam("training_step", f"{GRPO}.training_step", "15ea836c392b6976",
         "overridden: after the step's last micro-batch (accelerator.sync_gradients) sets lr x SNR factor; under "
         "DeepSpeed, installs the hook in ZeRO's optimizer step that sets it there (oblr_trl/deepspeed_step.py)",
         "that the gradient is complete after the super call at sync_gradients, and _step bookkeeping; that "
         "Accelerate's DeepSpeed backward still calls engine.step() at the boundary"),
    Seam("create_model_card", "trl.trainer.base_trainer._BaseTrainer.create_model_card", "868cba276e080ec4",
         "overridden: appends the OBLR-PO section; oblr_trl/card.py fixes what its template writes for local models",
         "card.py's fix_trl_card patterns against the card it writes; _tag_names/_name/_paper still used"),
    Seam("_save_checkpoint", f"{GRPO}._save_checkpoint", "10fa449292ba1d3d",
         "overridden: writes oblr_state.json (atomically) into the checkpoint folder before the parent's save, whose "
         "last write, trainer_state.json, marks a checkpoint complete (transformers' Trainer._save_checkpoint)",
         "the folder name (PREFIX_CHECKPOINT_DIR-global_step under _get_output_dir), should_save, and that "
         "trainer_state.json is still written last (oblr_trl/state_file.py; tests/integration/test_save_crash.py)"),
    Seam("_load_optimizer_and_scheduler", f"{GRPO}._load_optimizer_and_scheduler", "d6497323f7e1d3a4",
         "overridden: reads oblr_state.json on resume (called with the checkpoint folder, on every rank)",
         "that it is still called once on resume with the checkpoint path; tests/integration/test_resume.py"),
    Seam("log", f"{GRPO}.log", "14517d3dbad259c0",
         "relied on: OBLR-PO's metrics go into self._metrics['train'] and are averaged and logged by it",
         "the _metrics layout and that every key of it is logged (the oblr/* metrics, the card's table)"),
    Seam("_get_train_sampler", f"{GRPO}._get_train_sampler", "c0ce48638e78ccc9",
         "relied on: RepeatSampler puts each prompt's num_generations completions in consecutive rows",
         "that groups stay consecutive (the baseline's reshape(-1, G), oblr_row // unit)"),
    Seam("create_optimizer", "transformers.trainer.Trainer.create_optimizer", None,
         "overridden: registers the pre-step hook that refuses an unsized step",
         "if TRL now overrides it: that the optimizer it returns is the one stepped"),
    Seam("train", "transformers.trainer.Trainer.train", None,
         "overridden: resolves resume_from_checkpoint=True to the latest complete checkpoint (transformers takes the "
         "highest-numbered folder, however incomplete), resets the step sizer, restores the lr after an exception",
         "if TRL now overrides it: the resume argument's meaning; that train() may run twice on one trainer"),
    Seam("_get_output_dir", "transformers.trainer.Trainer._get_output_dir", None,
         "called by the _save_checkpoint override for the checkpoint folder",
         "if TRL now overrides it: the folder _save_checkpoint writes to"),
)


def source_hash(obj) -> str:
    """The first 16 hex digits of the SHA-256 of ``obj``'s source (``inspect.getsource``, dedented)."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode()).hexdigest()[:16]


def owner(obj) -> str:
    """``module.qualname`` of the function that defines ``obj``."""
    fn = inspect.unwrap(obj)
    return f"{fn.__module__}.{fn.__qualname__}"


def drift(seams: tuple[Seam, ...] = SEAMS, trainer_cls: type = GRPOTrainer) -> list[str]:
    """One message per seam of ``trainer_cls`` that is gone, moved or changed since its recorded hash (empty: none),
    naming the method and what to re-check."""
    problems = []
    for seam in seams:
        method = getattr(trainer_cls, seam.name, None)
        where = f"{trainer_cls.__name__}.{seam.name}"
        if method is None:
            problems.append(f"{where} is gone (OBLR-PO {seam.why}); re-check: {seam.recheck}.")
        elif owner(method) != seam.owner:
            problems.append(f"{where} is now defined by {owner(method)}, not {seam.owner} (OBLR-PO {seam.why}); "
                            f"re-check: {seam.recheck}; then update tests/seam_table.py.")
        elif seam.sha is not None and source_hash(method) != seam.sha:
            problems.append(f"{where} changed in this TRL (source hash {source_hash(method)}, recorded {seam.sha}; "
                            f"OBLR-PO {seam.why}); re-check: {seam.recheck}; then update its hash in "
                            "tests/seam_table.py.")
    return problems


if __name__ == "__main__":  # the current hashes, to paste after re-checking a changed seam
    import argparse

    argparse.ArgumentParser(description="Print each TRL seam's owner and current source hash (to paste into SEAMS "
                                        "after re-checking a changed seam).").parse_args()
    for seam in SEAMS:
        method = getattr(GRPOTrainer, seam.name, None)
        print(f"{seam.name:40s} {owner(method) if method else 'gone':70s} {source_hash(method) if method else ''}")
