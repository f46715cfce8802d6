"""Where the per-sequence gradients keep what they learn about one model: a :class:`ModelPlan`, carried on the model
itself (one attribute of the ``*ForCausalLM``, as Opacus' ``GradSampleModule`` keeps its state on itself), never in a
module global. Two models, or two trainers, in one process cannot see each other's plan.

The plan holds, per model: which module takes which rule (:func:`~.support.coverage_plan` fills ``covered``, once
per model, again only when its trainable parameters, its modules or the rules change), what the recognisers found by
probing each module (:mod:`.recognise`, :mod:`.experts`, :mod:`.routers`: ``memo``), which modules are used
functionally and by whom (:func:`~.ledger.functional_owners`), the head's observed transform (:mod:`.head_transform`)
and what the coverage probe passed with (:mod:`.coverage`). What one pass's forward hands to its backward is the
pass's own (:class:`~.experts.RoutedCaptures`, owned by :class:`~.engine._Pass`). Nothing here imports a rule or a
hook.

The plan also keeps the model resolved (:func:`view_of`): a :class:`ModelView` of the wrapper the trainer calls, the
``*ForCausalLM``, its backbone, head and text config, and a soft prompt's ``PeftModel``, found once and found again
only when the model's structure changes. A pass resolves the model once and hands the view to the rooms it calls."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import nn

from . import soft_prompt
from .lm import backbone_of, output_head, text_config, under_peft, unwrap_causal_lm, unwrap_distributed

ATTRIBUTE = "_oblr_grad_norms_plan"


class ModelPlan:
    """One model's per-sequence-gradient state (see the module docstring). A copy or a pickle of the model gets a new,
    empty plan: a copy is another model (its modules are other objects), and planning it again is always right."""

    def __init__(self):
        # what a recogniser found, by (kind, module): a tensor rule ('rule'), a bank's layout ('bank'), a router
        # ('router')
        self.memo: dict[tuple[str, nn.Module], object] = {}
        self.owners: tuple[tuple[str, ...], dict] | None = None  # (trainable names, {borrowed module: ancestor})
        # support.coverage_plan: each trainable module with its rule ([Covered]), every module none covers
        # ([Unsupported]), and what they were resolved under (trainable parameter names, the modules, the per-row
        # limit, switched-off rules, registered rules)
        self.covered: list = []
        self.unsupported: list = []
        self.key: tuple | None = None
        self.head_transform = None  # the head's transform as observed (head_transform.check), or None
        self.probed: tuple[str, ...] | None = None  # the trainable parameters the coverage probe passed with
        self.warned_unchecked = False  # first seen sharded: warned once (coverage.check_once)
        self.probing = False  # the coverage probe's own engine pass is running: it is not probed again
        self.view: ModelView | None = None  # the model resolved (view_of), with what it was resolved under

    def __deepcopy__(self, memo) -> "ModelPlan":
        return ModelPlan()

    def __reduce__(self):
        return ModelPlan, ()


def plan_of(model: nn.Module) -> ModelPlan:
    """The plan carried by ``model``'s ``*ForCausalLM`` (under DDP/PEFT wrappers), made empty on first use."""
    return plan_of_lm(unwrap_causal_lm(model))


def plan_of_lm(lm: nn.Module) -> ModelPlan:
    """The plan carried by ``lm``, a ``*ForCausalLM`` already unwrapped, made empty on first use."""
    plan = vars(lm).get(ATTRIBUTE)
    if plan is None:
        plan = ModelPlan()
        object.__setattr__(lm, ATTRIBUTE, plan)  # a plain attribute, not a submodule, parameter or buffer
    return plan


def trainable_names(lm: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in lm.named_parameters() if p.requires_grad)


@dataclass(frozen=True, eq=False)
class ModelView:
    """One model resolved (:func:`view_of`): what each room of the pass would otherwise find again from the wrapper.

    ``outer``: the model under DDP/Accelerate wrappers, as the trainer's forward calls it (a PEFT wrapper kept);
    ``lm``: its ``*ForCausalLM``; ``backbone``: the module under the head (:func:`~.lm.backbone_of`); ``head``: the
    head the logits come from (:func:`~.lm.output_head`); ``head_wrapper``: what ``get_output_embeddings`` returns
    (PEFT's ``ModulesToSaveWrapper`` around the head, or the head itself); ``config``: the text config;
    ``prompted``: the ``PeftModel`` whose active adapter is a soft prompt (:mod:`.soft_prompt`), or None;
    ``trainable``: the ``*ForCausalLM``'s trainable parameter names; ``module_ids``: its modules, by identity;
    ``plan``: its :class:`ModelPlan`; ``key``: what it was resolved under (:func:`view_key`).

    The view is kept on the ``*ForCausalLM``'s plan, so it holds the model, its wrappers and the plan by weak
    references: strong ones would make a cycle, and a deleted model's memory would wait for the garbage collector."""

    refs: tuple  # weak references to outer, lm and prompted (None where there is none)
    backbone: nn.Module
    head: nn.Module | None
    head_wrapper: nn.Module | None
    config: object
    trainable: tuple[str, ...]
    module_ids: tuple[int, ...]
    key: tuple

    @property
    def outer(self) -> nn.Module | None:
        return self.refs[0]()

    @property
    def lm(self) -> nn.Module | None:
        return self.refs[1]()

    @property
    def prompted(self) -> nn.Module | None:
        return None if self.refs[2] is None else self.refs[2]()

    @property
    def plan(self) -> ModelPlan:
        return plan_of_lm(self.lm)


def view_key(outer: nn.Module, lm: nn.Module, head_wrapper: nn.Module | None) -> tuple:
    """What a view is resolved under: the trainable parameter names, the modules (an adapter added, a layer
    replaced), the active adapter (a soft prompt's, switched), and the head wrapper's active adapters and switch
    (PEFT's ``modules_to_save``)."""
    head_state = (getattr(head_wrapper, "active_adapters", None), getattr(head_wrapper, "disable_adapters", None))
    return trainable_names(lm), tuple(map(id, lm.modules())), getattr(outer, "active_adapter", None), head_state


def view_of(model) -> ModelView:
    """``model`` (a causal LM, possibly PEFT/DDP-wrapped) resolved: its :class:`ModelView`, kept on its plan and
    resolved again only when asked for through another wrapper or when :func:`view_key` changes (two lookups in
    :mod:`.lm` when nothing changed). A view passed in is returned as it is: it is one pass's, handed down."""
    if isinstance(model, ModelView):
        return model
    outer = unwrap_distributed(model)
    lm = under_peft(outer)
    plan = plan_of_lm(lm)
    seen = plan.view
    if seen is not None and seen.outer is outer and seen.key == view_key(outer, lm, seen.head_wrapper):
        return seen
    get_head = getattr(lm, "get_output_embeddings", None)
    wrapper = get_head() if callable(get_head) else None
    key = view_key(outer, lm, wrapper)
    prompted = soft_prompt.soft_prompt_model(outer)
    refs = weakref.ref(outer), weakref.ref(lm), None if prompted is None else weakref.ref(prompted)
    plan.view = ModelView(refs, backbone_of(lm), output_head(lm), wrapper, text_config(lm), key[0], key[1], key)
    return plan.view
