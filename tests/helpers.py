"""Shared test fixtures: the tiny setup every trainer test runs on, and probes that read public results only.

Test modules import from here (tests/ is on the tests' path: setup.cfg's pythonpath), never from each other.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch
from datasets import Dataset
from transformers import TrainerCallback

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_model, build_tokenizer

TOKENIZER = build_tokenizer()
GROUP = 4
DATASET = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i % 3}"}]} for i in range(64)])


def length_reward(completions, **kwargs):
    """A reward with spread inside groups and a direction shared by all prompts: the count of '1' and '2'."""
    return [float(c[0]["content"].count("1") + c[0]["content"].count("2")) for c in completions]


def common_args(**overrides) -> dict:
    args = dict(output_dir="/tmp/oblr-test", per_device_train_batch_size=8, num_generations=GROUP,
                max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                learning_rate=1e-2, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
    args.update(overrides)
    return args


class Recorder:
    """Mixin for any GRPOTrainer subclass: keeps each generation batch's output (with the rewards TRL computed) and
    each micro-batch the loss saw. Uses only the trainer's public data flow."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.generations, self.micro_batches = [], []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards = rewards.clone()
        return rewards

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.generations.append({k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()})
        self.generations[-1]["rewards"] = self._last_rewards
        return out

    def compute_loss(self, model, inputs, *a, **k):
        self.micro_batches.append({k2: v.clone() if torch.is_tensor(v) else v for k2, v in inputs.items()})
        return super().compute_loss(model, inputs, *a, **k)


class LRProbe(TrainerCallback):
    """Reads the optimizer's lr right before each step and the scheduler's lr after it."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.applied, self.after = [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.applied.append(self.trainer.optimizer.param_groups[0]["lr"])

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append((self.trainer.optimizer.param_groups[0]["lr"], self.trainer.lr_scheduler.get_last_lr()[0]))


def recording(cls):
    """``cls`` with the :class:`Recorder` mixin (cached, so one class per trainer type)."""
    if issubclass(cls, Recorder):
        return cls
    if cls not in _RECORDING:
        _RECORDING[cls] = type(f"Recording{cls.__name__}", (Recorder, cls), {})
    return _RECORDING[cls]


_RECORDING: dict = {}


def train(cls, args, reward=length_reward, model=None, dataset=DATASET, resume_from_checkpoint=None, **kwargs):
    """Build ``recording(cls)`` on the tiny model (``kwargs`` go to the constructor) and train it; returns the trainer
    and its :class:`LRProbe`."""
    trainer = recording(cls)(model=model or build_model(TOKENIZER), processing_class=TOKENIZER,
                             reward_funcs=kwargs.pop("reward_funcs", [reward]), args=args, train_dataset=dataset,
                             **kwargs)
    probe = LRProbe(trainer)
    trainer.add_callback(probe)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer, probe


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def last_logged(trainer, key):
    """One value per step: a resumed run's log_history holds the checkpoint's entries, then its own."""
    by_step = {h["step"]: h[key] for h in trainer.state.log_history if key in h}
    return [by_step[s] for s in sorted(by_step)]


def assert_finite_everywhere(trainer, inf_snr_ok=False):
    for gen in trainer.generations:
        assert torch.isfinite(gen["advantages"]).all()
        if "oblr_gram" in gen:
            assert torch.isfinite(gen["oblr_gram"]).all()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    for h in trainer.state.log_history:
        for k, v in h.items():
            if k == "oblr/snr" and inf_snr_ok:  # a noise estimate <= 0 is an infinite SNR (scale 1), never NaN
                assert v >= 0, (k, v)
            elif k.startswith("oblr/") or k in ("loss", "grad_norm"):
                assert math.isfinite(v), (k, v)
    assert all(0.0 <= s <= 1.0 for s in logged(trainer, "oblr/lr_scale"))


# ------------------------------------------------------------ the zoo's trainer (tests/grad_norms: test_zoo, test_coverage)
def zoo_trainer(model, **overrides):
    """An `OBLRPOTrainer` on `model` (a zoo family's miniature) with the tiny tokenizer, 16 prompts and a length
    reward; `overrides` go to `OBLRPOConfig`."""
    tokenizer = build_tokenizer()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i % 3}"}]} for i in range(16)])
    args = dict(output_dir="/tmp/oblr-zoo-test", per_device_train_batch_size=4, num_generations=2,
                max_completion_length=4, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
    args.update(overrides)
    return OBLRPOTrainer(model=model, processing_class=tokenizer, args=OBLRPOConfig(**args), train_dataset=dataset,
                         reward_funcs=[lambda completions, **kw: [float(len(c[0]["content"])) for c in completions]])


# ------------------------------------------------- torchrun equivalence runs (tests/integration: distributed, deepspeed)
EQUIVALENCE_SCRIPT = os.path.join(os.path.dirname(__file__), "integration", "distributed", "equivalence_run.py")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_env() -> dict:
    """The environment of a launched run (torchrun, `accelerate launch`): one thread per process, no Hub, and this
    checkout first on the path. A launched script's own folder heads its path, so without it every process would
    import whichever oblr_trl is installed in the environment, not the one under test.

    DeepSpeed compiles a C++ op at its first launch (its CPU communication kernel, about a minute); it is kept in this
    environment's own folder, so that test runs from another virtualenv on the same machine (another torch) do not
    rebuild it in turn in the one shared default folder at every launch."""
    path = os.pathsep.join(p for p in (CHECKOUT, os.environ.get("PYTHONPATH", "")) if p)
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path,
            "TORCH_EXTENSIONS_DIR": extensions}


def assert_ran(proc) -> None:
    """A launched run exited 0 (else its stderr's tail)."""
    assert proc.returncode == 0, proc.stderr[-4000:]


_EQUIVALENCE_RUNS: dict = {}  # (nproc, per_device, flags) -> the JSON of that run, once per test session


def run_equivalence(tmp_path, nproc: int, per_device: int, mode: str = "ddp") -> dict:
    """`EQUIVALENCE_SCRIPT` under torchrun on `nproc` CPU processes (gloo), `per_device` completions each, in `mode`;
    returns the JSON it writes.

    A run is deterministic (seeded, generation replaced by a pure function), so each distinct run is launched once
    per session and its JSON shared by the tests that compare against it (most compare with the same 1-process
    reference), each getting its own copy. Runs that save or resume a checkpoint read and write their folder and are
    always launched. ``fsdp2`` only acts under several processes (the 1-process reference of that mode is a plain
    run), so at 1 process it is left out of the key."""
    flags = mode.split("+")
    if nproc == 1:
        flags = [f for f in flags if f != "fsdp2"] or ["ddp"]
    key = (nproc, per_device, tuple(sorted(flags)))
    cacheable = not {"save", "resume"} & set(flags)
    if cacheable and key in _EQUIVALENCE_RUNS:
        return json.loads(_EQUIVALENCE_RUNS[key])
    out = tmp_path / f"{mode}-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           EQUIVALENCE_SCRIPT, str(out), str(per_device), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=launch_env())
    assert_ran(proc)
    text = out.read_text()
    if cacheable:
        _EQUIVALENCE_RUNS[key] = text
    return json.loads(text)


# ------------------------------------------- cost-model shapes and benchmark scripts (test_cost_*, memory, overhead)
def qwen3_shape(width="0.6B", *, rows=8, completion=512, lora=False, ckpt=True, layers=28, prompt=32, vocab=151936):
    """A Qwen3 of ``width`` (28 layers, its 151,936-token tied head) with a micro-batch of ``rows`` x (32 +
    ``completion``) tokens, as :func:`oblr_trl.path_choice.describe` gives it (:class:`oblr_trl.cost_model.Shape`)."""
    from oblr_trl import cost_model as cm

    d, f = {"0.6B": (1024, 3072), "1.7B": (2048, 6144)}[width]
    q, kv = 2048, 1024
    base = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    adapters = tuple((i, 16) for i, _ in base) + tuple((16, o) for _, o in base) if lora else ()
    return cm.Shape(layers=layers, hidden=d, vocab=vocab, heads=16, head_dim=128,
                    linears=tuple((i, o, not lora) for i, o in base), adapters=adapters, head_trainable=not lora,
                    tied=True, rows=rows, prompt=prompt, completion=completion, itemsize=4, checkpointing=ckpt,
                    group=8)


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_benchmark(name):
    """``benchmarks/NAME.py`` as a fresh module (its folder is on the tests' path, setup.cfg's ``pythonpath``, as it is
    on a script's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

