"""oblr_trl/cost_model.py: the FLOP and byte model of the update; oblr_trl/path_choice.py: the default's choice from
it (issue 47, item 3).

The choices are checked on shapes whose counted answer is known (benchmarks/results/cost_counts_full.md, Qwen3 widths
at 28 layers, counted through training_step): each would fail if the rule picked the other path."""

import pytest
import torch

from helpers import qwen3_shape
from oblr_trl import cost_model as cm
from oblr_trl import path_choice as pc


qwen3 = qwen3_shape


def test_without_checkpointing_the_default_takes_one_backward_whole():
    # counted: 0.65-0.85x GRPO's peak bytes, 1.14-1.24x its FLOPs
    choice = pc.choose(qwen3(ckpt=False))
    assert choice.one_backward and choice.chunk == 8 and choice.flops_ratio <= pc.FLOPS_TARGET


def test_full_fine_tuning_under_checkpointing_takes_one_backward_replayed():
    # counted: one_backward's kept factors 2.2-8.9x GRPO's peak bytes (even one group of 8 of 64 rows keeps more than
    # GRPO's 1.1x); replayed (no factors kept) within 1.1x, at fewer FLOPs than two passes (no second forward)
    for shape in (qwen3(rows=8), qwen3(rows=64), qwen3("1.7B", rows=64), qwen3(completion=4096)):
        assert pc.fitting_chunk(shape)[0] == 0
        choice = pc.choose(shape)
        assert choice.one_backward and choice.replay and choice.chunk % 8 == 0 and choice.chunk > 0
        assert choice.bytes_ratio <= pc.BYTES_TARGET
        grpo = cm.flops(shape, "grpo")
        assert pc.FLOPS_TARGET < choice.flops_ratio < cm.flops(shape, "two_passes") / grpo
        # where replaying is not allowed (several processes): two passes, as before
        old = pc.choose(shape, replay=False)
        assert not old.one_backward and old.chunk == 0 and old.bytes_ratio > pc.BYTES_TARGET


def test_replay_costs_two_passes_less_the_loss_passs_forward():
    """Replayed, the update is the norms pass's graph's second backward: two passes' FLOPs less the loss pass's
    forward (each layer's maps and attention) and its head (GRPO's 4 logits products over T - 1 positions, for the 2
    of the update's over the C completion positions), by hand on one linear layer."""
    s = cm.Shape(layers=1, hidden=4, vocab=10, heads=1, head_dim=4, linears=((4, 6, True),), adapters=(),
                 head_trainable=True, tied=True, rows=2, prompt=1, completion=3, itemsize=4, checkpointing=True,
                 group=2)
    N, T = 2 * 4, 4
    fwd, att_f = 2 * N * 24, 4 * 2 * 1 * T * T * 4
    head_grpo, head_update = 4 * 2 * (2 * 3) * 4 * 10, 2 * 2 * (2 * 3) * 4 * 10
    assert cm.flops(s, "replay") == pytest.approx(cm.flops(s, "two_passes") - fwd - att_f - head_grpo + head_update)
    # its bytes: the weight gradients (the layer's and the head's, float32) and hidden-sized tensors, no factors
    assert cm.peak_bytes(s, "replay", 2) == pytest.approx(4 * (24 + 40) + (1 + cm.REPLAY_HIDDEN) * 2 * T * 4 * 4)
    assert cm.peak_bytes(s, "replay", 1) < cm.peak_bytes(s, "replay", 2)


def test_lora_under_checkpointing_takes_one_backward_in_chunks_where_the_whole_batch_does_not_fit():
    # counted: 0.37x at 8 x 512 (whole); 1.41x at 1.7B 64 x 512 whole, so fewer rows per chunk
    small = pc.choose(qwen3(lora=True))
    assert small.one_backward and small.chunk == 8
    big = qwen3("1.7B", rows=64, lora=True)
    assert cm.peak_bytes(big, "one_backward") / cm.peak_bytes(big, "grpo") > pc.BYTES_TARGET
    choice = pc.choose(big)
    assert choice.one_backward and 8 <= choice.chunk < 64 and choice.chunk % 8 == 0
    assert choice.bytes_ratio <= pc.BYTES_TARGET


def test_the_flop_target_sends_a_head_heavy_model_to_two_passes():
    """One small layer under a 100k head, long completions: the head's norm (2 C d V) and its recomputed product make
    one_backward's FLOPs about 1.5x GRPO's, though its memory is fine."""
    shape = cm.Shape(layers=1, hidden=64, vocab=100_000, heads=1, head_dim=64, linears=((64, 64, True),), adapters=(),
                     head_trainable=True, tied=False, rows=8, prompt=1, completion=4096, itemsize=4,
                     checkpointing=False, group=8)
    choice = pc.choose(shape)
    assert choice.flops_ratio > pc.FLOPS_TARGET and choice.bytes_ratio <= pc.BYTES_TARGET_NO_CKPT
    assert not choice.one_backward


def test_flops_by_hand_on_one_linear_layer():
    s = cm.Shape(layers=1, hidden=4, vocab=10, heads=1, head_dim=4, linears=((4, 6, True),), adapters=(),
                 head_trainable=True, tied=True, rows=2, prompt=1, completion=3, itemsize=4, checkpointing=False,
                 group=2)
    N, T = 2 * 4, 4
    att = 4 * 2 * 1 * T * T * 4
    grpo = 6 * N * 24 + att * 3.5 + 4 * 2 * (2 * 3) * 4 * 10
    assert cm.flops(s, "grpo") == pytest.approx(grpo)
    norms = 2 * min(2 * T * T * 10, 2 * T * 24)
    head_norm = 2 * min(2 * 9 * 14, 2 * 3 * 40)
    layer = grpo - 4 * 2 * 6 * 40  # GRPO's head: 4 logits products over the 2 x 3 scored positions
    assert cm.flops(s, "one_backward") == pytest.approx(layer + norms + 5 * 2 * 2 * 3 * 40 + head_norm)


def test_bytes_per_layer_under_checkpointing_are_inputs_and_kept_factors():
    s1, s2 = qwen3(layers=1), qwen3(layers=2)
    n, d = 8 * 544, 1024
    assert cm.peak_bytes(s2, "grpo") - cm.peak_bytes(s1, "grpo") == pytest.approx(n * d * 4)
    # per row and layer: each trainable map's smaller of T (in + out) and in x out
    kept = sum(min(544 * (i + o), i * o) for i, o, _ in s1.linears)
    assert cm.kept_per_row(s1) == kept
    assert cm.peak_bytes(s2, "one_backward", 4) - cm.peak_bytes(s1, "one_backward", 4) == pytest.approx(
        (4 * 544 * d + 4 * kept) * 4)
    # LoRA: the adapters' per-sample gradients, r (in + out) each, whatever the length
    lora = qwen3(lora=True, layers=1)
    assert cm.kept_per_row(lora) == sum(16 * i for i, _, _ in lora.linears) + sum(16 * o for _, o, _ in lora.linears)


def test_chunk_sizes_table():
    assert pc.chunk_sizes(64, 8) == [64, 32, 24, 16, 8]  # 1, 2, 3 (3+3+2 groups), 4 and 8 chunks
    assert pc.chunk_sizes(8, 8) == [8]
    assert pc.chunk_sizes(12, 8) == [12]  # a group spans ranks: the rows whole


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="one of .*grpo"):
        cm.flops(qwen3(), "three_passes")


def test_describe_reads_a_model_and_its_lora_adapters():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oblr_trl.path_choice import describe

    config = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=100, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    s = describe(model, 4, 5, 7, 2, True, 2)
    assert (s.layers, s.hidden, s.vocab, s.heads, s.head_dim, s.tokens) == (3, 32, 100, 4, 8, 12)
    assert sorted(s.linears) == sorted([(32, 32, True), (32, 16, True), (32, 16, True), (32, 32, True),
                                        (32, 48, True), (32, 48, True), (48, 32, True)])
    assert s.adapters == () and s.head_trainable and not s.tied
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    s = describe(lora, 4, 5, 7, 2, True, 2)
    assert all(not t for _, _, t in s.linears) and not s.head_trainable
    assert sorted(s.adapters) == sorted([(32, 2), (2, 32), (48, 2), (2, 32)])


def test_describe_reads_zero3_partitioned_weights_by_their_whole_shape():
    """DeepSpeed ZeRO-3 leaves each rank a flat shard of a weight, its whole shape in ``ds_shape``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    from oblr_trl.path_choice import describe

    qwen = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50, n_positions=32))
    for model in (qwen, gpt2):
        whole = describe(model, 4, 5, 7, 2, True, 2)
        for p in model.parameters():
            p.ds_shape = tuple(p.shape)
            p.data = torch.empty(0)
        assert describe(model, 4, 5, 7, 2, True, 2) == whole


def test_the_route_keeps_trls_micro_batches_for_the_norms_pass_under_deepspeed():
    """Under DeepSpeed no cost-model chunks (ZeRO-3 left a gathered parameter active across back-to-back norms
    passes): the route is decided at construction, whatever ``one_backward`` asks for."""
    from oblr_trl import OBLRPOConfig
    from oblr_trl.path_choice import Route

    for one_backward in (None, False, True):
        args = OBLRPOConfig(output_dir="/tmp/unused", one_backward=one_backward, gradient_checkpointing=True,
                            report_to="none", use_cpu=True)
        route, _, _ = Route.for_trainer(args, needs_norms=True, fsdp1=False, aux_loss=False, deepspeed=True)
        assert route.decided and not route.on and route.norms_chunk == 0
        route, _, _ = Route.for_trainer(args, needs_norms=True, fsdp1=False, aux_loss=False, deepspeed=False)
        assert not route.decided  # decided at the first generation, from the shapes


def test_describe_reads_gpt2s_conv1d_maps():
    from transformers import GPT2Config, GPT2LMHeadModel

    from oblr_trl.path_choice import describe

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50, n_positions=32))
    s = describe(model, 2, 3, 4, 4, False, 2)
    assert s.layers == 2 and s.tied and s.vocab == 50 and s.heads == 2 and s.head_dim == 8
    assert sorted(s.linears) == sorted([(16, 48, True), (16, 16, True), (16, 64, True), (64, 16, True)])


def test_the_two_pass_norms_pass_is_chunked_where_the_whole_micro_batch_exceeds_the_target():
    # counted: two passes at 64 x 512 under checkpointing hold 1.39x GRPO's peak (the norms pass keeps each layer's
    # output gradient too); half the rows per norms chunk hold what GRPO's loss pass does
    big = qwen3(rows=64)
    assert cm.peak_bytes(big, "two_passes") / cm.peak_bytes(big, "grpo") > pc.BYTES_TARGET
    chunk = pc.norms_chunk(big)
    assert chunk < 64 and cm.peak_bytes(big, "two_passes", chunk) <= pc.BYTES_TARGET * cm.peak_bytes(big, "grpo")
    assert pc.norms_chunk(qwen3(rows=8)) == 8  # one group: nothing to split
    assert pc.norms_chunk(qwen3(rows=64, ckpt=False)) == 64  # without checkpointing GRPO holds more
