"""What the per-sequence pass remembers about a model (oblr_trl/grad_norms/plan.py: the view, the coverage plan,
functional users, the recognisers' findings, the head's transform, the probe's verdict) never outlives the model it
was found on. Each change a user or a callback can make is made before the first pass and after one, and the norms
are judged against per-row autograd on the model as it is then: exact, or refused by name. The checks themselves
leave the model as it was: no dtype flipped in place (an enclosing autocast region keeps working), each module's own
train/eval flag kept."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from oblr_trl.grad_norms import UnsupportedModulesError, per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms.model import float32_mode, plan_of
from reference import padded_batch, per_sample_grads, per_sample_sq_norms

VOCAB = 97
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
WHEN = ["before", "after"]  # the change made before the first pass, or between two passes


def llama(seed=0, **overrides):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides})).float().train()


def batch():
    return padded_batch(VOCAB)


def norms(model):
    return per_sequence_grad_sq_norms(model, *batch())


def assert_exact(model, rtol=1e-5):
    ours, reference = norms(model).double(), per_sample_sq_norms(model, *batch())
    torch.testing.assert_close(ours, reference, rtol=rtol, atol=1e-9)


def changed(model, when, change):
    """``model`` after ``change``, made before its first pass or between two."""
    if when == "after":
        norms(model)
    change(model)
    return model


def only(model, *parts):
    model.requires_grad_(False)
    for name, module in model.named_modules():
        if any(name.endswith(p) for p in parts):
            module.requires_grad_(True)
    return model


# ---------------------------------------------------------------- bf16 autocast: the checks never flip a dtype in place
def test_a_check_inside_autocast_leaves_the_regions_casts_reaching_the_weights():
    """Pure torch: an in-place dtype flip (``w.data = w.data.double()`` and back) rebuilds the weight's autograd
    link, and the autocast region's cached bf16 cast no longer reaches it (``autograd.grad`` returns None). The
    checks' float64 and float32 looks run on copies: inside the region, every weight still gets its gradient, equal
    to the gradient in a fresh region."""
    model = llama()
    ids, attention, _ = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=attention).logits.float().sum()  # the region caches the weights' casts
        with float32_mode(model, torch.float64) as wide:
            assert wide and model.lm_head.weight.dtype == torch.float64
        params = [p for p in model.parameters() if p.requires_grad]
        inside = torch.autograd.grad(model(input_ids=ids, attention_mask=attention).logits.float().sum(), params,
                                     allow_unused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = torch.autograd.grad(model(input_ids=ids, attention_mask=attention).logits.float().sum(), params)
    assert all(g is not None for g in inside)
    for got, expected in zip(inside, fresh):
        torch.testing.assert_close(got, expected)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def float64_look(monkeypatch):
    """The probe's float32 look made to miss, so that it looks again with the model in float64 (what a real miss,
    a parameter whose float32 rounding is near the promise, leads to)."""
    from oblr_trl.grad_norms import coverage
    from oblr_trl.grad_norms.coverage import Unsupported

    real = coverage._probe

    def probe(view, rtol):
        if next(view.lm.parameters()).dtype == torch.float32:
            return [Unsupported("model.layers.0.mlp.up_proj", "Linear", "a float32 miss")]
        return real(view, rtol)

    monkeypatch.setattr(coverage, "_probe", probe)


@pytest.mark.parametrize("when", WHEN)
def test_a_trainable_set_that_grows_inside_bf16_autocast(when, monkeypatch):
    """TRL's default bf16=True (float32 weights, bf16 autocast): layer 0's attention unfrozen inside the autocast
    region the passes run in; the re-check looks at the model in float64. The norms then equal per-row autograd's,
    run in a fresh region (bf16 rounding apart), and inside the region every weight keeps its dtype and gradient."""
    float64_look(monkeypatch)
    model = only(llama(), "mlp")
    ids, attention, _ = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=attention).logits.float().sum().backward()  # GRPO's pass: casts cached
        if when == "after":
            norms(model)
        model.model.layers[0].self_attn.requires_grad_(True)
        model(input_ids=ids, attention_mask=attention).logits.float().sum().backward()  # the new ones' casts too
        got = norms(model).double()
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(model(input_ids=ids, attention_mask=attention).logits.float().sum(), params,
                                    allow_unused=True)
    assert all(g is not None for g in grads)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = per_sample_sq_norms(model, *batch())
    torch.testing.assert_close(got, reference, rtol=3e-2, atol=1e-6)


@pytest.mark.parametrize("when", WHEN)
def test_a_bf16_model_whose_trainable_set_grows_inside_autocast(when):
    """A bf16-stored model (the re-check judges a float32 copy): the norms equal per-row autograd's, and every weight
    keeps its dtype."""
    model = only(llama().to(torch.bfloat16), "mlp")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if when == "after":
            norms(model)
        model.model.layers[0].self_attn.requires_grad_(True)
        got = norms(model).double()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = per_sample_sq_norms(model, *batch())
    torch.testing.assert_close(got, reference, rtol=3e-2, atol=1e-6)


# ---------------------------------------------------------------- each module's train/eval flag is its own
class ModeScale(nn.Module):
    """Halves its input in eval mode (a module whose result depends on its own mode, as BatchNorm's does)."""

    def forward(self, x):
        return x if self.training else 0.5 * x


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("eval_layer", [True, False], ids=["one-layer-in-eval", "one-layer-in-train"])
def test_each_modules_mode_is_kept_and_the_norms_are_its_models(when, eval_layer):
    model = llama()
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.Sequential(layer.mlp.act_fn, ModeScale())
    if not eval_layer:
        model.eval()

    def change(m):
        m.model.layers[0].train(not eval_layer)

    model = changed(model, when, change)
    modes = {name: m.training for name, m in model.named_modules()}
    assert_exact(model)
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_validate_keeps_each_modules_mode():
    model = llama()
    model.model.layers[1].eval()
    modes = {name: m.training for name, m in model.named_modules()}
    validate(model)
    assert {name: m.training for name, m in model.named_modules()} == modes


# ---------------------------------------------------------------- the head's transform, observed on the model as it is
class DoublingLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def _head_hook(model):
    model.lm_head.register_forward_hook(lambda module, args, output: 2 * output)


def _doubling_head(model):
    head = DoublingLinear(CONFIG["hidden_size"], VOCAB, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("change", [_head_hook, _doubling_head], ids=["hook", "subclass"])
def test_a_head_that_doubles_its_logits(when, change):
    assert_exact(changed(llama(), when, change))


@pytest.mark.parametrize("when", WHEN)
def test_a_head_hook_under_lora(when):
    import peft

    model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model = changed(model, when, lambda m: m.get_base_model().lm_head.register_forward_hook(
        lambda module, args, output: 2 * output))
    assert_exact(model)


@pytest.mark.parametrize("when", WHEN)
def test_gemma2s_soft_cap_set_after_construction(when):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(**CONFIG, final_logit_softcapping=None, attn_logit_softcapping=None)
    model = Gemma2ForCausalLM(config).float().train()
    model = changed(model, when, lambda m: setattr(m.config, "final_logit_softcapping", 3.0))
    assert_exact(model)


# ---------------------------------------------------------------- the probe's verdict, for the model it judged
def _down_hook(model):
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, output: 2 * output)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("trainable", ["mlp", "all"])
def test_a_hook_on_a_layer_is_refused_by_name(when, trainable):
    model = llama() if trainable == "all" else only(llama(), "mlp")
    model = changed(model, when, _down_hook)
    with pytest.raises(UnsupportedModulesError, match=r"model\.layers\.1\.mlp\.down_proj"):
        norms(model)
    with pytest.raises(UnsupportedModulesError, match=r"model\.layers\.1\.mlp\.down_proj"):  # and again, every pass
        norms(model)


@pytest.mark.parametrize("when", WHEN)
def test_a_global_forward_hook_on_a_layer_is_refused_by_name(when):
    handles = []

    def change(model):
        down = model.model.layers[1].mlp.down_proj
        handles.append(nn.modules.module.register_module_forward_hook(
            lambda module, args, output: 2 * output if module is down else None))

    try:
        model = changed(only(llama(), "mlp"), when, change)
        with pytest.raises(UnsupportedModulesError, match=r"model\.layers\.1\.mlp\.down_proj"):
            norms(model)
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------- functional use, found on the forward as it is
def _functional_mlp(model):
    mlp = model.model.layers[1].mlp

    def forward(x, mlp=mlp):
        return F.linear(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight)

    mlp.forward = forward


class FunctionalMLP(nn.Module):
    """Llama's MLP that applies its down projection's weight itself (the projection's forward never runs)."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x):
        return F.linear(self.act_fn(self.gate_proj(x)) * self.up_proj(x), self.down_proj.weight)


def _custom_class(model):
    model.model.layers[1].mlp = FunctionalMLP(model.model.layers[1].mlp)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("change", [_functional_mlp, _custom_class], ids=["forward-patched", "class-swapped"])
def test_a_weight_used_functionally_after_a_change(when, change):
    assert_exact(changed(only(llama(), "mlp"), when, change))


def test_a_custom_mlp_swapped_in_and_back():
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = only(llama(), "mlp")
    original = model.model.layers[1].mlp
    norms(model)
    _custom_class(model)
    assert_exact(model)
    back = LlamaMLP(model.config)
    back.load_state_dict(original.state_dict())
    model.model.layers[1].mlp = back
    assert_exact(model)


# ---------------------------------------------------------------- the recognisers' findings, per forward
@pytest.mark.parametrize("when", WHEN)
def test_a_norm_patched_to_a_centred_norm(when):
    def change(model):
        norm = model.model.layers[0].input_layernorm

        def forward(x, norm=norm):
            return norm.weight * F.layer_norm(x, x.shape[-1:], eps=norm.variance_epsilon)

        norm.forward = forward

    model = changed(llama(), when, change)
    try:
        assert_exact(model)
    except UnsupportedModulesError as error:  # or refused naming the patched norm
        assert "model.layers.0.input_layernorm" in str(error)


# ---------------------------------------------------------------- trainable parameters outside the *ForCausalLM
def _prompt(kind, base):
    import peft

    if kind == "prompt":
        config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    else:
        config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    return peft.get_peft_model(base, config)


def test_prefix_tuning_after_prompt_tuning_on_the_same_base_is_refused():
    base = llama()
    prompted = _prompt("prompt", base)
    assert_exact(prompted)
    prefixed = _prompt("prefix", prompted.get_base_model())
    with pytest.raises(UnsupportedModulesError, match="prefix tuning"):
        norms(prefixed)


def test_prefix_tuning_after_validating_the_frozen_base_is_refused():
    base = llama().requires_grad_(False)
    validate(base)
    prefixed = _prompt("prefix", base)
    with pytest.raises(UnsupportedModulesError, match="prefix tuning"):
        norms(prefixed)


# ---------------------------------------------------------------- grad mode
@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_are_refused_every_call(when, mode):
    model = llama()
    if when == "after":
        norms(model)
    context, advice = ((torch.no_grad, torch.enable_grad) if mode == "no_grad" else
                       (torch.inference_mode, lambda: torch.inference_mode(False)))
    with context():
        for _ in range(2):
            with pytest.raises(RuntimeError, match=mode):
                norms(model)
        with advice():  # the advice works
            ours = norms(model).double()
    torch.testing.assert_close(ours, per_sample_sq_norms(model, *batch()), rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------- the checks change nothing, and the key is cheap
def test_a_pass_leaves_every_parameter_as_it_was():
    model = llama().to(torch.bfloat16)
    params = {n: (p, p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms(model)
    assert {n: (p, p.dtype, p.data_ptr()) for n, p in model.named_parameters()} == params


def test_an_unchanged_model_is_checked_once():
    model = llama()
    norms(model)
    probed = plan_of(model).probed
    model.model.layers[0].requires_grad_(False)
    model.model.layers[0].requires_grad_(True)  # the same trainable set again
    norms(model)
    assert plan_of(model).probed is probed


def test_rows_match_per_row_autograd_after_many_changes():
    """Changes one after another on one model, each judged on the model as it then is."""
    model = only(llama(), "mlp")
    assert_exact(model)
    model.model.layers[0].self_attn.requires_grad_(True)
    assert_exact(model)
    _head_hook(model)
    assert_exact(model)
    _functional_mlp(model)
    assert_exact(model)
    rows = per_sample_grads(model, *batch())
    assert len(rows) == batch()[0].shape[0]
