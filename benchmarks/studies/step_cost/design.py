"""step_cost.py's design: the models (tiny/small, and random-initialised models of real shapes), the measured
functions per device, and the RL step's trainer kinds, each compared with the GRPO kind of its checkpointing setting."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

GROUP = 8
TINY = ("tiny", "small")
# Random-initialised models of real shapes (the published configs' sizes; no weights are read).
SHAPES = {
    "medium": (Qwen3Config, Qwen3ForCausalLM, dict(vocab_size=32768, hidden_size=256, intermediate_size=1024,
                                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=64)),
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                         num_hidden_layers=30, num_attention_heads=9,
                                                         num_key_value_heads=3, head_dim=64, rope_theta=100000.0)),
    "qwen3-0.6b": (Qwen3Config, Qwen3ForCausalLM, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                                       num_hidden_layers=28, num_attention_heads=16,
                                                       num_key_value_heads=8, head_dim=128)),
    "qwen3-1.7b": (Qwen3Config, Qwen3ForCausalLM, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                                       num_hidden_layers=28, num_attention_heads=16,
                                                       num_key_value_heads=8, head_dim=128)),
}
SIZES = TINY + tuple(SHAPES)
# The measured functions. "update_*" are the two modes' updates; "*_ckpt" the same under gradient checkpointing.
FNS_CPU = ["fwdbwd", "norms", "update", "loop", "update_one_backward", "group", "update_group"]
FNS_CUDA = ["fwdbwd", "fwdbwd_ckpt", "norms", "group", "loop", "loop_sq", "update_group", "update_group_ckpt",
            "update_one_backward", "update_one_backward_ckpt"]
GRAM_FNS = ("group", "update_group", "update_group_ckpt")  # skipped past --max-gram-gflop
MEM_CPU = ["fwdbwd", "norms", "update_one_backward", "group", "fwdbwd_ckpt", "update_one_backward_ckpt",
           "group_ckpt"]
# OBLR-PO's kinds: its mode (one_backward True / False / None = the automatic default) and whether TRL's gradient
# checkpointing is on; each is compared with the GRPO kind of the same checkpointing setting.
STEP_KINDS = ("grpo", "grpo_no_ckpt", "two_pass", "one_backward", "default", "one_backward_no_ckpt",
              "default_no_ckpt")
STEP_MODE = {"two_pass": False, "one_backward": True, "default": None, "one_backward_no_ckpt": True,
             "default_no_ckpt": None}


def grpo_of(kind: str) -> str:
    """The GRPO kind with ``kind``'s checkpointing setting."""
    return "grpo_no_ckpt" if kind.endswith("no_ckpt") else "grpo"
