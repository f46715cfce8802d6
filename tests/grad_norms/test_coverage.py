"""The coverage ledger (oblr_trl/grad_norms/coverage.py): a parameter reached other than through its module's forward
is either borrowed onto the exact per-row path or refused by name, never silently left out."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms import UnsupportedModulesError, coverage
from studies.zoo import VOCAB, build
from reference import padded_batch, per_sample_sq_norms


class FunctionalConv(nn.Module):
    """A Mamba-style mixer in miniature: a depthwise causal conv whose child ``conv``'s weight and bias go to
    ``F.conv1d`` directly; ``conv.forward`` never runs, so no hook on it ever fires."""

    def __init__(self, d, kernel=3):
        super().__init__()
        self.conv = nn.Conv1d(d, d, kernel, groups=d, padding=kernel - 1)
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        t = x.shape[1]
        y = F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, padding=self.conv.padding[0],
                     groups=self.conv.groups)[..., :t]
        return x * self.gain + y.transpose(1, 2)


class DoubleUse(nn.Module):
    """Calls its child (a hook sees that use) and also multiplies by the child's weight directly (none sees that)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x) + x @ self.lin.weight


class BatchCentred(nn.Module):
    """Mixes the rows of the batch (subtracts the batch mean): per-sequence gradients do not exist row by row."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) * self.gain + x


def _llama_with(make, tie=True, seed=0, vocab_size=VOCAB):
    model = build("Llama", tie, seed=seed, vocab_size=vocab_size)
    torch.manual_seed(seed + 1)
    for layer in model.model.layers:
        n = layer.mlp.up_proj.out_features
        layer.mlp.act_fn = nn.Sequential(nn.SiLU(), make(n))
        with torch.no_grad():
            for p in layer.mlp.act_fn.parameters():
                p.normal_(0, 0.5)
    return model


def _exact(model):
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_child_weight_used_functionally_is_borrowed_and_exact(tie):
    model = _llama_with(FunctionalConv, tie)
    owners = coverage.functional_owners(model)
    mixers = [layer.mlp.act_fn[1] for layer in model.model.layers]
    assert owners == {m.conv: m for m in mixers}
    assert validate(model) == []
    _exact(model)


def test_without_borrowing_the_probe_refuses_the_functional_conv_by_name(monkeypatch):
    """The probe alone (no discovery) finds the share no hook sees: conv.weight and conv.bias get no per-sequence
    gradient at all, and are named."""

    model = _llama_with(FunctionalConv)
    monkeypatch.setattr(coverage, "functional_owners", lambda model: {})
    found = validate(model, strict=False)
    assert [m.name for m in found] == [f"model.layers.{i}.mlp.act_fn.1.conv" for i in range(2)]
    assert all("weight" in m.reason and "bias" in m.reason and "projection on autograd's per-sequence gradients 0%" in m.reason
               for m in found)


def test_a_weight_used_by_its_module_and_functionally_is_refused_and_the_advice_works():
    model = _llama_with(DoubleUse)
    with pytest.raises(UnsupportedModulesError) as refused:
        validate(model)
    assert [m.name for m in refused.value.modules] == [f"model.layers.{i}.mlp.act_fn.1.lin" for i in range(2)]
    assert "requires_grad_(False)" in str(refused.value)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    with pytest.raises(UnsupportedModulesError):  # the engine itself refuses too, before computing anything
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    for layer in model.model.layers:  # the advice: freeze them
        layer.mlp.act_fn[1].lin.requires_grad_(False)
    assert validate(model) == []
    _exact(model)


def test_a_pass_that_fails_is_a_refusal_naming_every_module_by_path():
    model = _llama_with(BatchCentred)
    found = validate(model, strict=False)
    assert [(f.name, f.type) for f in found] == [(f"model.layers.{i}.mlp.act_fn.1", "BatchCentred") for i in range(2)]
    assert all("BatchCentred does not treat the sequences independently" in f.reason for f in found)


def test_the_probe_leaves_grads_and_mode_as_they_were():
    model = _llama_with(FunctionalConv).train()
    marker = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = marker[n].clone()
    assert coverage.probe(model) == []
    assert model.training
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, marker[n])


@pytest.mark.parametrize("borrow", [True, False], ids=["borrowed", "not-borrowed"])
def test_a_bf16_model_is_probed_in_float32_and_put_back_bit_for_bit(monkeypatch, borrow):
    """In bf16 the reference's own logits are too coarse (a real 49k-vocabulary model was refused everywhere before
    the upcast); the verdict must be the float32 one, and the weights must come back unchanged."""

    model = _llama_with(FunctionalConv).to(torch.bfloat16)
    if not borrow:
        monkeypatch.setattr(coverage, "functional_owners", lambda model: {})
    before = {n: t.clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    found = validate(model, strict=False)
    assert [m.name for m in found] == ([] if borrow else [f"model.layers.{i}.mlp.act_fn.1.conv" for i in range(2)])
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.dtype == before[n].dtype and torch.equal(t, before[n])


def test_the_engine_probes_once_per_set_of_trainable_parameters(monkeypatch):
    model = _llama_with(FunctionalConv)
    calls = []
    real = coverage.probe
    monkeypatch.setattr(coverage, "probe", lambda m: calls.append(1) or real(m))
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    assert len(calls) == 1
    model.model.embed_tokens.requires_grad_(False)  # another set of trainable parameters: probed again
    per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    assert len(calls) == 2


@pytest.mark.parametrize("target", [dict(use_dora=True), dict(modules_to_save=["lm_head"])], ids=["dora", "head"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_peft_dora_and_a_trained_head_copy_are_exact(target, tie):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build("Llama", tie), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, **target))
    assert validate(model) == []
    _exact(model)


# ------------------------------------------------------------------ the trainer: every parameter trained, as GRPO does
def _spread(completions, **kwargs):  # rewards that differ within a group
    return [float(sum(map(ord, c[0]["content"])) % 5) for c in completions]


@pytest.mark.parametrize("one_backward", [False, True], ids=["two_passes", "one_backward"])
@pytest.mark.parametrize("family", ["NemotronH", "functional-conv"])
def test_the_trainer_changes_every_parameter(family, one_backward):
    """TRL's own check on its subclasses (test_train: every parameter changed after training), on the family where
    conv1d stayed frozen under one_backward, and on the miniature mixer."""
    from helpers import zoo_trainer as _trainer

    from oblr_trl.demo.tiny import build_tokenizer

    vocab = len(build_tokenizer())
    model = (build(family, tie=True, vocab_size=vocab) if family != "functional-conv"
             else _llama_with(FunctionalConv, vocab_size=vocab))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _trainer(model, one_backward=one_backward, bf16=False, learning_rate=0.1, max_completion_length=6,
                       num_generations=4, per_device_train_batch_size=8, max_steps=2)
    trainer.reward_funcs = [_spread]
    trainer.train()
    assert trainer.uses_one_backward is one_backward
    assert any(h.get("oblr/lr_scale", 0) > 0 for h in trainer.state.log_history)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []


def test_a_model_first_seen_sharded_is_not_passed_silently(caplog):
    """Shards cannot run the probe's plain forward: a model first seen already sharded gets one warning naming the
    fix (validate before sharding), never a silent pass; one validated before sharding gets none."""
    import logging

    fresh, checked = _llama_with(FunctionalConv), _llama_with(FunctionalConv)
    coverage.check_once(checked)  # validated while plain
    for model in (fresh, checked):
        for p in model.parameters():
            p.ds_id = 0  # what ZeRO-3 marks a partitioned parameter with
    with caplog.at_level(logging.WARNING, logger="oblr_trl.grad_norms.coverage"):
        coverage.check_once(fresh)
        coverage.check_once(fresh)
        coverage.check_once(checked)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "LlamaForCausalLM" in warned[0] and "validate(model) before sharding" in warned[0]


def test_functional_users_found_before_sharding_stand_once_sharded(caplog):
    """Sharding changes the model's state (ZeRO-3 hooks every module, FSDP2 swaps classes and parameters), so what was
    found on it is forgotten, and shards cannot run the discovery's forward again: the functional users found before
    sharding (the same modules) stand. Before, none did, and the conv's share of each norm was left out; and the
    model, checked before sharding, was warned about as first seen sharded."""
    import logging

    model = _llama_with(FunctionalConv)
    coverage.check_once(model)
    found = coverage.functional_owners(model)
    assert found and all(isinstance(m, nn.Conv1d) for m in found)
    for module in model.modules():
        module.register_forward_pre_hook(lambda module, args: None)  # as ZeRO-3's parameter fetch
    for p in model.parameters():
        p.ds_id = 0  # what ZeRO-3 marks a partitioned parameter with
    assert coverage.functional_owners(model) == found
    with caplog.at_level(logging.WARNING, logger="oblr_trl.grad_norms.coverage"):
        coverage.check_once(model)
    assert not caplog.records


@pytest.mark.parametrize("family", ["Llama", "Mamba-2"])
def test_a_float32_miss_is_looked_at_again_in_float64(monkeypatch, family):
    """A miss that float32 rounding could explain is judged again with the model in float64 (the engine runs there,
    exact); the verdict is float64's, and every weight comes back in its dtype, bit for bit."""
    model = build(family)
    before = {n: t.clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    judged = []
    real = coverage._mismatches

    def strict_in_float32(modules, sums, rtol):
        dtype = next(modules[""].parameters()).dtype
        judged.append(dtype)
        found = real(modules, sums, rtol)
        assert found == [] or dtype == torch.float32
        if dtype == torch.float64:  # the engine's own float32 products (its head, mm32) leave about 1e-7
            assert real(modules, sums, 1e-6) == []
        return found + ([coverage.Unsupported("model.norm", "RMSNorm", "a float32 miss")] if dtype == torch.float32
                        else [])

    monkeypatch.setattr(coverage, "_mismatches", strict_in_float32)
    assert validate(model, strict=False) == []
    assert judged == [torch.float32, torch.float64]
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    assert all(after[n].dtype == t.dtype and torch.equal(after[n], t) for n, t in before.items())


class Regrouped(nn.Module):
    """Runs its child on the tokens regrouped in pairs: the child's rows are not the batch's sequences."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + self.lin(x.reshape(-1, 2, x.shape[-1])).reshape(x.shape)


def test_rows_that_cannot_be_paired_are_refused_by_the_modules_path():
    """Before: a bare NotImplementedError naming only the class (as DoRA's, at 5 sequences)."""
    model = _llama_with(Regrouped)
    found = validate(model, strict=False)
    assert [(f.name, f.type) for f in found] == [(f"model.layers.{i}.mlp.act_fn.1.lin", "Linear") for i in range(2)]
    assert all("Linear's input has leading dimension 8" in f.reason for f in found)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    with pytest.raises(UnsupportedModulesError, match=r"'model.layers.0.mlp.act_fn.1.lin' \(Linear\)"):
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask)


def test_the_probe_holds_two_gradients_at_a_time_not_four(monkeypatch):
    """Construction's peak stays under a training step's: the probe compares one sequence at a time (the engine's
    gradient and autograd's), in float64 slices, instead of holding both for every sequence (4 gradient-sized buffers
    and float64 copies of the largest parameter, which set the run's peak on a GPU with checkpointing)."""
    from studies.counting import LiveBytes
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # a head-heavy model, as real ones are: the embedding is most of the parameters
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(coverage, "PAIR_CHUNK", 1 << 14)  # a slice as small against this model as 4M is against a real one
    live = LiveBytes()
    with live:
        assert validate(model, strict=False) == []
    assert live.peak < 3 * grad_bytes, live.peak / grad_bytes
