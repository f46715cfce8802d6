"""Quantized bases under PEFT (oblr_trl/grad_norms/quantized.py, coverage.py): QLoRA exact against per-row autograd
whatever bitsandbytes' CPU kernel did to the weights before, the probe at the promised tolerance on them, and a
model whose backward goes through an operator without a backward formula refused by name, with advice that works.

Before: on a CPU with AVX512-BF16, one eval-mode forward without gradients (generation, evaluation, the probe's own
discovery) repacked the 4-bit weights for bitsandbytes' inference kernel, which has no backward; every later gradient
through those layers was wrong, autograd's too, so the probe compared wrong with wrong and passed (norms 2-6x too
small on a 2-layer Llama)."""

import copy
import logging

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms import coverage, keep_differentiable
from oblr_trl.grad_norms.model import view_of
from oblr_trl.grad_norms.quantized import Restored, backward_gaps
from oblr_trl.grad_norms.coverage import Unsupported, UnsupportedModulesError
from fingerprint import differences, fingerprint
from reference import padded_batch, per_sample_sq_norms

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
from bitsandbytes.functional import has_avx512bf16  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama checkpoint (hidden 64, 2 layers): what a user's model folder is."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def qlora(path, quant="nf4", double=False, compute=torch.float32, bits=4, storage=torch.uint8):
    if bits == 4:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double,
                                    bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=storage)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=compute)
    torch.manual_seed(0)  # LoRA's A: the same draw in every copy
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA's B starts at 0: give every adapter a gradient path through the base layers
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


def reference_norms(path, ids, attention, completion_mask, **kwargs):
    """Per-row autograd on a copy whose 4-bit layers never took the inference kernel (repacking switched off before
    its first forward), with no operator lacking a backward on the way (checked)."""
    model = qlora(path, **kwargs)
    keep_differentiable(model)
    with backward_gaps() as gaps:
        norms = per_sample_sq_norms(model, ids, attention, completion_mask)
    assert gaps == []
    return norms


CASES = [dict(quant=q, double=d, compute=c) for q in ("nf4", "fp4") for d in (False, True)
         for c in (torch.float32, torch.bfloat16)]


def tolerance(kwargs):
    return 1e-5 if kwargs["compute"] == torch.float32 else 2e-2  # bf16 compute: two runs' own rounding


IDS = lambda k: f"{k['quant']}-{'dq' if k['double'] else 'sq'}-{str(k['compute']).split('.')[-1]}"  # noqa: E731


@pytest.mark.parametrize("kwargs", CASES, ids=IDS)
def test_qlora_is_exact(saved, kwargs):
    """The model as loaded, as OBLRPOTrainer sees it at construction (nothing has run it yet)."""
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(qlora(saved, **kwargs), ids, attention, completion_mask).double()
    expected = reference_norms(saved, ids, attention, completion_mask, **kwargs)
    assert expected[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours, expected, rtol=tolerance(kwargs), atol=1e-9)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Tiny Llama checkpoints (hidden 128, 2 layers: layers wider than bitsandbytes' 64-value blocks, where a block
    scale out of order shows), tied and untied embeddings, by ``tie``."""
    paths = {}
    for tie in (True, False):
        torch.manual_seed(0)
        paths[tie] = tmp_path_factory.mktemp(f"llama-128-{'tied' if tie else 'untied'}")
        LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                     tie_word_embeddings=tie)).save_pretrained(paths[tie])
    return paths


def fresh(path, **kwargs):
    """The reference: a fresh load of the same checkpoint, which no CPU repacking will ever touch."""
    model = qlora(path, **kwargs)
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def generate(model, ids, attention):
    """What a user does before training: look at a few answers (under no_grad, in eval mode)."""
    with torch.no_grad():
        model.generate(input_ids=ids[3:], attention_mask=attention[3:], max_new_tokens=3, do_sample=False,
                       pad_token_id=0)


def repacked(model) -> bool:
    return any(getattr(m.weight.quant_state, "packing_format_for_cpu", False)
               for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))


def assert_the_model_as_loaded(model, reference, ids, attention, completion_mask, rtol):
    """Bit for bit the reference (every tensor, buffer and quantization state field), the same logits, and norms
    that are per-row autograd's on the reference."""
    assert differences(fingerprint(reference), fingerprint(model)) == []
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=attention).logits,
                                   reference(input_ids=ids, attention_mask=attention).logits, rtol=0, atol=0)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask).double()
    with backward_gaps() as gaps:
        expected = per_sample_sq_norms(reference, ids, attention, completion_mask)
    assert gaps == [] and expected[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours, expected, rtol=rtol, atol=1e-9)


GENERATE_FIRST = [dict(quant=q, double=d, tie=t) for q in ("nf4", "fp4") for d in (False, True) for t in (True, False)]
GENERATE_FIRST += [dict(quant="nf4", double=d, tie=True, compute=torch.bfloat16) for d in (False, True)]
GENERATE_FIRST += [dict(quant="nf4", double=d, tie=True, storage=torch.bfloat16) for d in (False, True)]


@pytest.mark.parametrize("kwargs", GENERATE_FIRST, ids=lambda k: "-".join(
    [k["quant"], "dq" if k["double"] else "sq", "tied" if k["tie"] else "untied"]
    + [f"{key}-{str(v).split('.')[-1]}" for key, v in k.items() if key in ("compute", "storage")]))
def test_qlora_after_a_generation_is_exact_against_a_fresh_load(wide, kwargs):
    """A generate() before the trainer: bitsandbytes repacks the 4-bit weights for its CPU kernel; validate (so the
    trainer's construction) undoes it exactly, and the model is a fresh load's bit for bit. Before, bitsandbytes'
    inverse left the block scales out of order (single quantization: logits 5-43% off a fresh load, norms 5-37%) or
    re-quantized from bf16 (double: 0.1%), and validate passed."""
    kwargs = dict(kwargs)
    path = wide[kwargs.pop("tie")]
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    model = qlora(path, **kwargs)
    generate(model, ids, attention)
    assert repacked(model) == has_avx512bf16()
    assert validate(model) == []
    assert not repacked(model)
    rtol = 1e-5 if kwargs.get("compute", torch.float32) == torch.float32 else 2e-2
    assert_the_model_as_loaded(model, fresh(path, **kwargs), ids, attention, completion_mask, rtol)


@pytest.mark.skipif(not has_avx512bf16(), reason="bitsandbytes' CPU inference kernel needs AVX512-BF16")
@pytest.mark.parametrize("double", [False, True], ids=["sq", "dq"])
def test_a_generation_before_oblr_trl_was_imported_is_refused_and_changes_nothing(wide, monkeypatch, double):
    """Repacked by bitsandbytes as it is before oblr_trl is imported (nothing recorded): the scales are lost, so
    validate refuses, naming the layers, and leaves the model bit for bit as it was; the advice (reload, construct the
    trainer, then generate) gives a model that is exact against a fresh load."""
    import bitsandbytes.nn.modules as bnb_modules

    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    model = qlora(wide[False], double=double)
    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu",
                        bnb_modules._convert_weight_packed_for_cpu.__wrapped__)
    generate(model, ids, attention)
    monkeypatch.undo()
    before = fingerprint(model)
    with pytest.raises(UnsupportedModulesError) as refused:
        validate(model)
    assert "q_proj.base_layer" in str(refused.value) and "generate after constructing the trainer" in str(refused.value)
    with pytest.raises(ValueError, match="Reload the model"):
        keep_differentiable(model)
    assert differences(before, fingerprint(model)) == []
    model = qlora(wide[False], double=double)  # the advice: reload, construct (validate), then generate
    assert validate(model) == []
    generate(model, ids, attention)
    assert not repacked(model)
    assert_the_model_as_loaded(model, fresh(wide[False], double=double), ids, attention, completion_mask, 1e-5)


@pytest.mark.skipif(not has_avx512bf16(), reason="bitsandbytes' CPU inference kernel needs AVX512-BF16")
def test_a_refusal_after_the_undoing_repacks_again_bit_for_bit(wide, monkeypatch):
    """validate undoes the repacking before its checks; where a check then refuses, the model goes back to exactly
    what it was (repacked, the switches on)."""
    ids, attention, _ = padded_batch(VOCAB, batch=4)
    model = qlora(wide[True])
    generate(model, ids, attention)
    before = fingerprint(model)
    monkeypatch.setattr(coverage, "probe", lambda model: [Unsupported("lm_head", "Linear", "refused for the test")])
    assert validate(model, strict=False)[0].reason == "refused for the test"
    assert repacked(model) and differences(before, fingerprint(model)) == []


@pytest.mark.parametrize("double", [False, True], ids=["sq", "dq"])
def test_bf16_storage_is_exact_and_never_cast(wide, double):
    """FSDP-QLoRA's storage (bnb_4bit_quant_storage=torch.bfloat16): the codes in a bf16 tensor are recognised as
    packed, so the probe's float32 upcast leaves them alone. Before, the head check cast them to float32 and back
    (logits moved 10-14%), then refused the model with a bare reshape error."""
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    model = qlora(wide[True], double=double, storage=torch.bfloat16)
    before = fingerprint(model)
    assert validate(model) == []
    switches = [k for k in differences(before, fingerprint(model)) if not k.endswith("support_avx512bf16_for_cpu")]
    assert switches == []  # nothing but the repacking switches changed (documented: switched off)
    reference = fresh(wide[True], double=double, storage=torch.bfloat16)
    assert_the_model_as_loaded(model, reference, ids, attention, completion_mask, 1e-5)
    with torch.no_grad():  # and the same model as a uint8-stored load
        torch.testing.assert_close(model(input_ids=ids).logits, fresh(wide[True], double=double)(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_lora_on_an_8bit_base_is_exact(saved):
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    model = qlora(saved, bits=8)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask).double()
    torch.testing.assert_close(ours, per_sample_sq_norms(model, ids, attention, completion_mask), rtol=1e-5,
                               atol=1e-9)


def test_the_probe_checks_a_quantized_base_at_the_promised_tolerance(saved, monkeypatch):
    """bf16 compute, bf16 adapters: the probe upcasts what floats and computes the 4-bit layers in float32, so it
    judges at 1e-4, not at the half-precision bound it used to apply to any quantized model."""
    model = qlora(saved, compute=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert torch.bfloat16 in dtypes.values()  # the norms, the embedding: what made the probe fall back before
    seen = []
    real = coverage._mismatches
    monkeypatch.setattr(coverage, "_mismatches", lambda modules, found, rtol: seen.append(rtol) or real(
        modules, found, rtol))
    assert validate(model) == []
    assert seen == [coverage.RTOL]
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes  # put back


@pytest.mark.skipif(not has_avx512bf16(), reason="bitsandbytes' CPU inference kernel needs AVX512-BF16")
def test_a_backward_without_a_formula_is_refused_by_name_and_the_advice_works(saved, monkeypatch):
    """The class of hole: autograd itself wrong, so a probe against autograd passes. With the repair switched off,
    validate refuses, naming the operator; the advice it gives (keep_differentiable) then makes it pass."""
    ids, attention, _ = padded_batch(VOCAB, batch=4)
    model = qlora(saved)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attention)
    monkeypatch.setattr(coverage, "restore", lambda lm: Restored())
    found = validate(model, strict=False)
    assert len(found) == 1 and "bitsandbytes::gemv_4bit" in found[0].reason
    assert "keep_differentiable" in found[0].reason
    assert keep_differentiable(model)  # the layers it undid
    monkeypatch.undo()
    assert validate(model) == []


def test_undoing_the_repacking_warns_once_naming_the_layers(saved, caplog):
    ids, attention, _ = padded_batch(VOCAB, batch=4)
    model = qlora(saved)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attention)
    with caplog.at_level(logging.WARNING, logger="oblr_trl.grad_norms.quantized"):
        undone = keep_differentiable(model)
        assert keep_differentiable(model) == []  # switched off: nothing repacks again
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attention)
        assert keep_differentiable(model) == []
    assert len(caplog.records) == (1 if undone else 0)
    if has_avx512bf16():
        assert undone and undone[0] in caplog.records[0].getMessage()


@pytest.mark.parametrize("fmt", ["torchao-int8", "quanto-int8", "quanto-int4"])
def test_other_quantized_bases_under_lora_are_exact(fmt, tmp_path):
    """Quantization formats beyond bitsandbytes that run on a CPU, through transformers' own loading: exact, or
    (were they not) refused by the probe; never silently wrong."""
    import transformers

    if fmt.startswith("torchao"):
        pytest.importorskip("torchao")
        from torchao.quantization import Int8WeightOnlyConfig

        config = transformers.TorchAoConfig(Int8WeightOnlyConfig())
    else:
        pytest.importorskip("optimum.quanto")
        config = transformers.QuantoConfig(weights=fmt.split("-")[1])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
                     ).save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.float32,
                                                device_map="cpu")
    torch.manual_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0,
                                                      init_lora_weights="gaussian")).eval()
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    expected = per_sample_sq_norms(model, ids, attention, completion_mask)
    assert validate(model) == []
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask).double()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-9)


def test_a_quantized_model_that_cannot_run_in_float32_is_judged_as_it_computes_with_a_warning(saved, monkeypatch,
                                                                                             caplog):
    """The one exception to 1e-4: a forward that fails with the floats upcast (a kernel without float32) is probed
    as it computes, within NATIVE_HALF_RTOL, and says so."""
    model = qlora(saved, compute=torch.bfloat16)
    real, rtols = coverage._probe, []

    def failing_upcast(view, rtol):
        rtols.append(rtol)
        if len(rtols) == 1:  # the float32 look: its pass fails
            return [coverage.Unsupported("", "LlamaForCausalLM", "the per-sequence gradient pass fails on it: "
                                         "RuntimeError: no float32 kernel")]
        return real(view, rtol)

    monkeypatch.setattr(coverage, "_probe", failing_upcast)
    with caplog.at_level(logging.WARNING, logger="oblr_trl.grad_norms.coverage"):
        assert validate(model) == []
    assert rtols == [coverage.RTOL, coverage.NATIVE_HALF_RTOL]
    assert view_of(model).quantized  # what the probe asks of the model resolved: its packed 4-bit weights
    assert any("cannot be checked in float32" in r.getMessage() for r in caplog.records)


def test_prepare_model_for_kbit_training_defaults_are_exact(saved):
    """PEFT's QLoRA preparation turns reentrant checkpointing on by default (transformers' and TRL's default is
    non-reentrant); the pass runs those layers under its own checkpoint (grad_norms/hooks.py) and gives
    per-row autograd's norms, taken on a fresh copy without checkpointing. (Before, refused.)"""
    import copy

    base = AutoModelForCausalLM.from_pretrained(saved, quantization_config=BitsAndBytesConfig(load_in_4bit=True),
                                                dtype=torch.float32)
    base = peft.prepare_model_for_kbit_training(base)  # its defaults: reentrant checkpointing
    torch.manual_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0,
                                                      init_lora_weights="gaussian")).train()
    from oblr_trl.grad_norms.hooks import runs_reentrant

    assert runs_reentrant(model)
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4)
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask).double()
    fresh = copy.deepcopy(model)
    fresh.base_model.model.gradient_checkpointing_disable()
    expected = per_sample_sq_norms(fresh, ids, attention, completion_mask)
    assert expected[[0, 1, 3]].min() > 0
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-9)
    assert runs_reentrant(model)  # the model's own setting, kept

