"""The designed grid of step shapes that `simkv calibrate` measures.

Four families, each a full factorial over two axes:
  decode   B decodes at context C                       (batch size x context length)
  ragged   B decodes with contexts spread evenly over [C/4, 7C/4] (mean C): a replay's
           decodes have every length, and a kernel may care about more than their sum
  prefill  n new tokens after c cached                  (chunk size x cached context): one
           chunk, or split evenly over the fewest sequences max_model_len allows
  mixed    k chunks of n tokens + B decodes at context C (the steps chunked prefill makes)
Points beyond `max_num_batched_tokens` (a step never schedules more) or beyond the KV pool
are dropped. Points are measured in a shuffled order with the corners first, so a run cut
short by its time budget still spans the space.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simkv.calibration.costmodel import shape_features

PRESETS = {
    # CPU / tiny model: small steps, a CI run takes well under two minutes.
    "tiny": {
        "decode": {"batch": [1, 2, 4, 8, 16, 24, 32], "context": [16, 64, 160, 320]},
        "ragged": {"batch": [8, 32], "context": [64, 256]},
        "prefill": {"chunk": [8, 16, 32, 64, 128, 256], "cached": [0, 64, 256]},
        "mixed": {"chunks": [1, 2], "chunk": [16, 64, 160], "batch": [2, 8, 16], "context": [64, 256]},
    },
    # GPU / 7-8B models, up to vLLM's batch defaults on a B200 (1,024 sequences, 16,384 tokens);
    # a calibration's --max-num-seqs / --max-num-batched-tokens and its KV pool drop what is beyond.
    "default": {
        "decode": {"batch": [1, 4, 16, 32, 64, 128, 256, 512, 1024], "context": [128, 512, 1024, 2048, 4096]},
        "ragged": {"batch": [16, 64, 256, 1024], "context": [512, 2048]},
        "prefill": {"chunk": [16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384], "cached": [0, 1024, 4096]},
        "mixed": {"chunks": [1, 2], "chunk": [64, 512, 2048], "batch": [8, 32, 128, 512], "context": [512, 2048]},
    },
}


@dataclass
class GridPoint:
    family: str
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (cached, new)
    decodes: list[int] = field(default_factory=list)  # cached context of each decode

    @property
    def features(self) -> tuple[int, int, int, int, int]:
        return shape_features(self.prefills, self.decodes)

    @property
    def tokens(self) -> int:
        return self.features[0]

    def describe(self) -> dict:
        d = {"family": self.family}
        if self.prefills:
            d["chunks"] = len(self.prefills)
            d["chunk_tokens"] = self.prefills[0][1]
            d["cached_tokens"] = self.prefills[0][0]
        if self.decodes:
            d["batch"] = len(self.decodes)
            d["context"] = self.decodes[0] if self.family != "ragged" else sum(self.decodes) // len(self.decodes)
        return d

    def label(self) -> str:
        d = self.describe()
        parts = [d["family"]]
        if "chunks" in d:
            parts.append(f"{d['chunks']}x{d['chunk_tokens']}@{d['cached_tokens']}")
        if "batch" in d:
            parts.append(f"B{d['batch']}@{d['context']}")
        return " ".join(parts)


def ragged_contexts(batch: int, context: int) -> list[int]:
    """`batch` contexts spread evenly over [context/4, 7*context/4], mean `context` (one if batch is 1)."""
    if batch == 1:
        return [context]
    lo, hi = context // 4, (7 * context) // 4
    return [lo + (hi - lo) * i // (batch - 1) for i in range(batch)]


def prefill_chunks(cached: int, new: int, max_model_len: int) -> list[tuple[int, int]]:
    """`new` prefill tokens after `cached`: one chunk when a sequence can hold them, else split
    evenly over the fewest sequences that can (each after `cached`), as a step of a full token
    budget over shorter prompts is; one chunk (dropped as too long) when no sequence can."""
    room = max_model_len - 1 - cached
    if cached + new < max_model_len or room < 1:
        return [(cached, new)]
    k = -(-new // room)
    return [(cached, new // k + (1 if i < new % k else 0)) for i in range(k)]


def blocks_for(point: GridPoint, block_size: int) -> int:
    return (sum(-(-(c + n) // block_size) for c, n in point.prefills)
            + sum(-(-(ctx + 1) // block_size) for ctx in point.decodes))


def build_grid(preset: str | dict = "default", max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
               max_model_len: int = 8192, num_blocks: int | None = None, block_size: int = 16,
               seed: int = 0) -> tuple[list[GridPoint], list[dict]]:
    """The points to measure, in measuring order, and the points dropped (with the reason)."""
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    points: list[GridPoint] = []
    d, p, m = spec["decode"], spec["prefill"], spec["mixed"]
    for b in d["batch"]:
        for c in d["context"]:
            points.append(GridPoint("decode", [], [c] * b))
    for b in spec.get("ragged", {}).get("batch", []):
        for c in spec["ragged"]["context"]:
            points.append(GridPoint("ragged", [], ragged_contexts(b, c)))
    for n in p["chunk"]:
        for c in p["cached"]:
            points.append(GridPoint("prefill", prefill_chunks(c, n, max_model_len), []))
    for k in m["chunks"]:
        for n in m["chunk"]:
            for b in m["batch"]:
                for c in m["context"]:
                    points.append(GridPoint("mixed", [(0, n)] * k, [c] * b))
    kept, dropped = [], []
    for pt in points:
        reason = None
        seqs = len(pt.prefills) + len(pt.decodes)
        longest = max([c + n for c, n in pt.prefills] + [c + 1 for c in pt.decodes])
        if pt.tokens > max_num_batched_tokens:
            reason = f"{pt.tokens} tokens > max_num_batched_tokens {max_num_batched_tokens}"
        elif seqs > max_num_seqs:
            reason = f"{seqs} sequences > max_num_seqs {max_num_seqs}"
        elif longest >= max_model_len:
            reason = f"context {longest} >= max_model_len {max_model_len}"
        elif num_blocks is not None and blocks_for(pt, block_size) > num_blocks - 1:
            reason = f"needs {blocks_for(pt, block_size)} KV blocks > pool {num_blocks - 1}"
        if reason:
            dropped.append({**pt.describe(), "reason": reason})
        else:
            kept.append(pt)
    return order_points(kept, seed), dropped


def order_points(points: list[GridPoint], seed: int = 0) -> list[GridPoint]:
    """Extremes of each family first (they pin the fit), the rest shuffled."""
    rng = np.random.default_rng(seed)
    first, rest = [], []
    for fam in ("decode", "ragged", "prefill", "mixed"):
        fam_pts = [p for p in points if p.family == fam]
        if not fam_pts:
            continue
        by_tokens = sorted(fam_pts, key=lambda p: (p.tokens, p.features[4] + p.features[3]))
        ends = {id(by_tokens[0]), id(by_tokens[-1])}
        first += [p for p in fam_pts if id(p) in ends]
        rest += [p for p in fam_pts if id(p) not in ends]
    order = rng.permutation(len(rest))
    return first + [rest[i] for i in order]
