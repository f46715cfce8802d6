"""Tiny random models of the architecture families the exact norms are checked on (2 layers, hidden 32, built from
transformers' config classes): the test zoo (tests/grad_norms/test_zoo.py) and the docs' generated support table
(docs/models.md, ``benchmarks/support_table.py``) both read this list."""

from __future__ import annotations

import torch

VOCAB = 48
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0, max_position_embeddings=64)
_NOT_LLAMA_NAMES = dict(hidden_size=None, intermediate_size=None, num_hidden_layers=None, num_attention_heads=None,
                        num_key_value_heads=None, max_position_embeddings=None)
_MOE = dict(num_experts_per_tok=2)

# family: (config class, model class, config overrides; None drops a common key)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=8, num_experts=4, moe_intermediate_size=16, **_MOE)),
    "Llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "Mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **_MOE)),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8)),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8)),
    "Gemma3 (text)": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8)),
    "Phi-3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "Phi-2": ("PhiConfig", "PhiForCausalLM", {}),
    "GPT-2": ("GPT2Config", "GPT2LMHeadModel", dict(_NOT_LLAMA_NAMES, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "GPT-NeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "GPT-Neo": ("GPTNeoConfig", "GPTNeoForCausalLM",
                dict(_NOT_LLAMA_NAMES, hidden_size=32, max_position_embeddings=64, num_layers=2, num_heads=4,
                     attention_types=[[["global", "local"], 1]], window_size=8)),
    "GPTBigCode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                   dict(_NOT_LLAMA_NAMES, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "OLMo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "Granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(logits_scaling=2.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3)),
    "Cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    "Cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(logit_scale=0.5)),
    "StableLM": ("StableLmConfig", "StableLmForCausalLM", {}),
    "Falcon": ("FalconConfig", "FalconForCausalLM", dict(num_key_value_heads=None, intermediate_size=None)),
    "DeepSeek-V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=4, n_shared_experts=1, num_key_value_heads=4, moe_intermediate_size=16,
                         kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                         head_dim=4, first_k_dense_replace=1, n_group=1, topk_group=1, **_MOE)),
    "GLM-4-MoE": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                  dict(head_dim=8, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                       first_k_dense_replace=1, n_group=1, topk_group=1, **_MOE)),
    "GPT-OSS": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, head_dim=8, sliding_window=4, **_MOE)),
    "OPT": ("OPTConfig", "OPTForCausalLM",
            dict(ffn_dim=48, word_embed_proj_dim=32, intermediate_size=None, num_key_value_heads=None)),
    # State-space and linear-attention mixers: their depthwise causal conv is used functionally (its weight passed to
    # a functional conv, never through the Conv1d's forward), so the mixer borrows it onto the per-row path
    # (coverage.py); the gated norms (norm(x * silu(gate))) take the per-row path too.
    "Mamba": ("MambaConfig", "MambaForCausalLM", dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=4)),
    "Mamba-2": ("Mamba2Config", "Mamba2ForCausalLM",
                dict(num_heads=8, head_dim=8, state_size=8, n_groups=1, conv_kernel=4, chunk_size=4, expand=2)),
    "NemotronH": ("NemotronHConfig", "NemotronHForCausalLM",
                  dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
                       mamba_d_conv=4, chunk_size=4)),
    "Bamba": ("BambaConfig", "BambaForCausalLM",
              dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                   mamba_chunk_size=4, mamba_expand=2)),
    "Granite-4.0-H": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                      dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                           mamba_n_groups=1, mamba_chunk_size=4, mamba_expand=2, num_local_experts=2,
                           num_experts_per_tok=1)),
    "Falcon-H1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_n_groups=1,
                       mamba_chunk_size=4, head_dim=8)),
    "Jamba": ("JambaConfig", "JambaForCausalLM",
              dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)),
    "Zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               dict(mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, chunk_size=4, num_hidden_layers=3,
                    hybrid_layer_ids=[1], layers_block_type=["mamba", "hybrid", "mamba"])),
    "Qwen3-Next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"],
                        num_experts_per_tok=1)),
    "LFM2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"], conv_L_cache=3)),
    # Heads whose transform is found by observation (head_transform.py): xLSTM's output_logit_soft_cap (30); MPT's
    # config logit_scale, which its model never reads.
    "xLSTM": ("xLSTMConfig", "xLSTMForCausalLM",
              dict(_NOT_LLAMA_NAMES, hidden_size=32, embedding_dim=32, num_heads=4, num_blocks=2, qk_dim_factor=0.5,
                   chunk_size=4)),
    "MPT": ("MptConfig", "MptForCausalLM",
            dict(_NOT_LLAMA_NAMES, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, logit_scale=0.5)),
    # Refused by name: its expert banks split a flat token list by per-expert counts the per-row re-run cannot split.
    "JetMoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(kv_channels=8, num_local_experts=4, num_experts_per_tok=2)),
}


_ATTENTION = ["q_proj", "k_proj", "v_proj"]
# PEFT adapters, on Qwen3's tiny model (or an MoE one): name -> (family, peft config class, its arguments). Non-zero
# initial weights, so that every adapter parameter has a gradient. The test zoo (tests/grad_norms/test_peft.py) and the
# support table read this list.
ADAPTERS: dict[str, tuple[str, str, dict]] = {
    "LoRA (with embed_tokens)": ("Qwen3", "LoraConfig",
                                 dict(r=4, target_modules=["embed_tokens", "q_proj", "down_proj"],
                                      init_lora_weights=False)),
    "DoRA (all-linear)": ("Qwen3", "LoraConfig", dict(r=4, target_modules="all-linear", use_dora=True,
                                                      init_lora_weights=False)),
    "VeRA": ("Qwen3", "VeraConfig", dict(r=4, target_modules=["q_proj", "v_proj"], init_weights=False)),
    "LoHa": ("Qwen3", "LoHaConfig", dict(r=4, target_modules=_ATTENTION, init_weights=False)),
    "LoKr": ("Qwen3", "LoKrConfig", dict(r=4, target_modules=_ATTENTION, init_weights=False)),
    "IA3": ("Qwen3", "IA3Config", dict(target_modules=[*_ATTENTION, "down_proj"], feedforward_modules=["down_proj"],
                                       init_ia3_weights=False)),
    # LoRA on the fused expert banks (PEFT's ParamWrapper): the gpt-oss recipe, and all-linear on an MoE model
    "LoRA (expert banks, target_parameters)": ("GPT-OSS", "LoraConfig", dict(
        r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False)),
    "LoRA (all-linear, MoE)": ("Qwen3-MoE", "LoraConfig", dict(r=4, target_modules="all-linear",
                                                             init_lora_weights=False)),
}


def build_adapted(adapter: str, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    """The adapter's family, tiny and random (:func:`build`), wrapped by PEFT with that adapter (needs peft)."""
    import peft

    family, config_cls, kwargs = ADAPTERS[adapter]
    return peft.get_peft_model(build(family, tie, seed=seed), getattr(peft, config_cls)(**kwargs))


def build(family: str, tie: bool = False, seed: int = 0, vocab_size: int = VOCAB) -> torch.nn.Module:
    """The family's tiny random model, in eval mode (no dropout), float32."""
    import transformers

    config_cls, model_cls, overrides = FAMILIES[family]
    kwargs = {k: v for k, v in {**_COMMON, **overrides, "vocab_size": vocab_size}.items() if v is not None}
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(tie_word_embeddings=tie, **kwargs)
    return getattr(transformers, model_cls)(config).eval()
