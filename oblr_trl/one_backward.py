"""The machinery of ``one_backward``: norms, advantages and the policy update from one forward and one backward.

No trainer state: the trainer calls these with what it holds, and they return what they found.

* :class:`Plan`: whether it runs, and in chunks of how many rows (decided at construction or the first generation).
* :func:`loss_and_grads`: one micro-batch's norms, advantages, gradient and SNR terms, chunk by chunk.

* :func:`blockers`: why a configuration cannot use it (then the two-pass path runs, and says why).
* :func:`whole_group_micro_batches`: TRL's shuffled micro-batches re-split so each holds whole groups.
* :func:`all_reduce_grads`: what DDP's backward hooks would have done, once per optimizer step.
* :func:`kept_bytes`, :func:`checkpointed_bytes`, :func:`chunk_budget`, :func:`chunk_rows`: under gradient
  checkpointing, chunks of whole groups whose kept memory (estimated before it runs) is at most what GRPO's
  checkpointed loss pass holds for the micro-batch, plus a tenth of a lower bound on GRPO's peak memory (the margin
  the memory goal allows).
"""

from __future__ import annotations

import torch
from trl.trainer.utils import split_tensor_dict

from .estimators import mask_nonfinite_products
from .grad_norms import per_sequence_grads
from .loss_terms import terms_beyond_ratio_one
from .trl_seam import sequence_inputs

ALL_REDUCE_BUCKET = 1 << 25  # elements per all-reduce (DDP's default bucket is 25 MiB)


def blockers(args, *, fsdp1: bool = False, aux_loss: bool = False, deepspeed: bool = False) -> list[str]:
    """Why ``one_backward`` cannot be used with ``args`` (an ``OBLRPOConfig``); empty: it can.

    ``one_backward`` forms the gradient of the policy term at ratio 1 only, so anything else TRL's loss would add
    (a KL term, an entropy bonus, an MoE router's auxiliary loss, token masks, importance weights) blocks it.
    """
    a, reasons = args, list(terms_beyond_ratio_one(args).values())
    if a.gradient_accumulation_steps % a.steps_per_generation:
        reasons.append(
            f"steps_per_generation={a.steps_per_generation} does not divide gradient_accumulation_steps="
            f"{a.gradient_accumulation_steps} (a generation's later micro-batches would be off-policy)"
        )
    elif a.steps_per_generation > 1 and a.per_device_train_batch_size % a.num_generations:
        reasons.append(
            f"per_device_train_batch_size={a.per_device_train_batch_size} is not a multiple of num_generations="
            f"{a.num_generations} with steps_per_generation={a.steps_per_generation} (each micro-batch must hold "
            "whole groups: a group's baseline needs all its norms)"
        )
    if a.use_vllm and getattr(a, "vllm_importance_sampling_correction", False):
        reasons.append("vllm_importance_sampling_correction=True (per-token importance weights)")
    if a.use_liger_kernel:
        reasons.append("use_liger_kernel=True (Liger computes the loss)")
    if a.fp16:
        reasons.append("fp16=True (the loss scaler would unscale gradients it never scaled; use bf16)")
    if aux_loss:
        reasons.append("the model's router auxiliary loss (router_aux_loss_coef != 0)")
    if fsdp1:
        reasons.append("FSDP1 (use FSDP2: fsdp_version 2)")
    if deepspeed:
        reasons.append("DeepSpeed (ZeRO owns the gradient buffers and reduces them in its backward hooks; "
                       "one_backward writes .grad outside autograd, which ZeRO would never see)")
    return reasons


def initial_choice(
    requested: bool | None, reasons: list[str], device_type: str, gradient_checkpointing: bool
) -> tuple[bool | None, str]:
    """``one_backward``'s path at construction, and why: ``True``, ``False``, or ``None`` (the automatic choice under
    gradient checkpointing on a CPU, decided at the first generation by :func:`chunk_rows`: whether one group's kept
    memory fits :func:`chunk_budget`).

    ``requested``: ``OBLRPOConfig.one_backward``; ``reasons``: :func:`blockers`. The automatic choice follows the
    measurements (``benchmarks/README.md``): faster on a CPU, no faster and heavier on a GPU.
    """
    if reasons:
        why = "; ".join(reasons)
        if requested:
            return False, f"one_backward=True falls back to two passes (norms pass, then the loss pass): {why}."
        return False, f"OBLR-PO takes the two-pass path (norms pass, then the loss pass): {why}."
    if requested is None and device_type != "cpu":
        return False, (
            f"OBLR-PO takes the two-pass path on {device_type} (one_backward=None): on a GPU one_backward was measured "
            "no faster and, under gradient checkpointing, 2-3.5x GRPO's memory (benchmarks/README.md); set "
            "one_backward=True to use it."
        )
    if requested or not gradient_checkpointing:
        return True, "OBLR-PO takes norms and update from one forward/backward (one_backward)."
    return None, ""


def whole_group_micro_batches(micro_batches: list[dict], group_size: int) -> list[dict]:
    """TRL's (shuffled) micro-batches of one generation batch, re-split so that each holds whole groups.

    Groups go in the order of their first row in TRL's shuffle (as random, and no random numbers drawn), each group's
    rows in row order. Rows are identified by ``oblr_row`` (consecutive within a group).
    """
    merged = {}
    for key, first in micro_batches[0].items():
        parts = [mb[key] for mb in micro_batches]
        if isinstance(first, list):
            merged[key] = [x for part in parts for x in part]
        elif torch.is_tensor(first) and first.dim() > 0:
            merged[key] = torch.cat(parts)
        else:  # None, or a scalar every micro-batch shares (num_items_in_batch)
            merged[key] = first
    index = merged["oblr_row"] - merged["oblr_row"].min()
    n, group = index.shape[0], index // group_size
    first = torch.full((n // group_size,), n, device=index.device)
    first.scatter_reduce_(0, group, torch.arange(n, device=index.device), "amin")
    rows = torch.argsort(first[group] * n + index)
    for key, value in merged.items():
        if torch.is_tensor(value) and value.dim() > 0:
            merged[key] = value[rows]
        elif isinstance(value, list):
            merged[key] = [value[i] for i in rows.tolist()]
    return split_tensor_dict(merged, len(micro_batches))


def all_reduce_grads(parameters, bucket_elements: int = ALL_REDUCE_BUCKET) -> None:
    """Sum the trainable parameters' ``.grad`` over ranks, in buckets, in the same order on every rank."""
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:  # e.g. a rank whose batch never reached a parameter: it still takes part
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:  # consecutive parameters of one gradient dtype, up to bucket_elements each
        if not buckets or size + p.numel() > bucket_elements or p.grad.dtype != buckets[-1][0].grad.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        torch.distributed.all_reduce(flat)
        for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(part.view_as(p))


def kept_bytes(model: torch.nn.Module, rows: int, tokens: int, itemsize: int) -> int:
    """What ``one_backward`` keeps until the update: per layer with trainable weights, the smaller of its input and
    output gradient (``rows * tokens * (n_in + n_out)``) and its per-sample gradients (``rows * n_in * n_out``).

    An upper bound for the layers' kept factors (an input several layers share is counted for each); embeddings keep
    their token ids only and count 0; the LM head keeps its input (``rows * tokens * n_in``): its output gradient is
    formed again in vocabulary chunks, never held (:mod:`.grad_norms.engine`). ``itemsize``: the activations' bytes
    per element (2 under bf16 autocast, 4 in fp32).
    """
    head = output_head(model)
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or not weight.requires_grad or weight.dim() != 2:
            continue
        if isinstance(module, torch.nn.Embedding):
            continue
        n_out, n_in = weight.shape  # nn.Linear's layout (GPT-2's Conv1D is the transpose: the same sum)
        if module is head:
            total += rows * tokens * n_in
            continue
        total += rows * min(tokens * (n_in + n_out), n_in * n_out)
    return total * itemsize


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head (``get_output_embeddings()``), or None where it has none."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


def checkpointed_bytes(model: torch.nn.Module, rows: int, tokens: int, completion_tokens: int, itemsize: int) -> int:
    """What a loss pass under gradient checkpointing (GRPO's) holds for a micro-batch of ``rows x tokens``: each
    checkpointed layer's input (``rows * tokens * hidden``, ``itemsize`` bytes) and the float32 logits of the
    completion tokens (``rows * completion_tokens * vocab``). A model without checkpointed layers counts its hidden
    states once. An estimate of the same kind as :func:`kept_bytes`, for the budget of :func:`chunk_budget`."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    vocab, hidden = model.get_input_embeddings().weight.shape
    head = output_head(model)
    if getattr(head, "weight", None) is not None:
        vocab = head.weight.shape[0]
    layers = max(1, sum(isinstance(m, GradientCheckpointingLayer) for m in model.modules()))
    return rows * (tokens * layers * hidden * itemsize + completion_tokens * vocab * 4)


def training_state_bytes(model: torch.nn.Module) -> int:
    """The model's weights, and for each trainable weight its gradient and Adam's two moments: what a training
    process holds whatever the batch."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size() * (4 if p.requires_grad else 1)
    return total


def process_peak_bytes(device: torch.device) -> int:
    """The most memory this process has held so far where the activations live: the accelerator's peak allocation,
    or the peak RSS on a CPU (0 where unknown). At the first generation it counts the weights and generation."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type == "cpu":
        try:
            import resource
            import sys

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
        except (ImportError, OSError):
            return 0
    return 0


def chunk_budget(model: torch.nn.Module, rows: int, tokens: int, completion_tokens: int, itemsize: int,
                 process_peak: int = 0) -> int:
    """What ``one_backward`` may keep per chunk under gradient checkpointing: what the checkpointed loss pass holds
    for the micro-batch, plus the margin the memory goal allows (peak memory at most 1.1x GRPO's under the same
    checkpointing setting): a tenth of a lower bound on GRPO's peak, the larger of that pass plus the training state
    (:func:`training_state_bytes`) and the process's peak so far (``process_peak``, :func:`process_peak_bytes`: a
    GRPO step generates too)."""
    held = checkpointed_bytes(model, rows, tokens, completion_tokens, itemsize)
    return held + max(held + training_state_bytes(model), process_peak) // 10


def chunk_rows(rows: int, group_size: int, kept_per_row: int, budget: int) -> int:
    """Rows per chunk of ``one_backward``'s micro-batch so that what a chunk keeps (``kept_per_row`` each) is at most
    ``budget``: ``rows`` where all fit; else whole groups of ``group_size``, as few chunks as fit and of equal size as
    far as they divide; ``0`` where not even one group fits or the rows are not whole groups (a group spans ranks)."""
    if rows * kept_per_row <= budget:
        return rows
    if rows % group_size or group_size * kept_per_row > budget:
        return 0
    groups, fit = rows // group_size, budget // (group_size * kept_per_row)
    chunks = -(-groups // fit)
    return -(-groups // chunks) * group_size


class Plan:
    """Whether ``one_backward`` runs, and in chunks of how many rows (0: the whole micro-batch).

    Set at construction from :func:`initial_choice`; under gradient checkpointing the chunks (and, for the automatic
    choice, whether it runs at all) are decided at the first generation by :meth:`decide`, from the batch's shape."""

    def __init__(self, enabled: bool | None, gradient_checkpointing: bool):
        self.enabled = enabled  # None: the automatic choice, until decide()
        self.chunk_rows = 0
        self.decided = not (enabled is not False and gradient_checkpointing)

    @classmethod
    def for_trainer(cls, args, *, needs_norms: bool, fsdp1: bool, aux_loss: bool, deepspeed: bool,
                    device_type: str) -> tuple["Plan", str, bool]:
        """The plan at construction, the message saying why (``""``: nothing to say) and whether it is a warning
        (asked for, or under DeepSpeed, and refused)."""
        if args.one_backward is False or not needs_norms:
            return cls(False, args.gradient_checkpointing), "", False
        reasons = blockers(args, fsdp1=fsdp1, aux_loss=aux_loss, deepspeed=deepspeed)
        enabled, why = initial_choice(args.one_backward, reasons, device_type, args.gradient_checkpointing)
        return cls(enabled, args.gradient_checkpointing), why, bool(reasons and (args.one_backward or deepspeed))

    @property
    def on(self) -> bool:
        return bool(self.enabled)

    def switch_off(self) -> None:
        self.enabled, self.chunk_rows, self.decided = False, 0, True

    def decide(self, model, batch: dict, args, group_size: int, max_completion_length: int, device,
               gather_min) -> str:
        """Chunks of whole groups keeping at most what GRPO's checkpointed loss pass holds for the micro-batch, plus a
        tenth of a lower bound on GRPO's peak memory (:func:`chunk_budget`), the same on every rank (``gather_min``:
        the minimum over ranks of a 1-element tensor). The automatic choice takes the two-pass path where not even one
        group fits; ``one_backward=True`` then runs one group at a time. Returns the message to log."""
        rows = min(batch["prompt_ids"].shape[0], args.per_device_train_batch_size)
        tokens = batch["prompt_ids"].shape[1] + max_completion_length
        itemsize = 2 if (args.bf16 or args.fp16) else 4
        kept = kept_bytes(model, 1, tokens, itemsize)
        budget = chunk_budget(model, rows, tokens, max_completion_length, itemsize, process_peak_bytes(device))
        chunk = int(gather_min(torch.tensor([chunk_rows(rows, group_size, kept, budget)], device=device)))
        if self.enabled is None:
            self.enabled = chunk > 0
        elif chunk == 0:  # one_backward=True: as little at a time as whole groups allow
            chunk = group_size if rows % group_size == 0 else rows
        self.chunk_rows, self.decided = (chunk if self.enabled else 0), True
        if self.enabled:
            how = ("one forward/backward per micro-batch." if chunk >= rows else
                   f"one forward/backward per chunk of {chunk} rows ({chunk // group_size} groups).")
        else:
            how = "two passes, keeping checkpointing's savings."
        return (f"OBLR-PO (one_backward={args.one_backward}, gradient checkpointing on): one_backward keeps "
                f"~{rows * kept / 2**30:.2f} GiB per micro-batch of {rows} x {tokens} tokens against a budget of "
                f"~{budget / 2**30:.2f} GiB (what GRPO's checkpointed pass holds, plus a tenth of a lower bound on "
                "GRPO's peak memory): " + how)


def rows_of(batch: dict, index, n: int) -> dict:
    """The batch's per-row tensors (first dimension ``n``) at ``index``, the rest as they are."""
    return {k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v for k, v in batch.items()}


def loss_and_grads(model, batch: dict, coefficients: torch.Tensor, *, unit: int, chunk: int, temperature: float,
                   autocast, advantages_of, snr: bool):
    """Norms, advantages and the policy update of one micro-batch from one forward and one backward per chunk of
    ``chunk`` rows (whole units, rows in generation order).

    Each chunk's backward reaches every layer's output; its norms give the baseline weights, and
    ``advantages_of(chunk_batch, sq_norms, unscorable)`` (an :class:`.advantages.AdvantageResult`) the advantages
    ``A_i``; each weight's gradient ``-sum_i c_i A_i u_i`` (TRL's loss at importance ratio 1) is then added to
    ``.grad``, with each SNR unit's ``||H_q||^2`` where ``snr``. Returns ``(loss, results, formed, warnings)``: the
    loss value (no graph), each chunk's AdvantageResult, the ``(unit ids, ||H_q||^2)`` formed and warning keys.
    """
    n = batch["oblr_row"].shape[0]
    loss, results, formed, warnings = 0.0, [], [], []
    for s in range(0, n, chunk):
        part = rows_of(batch, slice(s, s + chunk), n)
        input_ids, attention_mask, mask = sequence_inputs(part)
        with autocast():
            grads = per_sequence_grads(model, input_ids, attention_mask, mask, temperature=temperature,
                                       materialize=True)
        products, bad = mask_nonfinite_products(grads.inner_products(1))  # the weights need ||u_i||^2 only
        if bad.any():
            warnings.append("nonfinite_norms")
        result = advantages_of(part, products.reshape(-1), bad)
        results.append(result)
        a = coefficients[s : s + chunk] * result.values
        # the gradient of TRL's loss at ratio 1, and each unit's ||H_q||^2 = ||sum_{i in q} a_i u_i||^2 with it;
        # a unit of one row needs no block of its own: a_i^2 ||u_i||^2, from the norms above
        unit_sq = grads.accumulate_grad(-a, group_size=unit if snr and unit > 1 else None)
        if snr and unit == 1:
            dtype = torch.float32 if a.device.type == "mps" else torch.float64
            unit_sq = a.to(dtype).pow(2) * products.reshape(-1).to(dtype)
        if unit_sq is not None:
            formed.append((part["oblr_row"][::unit] // unit, unit_sq))
        loss = loss + (-(a * mask.sum(-1))).sum()
    return loss, results, formed, warnings
