"""The traffic of `vllm bench serve --dataset-name random-mm` (vLLM 0.33's RandomMultiModalDataset):
random prompts, as the random dataset draws them, each followed by synthetic images.

Each request's text is the random dataset's (simkv/traces/vllm_random.py: its lengths, prefix
and send times). Its images, as the client picks them:
- how many: uniformly from [floor(n (1 - r)), ceil(n (1 + r))], n = --random-mm-base-items-per-request,
  r = --random-mm-num-mm-items-range-ratio, the top clamped to the sum of
  --random-mm-limit-mm-per-prompt's caps over the modalities the buckets use;
- each one's size: a bucket of --random-mm-bucket-config, {(height, width, frames): probability}
  with the zero entries dropped and the rest renormalized; once a modality reaches its cap its
  buckets are dropped and the rest renormalized again.
An image of H x W pixels is as many placeholder tokens as the served model's processor makes of
it (ModelSpec.image_embeddings: Qwen2.5-VL, 81 for 256 x 256 and 1,196 for 720 x 1280). The
client sends the text and then the images (`openai-chat`, the only backend vLLM's client lets
send them: its mm_position "last"), so the images follow the prompt's text; the chat template's
tokens around them (the vision start and end markers among them) are not counted, as with the
text datasets. Every image is new (random pixels): no encoder-cache or prefix-cache hit on one.

Not vLLM's draws: the client draws the images from the stream that drew each prompt's tokens
(through the model's tokenizer), so simkv draws the same distributions from a stream of its own
(seeded with --seed); the text's lengths and send times stay vLLM's draw for draw. Videos
(buckets of more than one frame) are refused: their frames' sampling and tokens are not modelled.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from simkv.traces._columns import csr, offsets_of
from simkv.traces.errors import TraceError
from simkv.traces.images import FIRST_IMAGE_HASH
from simkv.traces.schema import Trace
from simkv.traces.vllm_random import RandomDataset

Bucket = tuple[int, int, int]  # (height, width, frames)
DEFAULT_LIMITS = (("image", 255), ("video", 1))
DEFAULT_BUCKETS: tuple[tuple[Bucket, float], ...] = (((256, 256, 1), 0.5), ((720, 1280, 1), 0.5),
                                                     ((720, 1280, 16), 0.0))
MM_SEED_STREAM = 11  # (simkv's stream for the images: np.random.default_rng([seed, 11]))


def modality(bucket: Bucket) -> str:
    if bucket[2] == 1:
        return "image"
    if bucket[2] > 1:
        return "video"
    raise TraceError(f"--random-mm-bucket-config: invalid item {bucket}: frames must be >= 1")


def normalized(buckets: dict[Bucket, float]) -> dict[Bucket, float]:
    """The zero entries dropped and the rest scaled to sum to 1 (vLLM's normalize_bucket_config)."""
    if any(p < 0 for p in buckets.values()):
        raise TraceError("--random-mm-bucket-config: probabilities must be non-negative")
    kept = {b: p for b, p in buckets.items() if p > 0}
    if not kept:
        raise TraceError("--random-mm-bucket-config: every probability is zero")
    total = sum(kept.values())
    return {b: p / total for b, p in kept.items()}


def parse_buckets(text: str) -> tuple[tuple[Bucket, float], ...]:
    """vLLM's --random-mm-bucket-config: a Python dict literal of (H, W, T) tuples to probabilities."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise TraceError(f"--random-mm-bucket-config {text!r} is not a Python dict literal") from None
    if not isinstance(value, dict):
        raise TraceError(f"--random-mm-bucket-config {text!r} must be a dict")
    out = []
    for key, p in value.items():
        if isinstance(key, str):
            try:
                key = ast.literal_eval(key)
            except (ValueError, SyntaxError):
                pass
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(x, int) for x in key)):
            raise TraceError(f"--random-mm-bucket-config: invalid bucket key {key!r}: expected (height, width, frames)")
        if not isinstance(p, (int, float)) or isinstance(p, bool):
            raise TraceError(f"--random-mm-bucket-config: the probability of {key} is not a number")
        out.append(((int(key[0]), int(key[1]), int(key[2])), float(p)))
    return tuple(out)


def parse_limits(text: str) -> tuple[tuple[str, int], ...]:
    """vLLM's --random-mm-limit-mm-per-prompt: JSON {"image": 3, "video": 0}."""
    try:
        value = json.loads(text)
    except ValueError:
        raise TraceError(f"--random-mm-limit-mm-per-prompt {text!r} is not JSON") from None
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value.values()):
        raise TraceError(f"--random-mm-limit-mm-per-prompt {text!r} must map modalities to whole numbers >= 0")
    return tuple((str(k), int(v)) for k, v in value.items())


@dataclass(frozen=True)
class RandomMultiModalDataset:
    """vllm bench serve's random-mm dataset (its flags' names)."""

    text: RandomDataset
    base_items_per_request: int = 1
    num_mm_items_range_ratio: float = 0.0
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = DEFAULT_LIMITS
    bucket_config: tuple[tuple[Bucket, float], ...] = DEFAULT_BUCKETS

    def sampling(self) -> tuple[int, int, dict[str, int], dict[Bucket, float]]:
        """(fewest items, most items, caps per modality, buckets), checked as vLLM checks them."""
        r = self.num_mm_items_range_ratio
        if not 0.0 <= r <= 1.0:
            raise TraceError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {r}")
        if self.base_items_per_request < 0:
            raise TraceError(f"--random-mm-base-items-per-request must be >= 0, got {self.base_items_per_request}")
        limits = dict(self.limit_mm_per_prompt)
        for bucket, _ in self.bucket_config:
            if modality(bucket) not in limits:
                raise TraceError(f"--random-mm-bucket-config: modality {modality(bucket)} of {bucket} is not in "
                                 f"--random-mm-limit-mm-per-prompt ({', '.join(limits)})")
        buckets = normalized(dict(self.bucket_config))
        videos = [b for b in buckets if modality(b) == "video"]
        if videos:
            raise TraceError(f"--random-mm-bucket-config: videos ({videos[0]}: {videos[0][2]} frames) are not "
                             "modelled; give their buckets probability 0")
        used = {modality(b) for b in buckets}
        limits = {k: v for k, v in limits.items() if k in used}
        n = self.base_items_per_request
        most = min(sum(limits.values()), math.ceil(n * (1 + r)))
        fewest = max(0, math.floor(n * (1 - r)))
        if fewest > most:
            raise TraceError(f"random-mm: the fewest items a request may have ({fewest}) exceed the most ({most}): "
                             "raise --random-mm-limit-mm-per-prompt or lower --random-mm-base-items-per-request")
        return fewest, most, limits, buckets

    def items(self) -> list[list[Bucket]]:
        """Each request's images (their buckets), in the order the client attaches them."""
        fewest, most, limits, buckets = self.sampling()
        rng = np.random.default_rng([self.text.seed, MM_SEED_STREAM])
        keys = list(buckets)
        out = []
        for _ in range(self.text.num_prompts):
            wanted = int(rng.integers(fewest, most + 1))
            counts = dict.fromkeys(limits, 0)
            probs = dict(buckets)
            chosen: list[Bucket] = []
            while len(chosen) < wanted:
                bucket = keys[int(rng.choice(len(keys), p=[probs[k] for k in keys]))]
                kind = modality(bucket)
                if counts[kind] < limits[kind]:
                    counts[kind] += 1
                    chosen.append(bucket)
                    continue
                probs = {k: (0.0 if modality(k) == kind else p) for k, p in probs.items()}
                if not any(probs.values()):
                    break
                probs = normalized(probs) | {k: 0.0 for k in keys if probs[k] == 0}
            out.append(chosen)
        return out

    def trace(self, image_embeddings: Callable[[int, int], int], hash_block_tokens: int = 16) -> Trace:
        """The requests as the server sees them: the random dataset's, each prompt followed by its
        images of image_embeddings(height, width) placeholder tokens each."""
        text = self.text.trace(hash_block_tokens)
        images = self.items()
        prompt = text.prompt_tokens.copy()
        rows, counts, kept = [], [], []
        number = FIRST_IMAGE_HASH
        for i, buckets in enumerate(images):
            at = int(prompt[i])
            ids = text.block_hashes(i)
            if buckets:
                ids = ids[:at // hash_block_tokens]  # (the text's full blocks: what follows is the images)
            for height, width, _ in buckets:
                tokens = image_embeddings(height, width)
                rows.append((at, tokens, number))
                at += tokens
                number += 1
            prompt[i] = at
            counts.append(len(buckets))
            kept.append(ids)
        hash_ids, hash_offsets = csr(kept)
        items = np.array(rows, np.int64).reshape(len(rows), 3)
        return dataclasses.replace(
            text, source="vllm bench serve --dataset-name random-mm", prompt_tokens=prompt, mm_items=items,
            mm_item_offsets=offsets_of(counts), hash_ids=hash_ids, hash_offsets=hash_offsets)
