"""A VLM's image inputs for a slice of rows of a TRL GRPO batch, as TRL's own forward slices them, so that the norms
pass and the logit proxy run the model on the images the loss sees (a pass without them would score another function
and be silently wrong).

Only the layout of the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is taken: ``pixel_values`` as patch rows
concatenated over the images, ``image_grid_thw`` (one row per image) and ``num_images`` (images per row), plus the
per-token ``mm_token_type_ids`` / ``token_type_ids``. Any other image layout is refused, naming its fields.
"""

from __future__ import annotations

import torch

# TRL 1.16's multimodal batch fields (GRPOTrainer._get_per_token_logps_and_entropies)
IMAGE_FIELDS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                "image_sizes", "image_position_ids")
PER_TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")
_TAKEN = {"pixel_values", "image_grid_thw", "num_images"}


def has_images(batch: dict) -> bool:
    return batch.get("pixel_values") is not None


def row_inputs(batch: dict, start: int, end: int) -> dict:
    """The model inputs beyond ``input_ids``/``attention_mask`` for rows ``start:end`` of ``batch`` (empty for a
    text-only batch)."""
    out = {k: batch[k][start:end] for k in PER_TOKEN_FIELDS if batch.get(k) is not None}
    if not has_images(batch):
        return out
    present = sorted(k for k in IMAGE_FIELDS if batch.get(k) is not None)
    if set(present) - _TAKEN or "image_grid_thw" not in present or "num_images" not in present:
        raise NotImplementedError(
            f"The batch carries images in a layout the exact norms pass does not slice (fields {present}; taken: "
            "pixel_values with image_grid_thw and num_images, the Qwen-VL family's). Use "
            "OBLRPOConfig(grad_norm_estimator='length', snr_lr=False), which needs no norms pass."
        )
    num_images = [int(n) for n in batch["num_images"]]
    grid = batch["image_grid_thw"]
    images = torch.tensor([0] + num_images).cumsum(0).tolist()
    patch_rows = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()  # first patch row of each image
    first, last = images[start], images[end]
    if first == last:  # no image in these rows (a model refuses empty pixel_values)
        return out
    out["pixel_values"] = batch["pixel_values"][patch_rows[first] : patch_rows[last]]
    out["image_grid_thw"] = grid[first:last]
    return out


def dataset_has_images(dataset) -> bool:
    """Whether a training dataset carries images the way TRL's GRPOTrainer takes them (an ``image``/``images``
    column)."""
    names = getattr(dataset, "column_names", None) or []
    return any(name in ("image", "images") for name in names)


def refuse_trainable_vision(model, dataset) -> None:
    """At construction: a dataset with images and a trainable module outside the text decoder (a vision tower) is
    refused, naming the modules, with the advice (freeze the tower) that makes the norms exact."""
    from .grad_norms.model import output_head, unwrap_causal_lm
    from .grad_norms.engine import refuse_outside_decoder

    if not dataset_has_images(dataset):
        return
    lm = unwrap_causal_lm(model)
    head = output_head(lm)
    trainable = [m for m in getattr(lm, "base_model", lm).modules()
                 if m is not head and any(p.requires_grad for p in m.parameters(recurse=False))]
    refuse_outside_decoder(lm, trainable, {"pixel_values": None})
