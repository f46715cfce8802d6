"""The model's plan (oblr_trl/grad_norms/model.py): each module's rule resolved once per model and carried on the model,
every per-model cache on that one object, the forward-to-backward hand-off owned by the pass. Two models in one
process never see each other's state, and nothing sits in a module global."""

import ast
import copy
import pathlib
import threading
from collections import Counter

import pytest
import torch

from oblr_trl import per_sequence_grad_inner_products, per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms import coverage, engine
from oblr_trl.grad_norms.rules import recognition, registry
from oblr_trl.grad_norms.model import plan_of, view_of
from studies.zoo import VOCAB, build
from reference import padded_batch

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "oblr_trl" / "grad_norms"
# registries filled at import, constant tables, and a capability probe of the platform (not of a model)
ALLOWED = {"GRAD_NORM_RULES", "_NAME_RULES", "UNREGISTERED_RULES", "RULE_COSTS", "CALL_RULES", "FAMILIES", "ADAPTERS", "_COMMON", "_NOT_LLAMA_NAMES",
           "_MOE", "_ATTENTION", "_OUT_DTYPE", "__all__"}
MUTABLE_CALLS = {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "dict", "list", "set", "defaultdict",
                 "deque", "Counter", "OrderedDict"}


def _module_level_mutables(source: str) -> list[str]:
    found = []
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        call = value.func if isinstance(value, ast.Call) else None
        name = getattr(call, "attr", getattr(call, "id", None))
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or \
                name in MUTABLE_CALLS:
            found += [t.id for t in targets if isinstance(t, ast.Name) and t.id not in ALLOWED]
    return found


def test_the_scan_finds_module_level_state():
    assert _module_level_mutables("import weakref\n_SEEN = weakref.WeakKeyDictionary()\n_N = [0]\nX: set = set()\n"
                                  "RTOL = 1e-4\nCALL_RULES = {}\n") == ["_SEEN", "_N", "X"]


def test_no_module_level_mutable_state_in_the_engine():
    found = {str(p.relative_to(PACKAGE)): _module_level_mutables(p.read_text())
             for p in sorted(PACKAGE.rglob("*.py"))}  # the rules' folder too
    assert {name: names for name, names in found.items() if names} == {}


def _norms(model, seed=0):
    ids, attention, completion_mask = padded_batch(VOCAB, batch=4, seed=seed)
    squared = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, temperature=0.7)
    streamed = per_sequence_grad_inner_products(model, ids, attention, completion_mask, group_size=2)
    materialized = engine.run_pass(view_of(model), ids, attention, completion_mask,
                                   covering=coverage.pass_plan, materialize=True)
    return squared, streamed, materialized.inner_products(2)


@pytest.mark.parametrize("pair", [("Qwen3-MoE", "Gemma2"), ("Qwen3-MoE", "Qwen3-MoE")],
                         ids=["two-architectures", "two-instances"])
def test_two_models_processed_alternately_give_the_norms_each_gives_alone(pair):
    """Expert banks (their routed pairs handed from the forward to the backward), routers, recognised norms and
    Gemma 2's observed soft cap: each model's state is its own, so alternating two models changes nothing."""
    first, second = pair
    alone = [_norms(build(first, seed=0)), _norms(build(second, seed=1))]
    models = [build(first, seed=0), build(second, seed=1)]
    for _ in range(2):
        for model, expected in zip(models, alone):
            for got, want in zip(_norms(model), expected):
                assert torch.equal(got, want)
    assert plan_of(models[0]) is not plan_of(models[1])
    own = [{c.module for c in plan_of(m).covered} for m in models]
    assert all(modules <= set(m.modules()) for modules, m in zip(own, models)) and not own[0] & own[1]


def test_each_module_s_rule_is_resolved_once_per_model(monkeypatch):
    """validate (its probe runs the engine too) and three passes resolve each trainable module once; its recogniser
    probe runs once; another set of trainable parameters, or of switched-off rules, resolves again (the recognisers'
    findings kept)."""
    resolved, recognised = Counter(), Counter()
    resolve, probe = coverage.resolve, recognition.recognise
    monkeypatch.setattr(coverage, "resolve", lambda module, *a: resolved.update([module]) or resolve(module, *a))
    monkeypatch.setattr(recognition, "recognise", lambda module: recognised.update([module]) or probe(module))
    model = build("Qwen3-MoE")
    assert validate(model) == []
    for _ in range(2):
        _norms(model)
    covered = [c.module for c in plan_of(model).covered]
    assert covered and resolved == Counter(covered)
    norms = [m for m in covered if type(m).__name__ == "Qwen3MoeRMSNorm"]
    assert norms and set(norms) <= set(recognised)  # recognised by what they compute (banks and routers tried too)
    assert set(recognised.values()) == {1}  # each probed once
    before = Counter(recognised)
    model.model.layers[0].mlp.requires_grad_(False)
    _norms(model)
    assert resolved == Counter(covered) + Counter(c.module for c in plan_of(model).covered)
    with registry.switched_off("expert_bank"):
        _norms(model)
    assert recognised == before


def test_switched_off_holds_in_its_own_thread_only():
    model = build("Qwen3-MoE")
    bank = model.model.layers[0].mlp.experts
    seen = {}
    entered, checked = threading.Event(), threading.Event()

    def other():
        with registry.switched_off("expert_bank"):
            seen["inside"] = coverage.how_handled(bank)
            entered.set()
            checked.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(10)
    seen["here"] = coverage.how_handled(bank)
    checked.set()
    thread.join()
    assert seen == {"inside": "per-row", "here": "routed"}


def test_a_copy_of_a_model_gets_its_own_plan():
    model = build("Qwen3-MoE")
    expected = _norms(model)
    twin = copy.deepcopy(model)
    assert plan_of(twin) is not plan_of(model) and plan_of(twin).covered == []
    for got, want in zip(_norms(twin), expected):
        assert torch.equal(got, want)
    assert {c.module for c in plan_of(twin).covered} <= set(twin.modules())
