"""The capture hooks leave nothing behind: after a pass, and once its result is dropped, no tensor of its graph is
alive. The output-gradient hooks sit on the graph's nodes and close over the capture's state, which held tensors of
the same graph: a cycle through C++ autograd nodes that Python's garbage collector cannot collect. Every pass's graph
and factors then stayed alive, and a training run's memory grew with every step (``make demo`` peaked at ~21 GB)."""

import gc

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from oblr_trl import per_sequence_grad_sq_norms
from oblr_trl.grad_norms import per_sequence_grads
import reference
from reference import B, D, T, hidden, randomised

VOCAB = 40


def graph_tensors() -> int:
    """Live tensors that belong to an autograd graph (they keep its nodes, and the nodes their saved tensors)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and o.grad_fn is not None)


def llama(checkpointing: bool):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("kwargs", [{}, {"materialize": True}, {"stream_group_size": 3}],
                         ids=["factored", "materialized", "streamed"])
def test_a_pass_leaves_no_graph_alive(checkpointing, kwargs):
    model = llama(checkpointing)
    ids, attention, completion_mask = reference.padded_batch(VOCAB)
    before = graph_tensors()
    for _ in range(3):
        grads = per_sequence_grads(model, ids, attention, completion_mask, **kwargs)
        grads.inner_products(kwargs.get("stream_group_size", 1))
        del grads
    assert graph_tensors() == before


def mixtral():
    """Expert banks (their routed forward keeps each routed pair's factors) and routers."""
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0)).train()


def gpt2():
    """Conv1D layers, learned positions shared by the rows (expanded per row), LayerNorms."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)).train()


@pytest.mark.parametrize("build", [lambda: llama(False), mixtral, gpt2], ids=["llama", "mixtral", "gpt2"])
def test_norms_leave_no_graph_alive(build):
    model = build()
    ids, attention, completion_mask = reference.padded_batch(VOCAB)
    before = graph_tensors()
    per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    assert graph_tensors() == before


def test_the_backward_targets_one_input_per_chain_of_checkpointed_layers():
    """Under checkpointing a layer whose input is the previous checkpointed layer's output is reached through that
    layer's input: only the first is a target. The backward returns its targets' gradients at its end, one per layer
    (with one_backward's replay, which keeps the graph, they came on top of every layer's checkpointed input: 1.40x
    GRPO's peak bytes at 28 layers, 64 x 512, counted)."""
    from oblr_trl.grad_norms.hooks import capture, checkpointed_layers

    model = llama(True)
    layers = checkpointed_layers(model.model)
    ids, attention, _ = reference.padded_batch(VOCAB)
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    with capture(linears, ids.shape[0], None, layers) as (_, targets):
        model.model(input_ids=ids, attention_mask=attention)
        assert len(layers) == 2 and len(targets) == 1


def test_lowest_edges_keeps_the_targets_no_other_target_is_reached_through():
    """A target with another below it in the graph is dropped: the backward to the lower one runs every node on the
    way, the dropped one's included. Targets on separate branches, and leaf tensors, are kept."""
    from torch.autograd.graph import get_gradient_edge as edge

    from oblr_trl.grad_norms.hooks import lowest_edges

    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    a = x * 2
    b = a.exp()
    c = b + a  # a diamond: a reaches c directly and through b
    d = y.sin()
    targets = [edge(c), edge(b), edge(a), edge(d), edge(a)]
    assert lowest_edges(targets) == [edge(a), edge(d)]  # once each
    assert lowest_edges([edge(c), x]) == [x]
    assert lowest_edges([edge(c), edge(d)]) == [edge(c), edge(d)]
    assert lowest_edges([edge(b), edge(b)]) == [edge(b)]

    seen = []
    for name, t in dict(a=a, b=b, c=c).items():
        t.register_hook(lambda g, name=name: seen.append(name))
    torch.autograd.grad((c * d).sum(), lowest_edges([edge(c), edge(b), edge(a), edge(d)]))
    assert sorted(seen) == ["a", "b", "c"]  # every dropped target's node ran


@pytest.mark.parametrize("build", [lambda: llama(False), mixtral, lambda: gpt2_without_dropout()],
                         ids=["llama", "mixtral", "gpt2"])
def test_the_backward_holds_one_gradient_per_lowest_target(build, monkeypatch):
    """The backward is taken to the lowest of the hooked inputs only (the embeddings' outputs here): it no longer
    holds one gradient per hooked layer's input to its end, and every layer's output gradient still arrives (the
    norms are autograd's, row by row)."""
    from oblr_trl.grad_norms import hooks

    kept = []
    lowest = hooks.lowest_edges
    monkeypatch.setattr(hooks, "lowest_edges", lambda targets: kept.append((len(targets), len(lowest(targets))))
                        or lowest(targets))
    model = build()
    ids, attention, completion_mask = reference.padded_batch(VOCAB)
    got = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    embeddings = sum(isinstance(m, nn.Embedding) for m in model.modules())
    assert kept[-1][0] > 4 * embeddings and kept[-1][1] == embeddings
    expected = reference.per_sample_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-4, atol=0)


def test_a_replayed_backward_records_nothing_and_frees_the_graph(monkeypatch):
    """one_backward's replayed update runs a second backward of the pass's graph, whose output-gradient hooks are
    still on its nodes: once the capture is closed they record nothing (else every module's output gradient would be
    held again), and the graph goes with the update."""
    from oblr_trl.grad_norms import hooks
    from oblr_trl.one_backward import replayed_update

    states = []
    init = hooks._Capture.__init__
    monkeypatch.setattr(hooks._Capture, "__init__", lambda self, *a: init(self, *a) or states.append(self))
    model = llama(True)
    ids, attention, completion_mask = reference.padded_batch(VOCAB)
    before = graph_tensors()
    grads = per_sequence_grads(model, ids, attention, completion_mask, stream_group_size=3, keep_graph=True)
    records = states[-1].records
    held = [r.output_grad is not None for r in records]
    assert held.count(False) >= 14  # the layers' 7 linear maps each, streamed: consumed in the backward
    replayed_update(grads, torch.ones(ids.shape[0]), torch.zeros(ids.shape[0], dtype=torch.bool))
    assert [r.output_grad is not None for r in records] == held
    assert all(p.grad is not None for p in model.parameters())
    del grads
    assert graph_tensors() == before


def test_half_autocast_layer_inputs_are_held_as_the_matmul_cast_them(monkeypatch):
    """Under half-precision autocast on a device whose products take half-precision operands (CUDA; here the CPU, by
    the device list), a linear layer's float32 input is held to the backward as autocast cast it for the matmul, once
    for the layers that read it, and the backward's targets are gradient edges: the float32 inputs (LayerNorm outputs,
    PEFT's float32 copies of bf16 inputs for LoRA) are freed as GRPO's backward frees them. The norms are the same,
    bit for bit (the backward's autocast_operands made the same cast), and less is live when the backward starts."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oblr_trl.grad_norms import engine, factors, hooks

    from studies.counting import LiveBytes

    monkeypatch.setattr(factors, "HALF_OPERAND_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, vocab_size=500, num_hidden_layers=2, pad_token_id=0)
    model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=8, target_modules="all-linear"))
    ids = torch.randint(1, 500, (4, 136))
    batch = (ids, torch.ones_like(ids), torch.ones(4, 128, dtype=torch.long))
    per_sequence_grad_sq_norms(model, *batch)  # the probe and the plan, outside the counts

    def run():
        live, at_backward = LiveBytes(), []
        backward = engine._backward_to_hooks
        with monkeypatch.context() as m:
            m.setattr(engine, "_backward_to_hooks", lambda *a, **k: at_backward.append(live.live) or backward(*a, **k))
            with torch.autocast("cpu", dtype=torch.bfloat16), live:
                norms = per_sequence_grad_sq_norms(model, *batch)
        gc.collect()
        return norms, at_backward[-1]

    cast_sources = {}  # the float32 inputs cast, by storage: half their bytes is saved, less the one the cast cache holds
    cast_once = factors.cast_once
    def counted(t, *args):
        if t.dtype == torch.float32:
            cast_sources.setdefault(t.data_ptr(), t.nbytes)
        return cast_once(t, *args)

    monkeypatch.setattr(factors, "cast_once", counted)
    norms, held = run()
    monkeypatch.setattr(factors, "cast_once", cast_once)
    monkeypatch.setattr(hooks._Capture, "held_input", lambda self, module, x, output: x.detach())  # the float32 input
    float32_norms, float32_held = run()
    assert torch.equal(norms, float32_norms)
    assert len(cast_sources) >= 4  # per layer: the q/k/v input, o's, gate/up's, down's (a freed one's address reused)
    saved = 0.4 * sum(cast_sources.values()) - max(cast_sources.values())
    assert float32_held - held >= saved > 0, (float32_held, held, cast_sources)


def gpt2_without_dropout():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()


@pytest.mark.parametrize("build", [lambda: llama(False), lambda: llama(True), gpt2_without_dropout],
                         ids=["llama", "llama-checkpointed", "gpt2"])
def test_the_pass_forms_no_parameter_gradient(build):
    """The backward stops at the hooked outputs of the modules whose input carries no gradient (the token and
    position embeddings) instead of going on to their weights: no parameter's gradient is formed, not even the
    embedding's dense ``(V, d)`` one, and the norms are still autograd's, row by row. (A hook on a parameter changes
    no module's state key: the pass after it runs as the one before.)"""
    model = build()
    ids, attention, completion_mask = reference.padded_batch(VOCAB)
    per_sequence_grad_sq_norms(model, ids, attention, completion_mask)  # the first checks the model: autograd's own
    formed = []
    handles = [p.register_hook(lambda g, name=name: formed.append(name)) for name, p in model.named_parameters()]
    got = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    for handle in handles:
        handle.remove()
    assert formed == []
    expected = reference.per_sample_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-4, atol=0)


# ----------------------------------------------------------------------------- the rows: per sequence, or refused
def test_an_input_shared_by_the_batch_is_expanded_per_row():
    """GPT-Neo's position embedding runs on (1, T) ids: each row's gradient comes from its own output gradient."""
    emb = randomised(nn.Embedding(20, D))
    shared = torch.arange(T)[None]

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.wpe = emb

        def forward(self, x):
            return x + self.wpe(shared)

    from oblr_trl.grad_norms import hooks

    x = hidden()
    r = torch.randn(B, T, D)
    model = Positions()
    with hooks.capture([emb], B) as (records, _):
        (model(x) * r).sum().backward(inputs=[emb.weight])
    (record,) = records
    assert record.activation.shape == (B, T) and record.output_grad.shape == (B, T, D)
    torch.testing.assert_close(record.output_grad, r)  # per row, not summed over the batch


def test_a_leading_dimension_that_is_not_the_batch_is_refused_by_name():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x.reshape(-1, 3, D))  # B*T = 20 rows regrouped by 3: no per-sequence layout

    from oblr_trl.grad_norms import hooks

    model = Odd()
    x = torch.randn(3, 4, D)  # a batch of 3 sequences of 4 tokens regrouped as 4 rows of 3: 4 is no multiple of 3
    with pytest.raises(hooks.RowsError, match="Linear's input has leading dimension 4") as refused:
        with hooks.capture([model.lin], 3) as _:
            model(x).sum().backward()
    assert refused.value.module is model.lin
    with hooks.capture([model.lin], 3) as (records, _):  # no gradient reaches it (as DoRA's detached weight norm):
        model(x).detach()  # no refusal, nothing recorded
    assert records == []


def test_a_sequence_first_layout_is_refused_not_mistaken_for_flattened_tokens():
    """(T, B, d) with T a multiple of B must not be reshaped to (B, T/B*..., d): that would pair the wrong tokens."""
    from oblr_trl.grad_norms import hooks

    lin = nn.Linear(D, D)
    with pytest.raises(hooks.RowsError, match="Linear's input has leading dimension 8"):
        with hooks.capture([lin], 4) as _:
            lin(torch.randn(8, 4, D)).sum().backward()  # sequence-first: 8 tokens of a batch of 4
