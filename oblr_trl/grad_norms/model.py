"""Where the per-sequence gradients keep what they learn about one model: a :class:`ModelPlan`, carried on the model
itself (one attribute of the ``*ForCausalLM``, as Opacus' ``GradSampleModule`` keeps its state on itself), never in a
module global. Two models, or two trainers, in one process cannot see each other's plan.

The plan holds, per model: which module takes which rule (:func:`~.coverage.coverage_plan` fills ``covered``, once
per model, again only when its trainable parameters, its modules or the rules change), what the recognisers found by
probing each module (:mod:`.rules.recognition`, :mod:`.rules.experts`, :mod:`.rules.routers`: ``memo``), which
modules are used functionally and by whom (:func:`~.coverage.functional_owners`), the head's observed transform
(:mod:`.head`) and what the coverage probe passed with (:mod:`.coverage`). What one pass's forward hands to its
backward is the pass's own (:class:`~.rules.experts.RoutedCaptures`, owned by :class:`~.engine._Pass`). Nothing here
imports a rule or a hook.

The plan also keeps the model resolved (:func:`view_of`): a :class:`ModelView` of the wrapper the trainer calls, the
``*ForCausalLM``, its backbone, head and text config, and a soft prompt's ``PeftModel``, found once and found again
only when the model's structure changes. A pass resolves the model once and hands the view to the rooms it calls.

Every remembered answer is kept under what it depends on (:func:`state_key`, built once per pass by walking the
modules: no tensor data is read): each module's identity and class, the forward it runs (an instance patch, or its
class's), its hooks (and the global ones), each parameter's identity and dtype, the config values a rule reads (soft
caps, scales), and the trainable parameters of the whole model handed in (a PEFT prompt encoder's included). When the
model's structure changes, everything found about it is forgotten (:meth:`ModelPlan.forget`); when only its
trainable set changes, the recognisers' findings and the head's transform are kept.

Below the plan: the parts of a causal LM under its wrappers (:func:`unwrap_causal_lm`, :func:`output_head`,
:func:`backbone_of`, :func:`text_config`, :func:`soft_prompt_model`), which only :func:`view_of` needs on a pass, and
the model run plainly for the checks (:func:`plain_mode`, :func:`float32_mode`, :func:`probe_batch`)."""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from .quantized import compute_dtype, packed, quantized

ATTRIBUTE = "_oblr_grad_norms_plan"


class ModelPlan:
    """One model's per-sequence-gradient state (see the module docstring). A copy or a pickle of the model gets a new,
    empty plan: a copy is another model (its modules are other objects), and planning it again is always right."""

    def __init__(self):
        # what a recogniser found, by (kind, module): a tensor rule ('rule'), a bank's layout ('bank'), a router
        # ('router')
        self.memo: dict[tuple[str, nn.Module], object] = {}
        self.owners: tuple[tuple, dict] | None = None  # (the view's key, {borrowed module: ancestor})
        # support.coverage_plan: each trainable module with its rule ([Covered]), every module none covers
        # ([Unsupported]), and what they were resolved under (the view's key, the per-row limit, switched-off rules,
        # registered rules)
        self.covered: list = []
        self.unsupported: list = []
        self.key: tuple | None = None
        self.head_transform = None  # the head's transform as observed (head_transform.check), or None
        self.probed: tuple | None = None  # the view's key (view_key) the coverage probe passed on
        self.warned_unchecked = False  # first seen sharded: warned once (coverage.check_once)
        self.probing = False  # the coverage probe's own engine pass is running: it is not probed again
        self.view: ModelView | None = None  # the model resolved (view_of), with what it was resolved under
        self.structure: tuple | None = None  # the structure (state_key) what is remembered was found on
        self.held = 0  # a check runs on copies swapped in (float32_mode): the view stands as it was
        # the last functional users ({borrowed module: ancestor}) and head transform found, kept through forget(): a
        # model whose parameters were sharded since (FSDP2, ZeRO-3: new hooks, classes or parameter objects, the same
        # modules) cannot run the forwards that find them again, and uses these (coverage.functional_owners,
        # head.transform_of)
        self.last_owners: dict | None = None
        self.last_head_transform = None
        self.ever_probed = False  # the probe passed on some state of this model (kept through forget(), as above)

    def forget(self, structure: tuple, trainable_changed: bool) -> None:
        """The model's structure or trainable set changed (:func:`state_key`): what depends on it is found again.
        A new structure forgets everything; a new trainable set only the coverage (functional users, rules chosen,
        the probe's pass): the recognisers' findings and the head's transform do not depend on it."""
        if self.structure is None:  # first resolved: what was found so far was found on this model as it is
            self.structure = structure
        elif structure != self.structure:
            self.memo, self.head_transform, self.structure = {}, None, structure
        elif not trainable_changed:
            return
        self.owners, self.key, self.probed = None, None, None

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
    ``lm``: its ``*ForCausalLM``; ``backbone``: the module under the head (:func:`~.model.backbone_of`); ``head``: the
    head the logits come from (:func:`~.model.output_head`); ``head_wrapper``: what ``get_output_embeddings`` returns
    (PEFT's ``ModulesToSaveWrapper`` around the head, or the head itself); ``config``: the text config;
    ``prompted``: the ``PeftModel`` whose active adapter is a soft prompt (:mod:`.rules.soft_prompt`), or None;
    ``trainable``: the ``*ForCausalLM``'s trainable parameter names; ``module_ids``: its modules, by identity;
    ``quantized``: whether a parameter holds quantized codes (:func:`~.quantized.quantized`); ``plan``: its
    :class:`ModelPlan`; ``key``: what it was resolved under (:func:`view_key`).

    The view is kept on the ``*ForCausalLM``'s plan, so it holds the model, its wrappers and the plan by weak
    references: strong ones would make a cycle, and a deleted model's memory would wait for the garbage collector."""

    refs: tuple  # weak references to outer, lm and prompted (None where there is none)
    backbone: nn.Module
    head: nn.Module | None
    head_wrapper: nn.Module | None
    config: object
    trainable: tuple[str, ...]
    module_ids: tuple[int, ...]
    quantized: bool
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


_CONFIG_WORDS = ("cap", "scal", "multiplier", "logit")  # config fields a rule or the head's transform reads
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(getattr(_torch_module, f"_global{name}") for name in _HOOKS)


# transformers' enable_input_require_grads hook only marks the embedding's output as requiring grad: registering it
# again changes nothing, and TRL re-enables gradient checkpointing around each generation, which registers it again
_IDEMPOTENT_HOOKS = ("make_inputs_require_grads",)


def _hook_ids(hooks: dict | None) -> tuple:
    """A hooks dict's handles, by id, but an idempotent hook's (:data:`_IDEMPOTENT_HOOKS`), which counts once."""
    if not hooks:
        return ()
    ids = [k for k, f in hooks.items()
           if getattr(getattr(f, "__code__", None), "co_name", None) not in _IDEMPOTENT_HOOKS]
    return (*ids, len(ids) < len(hooks))


def _walk(root: nn.Module, stop: nn.Module | None, structure: list, trainable: list) -> None:
    """Appends, for each module under ``root`` (not descending into ``stop``), its identity, class, the forward it
    runs, its hooks and its parameters' identities and dtypes to ``structure``, and its trainable parameters'
    identities to ``trainable``. Reads attributes only: O(modules + parameters), no tensor data."""
    stack = [root]
    pop, push, add, train = stack.pop, stack.extend, structure.extend, trainable.append
    while stack:
        m = pop()
        if m is None or m is stop:
            continue
        d = m.__dict__
        cls = type(m)
        add((id(m), cls, id(d.get("forward")), cls.forward))
        if d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_backward_hooks") \
                or d.get("_backward_pre_hooks"):  # the usual module has none: four lookups, no list
            add(tuple(_hook_ids(d.get(name)) for name in _HOOKS))
        for p in d["_parameters"].values():
            if p is not None:
                add((id(p), p.dtype))
                if p.requires_grad:
                    train(id(p))
        push(d["_modules"].values())


@functools.lru_cache(maxsize=4096)
def _read_by_rules(field: str) -> bool:
    """Whether a config field's name is one a rule or the head's transform reads (:data:`_CONFIG_WORDS`); by name
    alone, so each name is judged once."""
    lowered = field.lower()
    return any(w in lowered for w in _CONFIG_WORDS)


def _config_values(config) -> tuple:
    """The text config's numbers a rule or the head's transform reads (soft caps, scales, multipliers)."""
    if config is None:
        return ()
    return tuple((k, v) for k, v in vars(config).items()
                 if (v is None or isinstance(v, (int, float))) and _read_by_rules(k))


def state_key(outer: nn.Module, lm: nn.Module) -> tuple[tuple, tuple, tuple]:
    """What the remembered answers about a model depend on, in three parts: the ``*ForCausalLM``'s structure (its
    modules, their classes, forwards, hooks, parameters' identities and dtypes, the global hooks, the config's
    caps and scales), what lies outside it in the model handed in (a PEFT wrapper's modules: a prompt encoder), and
    the trainable parameters of the whole (by identity). Built in one walk of the modules, no tensor read."""
    structure: list = []
    outside: list = []
    trainable: list = []
    _walk(lm, None, structure, trainable)
    if outer is not lm:
        _walk(outer, lm, outside, trainable)
    structure.append(tuple(tuple(hooks) for hooks in _GLOBAL_HOOKS))
    structure.append(_config_values(text_config(lm)))
    return tuple(structure), tuple(outside), tuple(trainable)


def view_key(outer: nn.Module, lm: nn.Module, head_wrapper: nn.Module | None) -> tuple:
    """What a view is resolved under: the model's state (:func:`state_key`: modules, classes, forwards, hooks,
    parameters, config values, the trainable set), the active adapter (a soft prompt's, switched), and the head
    wrapper's active adapters and switch (PEFT's ``modules_to_save``)."""
    head_state = (getattr(head_wrapper, "active_adapters", None), getattr(head_wrapper, "disable_adapters", None))
    return (*state_key(outer, lm), getattr(outer, "active_adapter", None), head_state)


def module_names(view: "ModelView") -> dict:
    """``{module: qualified name}`` in the view's ``*ForCausalLM`` (what refusals name; walked when asked, not every
    pass, and not kept: the view holds no module strongly)."""
    return {m: n for n, m in view.lm.named_modules()}


def view_of(model) -> ModelView:
    """``model`` (a causal LM, possibly PEFT/DDP-wrapped) resolved: its :class:`ModelView`, kept on its plan and
    resolved again only when asked for through another wrapper or when :func:`view_key` changes (two lookups in
    :mod:`.model` when nothing changed). A view passed in is returned as it is: it is one pass's, handed down."""
    if isinstance(model, ModelView):
        return model
    outer = unwrap_distributed(model)
    lm = under_peft(outer)
    plan = plan_of_lm(lm)
    seen = plan.view
    if seen is not None and seen.outer is outer:
        if plan.held:  # a check's copies swapped in: the model is the one resolved
            return seen
        key = view_key(outer, lm, seen.head_wrapper)
        if seen.key == key:
            return seen
    get_head = getattr(lm, "get_output_embeddings", None)
    wrapper = get_head() if callable(get_head) else None
    key = view_key(outer, lm, wrapper)
    plan.forget(key[0], seen is None or seen.key[1:3] != key[1:3])
    prompted = soft_prompt_model(outer)
    refs = weakref.ref(outer), weakref.ref(lm), None if prompted is None else weakref.ref(prompted)
    module_ids = tuple(map(id, lm.modules()))
    plan.view = ModelView(refs, backbone_of(lm), output_head(lm), wrapper, text_config(lm), trainable_names(lm),
                          module_ids, quantized(lm), key)
    return plan.view


# ------------------------------------------------------------------------ the parts of a causal LM under its wrappers
def unwrap_distributed(model: nn.Module) -> nn.Module:
    """The model under DDP/Accelerate wrappers, as the trainer's forward calls it (a PEFT wrapper kept: its forward
    can add what the ``*ForCausalLM`` never sees, a prompt-learning adapter's virtual tokens)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module) and not hasattr(model, "get_base_model"):
        model = model.module  # DistributedDataParallel
    return model


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` module under DDP/Accelerate and PEFT wrappers."""
    return under_peft(unwrap_distributed(model))


def under_peft(outer: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a PEFT wrapper (``outer`` itself where it has none); ``outer`` is already
    unwrapped of DDP (:func:`unwrap_distributed`)."""
    return outer.get_base_model() if hasattr(outer, "get_base_model") else outer  # peft.PeftModel


def output_head(lm: nn.Module) -> nn.Module | None:
    """The LM head that computes the logits: ``get_output_embeddings()``, or, under PEFT's ``modules_to_save``
    (``ModulesToSaveWrapper``), the trainable copy its forward runs (the original stays frozen). None where the model
    has no head."""
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    copies = getattr(head, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict) and not getattr(head, "disable_adapters", False):
        active = list(getattr(head, "active_adapters", None) or [])
        if active and active[0] in copies:
            return copies[active[0]]
    return head


def text_config(lm: nn.Module):
    config = getattr(lm, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def backbone_of(lm: nn.Module) -> nn.Module:
    """The module under the head whose forward returns ``last_hidden_state``: ``base_model``, or, where that is the
    ``*ForCausalLM`` itself (Llama 4's and Mllama's text models name their prefix after a wrapper they lack), its
    decoder or ``model``."""
    base = getattr(lm, "base_model", lm)
    if base is not lm:
        return base
    for candidate in (lm.get_decoder() if hasattr(lm, "get_decoder") else None, getattr(lm, "model", None)):
        if isinstance(candidate, nn.Module) and candidate is not lm:
            return candidate
    return base


def _config(outer: nn.Module):
    configs = getattr(outer, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    return configs.get(getattr(outer, "active_adapter", None))


def soft_prompt_model(model: nn.Module) -> nn.Module | None:
    """The ``PeftModel`` (under DDP) when its active adapter is prompt tuning or P-tuning; else None."""
    outer = unwrap_distributed(model)
    config = _config(outer)
    if config is None or not getattr(config, "is_prompt_learning", False):
        return None
    return outer if str(getattr(config.peft_type, "value", config.peft_type)) in SOFT_PROMPTS else None


SOFT_PROMPTS = ("PROMPT_TUNING", "P_TUNING")


# -------------------------------------------------- the model run plainly: for discovery, observation and the probe
PROBE_BATCH, PROBE_PROMPT, PROBE_COMPLETION = 2, 4, 4


def sharded(lm: nn.Module) -> bool:
    """Parameters that are shards (FSDP2 DTensors, DeepSpeed ZeRO-3 partitions): no plain forward can run here."""
    return any(hasattr(p, "device_mesh") or hasattr(p, "ds_id") for p in lm.parameters())


def probe_batch(lm: nn.Module, batch: int = PROBE_BATCH, prompt: int = PROBE_PROMPT,
                completion: int = PROBE_COMPLETION) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``completion_mask`` of a small batch on the model's device: random token
    ids (never the pad id 0), the first row's prompt left-padded by 2, the last row's completion ending early."""
    embedding = lm.get_input_embeddings()
    if hasattr(embedding, "get_base_layer"):  # PEFT's adapter on the embedding (LoRA): the nn.Embedding it wraps
        embedding = embedding.get_base_layer()
    vocab, device = embedding.weight.shape[0], embedding.weight.device
    head = output_head(lm)
    if isinstance(head, nn.Linear):  # ids the head can score too (CPM-Ant's embedding is wider than its vocabulary)
        vocab = min(vocab, head.out_features)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(2, min(vocab, 1000)), (batch, prompt + completion), generator=g)
    attention = torch.ones_like(ids)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    ids[0, :2], attention[0, :2] = 0, 0
    completion_mask[-1, completion - 1 :] = 0
    attention[-1, -1] = 0
    return ids.to(device), attention.to(device), completion_mask.to(device)


def _accelerate_wrapped(module: nn.Module) -> bool:
    """Whether ``module``'s forward is Accelerate's mixed-precision wrapper (``prepare`` under ``bf16``/``fp16``: the
    forward run inside an autocast region, its outputs made float32), which keeps the forward it wrapped as
    ``_original_forward``."""
    forward = module.__dict__.get("forward")
    wrapped = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    return "_original_forward" in module.__dict__ and type(wrapped).__name__ == "ConvertOutputsToFp32"


@contextmanager
def plain_mode(lm: nn.Module):
    """Eval mode (no dropout, no gradient checkpointing), no autocast and full float32 matmuls (no TF32, whose 1e-3
    rounding is above the probe's 1e-4), for discovery, the head's observation and the probe; each module's own
    train/eval flag and the matmul precision are put back after (a model with some layers in eval and others in train
    keeps them so). Inside an autocast region, the region's own casts are left as they were. Accelerate's
    mixed-precision wrapper of the forward (which turns autocast on again inside) is set aside while inside, as
    Accelerate's own ``extract_model_from_parallel`` does, and put back after: the checks see the forward the trainer
    was constructed with. While inside, the model's plan keeps its view (what a check sets aside is the check's)."""
    plan = plan_of_lm(lm)
    outer = plan.view.outer if plan.view is not None else None
    modes = [(m, m.training) for m in lm.modules()]
    wrapped = [m for m in dict.fromkeys((lm, outer)) if m is not None and _accelerate_wrapped(m)]
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    device = lm.get_input_embeddings().weight.device
    plan.held += 1
    forwards = [(m, m.__dict__["forward"]) for m in wrapped]
    for m in wrapped:
        m.__dict__["forward"] = m._original_forward
    lm.eval()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    finally:
        for m, training in modes:
            m.training = training
        for m, forward in forwards:
            m.__dict__["forward"] = forward
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        plan.held -= 1


@contextmanager
def float32_mode(lm: nn.Module, dtype: torch.dtype = torch.float32):
    """The model computing in ``dtype`` (float32, or float64 for the probe's second look) while inside: each floating
    parameter and buffer in another dtype is replaced, in its module, by a copy in ``dtype`` (tied ones by one copy,
    a parameter's copy trainable as it is), and the originals are put back after. The user's tensors are never cast
    in place: their values, dtypes and autograd identity stay as they were (an in-place cast would rebuild a weight's
    autograd link, and an enclosing autocast region's cached casts of it would no longer reach it). A
    bf16/fp16/float32 value is exact in a wider type. In half precision the reference itself is too coarse to judge
    by: bf16 logits of a 49k vocabulary are spaced 0.125 apart near 20, which moves each sequence's gradient by tens
    of percent. A quantized model (weights stored 4- or 8-bit, whatever the storage dtype: :func:`~.quantized.packed`)
    keeps those weights: its floating parameters (the adapters, norms, biases) and buffers are copied upcast, and
    layers with their own compute dtype (bitsandbytes' 4-bit) compute in float32; it cannot run in float64 (the
    dequantizing kernels have no float64). While inside, the model's plan keeps its view (the copies are the check's).
    Yields whether the model runs in ``dtype``. Cost: a copy of every parameter not yet in ``dtype``, while inside."""
    wide = (torch.float32, torch.float64) if dtype == torch.float32 else (torch.float64,)
    if quantized(lm) and dtype != torch.float32:
        yield False
        return
    copies: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []

    def copy_of(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in copies:
            value = t.detach().to(dtype)
            copies[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if parameter else value
        return copies[id(t)]

    plan = plan_of_lm(lm)
    plan.held += 1
    try:
        for m in lm.modules():
            for store, parameter in ((m._parameters, True), (m._buffers, False)):
                for name, t in store.items():
                    if t is not None and not packed(t) and t.dtype not in wide:  # codes stay as stored
                        swapped.append((store, name, t))
                        store[name] = copy_of(t, parameter)
        with compute_dtype(lm, dtype):
            yield True
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t
        plan.held -= 1
