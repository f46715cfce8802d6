"""The LM head, in one module: its terms in vocabulary chunks (:func:`lm_head_terms`), what it computes, observed
(:func:`check`, :func:`transform_of`), and the adapters on it (:func:`adapter_of`, :class:`HeadPass`).

The LM head, handled as TRL's fused head handles it: the ``(B, T, V)`` logits are never held; the log-sum-exp and
the head's output gradient are formed in vocabulary chunks, with the model's logit scale, softcap and offset as
observed (below).

**What the head computes**, found by observation, not assumed by config name.

The engine scores completions with ``z = alpha * C * tanh(s / C)`` (or ``alpha * s`` without a cap) of the raw head
output ``s = h W^T + b`` (:func:`~.factors.head_logits`), ``h`` the backbone's ``last_hidden_state``. Models put
their own transforms between ``s`` and the logits they return: Gemma 2's ``final_logit_softcapping``, xLSTM's
``output_logit_soft_cap``, Cohere's ``logit_scale``, Granite's ``logits_scaling``, a fixed per-vocabulary offset; and
some config fields of the same names are read by nothing (MPT's ``logit_scale``). So, once per model state, on the probe
batch (:func:`~.model.probe_batch`, in float32, eval mode), the model's own output logits ``y`` are compared with
``s`` and one of these is fitted: ``y = a s``; ``y = a s + c_v`` (a per-vocabulary offset ``c``); ``y = P tanh(Q s)``
(a soft cap: before or after a scale, it is ``alpha = P Q``, ``C = 1 / Q``; a cap named by any config field with
"cap" in its name is tried first and taken where it fits, else ``P`` and ``Q`` are fitted). The simplest that
reproduces ``y`` as well as the best (:func:`fit`), within float precision (:data:`TOLERANCE`, relative, over the
positions attended to; :data:`NATIVE_HALF_TOLERANCE` for a quantized model, which runs in half precision), is what
the engine computes (where float32 does not reproduce it, or where the head computes in half precision inside the
model's own forward, float64, which no autocast region casts, is tried: a forward that opens its own autocast region,
whose bf16-rounded logits a fit could take for a transform); where none does, the model is refused naming the head
and the difference.
A scale fitted to ``1 +- 1e-6`` is taken as 1. The transform is remembered on the model's plan
(:class:`~.model.ModelPlan`) under the model's state (:func:`~.model.state_key`): a hook on the head, a head of
another class, a forward patched or a cap set in the config afterwards is observed again. Cost: one forward of the
backbone and one of the model on the probe batch, once per model state. Models whose parameters are already shards
(no plain forward) use the config's names (:func:`from_config`), which :func:`~.coverage.check_once` warns about.

**The head under a PEFT adapter**: LoRA on ``lm_head`` (tied or untied embeddings) and ``trainable_token_indices``
(trained rows of a tied head), as the head's raw output ``s`` the engine's vocabulary chunks compute.

* LoRA: ``s = h W^T + b + c (x A^T) B^T`` with ``x`` the head's input after the adapter's dropout and ``c`` its
  scaling. The head's operands are widened: ``[h, c x A^T]`` against ``[W, B]``, so the softmax delta ``d/ds`` (and
  its log-sum-exp) come from the same chunks as a plain head's. Then ``B``'s per-sequence gradient is
  ``sum_t delta_t (x) c A x_t`` (the delta against the widened columns) and ``A``'s ``sum_t c (B^T delta_t) (x) x_t``
  (``B^T delta`` is the widened columns' output gradient); the head's input gradient adds ``c (B^T delta) A`` through
  the dropout. The widened weight is a copy of the head's, held for the pass (one more head's worth of memory).
* Trainable tokens: ``s = h W'^T + b`` with ``W'`` the weight with the trained rows put in (PEFT's ``index_copy``);
  the trained rows' per-sequence gradient is ``sum_t delta_t[idx] (x) h_t``. On tied embeddings the rows are one
  parameter with the embedding's (one slot in the ledger, :func:`~.engine._slots`).

Anything else on the head (DoRA and other LoRA variants, a LoRA bias, several active adapters, the base weight
trained beside trained token rows) is refused naming the head, with advice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import factors
from .factors import Dense, Factored, SoftmaxDelta, as_operand, head_logits, mm32
from .model import ModelView, float32_mode, plain_mode, probe_batch, sharded
from .result import ADVICE, Unsupported, UnsupportedModulesError


@torch.no_grad()
def lm_head_terms(h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, weight, bias, alpha: float,
                   softcap: float | None = None, self_products: int | None = None, kept: list | None = None):
    """Log-sum-exp of the scored logits and ``d sum_t log p / d h`` of the head, in vocabulary chunks. ``h`` and
    ``weight`` in half precision (the head under autocast) are multiplied as they are, into float32 (:func:`mm32`).

    With ``self_products=k``, also the head weight's own ``(B/k, k, k)`` per-sample inner products, from the same
    chunks of the softmax delta as the output gradient (:func:`~.factors.head_self_products`), else None: the widest
    tensors of the pass are then formed twice (log-sum-exp, then delta) instead of three times. ``kept``: a list the
    per-sample gradients are appended to, chunk by chunk, where those products form them."""
    lse = torch.full(h.shape[:-1], -float("inf"), device=h.device)
    size = factors.vocab_chunk(h.shape[0] * h.shape[1], weight.shape[0])  # VOCAB_CHUNK columns at least
    chunks = [(start, min(start + size, weight.shape[0])) for start in range(0, weight.shape[0], size)]
    for start, end in chunks:
        z, _ = head_logits(h, weight[start:end], None if bias is None else bias[start:end], alpha, softcap)
        lse = torch.logaddexp(lse, torch.logsumexp(z, dim=-1))
    delta = SoftmaxDelta(h, weight, bias, alpha, lse, labels, mask, softcap)
    grad_h = torch.zeros_like(h, dtype=torch.float32)
    dtype = delta.operand_dtype
    k = self_products or 1

    def columns():
        for start, end in chunks:
            cols = as_operand(delta.cols(start, end), dtype)
            grad_h.add_(mm32(cols, as_operand(weight[start:end], dtype)))
            yield start, end, cols.reshape(h.shape[0] // k, k * h.shape[1], end - start)  # blocked by k

    if self_products is None:
        for _ in columns():
            pass
        return lse, grad_h, None
    usage = Factored(delta, Dense(h)).blocked(k)
    return lse, grad_h, factors.head_self_products(usage, k, columns(), kept)


# -------------------------------------------------------------------------------- what the head computes, observed
TOLERANCE = 1e-5  # relative (Frobenius) difference allowed between the engine's head logits and the model's own
FLOAT_FLOOR = 1e-6  # float32 logits' own rounding (3e-7 on SmolLM2's 576-wide head): fits this close are as good
FIT_SAMPLES = 1 << 16  # logits the soft cap's P and Q are fitted on (every k-th); its error is taken on all
NATIVE_HALF_TOLERANCE = 2e-2  # where the model cannot be upcast (quantized weights): half-precision logits' rounding
_CAP_NAMES = ("final_logit_softcapping", "output_logit_soft_cap", "logit_softcapping", "logits_soft_cap")


@dataclass(frozen=True, eq=False)
class HeadTransform:
    """``z = scale * C * tanh((s + offset) / C)`` (``scale * (s + offset)`` when ``softcap`` is None) of the raw head
    output ``s = h W^T + b``; ``offset`` is per vocabulary entry, in the raw logits' units, or None."""
    scale: float = 1.0
    softcap: float | None = None
    offset: torch.Tensor | None = None
    observed: bool = False

    def bias(self, head_bias: torch.Tensor | None) -> torch.Tensor | None:
        """The head's bias with the offset folded in (its gradient is the same: ``d/db = d/ds``)."""
        if self.offset is None:
            return head_bias
        offset = self.offset.to(self.offset.device if head_bias is None else head_bias.device)
        return offset if head_bias is None else head_bias.float() + offset


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def from_config(config) -> HeadTransform:
    """The transform the text config's names suggest (used only where no forward can run: sharded parameters)."""
    scale = 1.0
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if _number(getattr(config, name, None)) is not None:
            scale = _number(getattr(config, name))
            break
    else:
        if _number(getattr(config, "logits_scaling", None)):
            scale = 1.0 / _number(config.logits_scaling)
    caps = [_number(getattr(config, n, None)) for n in _CAP_NAMES]
    return HeadTransform(scale, next((c for c in caps if c), None))


def _snap(scale: float) -> float:
    """1 where the fit is 1 but for rounding (float32 logits fit a scale to about 1e-8)."""
    return 1.0 if abs(scale - 1) < 1e-6 else scale


def _relative(y: torch.Tensor, fit: torch.Tensor) -> float:
    return float((y - fit).norm() / y.norm().clamp_min(1e-300))


def _linear(s: torch.Tensor, y: torch.Tensor) -> tuple[HeadTransform, float]:
    scale = _snap(float((s * y).sum() / (s * s).sum().clamp_min(1e-300)))
    return HeadTransform(scale, observed=True), _relative(y, scale * s)


def _offset(s: torch.Tensor, y: torch.Tensor) -> tuple[HeadTransform, float]:
    """``y = a s + c_v`` over ``(N, V)`` rows: ``a`` from the column-centred values, ``c`` the columns' mean rest."""
    sc, yc = s - s.mean(0), y - y.mean(0)
    scale = float((sc * yc).sum() / (sc * sc).sum().clamp_min(1e-300))
    offset = (y - scale * s).mean(0)
    if not scale:
        return HeadTransform(observed=True), float("inf")
    return HeadTransform(scale, offset=(offset / scale).float(), observed=True), _relative(y, scale * s + offset)


def _capped(s: torch.Tensor, y: torch.Tensor, named: list[float]) -> tuple[HeadTransform, float]:
    """``y = P tanh(Q s)``: a cap the config names, where it fits (``P = a C`` fitted), else Gauss-Newton on ``(P, Q)``
    from the cubic term of ``tanh`` (``y ~ P Q s - P Q^3 s^3 / 3``)."""
    def at(cap: float) -> tuple[HeadTransform, float]:
        t = cap * torch.tanh(s / cap)
        scale = _snap(float((t * y).sum() / (t * t).sum().clamp_min(1e-300)))
        return HeadTransform(scale, cap, observed=True), _relative(y, scale * t)

    tried = [at(cap) for cap in named]
    if any(error <= TOLERANCE for _, error in tried):
        return min(tried, key=lambda found: found[1])
    step = max(1, s.numel() // FIT_SAMPLES)
    x, target = s.flatten()[::step], y.flatten()[::step]
    for p, q in _starts(x, target):
        p, q = _gauss_newton(x, target, p, q)
        if q > 0:
            tried.append(at(1 / q))
    return min(tried, key=lambda found: found[1], default=(HeadTransform(observed=True), float("inf")))


def _starts(x: torch.Tensor, y: torch.Tensor) -> list[tuple[float, float]]:
    """Starting points for ``y = P tanh(Q x)``: from the cubic term of tanh (``y ~ P Q x - P Q^3 x^3 / 3``, a cap
    barely reached), and from the largest logit (``P`` just above it, ``Q`` by least squares on ``atanh(y / P)``, a cap
    that bites)."""
    starts = []
    coef = torch.linalg.lstsq(torch.stack([x, -(x**3) / 3], 1), y[:, None]).solution.flatten()  # P Q, P Q^3
    if coef[0] * coef[1] > 0:
        q = float((coef[1] / coef[0]) ** 0.5)
        starts.append((float(coef[0]) / q, q))
    p = float(y.abs().max()) * 1.01
    u = torch.atanh(y / p)
    if p > 0 and float((x * x).sum()) > 0:
        starts.append((p, float((x * u).sum() / (x * x).sum())))
    return starts


def _gauss_newton(x: torch.Tensor, y: torch.Tensor, p: float, q: float, steps: int = 100) -> tuple[float, float]:
    """Least squares of ``y = P tanh(Q x)`` from ``(p, q)``: Gauss-Newton, each step halved until it lowers the
    residual."""
    def residual(p, q):
        return float((y - p * torch.tanh(q * x)).pow(2).sum())

    current = residual(p, q)
    for _ in range(steps):
        t = torch.tanh(q * x)
        step = torch.linalg.lstsq(torch.stack([t, p * x * (1 - t * t)], 1), (y - p * t)[:, None]).solution.flatten()
        dp, dq = float(step[0]), float(step[1])
        for _ in range(30):
            if residual(p + dp, q + dq) <= current:
                break
            dp, dq = dp / 2, dq / 2
        else:
            break
        p, q, before, current = p + dp, q + dq, current, residual(p + dp, q + dq)
        if before - current <= 1e-15 * before:
            break
    return p, q


def fit(s: torch.Tensor, y: torch.Tensor, named_caps: list[float] = ()) -> tuple[HeadTransform, float, str]:
    """Of a scale, a scale and per-vocabulary offset, and a soft cap (with a scale), the simplest that reproduces
    ``y`` (``(N, V)``, the model's logits) from ``s`` (the raw head output) as well as the best does (within twice its
    error, or :data:`FLOAT_FLOOR`; a scale that fits within it is taken without trying the others); accepted by the
    caller if within :data:`TOLERANCE`. Returns it, its relative error, and what it
    is, in words."""
    s, y = s.double(), y.double()
    tried = [("scale", *_linear(s, y))]
    if tried[0][2] <= FLOAT_FLOOR:  # a scale reproduces the logits to float32's rounding: nothing else to find
        return tried[0][1], tried[0][2], tried[0][0]
    tried += [("scale and offset", *_offset(s, y)), ("soft cap", *_capped(s, y, list(named_caps)))]
    best = min(error for _, _, error in tried)
    kind, transform, error = next(t for t in tried if t[2] <= max(2 * best, FLOAT_FLOOR))
    return transform, error, kind


def _observe(view: ModelView, tolerance: float) -> tuple[HeadTransform, list[Unsupported]]:
    """The transform fitted to the model's own logits on the probe batch, or the refusal, naming the head."""
    lm, head = view.lm, view.head
    adapter = adapter_of(head)  # the head's raw output under LoRA or trained tokens (below)
    names = {m: n for n, m in lm.named_modules()}
    name, kind = names.get(head, "lm_head"), type(head).__name__
    ids, attention, _ = probe_batch(lm)
    ran: list[torch.dtype] = []  # the dtype the head computes in inside the model's own forward
    seen = head.register_forward_hook(lambda module, args, output: ran.append(output.dtype)
                                      if torch.is_tensor(output) else None)
    try:
        with torch.no_grad():
            hidden = view.backbone(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
            ran.clear()  # the backbone alone does not run the head
            y = lm(input_ids=ids, attention_mask=attention, use_cache=False).logits
    finally:
        seen.remove()
    coarse = [d for d in ran if d.is_floating_point and torch.finfo(d).eps > torch.finfo(hidden.dtype).eps]
    if coarse and tolerance == TOLERANCE:  # asked for full precision (a quantized model's own: not judged so)
        # an autocast inside the model's forward (one it opens itself; Accelerate's is set aside): its logits rounded to
        # coarse's dtype, and a fit to them could take the rounding for a transform (logits near two values, a
        # saturated head: a soft cap absorbs it). Refused here, so that the caller observes again in float64.
        return HeadTransform(), [Unsupported(name, kind, (
            f"the model's own forward computes its head in {coarse[0]}, not {hidden.dtype} (an autocast inside its "
            "forward): its logits cannot show the head's transform"))]
    width = adapter.linear.weight.shape[-1]
    if hidden.shape[-1] != width:
        return HeadTransform(), [Unsupported(name, kind, (
            f"its input width is {width}, the backbone's last_hidden_state {hidden.shape[-1]}: the "
            "model transforms the hidden states between the backbone and the head"))]
    s = adapter.raw_output(hidden)
    if y.shape != s.shape:
        return HeadTransform(), [Unsupported(name, kind, f"the model's own logits have shape {tuple(y.shape)}, its "
                                             f"head's output h W^T + b on last_hidden_state {tuple(s.shape)}")]
    keep = attention.bool()
    config = view.config
    caps = [c for c in (_number(v) for n, v in vars(config).items() if "cap" in n.lower()) if c and c > 0]
    transform, error, what = fit(s[keep], y[keep].double(), caps)
    if error <= tolerance:
        return transform, _unlike_trl_loss(lm, ids, attention, y, name, kind, tolerance)
    return HeadTransform(), [Unsupported(name, kind, (
        f"the model's own output logits differ from what the engine would compute from its head (h W^T + b on the "
        f"backbone's last_hidden_state) by a relative {_relative(y[keep].double(), s[keep]):.2g}, and no scale, "
        f"per-vocabulary offset or soft cap explains the difference (the closest, a {what}, leaves "
        f"{error:.2g}, above {tolerance:g})"))]


TRL_TOLERANCE = 1e-4  # relative difference allowed between TRL's fused head's log-probabilities and the logits'
_UNLIKE_TRL = "TRL's loss scores completions through its fused LM head"
TRL_HEAD_ADVICE = (
    "Remove what changes the head's output but is not in TRL's loss (a forward hook: its handle's .remove(); a "
    "patched forward: del model.lm_head.forward; a config scale the model never reads: unset it before constructing "
    "the trainer), or train without exact norms: OBLRPOConfig(grad_norm_estimator='length', snr_lr=False). Freezing "
    "the head does not help: the transform is in every parameter's gradient.")


def advice(found: list[Unsupported], default: str) -> str:
    """:data:`TRL_HEAD_ADVICE` where every refusal is the head unlike TRL's loss (:func:`_unlike_trl_loss`), else
    ``default``."""
    return TRL_HEAD_ADVICE if found and all(f.reason.startswith(_UNLIKE_TRL) for f in found) else default


def trl_fused_forward(lm: nn.Module):
    """The forward TRL's ``add_fused_lm_head`` patched on ``lm`` (what GRPOTrainer's loss calls, with
    ``fused_lm_head=True``), or None. Read where the checks run (:func:`~.ledger.plain_mode` sets Accelerate's
    wrapper aside, so the forward found is the one the trainer was constructed with)."""
    forward = lm.__dict__.get("forward")
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return forward if code is not None and "fused_lm_head" in code.co_varnames else None


def _fused_temperature(forward) -> float:
    """The temperature TRL's fused head divides by (a variable of the patched forward's closure; 1 if none)."""
    function = getattr(forward, "__func__", forward)
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    value = cells["temperature"].cell_contents if "temperature" in cells else 1.0
    return float(value) if _number(value) else 1.0


def _unlike_trl_loss(lm: nn.Module, ids: torch.Tensor, attention: torch.Tensor, y: torch.Tensor, name: str,
                     kind: str, tolerance: float) -> list[Unsupported]:
    """The head refused where the model carries TRL's fused head (GRPOTrainer's loss path) and its log-probabilities
    differ from the model's own logits' (``y``, which the engine's norms follow): TRL's fused head reads the head's
    weight and bias and the config's scale and cap, and never calls the head's forward, so a hook on the head, a
    patched forward or a subclass' forward (or a config scale the model never reads) is in one and not in the other.
    Empty where they agree, or where there is no fused head (the public functions on a plain model)."""
    forward = trl_fused_forward(lm)
    if forward is None:
        return []
    labels = ids.masked_fill(attention == 0, -100)
    try:
        with torch.no_grad():
            fused = forward(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs
    except Exception:  # TRL's loss cannot score this model (trained tokens on a tied head: no lm_head.bias), so no
        return []  # step trains on it (GRPO's fails in its loss; one_backward's update is the model's own logits')
    scored = labels[:, 1:] != -100
    own = torch.log_softmax(y[:, :-1].double() / _fused_temperature(forward), -1)
    own = own.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0][scored]
    difference = _relative(own, fused[:, -scored.shape[1]:][scored].double())
    if difference <= max(TRL_TOLERANCE, tolerance):
        return []
    return [Unsupported(name, kind, (
        f"{_UNLIKE_TRL} (model(..., fused_lm_head=True)), which reads "
        f"{name}.weight and bias and the config's logit scale and soft cap and never calls the head's forward; its "
        f"log-probabilities differ from the model's own logits' by a relative {difference:.2g}: something changes "
        f"the model's logits that GRPO's loss does not see (a forward hook on the head, a patched forward, a subclass' "
        f"forward, a config scale the model never reads), so the completions are sampled from one policy and trained "
        f"as another. Remove it (a hook: its handle's .remove(); a patched forward: del model.{name}.forward)"))]


def check(view: ModelView) -> list[Unsupported]:
    """The head's transform observed (remembered for the engine, on the model's plan), or the refusal naming the head
    and the difference; empty where there is nothing to observe (no Linear head, sharded parameters). ``view``: the
    model resolved (:func:`~.model.view_of`)."""
    lm, plan = view.lm, view.plan
    if plan.head_transform is not None or refusal(view.head) or sharded(lm):
        return []
    with plain_mode(lm), float32_mode(lm) as upcast:
        transform, refused = _observe(view, TOLERANCE if upcast else NATIVE_HALF_TOLERANCE)
    if refused and upcast:  # a forward that casts float32 itself (an autocast region inside): float64 it keeps
        try:
            with plain_mode(lm), float32_mode(lm, torch.float64) as wide:
                if wide:
                    wide_transform, wide_refused = _observe(view, TOLERANCE)
                    if not wide_refused:
                        transform, refused = wide_transform, []
        except Exception:  # no float64 forward (grouped matmuls of MoE banks): float32's refusal stands
            pass
    if not refused:
        plan.head_transform = plan.last_head_transform = transform
    return refused


def transform_of(view: ModelView) -> HeadTransform:
    """What the engine's head computes for the model resolved as ``view`` (:func:`~.model.view_of`): observed once
    (:func:`check`), or, for sharded parameters, as last observed before sharding, or :func:`from_config` where it
    never was. Raises :class:`~.result.UnsupportedModulesError` naming the head where no transform reproduces the
    model's logits."""
    if view.plan.head_transform is None and sharded(view.lm):  # observed before sharding, else from the config
        return view.plan.last_head_transform or from_config(view.config)
    refused = check(view)
    if refused:
        raise UnsupportedModulesError(refused, advice=advice(refused, ADVICE))
    seen = view.plan.head_transform
    return HeadTransform() if seen is None else seen


# ----------------------------------------------------------------------------------- the head under a PEFT adapter
HEAD_ADVICE = ("exact instead: the head trained whole (modules_to_save=['lm_head']), or LoRA on it with one active "
               "adapter, no DoRA and no lora_bias")


@dataclass(eq=False)
class HeadAdapter:
    """The head as the engine computes it: ``linear`` (the ``nn.Linear`` whose weight and bias ``s`` starts from),
    and LoRA's ``(A, B, dropout, scaling)`` or the trained tokens' ``(ParameterDict, adapter name, row indices)``."""
    linear: nn.Linear
    lora: tuple | None = None
    tokens: tuple | None = None

    @property
    def plain(self) -> bool:
        return self.lora is None and self.tokens is None

    @property
    def modules(self) -> list[nn.Module]:
        """The modules that own the adapter's parameters (their slots in the ledger)."""
        if self.lora is not None:
            return [self.lora[0], self.lora[1]]
        return [self.tokens[0]] if self.tokens is not None else []

    def raw_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """``s`` in float64, without dropout (the head's observation, :mod:`.head`, runs in eval mode)."""
        weight = self.linear.weight.detach().double()
        if self.tokens is not None:
            deltas, name, idx = self.tokens
            weight = weight.index_copy(0, idx.to(weight.device), deltas[name].detach().double())
        s = hidden.double() @ weight.T
        if self.linear.bias is not None:
            s = s + self.linear.bias.detach().double()
        if self.lora is not None:
            a, b, _, scaling = self.lora
            s = s + scaling * (hidden.double() @ a.weight.detach().double().T) @ b.weight.detach().double().T
        return s


def _refused(head: nn.Module, reason: str) -> UnsupportedModulesError:
    return UnsupportedModulesError([Unsupported("lm_head", type(head).__name__, f"{reason}; {HEAD_ADVICE}")])


def _one_active(head: nn.Module, names) -> str | None:
    active = [a for a in (getattr(head, "active_adapters", None) or []) if a in names]
    if len(active) > 1:
        raise _refused(head, f"{len(active)} adapters are active on the LM head ({active}); the per-sequence pass "
                             "forms one")
    return active[0] if active else None


def _lora(head: nn.Module) -> HeadAdapter:
    base = head.get_base_layer()
    if not isinstance(base, nn.Linear):
        raise _refused(head, f"LoRA on an LM head whose base layer is a {type(base).__name__}, not an nn.Linear")
    name = None if head.disable_adapters or head.merged else _one_active(head, head.lora_A.keys())
    if name is None:  # adapters off, or merged into the base weight: the base layer is the head
        return HeadAdapter(base)
    if name in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(name):
        raise _refused(head, "a LoRA variant (such as DoRA) on the LM head; the per-sequence pass forms plain LoRA")
    a, b = head.lora_A[name], head.lora_B[name]
    if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)) or a.bias is not None or b.bias is not None:
        raise _refused(head, "LoRA on the LM head with a bias (lora_bias=True) or non-Linear factors")
    return HeadAdapter(base, lora=(a, b, head.lora_dropout[name], float(head.scaling[name])))


def _tokens(head: nn.Module, layer: nn.Module) -> HeadAdapter:
    base = layer.base_layer
    if not isinstance(base, nn.Linear):
        raise _refused(head, f"trainable tokens on an LM head whose base layer is a {type(base).__name__}, not an "
                             "nn.Linear")
    name = None if layer.disable_adapters or layer.merged else _one_active(layer, layer.trainable_tokens_delta.keys())
    if name is None:
        return HeadAdapter(base)
    if base.weight.requires_grad:
        raise _refused(head, "the head's weight is trained beside trained token rows that replace some of its rows")
    idx = torch.as_tensor(layer.token_indices[name], dtype=torch.long)
    if idx.unique().numel() != idx.numel():
        raise _refused(head, "trainable_token_indices lists a token twice")
    return HeadAdapter(base, tokens=(layer.trainable_tokens_delta, name, idx))


def adapter_of(head: nn.Module | None) -> HeadAdapter:
    """The head as the engine computes it (:class:`HeadAdapter`); raises :class:`~.result.UnsupportedModulesError`
    naming the head where it is none of an ``nn.Linear``, LoRA on one, or trainable tokens on one."""
    if isinstance(head, nn.Linear):
        return HeadAdapter(head)
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    except ImportError:  # pragma: no cover - PEFT not installed: no PEFT head either
        LoraLayer = TrainableTokensLayer = ()
    if isinstance(head, LoraLayer):
        return _lora(head)
    layer = getattr(head, "token_adapter", head)  # PEFT's TrainableTokensWrapper, or the layer itself
    if isinstance(layer, TrainableTokensLayer):
        return _tokens(head, layer)
    raise _refused(head, "the LM head must be an nn.Linear (or one under PEFT's LoRA or trainable tokens)")


def refusal(head: nn.Module | None) -> list[Unsupported]:
    """:func:`adapter_of`'s refusal as entries (empty where the head is supported)."""
    try:
        adapter_of(head)
    except UnsupportedModulesError as error:
        return list(error.modules)
    return []


class HeadPass:
    """One pass's head under its adapter: the widened operands, the input gradient through the adapter, and the
    adapter's usages. ``read(param)``: the parameter as a plain tensor (gathered under ZeRO-3 or FSDP2)."""

    def __init__(self, adapter: HeadAdapter, read):
        self.adapter, self.read = adapter, read
        self.h = None  # the head's input rows, as the base weight's usage needs them
        self.x_in = self.x = self.u = self.a = None
        self.grad_u = None

    def operands(self, h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor):
        """``(h, W)`` widened for the adapter (``rows``: the head's input rows, with their graph cut)."""
        self.h = h
        adapter = self.adapter
        if adapter.tokens is not None:
            deltas, name, idx = adapter.tokens
            rows_in = self.read(deltas[name]).to(weight.dtype)
            return h, weight.index_copy(0, idx.to(weight.device), rows_in)
        if adapter.lora is None:
            return h, weight
        a, b, dropout, scaling = adapter.lora
        self.a = self.read(a.weight).float()
        self.x_in = rows.detach().float().requires_grad_(True)
        with torch.enable_grad():
            self.x = dropout(self.x_in)
        self.u = scaling * (self.x.detach() @ self.a.T)
        b_weight = self.read(b.weight).to(weight.dtype)
        return torch.cat([h, self.u.to(h.dtype)], -1), torch.cat([weight, b_weight], -1)

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The head's input gradient from the widened operands' ``grad``."""
        if self.adapter.lora is None:
            return grad
        width = self.h.shape[-1]
        scaling = self.adapter.lora[3]
        self.grad_u = grad[..., width:]
        through = torch.autograd.grad(self.x, self.x_in, scaling * self.grad_u @ self.a)[0]
        self.x_in = None
        return grad[..., :width] + through

    def usages(self, delta) -> list[tuple[nn.Module, str, Factored]]:
        """The adapter's ``(module, parameter name, usage)`` (``delta``: the head's softmax delta on the widened
        operands)."""
        adapter, found = self.adapter, []
        if adapter.lora is not None:
            a, b, _, scaling = adapter.lora
            if b.weight.requires_grad:
                found.append((b, "weight", Factored(delta, Dense(self.u))))
            if a.weight.requires_grad:
                found.append((a, "weight", Factored(Dense(scaling * self.grad_u), Dense(self.x.detach()))))
        elif adapter.tokens is not None:
            deltas, name, idx = adapter.tokens
            if deltas[name].requires_grad:
                idx = idx.to(self.h.device)
                cols = delta.gather_cols(idx.expand(self.h.shape[0], -1))
                found.append((deltas, name, Factored(Dense(cols), Dense(self.h))))
        return found
