"""gpu_backend/vision_tower.py: Qwen2.5-VL's ViT built from simkv's spec, its batched windowed
attention against transformers' own, and the timing bench/vision_encoder.py runs on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_backend.vision_tower import build_tower, dummy_image, time_tower, vision_config
from simkv.specs import get_model_spec


def _tiny():
    """Qwen2.5-VL-7B's spec with a small ViT: 4 layers of 64 (2 of them over the whole image),
    windows of 2 x 2 merged patches."""
    return dataclasses.replace(get_model_spec("qwen2.5-vl-7b"), vision_num_layers=4, vision_hidden_size=64,
                               vision_intermediate_size=96, vision_window_patches=16, vision_full_attention_layers=2,
                               hidden_size=32)


def test_the_config_is_qwen25_vl_7bs_vit():
    config = vision_config(get_model_spec("qwen2.5-vl-7b"))
    assert (config.depth, config.hidden_size, config.intermediate_size) == (32, 1280, 3420)
    assert config.fullatt_block_indexes == [7, 15, 23, 31]  # (as Qwen2.5-VL-7B's checkpoint places them)
    assert config.window_size == 112 and config.spatial_merge_size == 2 and config.out_hidden_size == 3584
    with pytest.raises(ValueError, match="only Qwen2.5-VL-style"):
        vision_config(get_model_spec("qwen3-vl-30b-a3b"))


@pytest.mark.parametrize("embeds", [16, 9])  # (windows of one size; windows cut at the image's edge: padded)
def test_the_batched_window_attention_equals_transformers_own(embeds):
    torch.manual_seed(0)
    ours = build_tower(_tiny(), dtype=torch.float32, num_heads=4)
    theirs = build_tower(_tiny(), dtype=torch.float32, num_heads=4, batched_windows=False)
    theirs.load_state_dict(ours.state_dict())
    pixels, grid = dummy_image(ours.config, embeds, dtype=torch.float32)
    with torch.inference_mode():
        a, b = ours(pixels, grid), theirs(pixels, grid)
    a, b = (getattr(x, "pooler_output", None) if getattr(x, "pooler_output", None) is not None
            else x.last_hidden_state for x in (a, b))
    assert a.shape == (embeds, 32)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_tower_is_timed():
    model = build_tower(_tiny(), dtype=torch.float32, num_heads=4)
    pixels, grid = dummy_image(model.config, 16, dtype=torch.float32)
    assert time_tower(model, pixels, grid, repeats=2, warmup=1) > 0
    with pytest.raises(ValueError, match="square number"):
        dummy_image(model.config, 10)
