"""Each completion's coefficient in TRL's GRPO loss at importance ratio 1, as pure functions of the batch.

At ratio 1 (on-policy: ``num_iterations=1``) the gradient of every TRL 1.16 loss type is a weighted sum of the
completions' scores,

    grad L = - sum_i c_i A_i grad sum_t log pi(o_i,t | q, o_i,<t),

so the step's gradient is the sum of per-sample contributions ``h_i = c_i A_i u_i`` (the SNR's samples) and the
baseline weights are the squared norms of the scores *as they enter the loss*, ``c_i^2 ||u_i||^2``.

``c_i`` has two factors: a per-sequence shape (``1 / |o_i|`` where the loss averages each sequence over its tokens,
``grpo`` and ``sapo``; 1 elsewhere) and the batch normalizer TRL divides by (per loss type). Both are derived here once;
``tests/test_loss_terms.py`` pins them to TRL's own ``_compute_loss`` by autograd for every loss type, so a change
in TRL fails a test instead of silently changing the SNR.

Per loss type at ratio 1 (every clip and soft gate is inactive or has slope 1 there): ``grpo``/``bnpo``/``dr_grpo``/
``dapo``/``luspo`` (clipped ratio: slope 1), ``sapo`` (``sigmoid(tau (r - 1)) 4 / tau``: slope 1 at r = 1), ``vespo``
(``phi(1) = 1``), ``cispo`` (``min(r, epsilon_high)`` detached: ``min(1, epsilon_high)``). ``importance_sampling_level=
"sequence"`` gives the same gradient at ratio 1 as ``"token"``.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's, all supported
PER_SEQUENCE_MEAN = ("grpo", "sapo")  # losses that average each sequence over its own tokens


def sequence_shape(loss_type: str, lengths: torch.Tensor) -> torch.Tensor:
    """The per-sequence factor of ``c_i``: ``1 / |o_i|`` for losses that average each sequence, else 1.

    Within one batch the rest of ``c_i`` is a constant, so this is all the baseline weights need
    (``w_i = shape_i^2 ||u_i||^2``; a baseline is invariant to a common factor of its weights).
    """
    _check(loss_type)
    if loss_type in PER_SEQUENCE_MEAN:
        return 1.0 / lengths.float().clamp(min=1.0)
    return torch.ones_like(lengths, dtype=torch.float32)


def loss_coefficients(
    loss_type: str,
    mask: torch.Tensor,
    *,
    accumulation_steps: int,
    num_processes: int,
    steps_per_generation: int,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | float | None = None,
    epsilon_high: float = float("inf"),
) -> torch.Tensor:
    """``c_i`` for each row of a training micro-batch: the factor of ``A_i * sum_t grad log pi`` in the step's
    gradient, averaged over ranks as DDP/FSDP do (``1 / num_processes``).

    Args:
        mask: ``(B, T)`` the completion tokens that enter the loss (TRL's ``completion_mask``, times ``tool_mask``).
        num_items_in_batch: the generation batch's token count (TRL's ``num_items_in_batch``, all ranks), needed by
            ``dapo``, ``cispo`` and ``vespo``.
        epsilon_high: ``cispo``'s cap on the (detached) ratio.
    """
    _check(loss_type)
    batch = mask.shape[0]
    lengths = mask.sum(-1).float()
    shape = sequence_shape(loss_type, lengths).to(mask.device)
    if loss_type in ("grpo", "sapo", "luspo"):  # mean over sequences, then / accumulation
        normalizer = torch.tensor(float(batch * accumulation_steps), device=mask.device)
    elif loss_type == "bnpo":  # tokens of the micro-batch
        normalizer = lengths.sum().clamp(min=1.0) * accumulation_steps
    elif loss_type == "dr_grpo":
        normalizer = torch.tensor(float(batch * max_completion_length * accumulation_steps), device=mask.device)
    else:  # dapo, cispo, vespo: num_items_in_batch spans the generation batch, rescaled to one accumulation window
        if num_items_in_batch is None:
            raise ValueError(f"loss_type={loss_type!r} needs num_items_in_batch (TRL's generation-batch token count).")
        items = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device).clamp(min=1.0)
        normalizer = items / num_processes * accumulation_steps / steps_per_generation
    gate = min(1.0, epsilon_high) if loss_type == "cispo" else 1.0
    return gate * shape / normalizer / num_processes


def _check(loss_type: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of TRL 1.16's loss types {list(LOSS_TYPES)}.")


def terms_beyond_ratio_one(args) -> dict[str, str]:
    """The options of TRL's loss in ``args`` that make its gradient more than the policy term at importance ratio 1,
    the term OBLR-PO's theory, its SNR estimate and ``one_backward``'s gradient cover: ``{key: what it adds}``, empty
    when none. One list for both uses: :class:`.config.OBLRPOConfig` warns that the SNR and the weights are then
    approximate; :func:`.path_choice.blockers` refuses ``one_backward`` for them."""
    found = {}
    if args.num_iterations != 1:
        found["num_iterations"] = f"num_iterations={args.num_iterations} (importance ratio != 1)"
    if args.beta != 0.0:
        found["beta"] = f"beta={args.beta} (a KL term in the loss)"
    if args.top_entropy_quantile < 1.0 or args.off_policy_mask_threshold is not None:
        found["token_masks"] = "top_entropy_quantile < 1 or off_policy_mask_threshold (token masks)"
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        found["entropy"] = "an entropy bonus (entropy_coef / use_adaptive_entropy: a term outside the policy gradient)"
    return found
