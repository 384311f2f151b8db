"""Images added to a trace's prompts (`simkv trace transform --images SHARE`), for what-if
replays of a multimodal model when the traffic's own trace has no images.

A chosen request gets `images_per_request` images of `image_tokens` placeholder tokens each
(Qwen2.5-VL makes an image of W x H pixels about (W / 28) x (H / 28) tokens: 1,024 for 896 x 896),
placed as a chat template places a user message's images: just before the prompt's last
`text_after` tokens, which follow them. The prompt grows by the images' tokens. Its hash list is
kept only over the blocks wholly before the images: what follows them is new content (the
text after an image cannot be matched in another prompt, whose image may differ).

Every image is a different one (its own mm_hash) unless `distinct_images` is given: then images
are drawn from that many, image k with weight 1 / (k + 1)^zipf_s, and a repeated image finds
the encoder's output cached (simkv/core/encoder_cache.py). A repeated image still adds no
prefix hit here, as its request's text before it differs; a trace whose block hashes describe
the content around its images can say more.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from simkv.traces._columns import concat_ranges
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

# (a transform's images are numbered from here, beyond the small ids a hand-made trace would use)
FIRST_IMAGE_HASH = 1 << 40


def add_images(trace: Trace, share: float, image_tokens: int, images_per_request: int = 1,
               distinct_images: int | None = None, zipf_s: float = 1.0, text_after: int = 16,
               seed: int = 0) -> tuple[Trace, int]:
    """A copy of `trace` whose requests carry images with probability `share`; returns it and the
    number of requests given images. A trace that already has multimodal items is refused."""
    for bad, what in [(not 0 < share <= 1, f"--images must be in (0, 1], got {share}"),
                      (image_tokens < 1, f"--image-tokens must be >= 1, got {image_tokens}"),
                      (images_per_request < 1, f"--images-per-request must be >= 1, got {images_per_request}"),
                      (distinct_images is not None and distinct_images < 1,
                       f"--distinct-images must be >= 1, got {distinct_images}"),
                      (zipf_s < 0, f"--image-zipf must be >= 0, got {zipf_s}"),
                      (text_after < 0, f"--image-text-after must be >= 0, got {text_after}"),
                      (trace.mm_items is not None, f"{trace.source}: the trace has multimodal items already")]:
        if bad:
            raise TraceError(what)
    rng = np.random.default_rng(seed)
    chosen = rng.random(len(trace)) < share
    rows = np.flatnonzero(chosen)
    count = len(rows) * images_per_request
    if distinct_images is None:
        hashes = FIRST_IMAGE_HASH + np.arange(count, dtype=np.int64)
    else:
        weights = 1.0 / np.arange(1, distinct_images + 1, dtype=np.float64) ** zipf_s
        hashes = FIRST_IMAGE_HASH + rng.choice(distinct_images, size=count, p=weights / weights.sum())
    prompt = trace.prompt_tokens.copy()
    start = prompt[rows] - np.minimum(text_after, prompt[rows])  # (where a row's first image goes)
    prompt[rows] += images_per_request * image_tokens
    per_row = np.zeros(len(trace), np.int64)
    per_row[rows] = images_per_request
    offsets = np.concatenate(([0], np.cumsum(per_row))).astype(np.int64)
    item_offsets = (np.repeat(start, images_per_request)
                    + np.tile(np.arange(images_per_request, dtype=np.int64) * image_tokens, len(rows)))
    items = np.stack([item_offsets, np.full(count, image_tokens, np.int64), hashes], axis=1).astype(np.int64)
    changed = replace(trace, prompt_tokens=prompt, mm_items=items, mm_item_offsets=offsets)
    if trace.hash_ids is not None:
        changed = _hashes_before(changed, rows, start)
    return changed, len(rows)


def _hashes_before(trace: Trace, rows: np.ndarray, start: np.ndarray) -> Trace:
    """The hash lists of `rows` cut to the blocks wholly before their images (at `start`)."""
    lengths = np.diff(trace.hash_offsets)
    block_tokens = trace.hash_block_tokens.copy()
    lengths[rows] = np.minimum(lengths[rows], start // np.maximum(block_tokens[rows], 1))
    keep = np.repeat(trace.hash_offsets[:-1], lengths) + concat_ranges(lengths)
    block_tokens[lengths == 0] = 0
    return replace(trace, hash_ids=trace.hash_ids[keep], hash_block_tokens=block_tokens,
                   hash_offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64))
