"""The LM head checked by observation (oblr_trl/grad_norms/head.py): whatever a model does between its head's
output ``h W^T + b`` and the logits it returns (a soft cap under any name, a scale, a per-vocabulary offset) is found
on its own logits and computed exactly, a config field nothing reads changes nothing, and a transform no fit explains
is refused naming the head. The probe (coverage.py) holds the promise, 1e-4, and catches a head transform of that
size that the engine does not compute."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms import UnsupportedModulesError, coverage, engine, head as head_transform
from oblr_trl.grad_norms.head import HeadTransform
from oblr_trl.grad_norms.model import view_of
from studies.zoo import VOCAB, build
from reference import padded_batch, per_sample_sq_norms


def _exact(model, rtol=1e-5):
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    reference = per_sample_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    assert reference[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours.double(), reference, rtol=rtol, atol=1e-9)
    return ours.double(), reference


def _with_head_hook(model, transform):
    """The model's own logits pass through ``transform`` after its head (the engine reads the head's weight, never
    its forward, so only observation can see it)."""
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: transform(out))
    return model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_xlstm_output_logit_soft_cap_is_found_and_exact(tie):
    """Before: the engine read only final_logit_softcapping, xLSTM caps by output_logit_soft_cap (30): 2.9e-4 off."""
    model = build("xLSTM", tie)
    assert validate(model) == []
    found = head_transform.transform_of(view_of(model))
    assert found.softcap == model.config.output_logit_soft_cap == 30 and found.scale == 1
    _exact(model)


@pytest.mark.parametrize("logit_scale", [0.5, "inv_sqrt_d_model"])
def test_mpt_logit_scale_that_its_model_never_reads_changes_nothing(logit_scale):
    """Before: 0.5 was trusted (15 modules falsely refused); 'inv_sqrt_d_model' failed inside float()."""
    model = build("MPT")
    model.config.logit_scale = logit_scale
    assert validate(model) == []
    assert head_transform.transform_of(view_of(model)).scale == 1
    _exact(model)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_an_unnamed_soft_cap_with_a_scale_is_fitted(tie):
    """A cap that bites (|logits| near the cap), under no config name, after a scale of 0.8: found by the fit."""
    model = _with_head_hook(build("Llama", tie), lambda out: 0.6 * torch.tanh(0.8 * out / 0.6))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # raw logits of a few units: deep in tanh's curve
    assert validate(model) == []
    found = head_transform.transform_of(view_of(model))
    assert found.softcap == pytest.approx(0.6 / 0.8, rel=1e-6) and found.scale == pytest.approx(0.8, rel=1e-6)
    _exact(model)


def test_a_per_vocabulary_offset_is_found():
    offset = torch.linspace(-1, 1, VOCAB)
    model = _with_head_hook(build("Qwen2"), lambda out: 1.5 * out + offset)
    assert validate(model) == []
    found = head_transform.transform_of(view_of(model))
    assert found.scale == pytest.approx(1.5, rel=1e-6)
    torch.testing.assert_close(found.offset, offset / 1.5, rtol=1e-5, atol=1e-6)
    _exact(model)


def test_a_transform_no_fit_explains_is_refused_naming_the_head():
    model = _with_head_hook(build("Qwen2"), lambda out: out + 0.3 * out.roll(1, dims=-1))
    with pytest.raises(UnsupportedModulesError, match=r"'lm_head' \(Linear\): the model's own output logits differ"):
        validate(model)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    with pytest.raises(UnsupportedModulesError, match="'lm_head'"):
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask)


@pytest.mark.parametrize("size", [1e-4, -1e-4])
def test_a_head_transform_of_1e4_is_caught_by_the_head_check(size):
    """A scale of 1 + 1e-4 is found and computed (exact); a 1e-4 mix of neighbouring logits, which no scale, offset or
    cap explains, is refused naming the head (the check compares logits to 1e-5)."""
    model = _with_head_hook(build("Llama"), lambda out: (1 + size) * out)
    assert validate(model) == []
    assert head_transform.transform_of(view_of(model)).scale == pytest.approx(1 + size, rel=1e-7)
    _exact(model)
    mixed = _with_head_hook(build("Llama"), lambda out: out + size * out.roll(1, dims=-1))
    with pytest.raises(UnsupportedModulesError, match="'lm_head'.*relative 0.0001"):
        validate(mixed)


@pytest.mark.parametrize("size", [2e-4, -2e-4])
def test_the_probe_holds_the_promise_per_parameter(size, monkeypatch):
    """With the engine blind to a head scale of 1 + 2e-4 (its transform forced to the identity), every parameter's
    per-sequence gradients are 2e-4 off: refused at the promise, 1e-4 (the old 1e-3 let it pass). A scale of 1 + 1e-4
    moves them by 0.99e-4 to 1.0e-4, the edge of the promise, which is why the head is checked by observation."""
    blind = _with_head_hook(build("Llama"), lambda out: (1 + size) * out)
    monkeypatch.setattr(engine, "transform_of", lambda lm: HeadTransform())
    found = validate(blind, strict=False)
    assert found and all("differ from autograd's" in f.reason for f in found)
    assert {f.name for f in found} >= {"model.embed_tokens", "lm_head", "model.layers.0.self_attn.q_proj"}
    monkeypatch.setattr(coverage, "RTOL", 1e-3)
    assert validate(blind, strict=False) == []


def test_the_probe_checks_the_total_too(monkeypatch):
    """Errors each under the per-parameter bound (its floor, for parameters with almost no gradient) but over the
    promise in total are refused, naming the parameters that carry them."""
    model = build("Llama")
    monkeypatch.setattr(engine, "transform_of", lambda lm: HeadTransform())
    blind = _with_head_hook(model, lambda out: 1.0002 * out)
    monkeypatch.setattr(coverage, "FLOOR", 1e4)  # a floor so wide that no single parameter is refused by itself
    found = validate(blind, strict=False)
    assert found and all("differ from autograd's" in f.reason for f in found)


def test_the_check_and_the_probe_run_without_tf32_and_put_the_precision_back():
    """TF32 matmuls (on GPUs) round to about 1e-3, above the 1e-4 the probe holds: off while it runs, then back."""
    seen = []
    model = build("Llama")
    model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)))
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        assert validate(model) == []
        assert seen and set(seen) == {("highest", False)}
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_a_model_that_cannot_be_upcast_is_checked_at_half_precisions_rounding():
    """Quantized weights (here: a frozen integer parameter) keep the model in bf16 while it is checked: its logits are
    rounded to about 4e-3, so the head is held to NATIVE_HALF_TOLERANCE (as the probe to NATIVE_HALF_RTOL), and a
    scale it applies is still found."""
    model = _with_head_hook(build("Llama"), lambda out: 2.0 * out).to(torch.bfloat16)
    model.register_parameter("codes", torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False))
    assert validate(model) == []
    assert head_transform.transform_of(view_of(model)).scale == pytest.approx(2.0, rel=1e-2)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_head_whose_input_is_not_last_hidden_state_is_refused_by_name():
    """ELECTRA's generator projects the hidden states (32) to its embedding width (16) before the head: before, a bare
    'mat1 and mat2 shapes cannot be multiplied' naming only the model."""
    import transformers

    torch.manual_seed(0)
    config = transformers.ElectraConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                                        is_decoder=True)
    model = transformers.ElectraForCausalLM(config).eval()
    found = validate(model, strict=False)
    assert [(f.name, f.type) for f in found] == [("generator_lm_head", "Linear")]
    assert "its input width is 16, the backbone's last_hidden_state 32" in found[0].reason


@pytest.mark.parametrize(("cap", "scale"), [(30.0, 1.0), (5.0, 0.5)])
def test_the_fit_finds_a_cap_on_a_large_vocabulary_from_a_sample(cap, scale):
    """A 49k vocabulary (P and Q fitted on every k-th logit, the error taken on all): a cap of 30 on logits of a few
    units moves them by about 1e-3, found to float precision without a config name."""
    s = 3 * torch.randn(13, 49152, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = (scale * cap * torch.tanh(s / cap)).float()
    found, error, kind = head_transform.fit(s, y)
    assert kind == "soft cap" and error <= head_transform.TOLERANCE
    assert found.softcap == pytest.approx(cap, rel=1e-4) and found.scale == pytest.approx(scale, rel=1e-4)


def test_a_saturated_head_under_an_autocast_forward_is_observed_in_float64():
    """A forward that opens a bf16 autocast of its own (as Accelerate's mixed-precision wrapper does; the checks set
    Accelerate's aside, not one like this) gives a float32 look logits rounded to bf16. On a saturated head (a bias
    of +-1e4: logits near two values, as in a run whose every completion is eos) a soft cap fitted that rounding
    within the 1e-5 tolerance (scale 2.7, cap 3726) and the engine scaled every gradient by 0.05; the probe then
    refused every module. The head computing in bf16 inside the forward is now seen and the transform observed in
    float64, which autocast leaves alone: the identity."""
    from accelerate.utils import convert_outputs_to_fp32

    model = build("Llama")
    head = model.get_output_embeddings()
    bias = torch.full((head.out_features,), -1e4)
    bias[3] = 1e4
    head.bias = torch.nn.Parameter(bias)
    assert validate(model) == []  # construction: the forward is still the model's own
    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    found = validate(model, strict=False)
    transform = head_transform.transform_of(view_of(model))
    assert found == []
    assert transform.softcap is None and transform.offset is None and transform.scale == 1


def _fused_logprob_sq_norms(model, ids, attention, completion_mask):
    """Per-row autograd of the loss path TRL's GRPOTrainer differentiates: ``model(..., fused_lm_head=True)``'s
    completion log-probabilities (its fused head), summed, one row at a time; squared norms over trainable params."""
    params = [p for p in model.parameters() if p.requires_grad]
    c = completion_mask.shape[1]
    norms = []
    for i in range(ids.shape[0]):
        row_ids, row_mask = ids[i : i + 1], attention[i : i + 1]
        labels = row_ids.masked_fill(row_mask == 0, -100)
        labels[:, :-c] = -100
        logps = model(input_ids=row_ids, attention_mask=row_mask, labels=labels, fused_lm_head=True).log_probs
        total = (logps[:, -c:] * completion_mask[i : i + 1]).sum()
        grads = torch.autograd.grad(total, params, allow_unused=True)
        norms.append(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    return torch.tensor(norms, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_under_trls_fused_head_the_norms_are_those_of_its_loss(temperature):
    """GRPOTrainer patches a fused LM head on the model (trl's add_fused_lm_head) and its loss scores completions
    through it: where nothing sits on the head, the norms equal per-row autograd of that loss path."""
    from trl.trainer.utils import add_fused_lm_head

    model = build("Llama")
    add_fused_lm_head(model, temperature=temperature)
    assert head_transform.trl_fused_forward(model) is not None
    assert validate(model) == []
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=temperature)
    torch.testing.assert_close(ours.double(), _fused_logprob_sq_norms(model, ids, attention, completion_mask),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("change", ["hook", "patched forward", "config scale the model never reads"])
def test_under_trls_fused_head_a_head_its_loss_does_not_see_is_refused_with_the_model_unchanged(change):
    """TRL's fused head reads lm_head.weight and bias and the config's scale and cap, never the head's forward: a x2
    hook on the head, a patched head forward, or MPT's logit_scale (read by TRL, never by MPT's model) makes the model's
    own logits, which the norms follow, differ from the loss GRPO differentiates. Refused naming the head and the fix,
    the model left as it was; the fix (the hook removed, the patch deleted, the scale unset) passes."""
    from trl.trainer.utils import add_fused_lm_head

    model = build("MPT" if change.startswith("config") else "Llama")
    head = model.get_output_embeddings()
    if change == "config scale the model never reads":
        model.config.logit_scale = 0.5
    add_fused_lm_head(model)  # as GRPOTrainer does at construction: reads the config's scale and cap then
    if change == "hook":
        handle = head.register_forward_hook(lambda module, args, out: 2 * out)
    elif change == "patched forward":
        head.forward = lambda x: 2 * torch.nn.functional.linear(x, head.weight, head.bias)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModulesError, match=r"(?s)'lm_head' \(Linear\): TRL's loss scores completions through "
                                                      r"its fused LM head.*Remove it.*Freezing the head does not help") as refused:
        validate(model)
    assert [m.name for m in refused.value.modules] == ["lm_head"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    with pytest.raises(UnsupportedModulesError, match="(?s)'lm_head'.*grad_norm_estimator='length', snr_lr=False"):
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    if change == "hook":
        assert len(head._forward_hooks) == 1
        handle.remove()
    elif change == "patched forward":
        del head.forward
    else:  # the scale TRL read, undone where it reads it: a fused head built again without it
        model.config.logit_scale = None
        del model.forward
        add_fused_lm_head(model)
    assert validate(model) == []
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), _fused_logprob_sq_norms(model, ids, attention, completion_mask),
                               rtol=1e-5, atol=1e-9)
