"""A vision tower to time (bench/vision_encoder.py): Qwen2.5-VL's ViT from transformers, shaped by
simkv's model spec, random weights (its time does not depend on their values).

simkv prices the vision encoder with a roofline (simkv/backends/vision_encoder.py) that nobody
has measured yet; this module builds the tower a spec describes and times it on a dummy image,
so a GPU run can say how far the roofline is off. transformers' own attention for it loops over
the windows in Python (one SDPA call per 64-patch window and layer) unless flash-attention is
installed, so `build_tower` gives each layer's attention a forward of ours that runs the
layer's windows as one batched SDPA call, as vLLM runs them with its varlen flash attention.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

_PATCH_PIXELS = 14  # Qwen2.5-VL's patches: 14 x 14 pixels, 2 frames, 3 channels


def vision_config(spec, num_heads: int = 16):
    """Qwen2_5_VLVisionConfig of `spec`'s vision encoder (a gated MLP, windows of
    vision_window_patches patches but in vision_full_attention_layers layers, the last ones of
    each equal share, as Qwen2.5-VL places them). Other encoders are refused."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    if not spec.vision_num_layers or not spec.vision_gated_mlp or not spec.vision_window_patches:
        raise ValueError(f"model '{spec.name}': only Qwen2.5-VL-style vision encoders (gated MLP, windowed "
                         "attention) are built here")
    merge = math.isqrt(spec.vision_patches_per_embed)
    side = math.isqrt(spec.vision_window_patches)
    if merge * merge != spec.vision_patches_per_embed or side * side != spec.vision_window_patches:
        raise ValueError(f"model '{spec.name}': square merges and windows are built here")
    depth, full = spec.vision_num_layers, spec.vision_full_attention_layers
    every = depth // full if full else 0
    full_layers = [every * (k + 1) - 1 for k in range(full)] if full else []
    return Qwen2_5_VLVisionConfig(
        depth=depth, hidden_size=spec.vision_hidden_size, intermediate_size=spec.vision_intermediate_size,
        num_heads=num_heads, out_hidden_size=spec.hidden_size, patch_size=_PATCH_PIXELS, spatial_merge_size=merge,
        window_size=side * _PATCH_PIXELS, fullatt_block_indexes=full_layers, hidden_act="silu", in_channels=3,
        temporal_patch_size=2)


def varlen_attention(query, key, value, cu_seqlens, scaling: float):
    """Non-causal attention within each [cu_seqlens[i], cu_seqlens[i + 1]) of the packed sequence,
    as one SDPA call: the segments padded to the longest (a mask where they differ).
    query, key, value: (tokens, heads, head_dim); returns (tokens, heads, head_dim)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    longest = max(lengths)
    if all(n == longest for n in lengths):
        q, k, v = (t.unflatten(0, (len(lengths), longest)).transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)  # (segments, heads, longest, d)
        return out.transpose(1, 2).flatten(0, 1)
    heads, dim = query.shape[1], query.shape[2]
    padded = [query.new_zeros(len(lengths), heads, longest, dim) for _ in range(3)]
    mask = torch.zeros(len(lengths), 1, 1, longest, dtype=torch.bool, device=query.device)
    start = 0
    for i, n in enumerate(lengths):
        for dst, src in zip(padded, (query, key, value)):
            dst[i, :, :n] = src[start:start + n].transpose(0, 1)
        mask[i, ..., :n] = True
        start += n
    out = F.scaled_dot_product_attention(*padded, attn_mask=mask, scale=scaling)
    return torch.cat([out[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)], dim=0)


def _batched_window_forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    """A Qwen2.5-VL vision attention layer's forward with `varlen_attention` (its own weights)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    seq_length = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    out = varlen_attention(q, k, v, cu_seqlens, self.scaling)
    return self.proj(out.reshape(seq_length, -1))


def build_tower(spec, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, num_heads: int = 16,
                batched_windows: bool = True):
    """The vision tower of `spec`, random weights, in eval mode on `device`; `batched_windows`:
    its attention layers run `varlen_attention` (else transformers' SDPA path, a call a window)."""
    import types

    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = vision_config(spec, num_heads)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen2_5_VisionTransformerPretrainedModel(config)
    if batched_windows:
        for block in model.blocks:
            block.attn.forward = types.MethodType(_batched_window_forward, block.attn)
    return model.to(dtype=dtype).eval()


def dummy_image(config, embeds: int, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """A square image of `embeds` embeddings (a side of sqrt(embeds) merged patches): its
    flattened patches and grid (1, height, width) in patches."""
    side = math.isqrt(embeds)
    if side * side != embeds:
        raise ValueError(f"a square image: embeds must be a square number, got {embeds}")
    patches_side = side * config.spatial_merge_size
    per_patch = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.randn(patches_side * patches_side, per_patch, device=device, dtype=dtype)
    grid = torch.tensor([[1, patches_side, patches_side]], device=device)
    return pixels, grid


@torch.inference_mode()
def time_tower(model, pixels, grid, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of one forward pass over the image (CUDA events on a GPU)."""
    cuda = pixels.is_cuda
    times = []
    for k in range(warmup + repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(pixels, grid)
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            model(pixels, grid)
            elapsed = time.perf_counter() - t0
        if k >= warmup:
            times.append(elapsed)
    times.sort()
    return times[len(times) // 2]
