"""One OBLR-PO run with deterministic completions, for comparing 1 process with N (torchrun) on the same data.

    torchrun --nproc_per_node 2 tests/distributed/equivalence_run.py OUT.json PER_DEVICE_BATCH [MODE]

MODE is ``ddp`` (default) or ``+``-joined flags, e.g. ``fsdp2+fp32+degenerate+nan``:

* ``degenerate``: the second half of the global batch (all of rank 1's data under 2 processes) gets empty completions
  with identical (zero) rewards; with ``nan`` as well, their rewards are None (NaN, unscorable) instead.
* ``fsdp2``: under several processes, Accelerate's FSDP2 path (`fsdp2_prepare_model`, `fully_shard`, DTensor
  parameters), asked for through the Trainer's own ``fsdp`` arguments; see `enable_accelerate_fsdp_on_cpu`. The
  1-process reference of the same mode is a plain run.
* ``fp32``: no bf16 autocast (``bf16=False``). FSDP2's bf16 policy casts the parameters themselves to bf16 while a
  plain or DDP run autocasts fp32 parameters, a difference of ~1e-3 by design; in fp32 the layouts agree to ~1e-6.

Generation is replaced at TRL's narrowest seam (`rollout_func`) by a pure function of (prompt, position in its group),
so every process layout sees the same completions; the rest of the step (rewards gathered across ranks, the norms
pass, the baseline, the SNR step size) runs for real.
"""

import hashlib
import json
import logging
import os
import sys

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, gather_object
from datasets import Dataset
from transformers import TrainerCallback

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model, build_tokenizer
from oblr_trl.grad_norms.hooks import runs_reentrant

GROUP = 4
TOKENIZER = build_tokenizer()


def completion_text(prompt: str, position: int) -> str:
    digest = hashlib.sha256(f"{prompt}|{position}".encode()).hexdigest()
    return "".join(c for c in digest if c.isdigit())[: 1 + position + len(prompt) % 3]


DEGENERATE_FROM = None  # with mode "degenerate": completions from this global index on are empty (EOS alone)
NAN_FOR_EMPTY = False  # with "degenerate+nan": those empty completions get reward None (NaN) instead of 0


def deterministic_rollout(prompts, trainer):
    offset = trainer.accelerator.process_index * len(prompts)
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        text = TOKENIZER.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids.append(TOKENIZER(text, add_special_tokens=False)["input_ids"])
        answer = completion_text(prompt[-1]["content"], (offset + i) % GROUP)
        if DEGENERATE_FROM is not None and offset + i >= DEGENERATE_FROM:
            answer = ""  # identical (zero) rewards and empty completions: all of rank 1's data under 2 processes
        completion_ids.append(TOKENIZER(answer, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": [[0.0] * len(c) for c in completion_ids]}


def ones_reward(completions, **kwargs):
    return [None if NAN_FOR_EMPTY and c[0]["content"] == "" else float(c[0]["content"].count("1")) for c in completions]


def enable_accelerate_fsdp_on_cpu() -> None:
    """Test harness only: let Accelerate take its real FSDP path on CPU (gloo) processes.

    Why: Accelerate 1.15 switches to ``DistributedType.FSDP`` only inside the branch of ``AcceleratorState.__init__``
    (accelerate/state.py, ~line 986-1015) taken for accelerator-backed multi-process types (MULTI_GPU, MULTI_NPU,
    MULTI_XPU, ...), never for MULTI_CPU: on CPU the FSDP plugin the Trainer passes is dropped and the run silently
    becomes DDP. This wrapper changes nothing but that gate: when the state came out MULTI_CPU although an FSDP plugin
    was passed, it makes the same three assignments as that branch, verbatim. Everything after it
    (`fsdp2_prepare_model`, `fully_shard`, DTensor parameters, the optimizer rebinding, gradient clipping over
    DTensors, the Trainer's ``is_fsdp_enabled``) is Accelerate's, Transformers' and torch's own code, unchanged.
    """
    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type  # as __init__ ends

    AcceleratorState.__init__ = __init__


def zero3_gathered(params, stage):
    """ZeRO-3's partitioned parameters gathered whole for reading (a no-op otherwise)."""
    if stage != 3:
        import contextlib

        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def deepspeed_config(stage: int, offload_param: bool = False) -> dict:
    """A DeepSpeed config as examples/accelerate_configs/deepspeed_zero*.yaml produce, with "auto" filled from the
    Trainer's arguments; ``offload_param``: ZeRO-3 keeps the parameters on the CPU (refused with exact norms)."""
    zero = {"stage": stage, **({"offload_param": {"device": "cpu"}} if offload_param else {})}
    return {
        "zero_optimization": zero,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    }


class RecordLR(TrainerCallback):
    """The learning rate each optimizer step is taken with, on this rank (right before ``optimizer.step()``)."""

    def __init__(self):
        self.lrs = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append([group["lr"] for group in optimizer.param_groups])


class Recorder(OBLRPOTrainer):
    records = []
    ds_applied_lrs = []  # under DeepSpeed: per optimizer step, the lr of each group the ZeRO optimizer stepped with

    def _install_zero_hook(self):
        super()._install_zero_hook()
        sizer = self._zero_hook  # registered after the ZeroStepHook's hook: sees the lr the update is taken with

        def record(optimizer, args, kwargs):
            if sizer.steps > len(self.ds_applied_lrs):
                self.ds_applied_lrs.append([])
            self.ds_applied_lrs[-1].extend(group["lr"] for group in optimizer.param_groups)

        sizer.base.register_step_pre_hook(record)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        prompts = gather_object([x["prompt"][-1]["content"] for x in inputs])
        completions = gather_object(TOKENIZER.batch_decode(out["completion_ids"], skip_special_tokens=True))
        advantages = self.accelerator.gather(out["advantages"]).tolist()
        self.records.append(sorted(zip(prompts, completions, advantages)))
        return out


def main(out_path: str, per_device: int, mode: str = "ddp"):
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i % 7}"}]} for i in range(64)])
    global DEGENERATE_FROM, NAN_FOR_EMPTY
    flags = set(mode.split("+"))
    assert flags <= {"ddp", "degenerate", "nan", "fsdp2", "fp32", "one_backward", "ga2", "chunk", "zero0", "zero1",
                     "zero2", "zero3", "offload", "save", "resume", "ema", "lora", "reentrant"}, mode
    if "chunk" in flags:  # no chunk fits: one_backward under checkpointing (on here) runs one group at a time
        import oblr_trl.path_choice

        oblr_trl.path_choice.fitting_chunk = lambda shape, budget=None: (0, float("inf"))
    extra = {"bf16": False} if "fp32" in flags else {}
    if "ga2" in flags:  # two micro-batches per optimizer step, one generation batch for both
        extra["gradient_accumulation_steps"] = 2
    extra["one_backward"] = "one_backward" in flags  # the two-pass path unless asked (the default chooses by the cost model)
    if "degenerate" in flags:
        DEGENERATE_FROM = 8  # the global batch is 16: the second half
        NAN_FOR_EMPTY = "nan" in flags
    fsdp2 = "fsdp2" in flags and int(os.environ.get("WORLD_SIZE", "1")) > 1  # the 1-process reference is plain
    if fsdp2:
        enable_accelerate_fsdp_on_cpu()
        # as a user asks for it; Accelerate shards each decoder layer (the model's _no_split_modules), the tied
        # embedding with the final norm and the LM head as one unit, then the root
        extra.update(fsdp="full_shard", fsdp_config={"version": 2, "reshard_after_forward": True})
    stage = next((int(f[-1]) for f in flags if f.startswith("zero")), None)
    if stage is not None:  # DeepSpeed ZeRO through the Trainer's own `deepspeed` argument ("auto": from the args)
        extra["deepspeed"] = deepspeed_config(stage, offload_param="offload" in flags)
    output_dir = "/tmp/oblr-equivalence"
    if flags & {"save", "resume"}:  # a checkpoint after each step, beside OUT.json (DeepSpeed's own format with zero*)
        output_dir = os.path.join(os.path.dirname(os.path.abspath(out_path)), "checkpoints")
        extra.update(save_strategy="steps", save_steps=1)
    if "ema" in flags:  # step 2's scale depends on step 1's SNR state: a resume must carry it over
        extra["snr_ema"] = 0.5
    if "reentrant" in flags:  # reentrant gradient checkpointing asked for (TRL forces it for LoRA under ZeRO-3)
        extra["gradient_checkpointing_kwargs"] = {"use_reentrant": True}
    extra.setdefault("save_strategy", "no")
    # the paper's reading, so that each step's lr scale is its SNR factor, compared across engines and ranks (the
    # calibrated default applies the scheduled lr in its first 10 steps: these runs are 2 steps long)
    extra.setdefault("snr_lr_mode", "eta_max")
    args = OBLRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=per_device, num_generations=GROUP,
        max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", use_cpu=True, learning_rate=1e-2,
        seed=0, data_seed=0, disable_tqdm=True, **extra,
    )
    if "lora" in flags:  # TRL's --use_peft recipe; under ZeRO-3 TRL forces reentrant checkpointing for it
        from peft import LoraConfig

        extra_trainer = {"peft_config": LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                   init_lora_weights="gaussian")}
    else:
        extra_trainer = {}
    warnings = []  # OBLR-PO's warnings on this rank (e.g. one_backward switched off under DeepSpeed)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("oblr_trl.trainer").addHandler(handler)
    torch.manual_seed(0)
    trainer = Recorder(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[ones_reward], args=args,
                       train_dataset=dataset, rollout_func=deterministic_rollout, **extra_trainer)
    if "one_backward" in flags:
        trainer.ALL_REDUCE_BUCKET = 4096  # many small all-reduce buckets, as a large model would have
    lr_recorder = RecordLR()
    trainer.add_callback(lr_recorder)
    trainer.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-1") if "resume" in flags else None)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    fsdp_facts = {  # what actually ran, on this rank
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": getattr(trainer.model_wrapped, "zero_optimization_stage", lambda: None)(),
        "zero_optimizer": type(getattr(trainer.model_wrapped, "optimizer", None)).__name__,
        "is_fsdp2": bool(trainer.accelerator.is_fsdp2),
        "trainer_is_fsdp_enabled": bool(trainer.is_fsdp_enabled),
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in trainer.model_wrapped.modules()),
        "root_is_fsdp": isinstance(trainer.model_wrapped, FSDPModule),
        "all_params_dtensor": all(isinstance(p, DTensor) for p in trainer.model_wrapped.parameters()),
        "optimizer_params_dtensor": all(isinstance(p, DTensor) for g in trainer.optimizer.param_groups for p in g["params"]),
        "reentrant_checkpointing": runs_reentrant(trainer.model_wrapped),
    }
    if trainer.is_deepspeed_enabled:  # from the config (zero*) or from `accelerate launch`'s DeepSpeed plugin
        stage = trainer.model_wrapped.zero_optimization_stage()
    lrs_per_rank = gather_object([trainer.ds_applied_lrs if trainer.is_deepspeed_enabled else lr_recorder.lrs])
    # the trained parameters, summed (gathered first where sharded): the updates of both layouts must agree
    params = list(trainer.model_wrapped.parameters())
    with zero3_gathered(params, stage):
        param_sum = sum(float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().abs().sum())
                        for p in params)
    facts_per_rank = gather_object([fsdp_facts])
    if trainer.accelerator.is_main_process:
        by_step = {h["step"]: h for h in trainer.state.log_history if "oblr/lr_scale" in h}  # a resumed run: its own
        logs = [by_step[step] for step in sorted(by_step)]
        with open(out_path, "w") as f:
            json.dump({
                "world_size": trainer.accelerator.num_processes,
                "records": trainer.records,
                "lr_scale": [h["oblr/lr_scale"] for h in logs],
                "snr": [h["oblr/snr"] for h in logs],
                "grad_norm": [h["grad_norm"] for h in logs],
                "num_samples": [h["oblr/num_samples"] for h in logs],
                "unscorable": [h["oblr/unscorable"] for h in logs],
                "lr": [h["oblr/lr"] for h in logs],
                "learning_rate": [h["learning_rate"] for h in logs],  # the scheduled lr TRL logs for the step
                "applied_lrs": lrs_per_rank,  # per rank, per optimizer step, per param group
                "fsdp": facts_per_rank,
                "one_backward": bool(trainer.uses_one_backward),
                "warnings": warnings,
                "chunk_rows": trainer.route.chunk_rows,
                "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
                "param_abs_sum": param_sum,
            }, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
    # Tear down deterministically: an orderly process-group shutdown, then exit without running C++ static
    # destructors, which intermittently aborted a rank at interpreter exit ("terminate called without an active
    # exception") after the run itself had finished.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
