"""One training run on the testbed policy (``oblr_trl.demo.testbed``), in this process: its record as a dict.

    python benchmarks/studies/testbed_run.py '{"arm": "GRPO", "lr": 1e-3, "seed": 0, "prompts": 32, "steps": 50}' OUT.json

Arms: GRPO (trl.GRPOTrainer, group-std reward scaling), GRPO-shuffled (the same with each step's rewards permuted
across its completions: the same reward level, no information), OBLR-PO (the defaults), SNR-only (GRPO's advantages
under the SNR step), baseline-only (the gradient-weighted baseline at a constant lr). Every run: the cached warm
policy, fresh training-split problems each step (``prompts`` x 8 completions at T = 1, 8 new tokens at most), a
constant lr, 1 torch thread; held-out sampled accuracy (1 sample each of ``CURVE_PROBLEMS`` held-out problems) every
``curve_every`` steps; at the end sampled (4 each) and greedy accuracy on ``EVAL_PROBLEMS`` distinct held-out problems.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

GROUP = 8
EVAL_PROBLEMS = 1000  # distinct held-out problems of the final evaluation
EVAL_SAMPLES = 4
CURVE_PROBLEMS = 500
CURVE_SEED = 7  # the curve's held-out problems (the final evaluation's are the first EVAL_PROBLEMS of seed 1)
EVAL_SEED = 1
HISTORY_KEYS = ("reward", "oblr/lr_scale", "oblr/noise_scale", "oblr/snr", "oblr/lr", "oblr/eta_max", "learning_rate")

ARM_OPTIONS = {
    "GRPO": None,
    "GRPO-shuffled": None,
    "OBLR-PO": {},
    "SNR-only": dict(baseline="mean", leave_one_out=False, scale_rewards="group"),
    "baseline-only": dict(snr_lr=False),
}


def shuffled(reward_fn, seed: int):
    """`reward_fn` whose rewards are permuted across the batch it scores (seeded; one permutation per call)."""
    rng = random.Random(seed)

    def fn(*args, **kwargs):
        rewards = list(reward_fn(*args, **kwargs))
        rng.shuffle(rewards)
        return rewards

    fn.__name__ = fn.__qualname__ = reward_fn.__name__
    return fn


def run(spec: dict) -> dict:
    import torch
    import transformers
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.demo import testbed as tb

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    start, cpu0 = time.time(), time.process_time()
    arm, lr, seed, prompts, steps = spec["arm"], spec["lr"], spec["seed"], spec["prompts"], spec["steps"]
    if arm not in ARM_OPTIONS:
        raise ValueError(f"testbed_run: arm={arm!r}; allowed: {list(ARM_OPTIONS)}")
    tb_spec = tb.TestbedSpec(**spec.get("testbed", {}))
    model, tokenizer = tb.load_or_build_testbed(tb_spec, cache_dir=spec.get("cache_dir"))
    set_seed(seed)
    train = tb.make_dataset("train", prompts * steps, seed=1000 + seed)
    curve_problems = tb.draw_problems("held_out", CURVE_PROBLEMS, CURVE_SEED, distinct=True)
    eval_problems = tb.draw_problems("held_out", EVAL_PROBLEMS, EVAL_SEED, distinct=True)
    reward = tb.reward_func if arm != "GRPO-shuffled" else shuffled(tb.reward_func, 10_000 + seed)
    common = dict(output_dir=spec.get("output_dir", "outputs/testbed/tmp"), max_steps=steps,
                  per_device_train_batch_size=prompts * GROUP, gradient_accumulation_steps=1,
                  num_generations=GROUP, learning_rate=lr, lr_scheduler_type="constant", max_completion_length=8,
                  temperature=1.0, seed=seed, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True, use_cpu=True, loss_type=OBLRPOConfig.loss_type, beta=0.0,
                  activation_checkpointing=False)  # TRL checkpoints by default; this model needs no memory saving
    if ARM_OPTIONS[arm] is None:
        config, trainer_cls = GRPOConfig(scale_rewards="group", **common), GRPOTrainer
    else:
        options = dict(ARM_OPTIONS[arm])
        if "snr_lr_mode" in OBLRPOConfig.__dataclass_fields__ and options.get("snr_lr", True):
            options["snr_lr_mode"] = spec.get("snr_lr_mode", "calibrated")
        config, trainer_cls = OBLRPOConfig(**options, **common), OBLRPOTrainer
    curve = []

    def held_out(m, step):
        scores = tb.evaluate(m, tokenizer, curve_problems, temperature=1.0)
        curve.append(dict(step=step, sampled=sum(scores) / len(scores)))

    class Curve(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % spec.get("curve_every", 10) == 0:
                held_out(model, state.global_step)

    held_out(model, 0)
    trainer = trainer_cls(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config,
                          train_dataset=train)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Curve())
    t_train = time.time()
    trainer.train()
    train_s = time.time() - t_train
    m = trainer.model
    sampled = tb.evaluate(m, tokenizer, eval_problems, temperature=1.0, num_samples=EVAL_SAMPLES)
    greedy = tb.evaluate(m, tokenizer, eval_problems)
    history = [{k: e[k] for k in HISTORY_KEYS if k in e} | dict(step=e["step"]) for e in trainer.state.log_history
               if "reward" in e]
    return dict(spec=spec, arm=arm, lr=lr, seed=seed, prompts=prompts, steps=steps, group_size=GROUP,
                testbed=tb_spec.key(), lr_mode=getattr(config, "snr_lr_mode", "eta_max") if arm in (
                    "OBLR-PO", "SNR-only") else None, sampled=sum(sampled) / len(sampled), greedy=sum(greedy) / len(greedy),
                eval_problems=EVAL_PROBLEMS, eval_samples=EVAL_SAMPLES, curve=curve, history=history,
                seconds=round(time.time() - start, 1), train_seconds=round(train_s, 1),
                seconds_per_step=round(train_s / steps, 2), cpu_seconds=round(time.process_time() - cpu0, 1),
                torch_threads=torch.get_num_threads(),
                when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


if __name__ == "__main__":
    out = Path(sys.argv[2])
    record = run(json.loads(sys.argv[1]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out)
    print(json.dumps({k: record[k] for k in ("arm", "lr", "seed", "sampled", "greedy", "seconds_per_step",
                                             "cpu_seconds")}))
