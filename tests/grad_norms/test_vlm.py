"""Qwen2-VL (tiny, random): exact per-sequence norms on text-only batches with the vision tower trainable or frozen,
and on batches with images once the tower is frozen; a trainable tower with images is refused by name, and the advice
(freeze it) is applied here and works."""

import pytest
import torch

from oblr_trl import per_sequence_grad_sq_norms, validate
from oblr_trl.grad_norms import UnsupportedModulesError
from reference import padded_batch, per_sample_sq_norms

IMAGE, VISION_START, VISION_END, VOCAB = 60, 62, 63, 64
GRID = (1, 4, 4)  # one frame of 4 x 4 patches: 16 patch rows, 4 image tokens after the 2 x 2 merge


def _model(frozen_tower: bool):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=2, in_chans=3),
        image_token_id=IMAGE, video_token_id=61, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    if frozen_tower:
        model.model.visual.requires_grad_(False)
    return model


def _image_batch(batch=4, prompt=9, completion=6):
    """Left-padded prompts holding one image each (vision start, 4 image tokens, vision end), right-padded
    completions; the images' patch rows concatenated in row order, as a Qwen2-VL processor returns them."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, IMAGE, (batch, prompt + completion), generator=g)
    attention = torch.ones_like(ids)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = VISION_START, IMAGE, VISION_END
    ids[0, :2], attention[0, :2] = 0, 0  # left padding
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    completion_mask[1, 3:], ids[1, prompt + 3 :], attention[1, prompt + 3 :] = 0, 0, 0  # right padding
    patches = GRID[0] * GRID[1] * GRID[2]
    pixel_values = torch.randn(batch * patches, 3 * 2 * 2 * 2, generator=g)
    grid = torch.tensor([GRID] * batch)
    return ids, attention, completion_mask, pixel_values, grid


def _inputs(ids, pixel_values, grid, rows):
    patches = GRID[0] * GRID[1] * GRID[2]
    return dict(pixel_values=pixel_values[rows.start * patches : rows.stop * patches], image_grid_thw=grid[rows],
                mm_token_type_ids=(ids[rows] == IMAGE).int())


def _per_row_reference(model, ids, attention, completion_mask, pixel_values, grid):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for b in range(ids.shape[0]):
        rows = slice(b, b + 1)
        logits = model(input_ids=ids[rows], attention_mask=attention[rows], use_cache=False,
                       **_inputs(ids, pixel_values, grid, rows)).logits
        c = completion_mask.shape[1]
        logps = torch.log_softmax(logits[:, -c - 1 : -1].float(), -1).gather(-1, ids[rows, -c:, None])[..., 0]
        grads = torch.autograd.grad((logps * completion_mask[rows]).sum(), params, allow_unused=True)
        out.append(sum(g.double().pow(2).sum() for g in grads if g is not None))
    return torch.stack(out)


@pytest.mark.parametrize("frozen_tower", [False, True], ids=["tower-trainable", "tower-frozen"])
def test_text_only_batches_are_exact(frozen_tower):
    model = _model(frozen_tower)
    assert validate(model) == []  # the tower's Conv3d patch embedding takes the per-row path; the rest rules
    ids, attention, completion_mask = padded_batch(IMAGE, batch=4)  # no image tokens
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)
    torch.testing.assert_close(ours.double(), per_sample_sq_norms(model, ids, attention, completion_mask),
                               rtol=1e-4, atol=1e-9)


def test_images_with_a_trainable_tower_are_refused_and_freezing_it_works():
    model = _model(frozen_tower=False)
    ids, attention, completion_mask, pixel_values, grid = _image_batch()
    inputs = _inputs(ids, pixel_values, grid, slice(0, ids.shape[0]))
    with pytest.raises(UnsupportedModulesError, match=r"model\.visual\.requires_grad_\(False\)") as refused:
        per_sequence_grad_sq_norms(model, ids, attention, completion_mask, model_inputs=inputs)
    names = [m.name for m in refused.value.modules]
    assert "model.visual.patch_embed.proj" in names and all(n.startswith("model.visual.") for n in names)
    model.model.visual.requires_grad_(False)  # the advice
    ours = per_sequence_grad_sq_norms(model, ids, attention, completion_mask, model_inputs=inputs)
    reference = _per_row_reference(model, ids, attention, completion_mask, pixel_values, grid)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-9)
    blind = per_sequence_grad_sq_norms(model, ids, attention, completion_mask)  # the images left out: another answer
    assert ((blind.double() - reference).abs() / reference).max() > 1e-2


def test_the_trainers_row_slices_of_a_trl_batch_give_the_same_norms():
    """What OBLRPOTrainer's norms pass does with a TRL GRPO batch holding images: chunks of rows, each with its own
    images sliced out (oblr_trl.multimodal.row_inputs). Row 1 holds two images and row 2 none."""
    from oblr_trl.multimodal import row_inputs

    model = _model(frozen_tower=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, IMAGE, (4, 19), generator=g)  # 15 prompt tokens, 4 completion tokens
    image = torch.tensor([VISION_START, IMAGE, IMAGE, IMAGE, IMAGE, VISION_END])
    ids[0, 2:8], ids[1, 1:7], ids[1, 7:13], ids[3, 2:8] = image, image, image, image
    attention = torch.ones_like(ids)
    ids[0, :2], attention[0, :2] = 0, 0  # left padding
    completion_mask = torch.ones(4, 4, dtype=torch.long)
    completion_mask[3, 2:], ids[3, 17:], attention[3, 17:] = 0, 0, 0  # right padding
    num_images = [1, 2, 0, 1]
    patches = GRID[0] * GRID[1] * GRID[2]
    batch = dict(pixel_values=torch.randn(sum(num_images) * patches, 24, generator=g),
                 image_grid_thw=torch.tensor([GRID] * sum(num_images)), num_images=num_images,
                 mm_token_type_ids=(ids == IMAGE).int())
    chunks = [per_sequence_grad_sq_norms(model, ids[s : s + 2], attention[s : s + 2], completion_mask[s : s + 2],
                                         model_inputs=row_inputs(batch, s, s + 2)) for s in (0, 2)]
    assert row_inputs(batch, 1, 2)["pixel_values"].shape[0] == 2 * patches
    assert "pixel_values" not in row_inputs(batch, 2, 3)  # a row without images: none passed
    reference = torch.cat([
        _per_row_reference_with(model, ids[b : b + 1], attention[b : b + 1], completion_mask[b : b + 1],
                                row_inputs(batch, b, b + 1)) for b in range(4)])
    torch.testing.assert_close(torch.cat(chunks).double(), reference, rtol=1e-4, atol=1e-9)


def _per_row_reference_with(model, ids, attention, completion_mask, inputs):
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False, **inputs).logits
    c = completion_mask.shape[1]
    logps = torch.log_softmax(logits[:, -c - 1 : -1].float(), -1).gather(-1, ids[:, -c:, None])[..., 0]
    grads = torch.autograd.grad((logps * completion_mask).sum(), params, allow_unused=True)
    return sum(g.double().pow(2).sum() for g in grads if g is not None).reshape(1)


def test_row_inputs_refuses_other_image_layouts_and_passes_text_fields():
    from oblr_trl.multimodal import row_inputs

    ids = torch.ones(4, 5, dtype=torch.long)
    assert row_inputs({"prompt_ids": ids}, 0, 2) == {}
    sliced = row_inputs({"token_type_ids": torch.arange(20).reshape(4, 5)}, 2, 4)
    torch.testing.assert_close(sliced["token_type_ids"], torch.arange(10, 20).reshape(2, 5))
    with pytest.raises(NotImplementedError, match=r"image_sizes.*grad_norm_estimator='length', snr_lr=False"):
        row_inputs({"pixel_values": torch.zeros(4, 3), "image_sizes": torch.zeros(4, 2), "num_images": [1] * 4}, 0, 2)


# ------------------------------------------------------------------- OBLRPOTrainer on image prompts (TRL's VLM path)
def _vlm_trainer_parts():
    """A tiny Qwen2-VL with a processor built offline (the character tokenizer of oblr_trl.demo.tiny plus the vision
    tokens, the PIL image processor; no video processor, which needs torchvision) and 8 image prompts of 8 x 8 pixels
    (one 4 x 4 patch grid: 4 image tokens each)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from oblr_trl.demo.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision})
    template = (
        "{%- for message in messages -%}"
        "{%- if message['content'] is string -%}{{ message['role'][0] + ': ' + message['content'] + '\\n' }}"
        "{%- else -%}{{ message['role'][0] + ': ' }}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{{ '\\n' }}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ 'a: ' }}{%- endif -%}")
    tokenizer.chat_template = template

    class ImageOnlyProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    images = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=64)
    processor = ImageOnlyProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)
    token = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=2, in_chans=3),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"))
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    rng = np.random.default_rng(0)
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i}?"}]}],
         "image": Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))} for i in range(8)])
    return model, processor, dataset


def _vlm_trainer(model, processor, dataset):
    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    args = OBLRPOConfig(output_dir="/tmp/oblr-vlm-test", per_device_train_batch_size=4, num_generations=2,
                        max_completion_length=4, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                        save_strategy="no", seed=0, disable_tqdm=True, bf16=False)
    return OBLRPOTrainer(model=model, processing_class=processor, args=args, train_dataset=dataset,
                         reward_funcs=[lambda completions, **kw: [float(len(str(c))) for c in completions]])


def test_trainer_refuses_a_trainable_tower_with_image_prompts_at_construction():
    model, processor, dataset = _vlm_trainer_parts()
    with pytest.raises(UnsupportedModulesError, match=r"model\.visual\.requires_grad_\(False\)") as refused:
        _vlm_trainer(model, processor, dataset)
    assert all(m.name.startswith("model.visual.") for m in refused.value.modules)


def test_trainer_on_image_prompts_with_the_tower_frozen_passes_the_images_and_is_exact(monkeypatch):
    from oblr_trl import norm_passes

    model, processor, dataset = _vlm_trainer_parts()
    model.model.visual.requires_grad_(False)  # the advice
    calls = []
    original = norm_passes.per_sequence_grad_inner_products

    def spy(model, ids, attention, mask, **kwargs):
        calls.append((ids, attention, mask, kwargs.get("model_inputs")))
        return original(model, ids, attention, mask, **kwargs)

    monkeypatch.setattr("oblr_trl.norm_passes.per_sequence_grad_inner_products", spy)
    trainer = _vlm_trainer(model, processor, dataset)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.route.enabled is False  # two passes with images
    assert calls and all(sorted(inputs) == ["image_grid_thw", "mm_token_type_ids", "pixel_values"]
                         for *_, inputs in calls)
    ids, attention, mask, inputs = calls[-1]  # the trainer's last chunk, at the trained weights
    model.eval()
    ours = per_sequence_grad_sq_norms(model, ids, attention, mask, model_inputs=inputs)
    per_image = inputs["pixel_values"].shape[0] // ids.shape[0]  # one image (one grid) per prompt
    reference = torch.cat([_per_row_reference_with(
        model, ids[b : b + 1], attention[b : b + 1], mask[b : b + 1],
        dict(pixel_values=inputs["pixel_values"][b * per_image : (b + 1) * per_image],
             image_grid_thw=inputs["image_grid_thw"][b : b + 1],
             mm_token_type_ids=inputs["mm_token_type_ids"][b : b + 1]))
        for b in range(ids.shape[0])])
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-9)
