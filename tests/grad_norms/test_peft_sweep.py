"""Every tuner type in PEFT's own registry (benchmarks/studies/peft_sweep.py), on tiny Llama and Qwen3, tied and
untied: exact against per-row autograd, refused by name, or not applicable with a stated reason; never silently wrong.
The committed table (benchmarks/results/peft_sweep.md, the docs' adapter table) is this sweep's output."""

import json
import os

import pytest

peft = pytest.importorskip("peft")
from studies import peft_sweep  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "peft_sweep")


@pytest.fixture(scope="module")
def results():
    return peft_sweep.sweep()


@pytest.fixture(scope="module")
def moe():
    return peft_sweep.moe_sweep()


def test_lora_on_moe_expert_banks_is_exact(moe):
    """target_parameters on the expert banks (the gpt-oss recipe) and all-linear, on Qwen3-MoE, GPT-OSS and Mixtral,
    tied and untied (before: the banks' wrappers were refused)."""
    assert list(moe) == list(peft_sweep.MOE_TARGETS)
    assert {v.status for row in moe.values() for v in row.values()} == {"exact"}, moe
    assert all(len(row) == len(peft_sweep.MOE_FAMILIES) * len(peft_sweep.TIES) for row in moe.values())


@pytest.fixture(scope="module")
def quantized():
    pytest.importorskip("bitsandbytes")
    return peft_sweep.quantized_sweep()


def test_quantized_bases_are_exact_against_a_fresh_load_or_refused_unchanged(quantized):
    """Every bitsandbytes setting, a generate() first and bf16 storage included: the model after validate is a fresh
    load's bit for bit, with exact norms; only a generation before oblr_trl was imported is refused (scales lost),
    and the refused model is left as it was (a changed one would read WRONG)."""
    from bitsandbytes.functional import has_avx512bf16

    assert list(quantized) == list(peft_sweep.QUANTIZED)
    lost = "QLoRA nf4, generate first, before import oblr_trl"
    for setting, row in quantized.items():
        expected = {"refused"} if setting == lost and has_avx512bf16() else {"exact"}
        assert {v.status for v in row.values()} == expected, (setting, row)
    assert all("Linear4bit" in v.detail for v in quantized[lost].values()) or not has_avx512bf16()


def test_every_registered_type_is_swept_on_every_model(results):
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    assert sorted(results) == sorted(str(getattr(t, "value", t)) for t in PEFT_TYPE_TO_CONFIG_MAPPING)
    assert all(len(row) == len(peft_sweep.FAMILIES) * len(peft_sweep.TIES) for row in results.values())


def test_no_case_is_silently_wrong(results):
    wrong = {(t, c): v.detail for t, row in results.items() for c, v in row.items() if v.status == "WRONG"}
    assert wrong == {}


def test_refusals_name_the_module_and_inapplicables_say_why(results):
    for row in results.values():
        for v in row.values():
            assert v.status in ("exact", "refused", "not applicable")
            assert v.status == "exact" or v.detail


def test_the_adapters_users_train_are_exact(results):
    """The methods a TRL user reaches for, and those the issue found exact, stay exact (a regression shows here)."""
    for name in ("LORA", "ADALORA", "IA3", "LOHA", "LOKR", "VERA", "OFT", "BOFT", "HRA", "FOURIERFT", "LN_TUNING",
                 "MISS", "C3A", "RANDLORA", "SHIRA", "DELORA", "PROMPT_TUNING", "P_TUNING"):
        assert {v.status for v in results[name].values()} == {"exact"}, (name, results[name])


def test_the_committed_table_is_this_sweeps(results, moe, quantized):
    """Regenerate with ``python benchmarks/peft_sweep.py`` when this fails for a new PEFT release."""
    with open(RESULTS + ".json") as f:
        committed = json.load(f)
    if committed.get("peft_version") != peft.__version__:
        pytest.skip(f"the table is of PEFT {committed.get('peft_version')}, this is {peft.__version__}: "
                    "the sweep above still checks every type")
    now = peft_sweep.to_json(results, moe, quantized)
    if [committed.get(k) for k in ("bitsandbytes_version", "avx512bf16")] != [now.get(k) for k in
                                                                            ("bitsandbytes_version", "avx512bf16")]:
        pytest.skip("the quantized table is of another bitsandbytes, or of a CPU with(out) AVX512-BF16: the sweep "
                    "above still checks every setting")
    assert committed == now
    with open(RESULTS + ".md") as f:
        assert f.read() == peft_sweep.document(results, moe, quantized)
