"""The whole-model pass (hooks, LM head, factor algebra, streaming, checkpointing, bf16) vs one ``torch.autograd.grad``
per sequence (tests/reference.py)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from oblr_trl import per_sequence_grad_inner_products, per_sequence_grad_sq_norms
from oblr_trl.grad_norms import UnsupportedModulesError, register_grad_norm_rule
import reference
from reference import per_sample_grads, per_sample_sq_norms, within_group_products

VOCAB, PROMPT, COMPLETION = 40, 5, 6


def qwen3(tie: bool):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tie, pad_token_id=0)
    return Qwen3ForCausalLM(cfg)


def llama(tie: bool):
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tie, pad_token_id=0,
                      attention_bias=True, mlp_bias=True)
    return LlamaForCausalLM(cfg)


def padded_batch(batch=6, seed=0, completion=COMPLETION):
    """Left-padded prompts, right-padded completions, one empty completion."""
    return reference.padded_batch(VOCAB, batch=batch, prompt=PROMPT, completion=completion, seed=seed)


@pytest.mark.parametrize("build", [qwen3, llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_norms_match_per_sample_autograd(build, tie):
    model = build(tie)
    ids, attention, completion_mask = padded_batch()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert ours.dtype == torch.float32 and ours.shape == (ids.shape[0],)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-6)
    assert ours[2] == 0  # the empty completion has no score
    assert all(p.grad is None for p in model.parameters())  # no .grad left behind


def test_tied_embeddings_count_the_summed_gradient():
    """Tied input/output embeddings: ||g_emb + g_head||^2, which differs from ||g_emb||^2 + ||g_head||^2."""
    model = qwen3(tie=True)
    ids, attention, completion_mask = padded_batch()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    model.model.embed_tokens.weight.requires_grad_(False)  # tied: freezes the head too
    without_embedding = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    assert (ours - without_embedding).abs().max() > 1e-3
    model.model.embed_tokens.weight.requires_grad_(True)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask), rtol=1e-4, atol=1e-6)


def test_group_inner_products_match_autograd():
    model = qwen3(tie=True)
    ids, attention, completion_mask = padded_batch()
    ours = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=3)
    grads = per_sample_grads(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), within_group_products(grads, 3), rtol=1e-4, atol=1e-5)


def test_lora_only_adapters():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        qwen3(tie=True),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
    ids, attention, completion_mask = padded_batch()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask), rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_norms():
    """Inside checkpointed layers the inputs come from the backward's recomputation (none kept from the forward)."""
    from oblr_trl.grad_norms import per_sequence_grads

    model = qwen3(tie=False)
    model.train()
    ids, attention, completion_mask = padded_batch()
    plain = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    kept = per_sequence_grads(model, ids, attention, completion_mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.testing.assert_close(per_sequence_grad_sq_norms(model, ids, attention, completion_mask), plain)
    # the kept factors (one_backward's path) pair each recomputed input with its output gradient too
    ckpt = per_sequence_grads(model, ids, attention, completion_mask)
    torch.testing.assert_close(ckpt.inner_products(2), kept.inner_products(2), rtol=1e-5, atol=1e-4)


def test_frozen_model_gives_zero_norms():
    model = qwen3(tie=True).requires_grad_(False)
    ids, attention, completion_mask = padded_batch()
    assert torch.equal(per_sequence_grad_sq_norms(model, ids, attention, completion_mask), torch.zeros(6))


def test_module_without_rule_is_named_then_its_rule_is_used(monkeypatch):
    """Above the per-row path's size limit a module with no rule is refused by name; a registered rule is used."""
    from oblr_trl.grad_norms.rules import per_row

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(48))

        def forward(self, x):
            return x * self.gain

    monkeypatch.setattr(per_row, "MAX_NUMEL", 0)
    model = qwen3(tie=True)
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), Scale())
    ids, attention, completion_mask = padded_batch()
    with pytest.raises(NotImplementedError, match="Scale"):
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask)

    @register_grad_norm_rule(Scale)
    def scale_rule(layer, activation, output_grad):  # y = x * gain: per-sample d gain = sum_t g_t * x_t
        from oblr_trl.grad_norms.factors import Materialized
        g, x = output_grad.reshape(output_grad.shape[0], -1, output_grad.shape[-1]), activation.reshape(activation.shape[0], -1, activation.shape[-1])
        return {"gain": Materialized((g * x).sum(1))}
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("materialize", [True, False], ids=["materialized", "ghost"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_both_layer_strategies_match_autograd(monkeypatch, materialize, tie):
    """The per-layer choice between token Grams and materialized per-sample gradients is exact either way."""
    from oblr_trl.grad_norms import factors

    all_dense = lambda u, v: all(isinstance(f, factors.Dense) for f in (u.left, u.right, v.left, v.right))
    monkeypatch.setattr(factors, "_materialize_cheaper", lambda u, v, k: materialize and all_dense(u, v))
    monkeypatch.setattr(factors, "_head_materialize_cheaper", lambda u, k: materialize)
    calls = []
    for name in ("_materialized_block_products", "_head_materialized_block_products"):
        monkeypatch.setattr(factors, name, lambda *a, _f=getattr(factors, name), _n=name: calls.append(_n) or _f(*a))
    check_group_products(qwen3(tie=tie), k=2)
    assert set(calls) == ({"_materialized_block_products", "_head_materialized_block_products"} if materialize else set())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_vocabulary_chunking_is_exact(monkeypatch, tie):
    """The LM head is processed in vocabulary chunks (log-sum-exp, output gradient, Grams): chunks of 7 of 40."""
    from oblr_trl.grad_norms import factors

    monkeypatch.setattr(factors, "VOCAB_CHUNK", 7)
    monkeypatch.setattr(factors, "HEAD_TILE_SHARE", 1 << 30)  # factors.vocab_chunk: VOCAB_CHUNK, not a larger chunk
    monkeypatch.setattr(factors, "_head_materialize_cheaper", lambda u, k: False)
    model = qwen3(tie=tie)
    ids, attention, completion_mask = padded_batch()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=1.3)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=1.3)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_norms_are_accurate_to_bf16():
    """Under bf16 autocast the factors are bf16, the Grams accumulate in fp32: the norms agree with per-sample
    autograd under the same autocast to bf16's precision (a few parts in a thousand per product, here < 3%)."""
    model = qwen3(tie=True)
    ids, attention, completion_mask = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
        reference = per_sample_sq_norms(model, ids, attention, completion_mask)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), reference, rtol=3e-2, atol=1e-3)


def test_bf16_autocast_materialized_layers_are_held_in_bf16_and_accurate_to_bf16():
    """materialize=True under bf16 autocast: per-sample gradients are held in bf16 (what autograd's own weight
    gradients are there), formed and summed in fp32; norms, weighted gradient and group norms agree with per-sample
    autograd under the same autocast to bf16's precision (measured: 1.7e-3, 6e-4 and 3.7e-3 relative, the same as
    with the factors kept in bf16)."""

    from oblr_trl.grad_norms import per_sequence_grads
    from oblr_trl.grad_norms.factors import Materialized

    model = llama(tie=False)
    ids, attention, completion_mask = padded_batch(completion=24)
    scale = torch.tensor([0.5, -1.25, 3.0, 0.0, -0.75, 2.0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = per_sequence_grads(model, ids, attention, completion_mask, materialize=True)
        per_sample = torch.stack(per_sample_grads(model, ids, attention, completion_mask)).double()
    held = [u for usages in grads.usages.values() for u in usages if isinstance(u, Materialized) and u.g.dim() == 3]
    assert len(held) == 14 and all(u.g.dtype == torch.bfloat16 for u in held)
    torch.testing.assert_close(grads.inner_products(1).reshape(-1).double(), per_sample.pow(2).sum(1), rtol=1e-2,
                               atol=1e-4)
    check_bf16_group_sums_and_weighted_grad(grads, model, (ids, attention, completion_mask), scale, per_sample)


@pytest.mark.parametrize("build", [qwen3, llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_weighted_gradient_from_the_same_backward_matches_autograd(build, tie):
    """One backward gives both: the norms now, and later sum_i s_i u_i once the per-sequence coefficients are known
    (OBLRPOConfig(one_backward=True)); the latter must equal autograd's gradient of sum_i s_i log pi(o_i)."""
    from reference import completion_logprob_sums

    from oblr_trl.grad_norms import per_sequence_grads

    model = build(tie)
    ids, attention, completion_mask = padded_batch()
    scale = torch.tensor([0.5, -1.25, 3.0, 0.0, -0.75, 2.0])
    grads = per_sequence_grads(model, ids, attention, completion_mask, temperature=0.7)
    torch.testing.assert_close(
        grads.inner_products(1).reshape(-1).double(),
        per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7), rtol=1e-4, atol=1e-6,
    )
    assert all(p.grad is None for p in model.parameters())
    grads.accumulate_grad(scale)
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (completion_logprob_sums(model, ids, attention, completion_mask, temperature=0.7) * scale).sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)
    grads.accumulate_grad(scale)  # accumulates like a second backward would
    for name, p in model.named_parameters():
        if name in reference:
            torch.testing.assert_close(p.grad, 2 * reference[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("materialize", [False, True], ids=["factored", "materialized"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_group_gradients_and_materialized_layers_match_autograd(tie, materialize, monkeypatch):
    """accumulate_grad(scale, group_size=k) also returns each block's ||sum_{i in q} s_i u_i||^2 (the SNR's group
    samples). With materialize=True (one_backward) the layers whose per-sample gradients are no larger than their
    factors keep them materialized. Norms, weighted gradient and group norms equal per-sample autograd's, also when a
    parameter's rows are formed in many slices."""
    from reference import completion_logprob_sums

    from oblr_trl.grad_norms import PerSequenceGradients, per_sequence_grads
    from oblr_trl.grad_norms.factors import Materialized

    model = llama(tie)  # with attention and MLP biases
    ids, attention, completion_mask = padded_batch(completion=24)  # 29 tokens: longer than the layers are wide
    scale = torch.tensor([0.5, -1.25, 3.0, 0.0, -0.75, 2.0])
    grads = per_sequence_grads(model, ids, attention, completion_mask, temperature=0.7, materialize=materialize)
    held = [u for usages in grads.usages.values() for u in usages if isinstance(u, Materialized) and u.g.dim() == 3]
    assert len(held) == (14 if materialize else 0)  # q, k, v, o, gate, up, down of both layers
    per_sample = torch.stack(per_sample_grads(model, ids, attention, completion_mask, temperature=0.7)).double()
    torch.testing.assert_close(
        grads.inner_products(1).reshape(-1).double(), per_sample.pow(2).sum(1), rtol=1e-4, atol=1e-6
    )
    monkeypatch.setattr(PerSequenceGradients, "ROW_BUDGET", 64)  # several row slices for every parameter
    monkeypatch.setattr(PerSequenceGradients, "HEAD_BUDGET", 64)  # the head's too
    group_sq = grads.accumulate_grad(scale, group_size=3)
    groups = (per_sample * scale.double()[:, None]).reshape(2, 3, -1).sum(1)
    torch.testing.assert_close(group_sq.double(), groups.pow(2).sum(1), rtol=1e-4, atol=1e-6)
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (completion_logprob_sums(model, ids, attention, completion_mask, temperature=0.7) * scale).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_products_accumulate_in_fp32_under_autocast():
    """The Grams and weighted sums run with autocast off: called inside a bf16 autocast region they give exactly what
    they give outside it (inside autocast, the matmuls would otherwise run in bf16: errors of ~1e-3)."""
    from oblr_trl.grad_norms import per_sequence_grads

    model = qwen3(tie=True)
    ids, attention, completion_mask = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = per_sequence_grads(model, ids, attention, completion_mask)
        inside = grads.inner_products(3)
    torch.testing.assert_close(inside, grads.inner_products(3), rtol=0, atol=0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_streamed_products_equal_the_kept_ones_and_free_the_layers(checkpointing):
    """per_sequence_grad_inner_products consumes each single-use layer's factors as its output gradient arrives
    (stream_group_size): same products as keeping every factor to the end. Only the tied embedding is kept, and the
    norm gains (a few values per row each, whose products are taken together at the end)."""
    from oblr_trl.grad_norms import per_sequence_grads

    model = qwen3(tie=True)
    model.train()
    if checkpointing:  # recomputations in the backward must not count as second calls
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, attention, completion_mask = padded_batch()
    kept = per_sequence_grads(model, ids, attention, completion_mask)
    streamed = per_sequence_grads(model, ids, attention, completion_mask, stream_group_size=3)
    torch.testing.assert_close(streamed.inner_products(3), kept.inner_products(3), rtol=1e-5, atol=1e-4)
    assert streamed.streamed.abs().max() > 0
    gains = [m.weight for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert {id(p) for p in streamed.params.values()} == {id(model.model.embed_tokens.weight), *map(id, gains)}
    assert all(len(usages) == 1 and usages[0].concatenable for slot, usages in streamed.usages.items()
               if getattr(*slot) is not model.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="streamed"):
        streamed.inner_products(2)


def test_a_module_called_twice_is_not_streamed():
    """A layer applied twice in one forward has two usages whose cross term needs both: kept to the end, exact."""
    model = qwen3(tie=False)
    mlp = model.model.layers[1].mlp
    forward = mlp.forward
    mlp.forward = lambda x: forward(x) + forward(0.5 * x)  # the same weights twice
    ids, attention, completion_mask = padded_batch()
    ours = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=2)
    grads = per_sample_grads(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), within_group_products(grads, 2), rtol=1e-4, atol=1e-5)


def test_checkpointed_layers_keep_no_input_from_the_forward():
    """The memory property behind the recomputation pairing: after the forward, no module inside a checkpointed layer
    holds its input (checkpointing keeps only the layers' inputs); the embedding and final norm outside them do."""
    from oblr_trl.grad_norms.engine import _hooked_modules
    from oblr_trl.grad_norms.coverage import coverage_plan
    from oblr_trl.grad_norms.hooks import capture as _capture, checkpointed_layers as _checkpointed_layers

    model = qwen3(tie=False)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, attention, _ = padded_batch()
    backbone = model.model
    layers = _checkpointed_layers(backbone)
    assert len(layers) == 2
    inside = {m for layer in layers for m in layer.modules()}
    hooked, per_row, _ = _hooked_modules(coverage_plan(model))
    assert not per_row  # every Qwen3 layer has a rule
    with _capture(hooked, ids.shape[0], None, layers) as (records, targets):
        backbone(input_ids=ids, attention_mask=attention, use_cache=False)
        held = [r for r in records if r.activation is not None]
        assert {r.module for r in held} == {backbone.embed_tokens, backbone.norm}  # outside the layers
        # per layer: q, k, v, o, gate, up, down, q_norm, k_norm and two layer norms, each waiting for its recomputation
        assert len([r for r in records if r.module in inside]) == 2 * 11
        # the final norm's input and the first checkpointed layer's input (the second's is the first's output,
        # reached through it: issue 47, one target per chain of checkpointed layers)
        assert len(targets) == 2


def test_autocast_operands_cast_a_shared_input_once_and_never_reuse_another(monkeypatch):
    """Under autocast a linear's float32 input is cast to its bf16 output gradient's dtype (what autograd's weight
    gradient uses); layers reading one input (q/k/v) share the cast through the pass's cache, keyed on the very
    tensor (same memory, shape and strides): a different tensor, or a view at another offset, gets its own cast."""
    from oblr_trl.grad_norms import factors
    from oblr_trl.grad_norms.factors import Dense, Factored, autocast_operands

    monkeypatch.setattr(factors, "HALF_OPERAND_DEVICES", ("cpu", "cuda"))  # the GPU's policy, here
    x = torch.randn(2, 5, 4)
    g = torch.randn(2, 5, 3).to(torch.bfloat16)
    cache = {}
    first = autocast_operands(Factored(Dense(g), Dense(x)), cache)
    assert first.right.t.dtype == torch.bfloat16 and torch.equal(first.right.t, x.to(torch.bfloat16))
    again = autocast_operands(Factored(Dense(g[..., :2]), Dense(x.detach())), cache)  # same memory: reused
    assert again.right.t is first.right.t
    other = x + 1
    cast = autocast_operands(Factored(Dense(g), Dense(other)), cache)
    assert torch.equal(cast.right.t, other.to(torch.bfloat16))
    view = x[:, 1:]
    cast = autocast_operands(Factored(Dense(g[:, 1:]), Dense(view)), cache)
    assert torch.equal(cast.right.t, view.to(torch.bfloat16))
    assert autocast_operands(Factored(Dense(x), Dense(x)), cache).right.t is x  # no half factor: unchanged


@pytest.mark.parametrize("k", [1, 3])
def test_row_products_split_into_a_batch_equal_the_plain_product(monkeypatch, k):
    """The within-block products of materialized per-sample gradients, with the long axis cut into pieces (whole rows
    of ``inner``, a divisor of the axis where ``inner`` does not divide it, or zero-padded pieces where none is near
    ``PIECE``) or not, held as blocks or as formed (``k`` given: one or several blocks), and the norms end to end with
    every axis cut."""
    from oblr_trl.grad_norms import factors

    a, b = torch.randn(2, k, 6 * 5), torch.randn(2, k, 6 * 5)
    plain = factors._row_products(a, b, 5)
    monkeypatch.setattr(factors, "SPLIT_MIN", 0)
    monkeypatch.setattr(factors, "PIECE", 8)
    assert factors._piece(30, 5) == 5 and factors._piece(30, 2) == 6 and factors._piece(30, 7) == 6
    assert factors._piece(31, 0) == 8  # 31 is prime: pieces of 8, the last zero-padded
    for inner in (5, 2, 7, 0):  # rows of 5; 3 rows of 2; pieces of 6 (7 does not divide 30; 0: no rows)
        torch.testing.assert_close(factors._row_products(a, b, inner), torch.bmm(a, b.transpose(1, 2)))
    for x, y in ((a, b), (a[:1], b[:1]), (a[..., :29], b[..., :29]), (torch.randn(1, k, 31),) * 2):
        exact = torch.bmm(x, y.transpose(1, 2))  # (several blocks, one block, not contiguous, padded) as formed:
        formed = x.reshape(-1, 1, x.shape[-1]), y.reshape(-1, 1, y.shape[-1])  # (nb k, 1, N)
        torch.testing.assert_close(factors._row_products(*formed, 0, k), exact)
        torch.testing.assert_close(factors._row_products(formed[0], formed[0], 0, k), torch.bmm(x, x.transpose(1, 2)))
    all_dense = lambda u, v: all(isinstance(f, factors.Dense) for f in (u.left, u.right, v.left, v.right))
    monkeypatch.setattr(factors, "_materialize_cheaper", lambda u, v, k: all_dense(u, v))  # every layer split
    monkeypatch.setattr(factors, "_head_materialize_cheaper", lambda u, k: True)
    torch.testing.assert_close(factors._row_products(a, b, 5), torch.bmm(a, b.transpose(1, 2)))
    torch.testing.assert_close(factors._row_products(a, a, 5), torch.bmm(a, a.transpose(1, 2)))
    torch.testing.assert_close(plain, torch.bmm(a, b.transpose(1, 2)))
    g = factors.Materialized(torch.randn(4, 1, 6 * 5).to(torch.bfloat16))  # a squared norm: a reduction, not a gemv
    torch.testing.assert_close(g.block_inner_products(g, 1), torch.bmm(g.g.float(), g.g.float().transpose(1, 2)))
    check_group_products(qwen3(tie=True), k=3)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("completion", [COMPLETION, 4 * VOCAB], ids=["unique-ids", "every-id"])
def test_tied_head_sparse_rows_in_slot_chunks_are_exact(monkeypatch, group, completion):
    """The tied embedding/head cross terms gather the head's softmax columns at the embedding's unique token ids in
    chunks of slots (bounded memory): one slot at a time gives the per-row autograd products. Where a block has more
    tokens than the vocabulary has ids, every id is a slot (no sort), with the same products. The embedding's own
    products and its two cross terms with the head are formed from one set of slots."""
    from oblr_trl.grad_norms import factors

    monkeypatch.setattr(factors, "GATHER_BUDGET", 1)  # one slot at a time
    monkeypatch.setattr(factors, "TIED_HEAD_KEPT", 0)  # the head's gradients not kept: the cross terms by slots
    found = []
    unique_slots = factors._unique_slots
    monkeypatch.setattr(factors, "_unique_slots", lambda ids, vocab: found.append(unique_slots(ids, vocab)) or found[-1])
    model = qwen3(tie=True)
    ids, attention, completion_mask = padded_batch(completion=completion)
    grads = per_sample_grads(model, ids, attention, completion_mask)
    ours = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=group)
    nb = len(grads) // group
    reference = torch.stack([torch.stack([torch.stack([grads[group * q + i].double() @ grads[group * q + j].double()
                                                       for j in range(group)]) for i in range(group)])
                             for q in range(nb)])
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-5)
    assert len(found) == 1  # the embedding's own products and both cross terms from one set of slots
    assert all(slots["m"] == (VOCAB if completion > VOCAB else group * ids.shape[1]) for slots in found)


def test_half_precision_operands_as_on_a_gpu_are_accurate_to_bf16(monkeypatch):
    """The GPU's policy (HALF_OPERAND_DEVICES), run here: under bf16 autocast every product takes bf16 operands (a
    linear's float32 input cast as autocast casts it, the head in bf16) with float32 sums. Norms, group products,
    the weighted gradient and the group norms agree with per-sample autograd under the same autocast to bf16's
    precision; off that policy (the CPU's default) the numbers are the float32-operand ones."""

    from oblr_trl.grad_norms import factors, per_sequence_grads

    model = qwen3(tie=True)
    ids, attention, completion_mask = padded_batch(completion=24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        default = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    monkeypatch.setattr(factors, "HALF_OPERAND_DEVICES", ("cpu", "cuda"))
    scale = torch.tensor([0.5, -1.25, 3.0, 0.0, -0.75, 2.0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
        products = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=3)
        grads = per_sequence_grads(model, ids, attention, completion_mask, materialize=True)
        per_sample = torch.stack(per_sample_grads(model, ids, attention, completion_mask)).double()
    assert not torch.equal(norms, default)  # the policy took effect
    torch.testing.assert_close(norms.double(), per_sample.pow(2).sum(1), rtol=1e-2, atol=1e-4)
    reference = torch.stack([per_sample[3 * q : 3 * q + 3] @ per_sample[3 * q : 3 * q + 3].T for q in range(2)])
    torch.testing.assert_close(products.double(), reference, rtol=1e-2, atol=1e-2 * float(reference.abs().max()))
    check_bf16_group_sums_and_weighted_grad(grads, model, (ids, attention, completion_mask), scale, per_sample)


def check_bf16_group_sums_and_weighted_grad(grads, model, batch, scale, per_sample):
    """Groups of 3: ``||sum_i scale_i g_i||^2`` against the per-sample gradients, and the weighted gradient left in
    ``.grad`` against autograd's under bf16 autocast (measured 3.7e-3 relative, as the factored form)."""
    from reference import completion_logprob_sums

    group_sq = grads.accumulate_grad(scale, group_size=3)
    groups = (per_sample * scale.double()[:, None]).reshape(2, 3, -1).sum(1)
    torch.testing.assert_close(group_sq.double(), groups.pow(2).sum(1), rtol=1e-2, atol=1e-4)
    ours = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (completion_logprob_sums(model, *batch) * scale).sum().backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    assert (ours - reference).norm() <= 1e-2 * reference.norm()


def check_group_products(model, k):
    """The within-group inner products of the padded batch's per-sequence gradients, groups of ``k``, against
    per-row autograd."""
    ids, attention, completion_mask = padded_batch()
    grads = [g.double() for g in per_sample_grads(model, ids, attention, completion_mask)]
    ours = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=k)
    reference = torch.stack([torch.stack([torch.stack([grads[k * q + i] @ grads[k * q + j] for j in range(k)])
                                          for i in range(k)]) for q in range(len(grads) // k)])
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_summed_self_products_share_an_input_gram_and_equal_the_pairs(k):
    """summed_self_products (what inner_products uses for parameters of one usage) equals the sum of each usage's
    block_inner_products with itself, while layers that read one input (q/k/v) share its Gram, and their output
    gradients' Grams are one Gram of those gradients side by side (issue 56): 3 usages on one input and one on another
    take 1 + 1 + 2 Gram products (bmm/baddbmm) instead of 8; small float32 materialized gradients take one product
    between them."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from oblr_trl.grad_norms.factors import Dense, Factored, Materialized, block_inner_products, summed_self_products

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 5, 24, generator=g), torch.randn(4, 5, 20, generator=g)  # wide: the Grams are cheaper
    usages = [Factored(Dense(torch.randn(4, 5, 32, generator=g)), Dense(x)) for _ in range(3)]
    usages += [Factored(Dense(torch.randn(4, 5, 30, generator=g)), Dense(y))]
    usages += [Materialized(torch.randn(4, 7, generator=g)), Materialized(torch.randn(4, 3, generator=g))]
    blocked = [u.blocked(k) for u in usages]
    expected = sum(block_inner_products(u, u, k) for u in blocked)
    counter = Products()
    with counter:
        summed = summed_self_products(blocked, k)
    torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-5)
    # the small ones' one product: with k = 1, a squared norm, a reduction (linalg_vector_norm)
    products = counter.calls["aten.bmm"] + counter.calls["aten.baddbmm_"] + counter.calls["aten.linalg_vector_norm"]
    assert products == 1 + 1 + 2 + 1
    assert summed_self_products([], k) is None


def test_materialized_half_squared_norms_as_a_reduction_equal_the_product(monkeypatch):
    """The squared norms of half-precision materialized per-sample gradients (bf16 autocast) are a float32-accumulating
    reduction instead of a (1 x N)(N x 1) product per sequence (a slow gemv on an H200): the norms are those of the
    product path (a float64 product of the same gradients, patched in)."""
    from oblr_trl.grad_norms import factors

    model, batch = qwen3(tie=True), padded_batch()
    real = factors._row_products
    blocks = lambda t, k: t if k is None else t.reshape(t.shape[0] // k, k, -1)  # noqa: E731 - (nb, k, N)
    monkeypatch.setattr(factors, "_row_products", lambda a, b, inner, k=None: torch.bmm(
        blocks(a, k).double(), blocks(b, k).double().transpose(1, 2)).float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        product = per_sequence_grad_sq_norms(model, *batch)
    monkeypatch.setattr(factors, "_row_products", real)
    reductions, vector_norm = [], torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda x, *a, **kw: reductions.append(tuple(x.shape)) or
                        vector_norm(x, *a, **kw))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reduced = per_sequence_grad_sq_norms(model, *batch)
    # the materialized gradients (at least the norm gains, concatenated) took it, as (B, 1, pieces, piece)
    pieces = [shape for shape in reductions if len(shape) == 4]
    assert len(pieces) >= 2 and all(shape[:2] == (6, 1) for shape in pieces)
    torch.testing.assert_close(reduced, product, rtol=1e-6, atol=0)


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("inner", [1024, 0])
def test_products_over_a_layers_long_axis_are_exact_to_1e_6(k, inner):
    """Issue 56: per-sample gradients of a Qwen3-0.6B MLP map hold N = 3,145,728 entries; one float32 (k, N)(N, k)
    product accumulates each dot serially: 2-4e-4 relative error on a CPU (measured), 20-40x the 1e-5 target. In
    pieces, summed by a reduction, within 1e-6 of float64, materialized usages and concatenated small ones alike
    (``inner`` 0: no row length known, zero-padded pieces)."""
    from oblr_trl.grad_norms import factors

    n = 1024 * 3072 + (0 if inner else 5)
    a = torch.randn(1, k, n, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = torch.bmm(a.double(), a.double().transpose(1, 2))
    for got in (factors._row_products(a, a, inner), factors.Materialized(a).block_inner_products(
            factors.Materialized(a), k)):
        assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 1e-6


def test_on_the_cpu_a_layers_own_products_take_the_route_of_fewer_multiply_adds():
    """With itself a usage's per-sample gradients are formed once (``T n_L n_R``), against the token Grams' ``T^2
    (n_L + n_R)``: counted twice, short sequences' MLPs took the Grams, 1.65x as long (8 x 96 tokens, 256 x 64)."""
    from oblr_trl.grad_norms.factors import Dense, Factored, _materialize_cheaper

    def usage(tokens, n_left, n_right):
        return Factored(Dense(torch.randn(8, tokens, n_left)), Dense(torch.randn(8, tokens, n_right)))

    mlp, short = usage(96, 256, 64), usage(8, 512, 128)
    assert _materialize_cheaper(mlp, mlp, 1)  # 1.6M multiply-adds a row against 2.9M
    assert not _materialize_cheaper(short, short, 1)  # 0.5M against 41k
    assert not _materialize_cheaper(mlp, usage(96, 256, 64), 1)  # two usages, both formed: 3.2M against 2.9M


def test_only_small_materialized_gradients_are_concatenated():
    """Norm gains and biases are concatenated into one product (fewer operator calls); on a CPU a layer's per-sample
    gradients (``one_backward``'s, 2 MB for 8 rows of a 512 x 128 map) take their own: copying them cost more (32 ms
    of an update's inner products on 4 layers, of 48). Elsewhere (a GPU, a launch per call; the meta tensors the
    operator calls are counted on) gradients up to 1M values are concatenated, LoRA's per-sample gradients among them."""
    from oblr_trl.grad_norms.factors import Materialized

    assert Materialized(torch.randn(8, 128)).concatenable
    assert not Materialized(torch.randn(8, 512, 128)).concatenable
    assert not Materialized(torch.randn(8, 128, dtype=torch.bfloat16)).concatenable
    assert Materialized(torch.empty(8, 512, 128, device="meta")).concatenable
    assert not Materialized(torch.empty(8, 1024, 1024, device="meta")).concatenable


def _spans_everywhere(monkeypatch):
    """Every dense layer formed per row over its spans (the CPU's threshold lifted, the route forced), with a record of
    the rows' products: the tiny test models' padding is far below the threshold that makes it pay."""
    from oblr_trl.grad_norms import factors

    monkeypatch.setattr(factors, "CPU_MACS_PER_CALL", 0)
    monkeypatch.setattr(factors, "_materialize_cheaper", lambda u, v, k: u.dense_pair and v.dense_pair)
    formed = []
    products = factors.TokenSpans.products
    monkeypatch.setattr(factors.TokenSpans, "products", lambda self, *a: formed.append(a[0].shape) or products(self, *a))
    return formed


@pytest.mark.parametrize("build", [qwen3, llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_layers_formed_over_each_rows_tokens_skip_its_padding_exactly(build, tie, monkeypatch):
    """Per-sample gradients formed row by row over each row's span (first attended token to the last scored one) give
    the norms, the within-group products and, materialized, the weighted gradient of per-row autograd: the padding
    skipped adds nothing. Rows with no scored token are zero."""
    from reference import completion_logprob_sums

    from oblr_trl.grad_norms import per_sequence_grads

    from oblr_trl.grad_norms.factors import Materialized

    formed = _spans_everywhere(monkeypatch)
    model = build(tie)
    ids, attention, completion_mask = padded_batch(completion=24)  # long enough for one_backward to form them all
    per_sample = torch.stack(per_sample_grads(model, ids, attention, completion_mask, temperature=0.7)).double()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    torch.testing.assert_close(ours.double(), per_sample.pow(2).sum(1), rtol=1e-4, atol=1e-6)
    assert ours[2] == 0 and len(formed) == 14  # q, k, v, o, gate, up, down of both layers
    products = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=3, temperature=0.7)
    torch.testing.assert_close(products.double(), within_group_products(list(per_sample), 3), rtol=1e-4, atol=1e-6)
    assert len(formed) == 28
    scale = torch.tensor([0.5, -1.25, 3.0, 0.0, -0.75, 2.0])
    grads = per_sequence_grads(model, ids, attention, completion_mask, temperature=0.7, materialize=True)
    held = [u for usages in grads.usages.values() for u in usages if isinstance(u, Materialized) and u.g.dim() == 3]
    assert len(held) == 14 and len(formed) == 42  # one_backward's layers, materialized over the spans
    grads.accumulate_grad(scale)
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (completion_logprob_sums(model, ids, attention, completion_mask, temperature=0.7) * scale).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_layer_whose_output_gradient_reaches_the_padding_is_formed_over_every_token(monkeypatch):
    """Nothing is assumed of the model: a hook that mixes each position with its mirror (not causal) sends gradient
    to the padding of the first layer's MLP and everything below it; those layers are formed over every token, the
    layers above over their spans, and the norms still equal per-row autograd's."""
    formed = _spans_everywhere(monkeypatch)
    model = qwen3(tie=False)
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out + 0.5 * out.flip(1))
    ids, attention, completion_mask = padded_batch()
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-6)
    assert len(formed) == 7  # the second layer's seven maps; none of the first layer's


def test_a_usage_takes_spans_only_where_a_factor_is_read_zero_outside_them(monkeypatch):
    from oblr_trl.grad_norms import factors
    from oblr_trl.grad_norms.factors import Dense, Factored, TokenSpans, trimmed

    monkeypatch.setattr(factors, "CPU_MACS_PER_CALL", 0)
    assert TokenSpans.of([0, 0], [5, 5], 5, "cpu") is None  # nothing to skip
    assert TokenSpans.of([0] * 4, [19] * 4, 20, "cpu") is None  # only the last token, which predicts nothing: 5%
    spans = TokenSpans.of([1, 0], [5, 2], 5, "cpu")
    assert spans.outside.tolist() == [0, 7, 8, 9] and spans.kept_share == 0.6
    g, x = torch.randn(2, 5, 16), torch.randn(2, 5, 8)
    g.view(-1, 16)[spans.outside] = 0
    usage = Factored(Dense(g), Dense(x))
    assert trimmed(usage, spans, 1).spans is spans
    torch.testing.assert_close(trimmed(usage, spans, 1).materialize(), usage.materialize())
    for value in (1e-30, float("nan")):  # any value outside, a NaN too, keeps every token
        leaked = g.clone()
        leaked[1, 3, 0] = value
        assert trimmed(Factored(Dense(leaked), Dense(x)), spans, 1).spans is None
    assert trimmed(Factored(Dense(x), Dense(g)), spans, 1).spans is spans  # either factor may be the zero one
    assert trimmed(usage, spans, 2).spans is spans  # blocks of rows: each row still formed over its own span
    meta = Factored(Dense(g.to("meta")), Dense(x.to("meta")))
    assert trimmed(meta, spans, 1) is meta  # off the CPU: batched as before
    monkeypatch.setattr(factors, "CPU_MACS_PER_CALL", 1 << 21)
    assert trimmed(usage, spans, 1) is usage  # 4 tokens x 128 multiply-adds do not pay for a call per row
    empty = TokenSpans.of([3, 0], [1, 5], 5, "cpu")  # a row with no scored token
    assert empty.products(g, x)[0].abs().max() == 0


def test_layers_reading_one_input_share_its_token_gram(monkeypatch):
    """The streamed pass takes one layer's products at a time (``self_products``): a dense pair on the token Grams
    whose input is the tensor the last one read (the gate and up projections) reuses that input's Gram; another
    tensor, even of equal values, does not. Each equals the pair's own products."""
    from oblr_trl.grad_norms import factors
    from oblr_trl.grad_norms.factors import Dense, Factored

    grams = []
    monkeypatch.setattr(factors, "gram", lambda a, b, _f=factors.gram: grams.append(a.width) or _f(a, b))
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16)  # 3 tokens through 16 -> 40 maps: the Grams are cheaper than materializing
    gate, up = Factored(Dense(torch.randn(4, 3, 40)), Dense(x)), Factored(Dense(torch.randn(4, 3, 40)), Dense(x))
    other = Factored(Dense(torch.randn(4, 3, 40)), Dense(x.clone()))
    for k in (1, 2):
        assert not factors._materialize_cheaper(gate.blocked(k), gate.blocked(k), k)
        cache, grams[:] = {}, []
        for u in (gate, up, other):
            expected = factors.block_inner_products(u.blocked(k), u.blocked(k), k)
            grams.clear()
            torch.testing.assert_close(factors.self_products(u, k, cache), expected)
            assert grams == ([40] if u is up else [16, 40]), (k, grams)  # up: its output side's Gram alone


def test_one_hot_gradients_formed_by_rows_equal_a_one_hot_product():
    """An embedding's per-sample gradients ``sum_t onehot(id_t) (x) g_t``, formed by adding each token's row at its
    id, equal the product of the one-hot matrix with the output gradients (repeated ids summed)."""
    from oblr_trl.grad_norms.factors import Dense, OneHot

    torch.manual_seed(0)
    ids = torch.tensor([[3, 1, 3, 0], [2, 2, 2, 4]])
    g = torch.randn(2, 4, 6)
    onehot = torch.nn.functional.one_hot(ids, 5).float()  # (B, T, V)
    torch.testing.assert_close(OneHot(ids, 5).materialize_with(Dense(g)), onehot.transpose(1, 2) @ g)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_route", ["materialized", "grams"])
def test_small_tied_head_keeps_its_gradients_for_the_cross_terms(monkeypatch, group, head_route):
    """Streamed, a tied head with a small vocabulary keeps the per-sample gradients its own products form; the
    embedding's are then scattered whole and the cross terms are two products (no slots). Where the head's products
    take the token Grams (no gradients formed), the cross terms take the slots. Both equal per-row autograd."""
    from oblr_trl.grad_norms import engine, factors
    from oblr_trl.grad_norms.factors import Materialized

    monkeypatch.setattr(factors, "_head_materialize_cheaper", lambda u, k: head_route == "materialized")
    slotted, kept = [], []
    unique_slots = factors._unique_slots
    monkeypatch.setattr(factors, "_unique_slots", lambda *a: slotted.append(1) or unique_slots(*a))
    add_head = engine._Pass.add_head
    monkeypatch.setattr(engine._Pass, "add_head", lambda self, *a: kept.append(self.head_grads) or add_head(self, *a))
    model = qwen3(tie=True)
    ids, attention, completion_mask = padded_batch()
    grads = [g.double() for g in per_sample_grads(model, ids, attention, completion_mask)]
    ours = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=group)
    reference = torch.stack([torch.stack([torch.stack([grads[group * q + i] @ grads[group * q + j]
                                                       for j in range(group)]) for i in range(group)])
                             for q in range(len(grads) // group)])
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-5)
    if head_route == "materialized":
        assert kept[-1].shape == (ids.shape[0], VOCAB, 32) and not slotted  # the last pass's (the check runs one)
    else:
        assert kept[-1] is None and slotted
