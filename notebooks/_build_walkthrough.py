"""Writes notebooks/oblrpo_walkthrough.ipynb, executed, with its outputs (plots included), so the repository page shows
them. Edit the cells here, then run this file (about 2 minutes on a CPU, offline):

    python notebooks/_build_walkthrough.py            # build and execute (needs the `notebook` or `dev` extra)
    python notebooks/_build_walkthrough.py --no-execute   # cells only, outputs empty

`tests/test_notebook.py` checks that the committed notebook holds these cells, executed, with its images, and runs
it again end to end.
"""

import argparse
import os
import tempfile
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOK = Path(__file__).with_name("oblrpo_walkthrough.ipynb")

cells = [
    new_markdown_cell("""# OBLR-PO walkthrough

[OBLR-PO](https://arxiv.org/abs/2511.23310) changes two things in GRPO-style RL fine-tuning:

1. **Baseline** (Theorem 7): each completion's reward is compared with the *gradient-weighted* mean of the other
   rewards in its group, `b = Σ w_j r_j / Σ w_j` with `w_j = ‖∇ log π(o_j|q)‖²`. That is the baseline with the least
   variance; no division by the reward std.
2. **Step size** (Theorem 4): each optimizer step uses `lr = lr_max · N·SNR / (1 + N·SNR)`, where `SNR = ‖∇J‖² / tr Σ`
   is estimated from the step's own `N` prompts. Noisy steps are shortened; clean steps run at full length.

This notebook runs on a CPU in about two minutes, offline: a tiny Qwen3 model learns one-digit sums from
[reasoning-gym](https://github.com/open-thought/reasoning-gym). We train it with `OBLRPOTrainer`, look at the SNR
and the step size, compare with TRL's `GRPOTrainer` using the same settings, measure held-out accuracy, and save the
model with its model card."""),
    new_code_cell("""import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices, raised inside TRL

import matplotlib.pyplot as plt
import torch
import transformers
from trl import GRPOConfig, GRPOTrainer

from oblr_trl import OBLRPOConfig, OBLRPOTrainer, evaluate_accuracy, load_or_build_warm_model, make_dataset, make_reward_func

%matplotlib inline
transformers.utils.logging.disable_progress_bar()  # no bar for loading a 0.1M-parameter model
torch.set_num_threads(1)  # a model this small gains nothing from threads, and on a shared machine they slow it down
work_dir = tempfile.mkdtemp(prefix="oblrpo_walkthrough_")
print(work_dir)"""),
    new_markdown_cell("""## 1. The model and the task

`load_or_build_warm_model` builds a ~0.1M-parameter Qwen3 with a character-level tokenizer and warms it up with 200
steps of supervised fine-tuning, so it already answers in the right format and gets some sums right. RL needs that:
a group whose rewards are all 0 (or all 1) carries no signal. The result is cached, so later runs load it."""),
    new_code_cell("""model, tokenizer = load_or_build_warm_model("chain_sum", steps=200)
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")

train_dataset = make_dataset("chain_sum", size=512, seed=0)   # training problems
eval_dataset = make_dataset("chain_sum", size=200, seed=1)    # held-out problems (disjoint seed)
reward = make_reward_func("chain_sum")                        # reasoning-gym's own verifier: 1.0 if correct, else 0.0
print(train_dataset[0]["prompt"], "->", train_dataset[0]["answer"])

accuracy_start = evaluate_accuracy(model, tokenizer, eval_dataset)
print(f"held-out accuracy after warm-up: {accuracy_start:.1%}")"""),
    new_markdown_cell("""## 2. Train with OBLR-PO

`OBLRPOConfig` is a `GRPOConfig` with OBLR-PO's options (all at the paper's defaults here). Each step samples 8
completions for each of 8 prompts (`per_device_train_batch_size=64`, `num_generations=8`), so the SNR is estimated
from `N = 8` prompts. `learning_rate` is `lr_max`."""),
    new_code_cell("""settings = dict(
    max_steps=30,
    per_device_train_batch_size=64,
    num_generations=8,
    learning_rate=1e-3,
    max_completion_length=8,
    temperature=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=False,  # a progress bar instead of one printed dict per step
    seed=0,
)
oblr_args = OBLRPOConfig(output_dir=os.path.join(work_dir, "oblrpo"), **settings)
print({name: getattr(oblr_args, name) for name in ("baseline", "leave_one_out", "grad_norm_estimator", "snr_lr", "scale_rewards")})

oblr_trainer = OBLRPOTrainer(
    model=model, processing_class=tokenizer, reward_funcs=[reward], args=oblr_args, train_dataset=train_dataset
)
oblr_trainer.train();"""),
    new_markdown_cell("""## 3. SNR and step size

Every step logs `oblr/snr` (the estimated gradient signal-to-noise ratio), `oblr/lr_scale` (the factor
`N·SNR/(1+N·SNR)` applied to the scheduled learning rate) and `oblr/lr` (the learning rate actually used)."""),
    new_code_cell("""def series(history, key):
    points = [(entry["step"], entry[key]) for entry in history if key in entry]
    return [p[0] for p in points], [p[1] for p in points]

oblr_history = oblr_trainer.state.log_history
fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
for ax, key in zip(axes, ["reward", "oblr/snr", "oblr/lr_scale"]):
    ax.plot(*series(oblr_history, key), marker="o", markersize=3)
    ax.set_title(key)
    ax.set_xlabel("step")
plt.tight_layout()
plt.show()

_, snrs = series(oblr_history, "oblr/snr")
_, scales = series(oblr_history, "oblr/lr_scale")
print(f"steps with SNR = 0 (step skipped): {sum(s == 0 for s in snrs)} of {len(snrs)}")
print(f"mean lr scale: {sum(scales) / len(scales):.2f}")"""),
    new_markdown_cell("""How to read these curves:

* With `N = 8` prompts per step the SNR estimate is noisy, and the estimator of `‖∇J‖²` is unbiased, so it can come
  out at zero: the step size is then 0 and the step is skipped. That is what Theorem 4 prescribes when the gradient
  is mostly noise.
* When some prompts' groups mix right and wrong answers in a consistent direction, the SNR rises and the step runs
  close to `lr_max`. OBLR-PO does not need a hand-tuned warm-up or decay to do that: the schedule is set by the data.
* If the scale stays near 0 for long stretches, use more prompts per step (larger `N`), or set `snr_ema`
  (smoothing across steps) or `lr_scale_min` (a floor)."""),
    new_markdown_cell("""## 4. The same run with GRPO

TRL's `GRPOTrainer` with the same settings and the same warmed-up starting point: group-mean baseline, rewards
divided by the group std, and a fixed learning rate."""),
    new_code_cell("""grpo_model, _ = load_or_build_warm_model("chain_sum", steps=200)  # the same warmed-up weights, reloaded
grpo_args = GRPOConfig(output_dir=os.path.join(work_dir, "grpo"), **settings)
grpo_trainer = GRPOTrainer(
    model=grpo_model, processing_class=tokenizer, reward_funcs=[reward], args=grpo_args, train_dataset=train_dataset
)
grpo_trainer.train()
grpo_history = grpo_trainer.state.log_history

def moving_average(values, window=5):
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]

for name, history in [("OBLR-PO", oblr_history), ("GRPO", grpo_history)]:
    steps, rewards = series(history, "reward")
    plt.plot(steps, moving_average(rewards), label=name)
plt.xlabel("step")
plt.ylabel("training reward (moving average of 5)")
plt.legend()
plt.show()"""),
    new_markdown_cell("""## 5. Held-out accuracy

Greedy decoding on the 200 held-out problems, scored by the same verifier as the reward. Both runs use the same
`lr_max`. GRPO takes every step at full length, while OBLR-PO shortens or skips the noisy ones, so at a learning rate
this high GRPO can drift away from the warmed-up policy where OBLR-PO holds still. This is one seed and 30 steps:
read it as an illustration, not a benchmark (see `examples/recipes/` for the paper's setting), and try other seeds
and learning rates."""),
    new_code_cell("""accuracy_oblr = evaluate_accuracy(oblr_trainer.model, tokenizer, eval_dataset)
accuracy_grpo = evaluate_accuracy(grpo_trainer.model, tokenizer, eval_dataset)
print(f"after warm-up: {accuracy_start:.1%}")
print(f"after OBLR-PO: {accuracy_oblr:.1%}")
print(f"after GRPO:    {accuracy_grpo:.1%}")"""),
    new_markdown_cell("""## 6. Save, with a model card

`save_model` writes the weights and the tokenizer. `create_model_card` (TRL) writes `README.md` with the `oblr-po`
tag and the paper's citation; `append_oblr_section` adds the OBLR-PO settings, the final metrics and the training
plots to it."""),
    new_code_cell("""from oblr_trl.card import append_oblr_section

output_dir = oblr_args.output_dir
oblr_trainer.save_model(output_dir)
oblr_trainer.create_model_card(model_name="tiny-qwen3-chain-sum-oblrpo")
append_oblr_section(output_dir, oblr_args, oblr_history)
print(sorted(os.listdir(output_dir)))
card = open(os.path.join(output_dir, "README.md")).read()
section = card[card.index("<!-- oblr-po:start -->"):]
print(section[section.index("### Metrics over the run"):section.index("### Training curves")])"""),

    new_markdown_cell("""## 7. Push to the Hub (not run here)

With a Hugging Face token (`huggingface-cli login`), the folder above is what gets uploaded:

```python
oblr_trainer.push_to_hub(model_name="tiny-qwen3-chain-sum-oblrpo")  # uses oblr_args.hub_model_id or the folder name
# push_to_hub regenerates TRL's README.md: add the OBLR-PO section back and upload it
readme = append_oblr_section(output_dir, oblr_args, oblr_history)
from huggingface_hub import upload_file
upload_file(path_or_fileobj=readme, path_in_repo="README.md", repo_id=oblr_trainer.hub_model_id)
```

For a real model, use `examples/oblrpo.py --push_to_hub` (see `examples/recipes/README.md`)."""),
]



def build() -> nbformat.NotebookNode:
    """The notebook's cells, without outputs."""
    return new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })


def execute(notebook: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel, offline, from a temporary folder; the outputs are stored in `notebook`."""
    import nbclient

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    with tempfile.TemporaryDirectory() as work:
        nbclient.NotebookClient(
            notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": work}}
        ).execute()
    return notebook


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--execute", action=argparse.BooleanOptionalAction, default=True,
                        help="Execute the notebook and store its outputs.")
    notebook = build()
    if parser.parse_args().execute:
        execute(notebook)
    nbformat.write(notebook, NOTEBOOK)
    print(f"Wrote {NOTEBOOK} ({NOTEBOOK.stat().st_size / 1e3:.0f} kB)")
