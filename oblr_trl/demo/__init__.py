"""The demo's room: what the example scripts, the notebook, the benchmarks and the tests use around the trainer.

* `tiny`: the embedded tiny Qwen3 and character tokenizer, built offline, warmed up by SFT and cached;
* `tasks`: reasoning-gym datasets, rewards and held-out scoring (needs the ``demo`` extra);
* `testbed`: a 0.29M-parameter policy on digit reversal whose per-prompt gradients agree (a small noise scale), with
  problems held out by a hash of the problem: the paper's regime on a CPU (``benchmarks/testbed.py``);
* `reference_model`: SmolLM2-135M-Instruct from the package index (``load_reference_model``; needs ``gguf``);
* `card`: the held-out results the example scripts write (``eval_results.json``, ``summary.json``) on a model card;
* `defaults`: the tiny model's task, warm-up steps and seed, shared by every entry point.

The trainer package (``oblr_trl``) never imports this room; ``oblr_trl.load_reference_model`` forwards here lazily.
``plot_training`` lives with the trainer (``oblr_trl.plotting``: the trainer's model card draws it) and is re-exported.
"""

from ..plotting import plot_training
from .card import has_oblr_section, load_held_out_results, write_held_out_results, write_model_card
from .reference_model import REFERENCE_MODELS, load_reference_model, resolve_model_path
from .tasks import evaluate_accuracy, evaluate_held_out, extract_answer, make_dataset, make_reward_func
from .tiny import build_model, build_tokenizer, load_or_build_warm_model, warmup_sft

__all__ = [
    "REFERENCE_MODELS",
    "build_model",
    "build_tokenizer",
    "evaluate_accuracy",
    "evaluate_held_out",
    "extract_answer",
    "has_oblr_section",
    "load_held_out_results",
    "load_or_build_warm_model",
    "load_reference_model",
    "make_dataset",
    "make_reward_func",
    "plot_training",
    "resolve_model_path",
    "warmup_sft",
    "write_held_out_results",
    "write_model_card",
]
