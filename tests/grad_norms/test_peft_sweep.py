"""Every tuner type in PEFT's own registry (oblr_trl/grad_norms/peft_sweep.py), on tiny Llama and Qwen3, tied and
untied: exact against per-row autograd, refused by name, or not applicable with a stated reason; never silently wrong.
The committed table (benchmarks/results/peft_sweep.md, the docs' adapter table) is this sweep's output."""

import json
import os

import pytest

peft = pytest.importorskip("peft")
from oblr_trl.grad_norms import peft_sweep  # noqa: E402

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


def test_the_committed_table_is_this_sweeps(results, moe):
    """Regenerate with ``python -m oblr_trl.grad_norms.peft_sweep`` when this fails for a new PEFT release."""
    with open(RESULTS + ".json") as f:
        committed = json.load(f)
    if committed.get("peft_version") != peft.__version__:
        pytest.skip(f"the table is of PEFT {committed.get('peft_version')}, this is {peft.__version__}: "
                    "the sweep above still checks every type")
    assert committed == peft_sweep.to_json(results, moe)
    with open(RESULTS + ".md") as f:
        assert f.read() == peft_sweep.document(results, moe)
