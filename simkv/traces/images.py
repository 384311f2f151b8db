"""Images added to a trace's prompts (`simkv trace transform --images SHARE`), for what-if
replays of a multimodal model when the traffic's own trace has no images.

A chosen request gets `images_per_request` images of `image_tokens` placeholder tokens each
(Qwen2.5-VL makes an image of W x H pixels about (W / 28) x (H / 28) tokens: 1,024 for 896 x 896),
placed as a chat template places a user message's images: just before the prompt's last
`text_after` tokens, which follow them. The prompt grows by the images' tokens.

Block hashes. Where the request's hash list can stay aligned (its hash block H divides the
images' tokens; the images then start at a block boundary, `text_after` rounded up to one), the
images get block ids of their own, derived from their mm_hash, and the ids after them move
behind them: equal images at equal places in equal prompts share their blocks, as vLLM keys a
block with the identifiers of the images in it. Otherwise the list is cut before the images
(what follows is new content).

Conversations. A session's later turn whose hash list repeats an earlier turn's prompt up to
that turn's image (a chat's history) shows the same image at the same place: its prompt grows
too, and, the blocks aligned, finds the earlier turn's blocks in the prefix cache, image included,
as a follow-up question about an uploaded image does in vLLM. A turn's own new image goes after
the ones it repeats.

Every new image is a different one (its own mm_hash) unless `distinct_images` is given: then
images are drawn from that many, image k with weight 1 / (k + 1)^zipf_s, and a repeated image
finds the encoder's output cached (simkv/core/encoder_cache.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from simkv.traces._columns import csr, offsets_of
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

# (a transform's images are numbered from here, beyond the small ids a hand-made trace would use)
FIRST_IMAGE_HASH = 1 << 40
# (an image's block ids: IMAGE_BLOCK_BASE + its number x 2^20 + the block; far from the small
# non-negative ids the importers and generators give text)
IMAGE_BLOCK_BASE = -(1 << 62)


def image_block_ids(mm_hash: int, num_blocks: int) -> list[int]:
    """The hash ids of an image's blocks (one id per hash block it fills)."""
    base = IMAGE_BLOCK_BASE + ((mm_hash - FIRST_IMAGE_HASH) << 20)
    return [base + b for b in range(num_blocks)]


def add_images(trace: Trace, share: float, image_tokens: int, images_per_request: int = 1,
               distinct_images: int | None = None, zipf_s: float = 1.0, text_after: int = 16,
               seed: int = 0) -> tuple[Trace, int]:
    """A copy of `trace` whose requests carry new images with probability `share` (and, in
    sessions, the images of their earlier turns they repeat); returns it and the number of
    requests given new images. A trace that already has multimodal items is refused."""
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
    n = len(trace)
    chosen = rng.random(n) < share
    count = int(chosen.sum()) * images_per_request
    if distinct_images is None:
        drawn = np.arange(count, dtype=np.int64)
    else:
        weights = 1.0 / np.arange(1, distinct_images + 1, dtype=np.float64) ** zipf_s
        drawn = rng.choice(distinct_images, size=count, p=weights / weights.sum()).astype(np.int64)
    new_hashes = iter((FIRST_IMAGE_HASH + drawn).tolist())
    placer = _Placer(trace, image_tokens, text_after)
    for i in range(n):
        placer.place(i, [next(new_hashes) for _ in range(images_per_request)] if chosen[i] else [])
    return placer.result(), int(chosen.sum())


class _Placer:
    """Places each row's images (in arrival order, so that a session's turns see their earlier
    turns' images) and builds the new prompt lengths, items and hash lists."""

    def __init__(self, trace: Trace, image_tokens: int, text_after: int) -> None:
        self.trace = trace
        self.tokens = image_tokens
        self.text_after = text_after
        self.has_hashes = trace.hash_ids is not None
        # per session: the images its turns have shown, (position in the original prompt, mm_hashes,
        # the original hash ids before it)
        self.shown: dict[str, list[tuple[int, list[int], tuple]]] = {}
        self.prompts = trace.prompt_tokens.copy()
        self.items: list[list[tuple[int, int, int]]] = []
        self.hash_lists: list[np.ndarray] = []
        self.block_tokens = trace.hash_block_tokens.copy() if self.has_hashes else None

    def place(self, i: int, new: list[int]) -> None:
        trace, prompt = self.trace, int(self.trace.prompt_tokens[i])
        ids = trace.block_hashes(i) if self.has_hashes else np.zeros(0, np.int64)
        h = int(trace.hash_block_tokens[i]) if self.has_hashes and len(ids) else 0
        aligned = h > 0 and self.tokens % h == 0
        session = trace.session_id[i] if trace.session_id is not None else None
        images: list[tuple[int, int]] = []  # (position in the original prompt, mm_hash), by position
        if session is not None and aligned:
            for at, hashes, before in self.shown.get(session, ()):
                if at < prompt and at // h <= len(ids) and tuple(ids[:at // h].tolist()) == before:
                    images += [(at, m) for m in hashes]
        if new:
            at = prompt - min(self.text_after, prompt)
            if aligned:
                at -= at % h
            if not images or at > images[-1][0]:
                images += [(at, m) for m in new]
                if session is not None and aligned:
                    self.shown.setdefault(session, []).append((at, new, tuple(ids[:at // h].tolist())))
        self.prompts[i] = prompt + self.tokens * len(images)
        self.items.append([(at + k * self.tokens, self.tokens, m) for k, (at, m) in enumerate(images)])
        self.hash_lists.append(self._ids(ids, h, aligned, images))
        if self.block_tokens is not None and not len(self.hash_lists[-1]):
            self.block_tokens[i] = 0

    def _ids(self, ids: np.ndarray, h: int, aligned: bool, images: list[tuple[int, int]]) -> np.ndarray:
        """The row's hash list with its images: their blocks between the text's (aligned), or cut
        before the first image."""
        if not images or not len(ids):
            return ids
        if not aligned:
            return ids[:images[0][0] // h] if h else ids[:0]
        parts, start = [], 0
        for at, m in images:
            parts += [ids[start:at // h], np.array(image_block_ids(m, self.tokens // h), np.int64)]
            start = at // h
        parts.append(ids[start:])
        return np.concatenate(parts).astype(np.int64)

    def result(self) -> Trace:
        offsets = offsets_of([len(row) for row in self.items])
        flat = [item for row in self.items for item in row]
        items = np.array(flat, np.int64).reshape(len(flat), 3)
        changed = replace(self.trace, prompt_tokens=self.prompts, mm_items=items, mm_item_offsets=offsets)
        if self.has_hashes:
            values, hash_offsets = csr(self.hash_lists)
            changed = replace(changed, hash_ids=values, hash_block_tokens=self.block_tokens, hash_offsets=hash_offsets)
        return changed
