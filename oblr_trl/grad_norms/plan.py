"""Where the per-sequence gradients keep what they learn about one model: a :class:`ModelPlan`, carried on the model
itself (one attribute of the ``*ForCausalLM``, as Opacus' ``GradSampleModule`` keeps its state on itself), never in a
module global. Two models, or two trainers, in one process cannot see each other's plan.

The plan holds, per model: which module takes which rule (:func:`~.support.coverage_plan` fills ``covered``, once
per model, again only when its trainable parameters, its modules or the rules change), what the recognisers found by
probing each module (:mod:`.recognise`, :mod:`.experts`, :mod:`.routers`: ``memo``), which modules are used
functionally and by whom (:func:`~.ledger.functional_owners`), the head's observed transform (:mod:`.head_transform`)
and what the coverage probe passed with (:mod:`.coverage`). What one pass's forward hands to its backward is the
pass's own (:class:`~.experts.RoutedCaptures`, owned by :class:`~.engine._Pass`). Nothing here imports a rule or a
hook."""

from __future__ import annotations

from torch import nn

from .lm import unwrap_causal_lm

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

    def __deepcopy__(self, memo) -> "ModelPlan":
        return ModelPlan()

    def __reduce__(self):
        return ModelPlan, ()


def plan_of(model: nn.Module) -> ModelPlan:
    """The plan carried by ``model``'s ``*ForCausalLM`` (under DDP/PEFT wrappers), made empty on first use."""
    lm = unwrap_causal_lm(model)
    plan = vars(lm).get(ATTRIBUTE)
    if plan is None:
        plan = ModelPlan()
        object.__setattr__(lm, ATTRIBUTE, plan)  # a plain attribute, not a submodule, parameter or buffer
    return plan
