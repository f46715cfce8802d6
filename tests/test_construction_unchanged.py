"""OBLRPOTrainer's construction on a model object changes it exactly as GRPOTrainer's does, and a refused one leaves
it bit for bit as it was (oblr_trl/construction_undo.py).

Judged by the fingerprint of every tensor, buffer and quantization state (tests/fingerprint.py), each
parameter's requires_grad and each dropout's p:
- accepted: equal to what GRPOTrainer's construction with the same args makes of a second copy of the same model
  (built the same way, or loaded again from the same folder), but for the changes named in DOCUMENTED;
- refused (the construction raises): equal to the model before the construction.
Cases: full fine-tuning, PEFT tuners from the sweep (accepted and refused: prefix tuning, LoRA on the LM head (TRL's own refusal); tied trainable_token_indices;
beta 0 and > 0; adapted by the user or by TRL from a peft_config), LoRA on GPT-OSS's expert banks, and bitsandbytes 4-bit bases (nf4/fp4, double quantization or
not, bf16 storage, a generate() first, with oblr_trl imported or before).

Before: GRPOTrainer's construction ran first, then our checks; a refusal left TRL's changes on the user's model (a
QLoRA model refused for its lost scales kept its adapters cast to bf16, a refused PEFT model with beta > 0 kept a 'ref'
adapter, a base given with a peft_config kept the injected layers)."""

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from oblr_trl import OBLRPOConfig, OBLRPOTrainer
from oblr_trl.demo.tiny import build_tokenizer
from oblr_trl.grad_norms.coverage import UnsupportedModulesError
from fingerprint import differences, fingerprint
from studies import peft_sweep
from studies.zoo import build

peft = pytest.importorskip("peft")
try:
    from bitsandbytes.functional import has_avx512bf16
except ImportError:  # no bitsandbytes: the quantized cases skip
    has_avx512bf16 = None
needs_bnb = pytest.mark.skipif(has_avx512bf16 is None, reason="needs bitsandbytes")
# bitsandbytes repacks for its CPU inference kernel (what generate() first does) only on a CPU with AVX512-BF16
repacks = pytest.mark.skipif(not (has_avx512bf16 and has_avx512bf16()), reason="needs AVX512-BF16's repacking")

TOKENIZER = build_tokenizer()
DATASET = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i % 3}"}]} for i in range(8)])
ARGS = dict(output_dir="/tmp/oblr-construction-test", per_device_train_batch_size=4, num_generations=2,
            max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
            disable_tqdm=True)
# What our construction changes beyond GRPOTrainer's, on an accepted model: bitsandbytes' CPU repacking switched off
# on each 4-bit layer (grad_norms/quantized.py: its inference kernel has no backward)
DOCUMENTED = ("support_avx512bf16_for_cpu",)


def state(model) -> dict:
    out = fingerprint(model)
    out.update({f"{n}.requires_grad": p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)})
    out.update({f"{n}.p": m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)})
    return out


def construct(cls, model, peft_config=None, **args):
    """The error the construction raised, or None."""
    config = (OBLRPOConfig if cls is OBLRPOTrainer else GRPOConfig)(**ARGS, **args)
    torch.manual_seed(2)  # the adapter a peft_config makes: the same draw in both constructions
    try:
        cls(model=model, processing_class=TOKENIZER, args=config, train_dataset=DATASET, peft_config=peft_config,
            reward_funcs=[lambda completions, **kw: [float(len(c[0]["content"])) for c in completions]])
    except Exception as error:  # noqa: BLE001 - the refusal is checked by the caller
        return error
    return None


def check(make, refused: bool, peft_config=None, **args):
    """Ours on one copy, GRPOTrainer's on another: accepted, the same but for DOCUMENTED; refused, unchanged."""
    ours, theirs = make(), make()
    before = state(ours)
    assert differences(before, state(theirs)) == []  # two copies of one model
    error = construct(OBLRPOTrainer, ours, peft_config, **args)
    if refused:
        assert isinstance(error, (UnsupportedModulesError, ValueError)), error
        assert differences(before, state(ours)) == []
        return error
    assert error is None
    assert construct(GRPOTrainer, theirs, peft_config, **args) is None
    extra = differences(state(theirs), state(ours))
    assert [k for k in extra if not k.endswith(DOCUMENTED)] == []
    return extra


def lora(family="Llama", tie=False, **kwargs):
    def make():
        torch.manual_seed(1)
        return peft.get_peft_model(build(family, tie), peft.LoraConfig(r=4, init_lora_weights=False, **kwargs))
    return make


ACCEPTED = {
    "full fine-tuning": (lambda: build("Llama", False), {}),
    "LoRA all-linear": (lora(target_modules="all-linear"), {}),
    "LoRA all-linear, beta 0.04, bf16 off": (lora(target_modules="all-linear"), dict(beta=0.04, bf16=False)),
    "IA3": (lambda: peft_sweep._adapted("IA3", "Qwen3", True), {}),
    "LoHa": (lambda: peft_sweep._adapted("LOHA", "Llama", False), dict(beta=0.04)),
    "GPT-OSS expert banks (target_parameters)": (
        lora("GPT-OSS", target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        {}),
    "LoRA with trainable_token_indices, tied embeddings": (
        lora(tie=True, target_modules=["q_proj"], trainable_token_indices=[1, 2, 3]), {}),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_an_accepted_model_is_changed_as_grpo_trainer_changes_it(name):
    make, args = ACCEPTED[name]
    assert check(make, refused=False, **args) == []


def test_a_base_with_a_peft_config_is_changed_as_grpo_trainer_changes_it():
    """TRL puts the adapter into the model object it is given: the same layers, the same draw, as GRPOTrainer's."""
    config = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)
    assert check(lambda: build("Qwen3", True), refused=False, peft_config=config) == []


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_a_refused_peft_model_is_unchanged(beta):
    """Prefix tuning: its trainable virtual tokens are refused by name; with beta > 0 GRPOTrainer had added a 'ref'
    adapter before our check refused."""
    error = check(lambda: peft_sweep._adapted("PREFIX_TUNING", "Llama", False), refused=True, beta=beta)
    assert "PrefixEncoder" in str(error) or "prompt" in str(error).lower()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_lora_on_the_lm_head_is_refused_as_grpo_trainer_refuses_it_and_the_model_is_unchanged(tie):
    """TRL's own refusal (its fused head reads lm_head.weight, so an adapter there would never train), raised by
    GRPOTrainer as by OBLRPOTrainer; the per-sequence norms themselves are exact there (tests/grad_norms/test_peft.py)."""
    error = check(lora(tie=tie, target_modules=["q_proj", "lm_head"]), refused=True)
    assert "Applying a PEFT adapter to `lm_head` is not supported" in str(error)
    assert "Applying a PEFT adapter to `lm_head` is not supported" in str(construct(
        GRPOTrainer, lora(tie=tie, target_modules=["q_proj", "lm_head"])(), None))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama checkpoint (hidden 128, tied), what a user's model folder is."""
    return peft_sweep._checkpoint("Llama", True, str(tmp_path_factory.mktemp("construction")))


def quantized(folder, generate=None, **kwargs):
    def make():
        model = peft_sweep.load_quantized(folder, **kwargs)
        if generate:
            ids, attention, _ = peft_sweep._batch()
            peft_sweep._generate(model, ids, attention, generate)
        return model
    return make


QUANTIZED = {
    "nf4": dict(),
    "fp4, double quant": dict(quant="fp4", double=True),
    "nf4, bf16 storage": dict(storage=torch.bfloat16),
}


@needs_bnb
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_a_quantized_model_is_changed_as_grpo_trainer_changes_it(folder, name):
    """GRPOTrainer casts the adapters to bf16 (QLoRA); ours does that and switches the repacking off, nothing else."""
    check(quantized(folder, **QUANTIZED[name]), refused=False)


@repacks
def test_generate_first_is_a_fresh_load_under_grpo_trainer(folder):
    """A generate() before the trainer (oblr_trl imported): bitsandbytes repacked the 4-bit weights; after our
    construction the model is what GRPOTrainer's construction makes of a fresh load, but for the switches."""
    ours, theirs = quantized(folder, generate="after import")(), quantized(folder)()
    assert construct(OBLRPOTrainer, ours) is None and construct(GRPOTrainer, theirs) is None
    assert [k for k in differences(state(theirs), state(ours)) if not k.endswith(DOCUMENTED)] == []


@repacks
@pytest.mark.parametrize("double", [False, True], ids=["sq", "dq"])
def test_a_refused_quantized_model_is_unchanged(folder, double):
    """Repacked before oblr_trl was imported: refused by name (its scales are lost); GRPOTrainer's bf16 cast of the
    adapters, done before our check, is undone."""
    error = check(quantized(folder, generate="before import", double=double), refused=True)
    assert "generate after constructing the trainer" in str(error)


@repacks
def test_a_base_refused_after_trl_applied_its_peft_config_is_unchanged(folder):
    """The user's quantized base (repacked before oblr_trl was imported) with a peft_config: TRL injects LoRA into the
    base and casts it to bf16, then our check refuses; the base comes back without the injected layers."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def make():
        base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32), dtype=torch.float32)
        ids, attention, _ = peft_sweep._batch()
        peft_sweep._generate(base.eval(), ids, attention, "before import")
        return base

    config = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)
    error = check(make, refused=True, peft_config=config)
    assert "generate after constructing the trainer" in str(error)
