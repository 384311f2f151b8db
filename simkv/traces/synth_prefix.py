"""``shared-prefix``: groups (tenants, system prompts) whose requests start with the group's prefix.

Request i belongs to group ``i % G`` (round-robin) or to a seeded random group. Its prompt is the
group's P_g shared tokens followed by its own tokens; its own prompt and output lengths are drawn
exactly as ``lognormal`` draws them (same seed -> same own lengths). The shared part is expressed
with block hashes: group g's k-th block of ``hash_block_tokens`` tokens has id ``g * stride + k``;
own tokens carry no hash (they are unique). Every P_g must be a multiple of ``hash_block_tokens``
so that no own token falls inside a hashed block.

The VLLM_SEMANTICS "req400 + 10 prefix groups" workload is ``shared_prefix(groups=10,
prefix_tokens=(1000,), hash_block_tokens=8)``: 125 group-specific ids per request.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkv.traces.arrivals import ArrivalProcess, arrival_rng
from simkv.traces.build import build_trace, consecutive_ids
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace
from simkv.traces.synth import REQ400_REQUESTS, REQ400_SEED, LognormalSizes

ASSIGNMENTS = ("round-robin", "random")


@dataclass(frozen=True)
class PrefixGroups:
    """G groups with prefix lengths (one value for all groups, or one per group)."""

    groups: int = 10
    prefix_tokens: tuple[int, ...] = (1000,)
    hash_block_tokens: int | None = None
    assign: str = "round-robin"
    salt_per_group: bool = False

    def lengths(self) -> np.ndarray:
        """Prefix length of each group (validated)."""
        if self.groups < 1:
            raise TraceError(f"shared-prefix: --groups must be >= 1, got {self.groups}")
        if len(self.prefix_tokens) not in (1, self.groups):
            raise TraceError(
                f"shared-prefix: give one --prefix-tokens value or {self.groups}, got {len(self.prefix_tokens)}"
            )
        lengths = np.broadcast_to(np.asarray(self.prefix_tokens, np.int64), (self.groups,)).copy()
        if (lengths < 0).any():
            raise TraceError("shared-prefix: prefix lengths must be >= 0")
        if self.assign not in ASSIGNMENTS:
            raise TraceError(f"shared-prefix: --assign must be one of {', '.join(ASSIGNMENTS)}")
        return lengths

    def block_tokens(self, lengths: np.ndarray) -> int:
        """The explicit hash block size, or the largest of 16, 8, 4, 2, 1 dividing every prefix."""
        if self.hash_block_tokens is not None:
            if self.hash_block_tokens < 1 or (lengths % self.hash_block_tokens).any():
                raise TraceError(
                    f"shared-prefix: every prefix length must be a multiple of --hash-block-tokens "
                    f"{self.hash_block_tokens}"
                )
            return self.hash_block_tokens
        return next(size for size in (16, 8, 4, 2, 1) if not (lengths % size).any())


def shared_prefix(
    spec: PrefixGroups = PrefixGroups(),
    n_requests: int = REQ400_REQUESTS,
    seed: int = REQ400_SEED,
    sizes: LognormalSizes = LognormalSizes(),
    arrival: ArrivalProcess = ArrivalProcess(),
    fast: bool = False,
) -> Trace:
    """Requests = group prefix + own lognormal-drawn tokens."""
    lengths = spec.lengths()
    block = spec.block_tokens(lengths)
    own_prompt, output = sizes.draw(n_requests, seed, fast)
    group = _groups(spec, n_requests, seed)
    blocks_per_group = lengths // block
    stride = max(int(blocks_per_group.max()), 1)
    hash_ids, offsets = consecutive_ids(group * stride, blocks_per_group[group])
    salt = np.array([f"group-{g}" for g in range(spec.groups)], dtype=object)[group] if spec.salt_per_group else None
    return build_trace(
        f"synth:shared-prefix(seed={seed})",
        arrival_time_s=arrival.times(n_requests, arrival_rng(seed)),
        prompt_tokens=lengths[group] + own_prompt,
        output_tokens=output,
        hash_ids=hash_ids if len(hash_ids) else None,
        hash_offsets=offsets if len(hash_ids) else None,
        hash_block_tokens=block,
        cache_salt=salt,
    )


def _groups(spec: PrefixGroups, count: int, seed: int) -> np.ndarray:
    if spec.assign == "round-robin":
        return np.arange(count, dtype=np.int64) % spec.groups
    return arrival_rng(seed, stream=2).integers(0, spec.groups, count).astype(np.int64)
