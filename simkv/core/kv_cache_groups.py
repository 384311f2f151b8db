"""KV-cache groups: which layers share a block table, as vLLM's hybrid KV-cache manager forms them.

A model whose layers all attend the whole sequence has one group: one block holds every
layer's K/V for `block_size` tokens. A model with sliding-window layers (Gemma 2/3, Mistral
7B v0.1) gets a group per attention type, split so that every group has the same number of
layers (`layers_per_block`, padded where a type has fewer): one block holds that many layers'
K/V, every group allocates its own blocks from the one shared pool, and a sliding-window
group gives back the blocks that fall out of its window (core/kv_cache_coordinator.py). Chunked
local attention (Llama 4) groups the same way: its local layers attend only the tokens of their own
`attention_chunk_size`-token chunk, and give back a chunk's blocks once the next chunk starts.
Linear-attention layers (Qwen3-Next's Gated DeltaNet, Mamba2) group the same way too (vLLM's
MambaSpec groups): a block of theirs holds one request's whole state for `layers_per_block` layers,
padded to the attention layers' page, and a request holds one per group while it runs (prefix
caching off: vLLM's mamba_cache_mode "none").

vLLM's rule (kv_cache_planning._get_kv_cache_groups_uniform_page_size): layers are bucketed by
type in order of first appearance; the group size is the smallest bucket's layer count, or the
largest's if that is under 1.5 times the smallest; bucket b splits into ceil(len(b) / size)
groups. `--disable-hybrid-kv-cache-manager` promotes sliding-window layers of a mixed model to
full attention for allocation (they still attend only their window); a model whose layers all
slide with one window keeps its single sliding-window group.
"""

from __future__ import annotations

from dataclasses import dataclass

LINEAR_ATTENTION = -1  # a layer's entry in `group_layers`'s windows: linear attention (a state, no K/V)


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    sliding_window: int  # 0: full attention (with `chunked`: the attention chunk size)
    num_layers: int  # real layers (the group is padded to `layers_per_block`)
    chunked: bool = False  # chunked local attention: `sliding_window` is the chunk size
    linear: bool = False  # linear attention: a state per request (vLLM's MambaSpec)

    @property
    def kind(self) -> str:
        if self.linear:
            return "mamba"
        if not self.sliding_window:
            return "full_attention"
        return (f"chunked_local_attention({self.sliding_window})" if self.chunked
                else f"sliding_window({self.sliding_window})")


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroupSpec, ...]
    layers_per_block: int  # K/V of this many layers (padding included) fill one block

    @property
    def chunked(self) -> bool:
        """The local groups are chunked local attention, not sliding windows."""
        return any(g.chunked for g in self.groups)

    @property
    def has_sliding_window(self) -> bool:
        """Some group frees blocks outside its window: the scheduler needs KVCacheCoordinator."""
        return any(g.sliding_window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Groups of several kinds, or of local layers (vLLM's hybrid KV-cache manager): a block
        holds `layers_per_block` layers and a request's blocks are counted per group."""
        return self.has_sliding_window or self.num_linear_groups > 0

    @property
    def num_linear_groups(self) -> int:
        """Groups of linear-attention layers: a request holds one state block in each."""
        return sum(g.linear for g in self.groups)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def num_padding_layers(self) -> int:
        return len(self.groups) * self.layers_per_block - sum(g.num_layers for g in self.groups)

    def describe(self) -> dict:
        return {"groups": [g.kind for g in self.groups], "layers_per_block": self.layers_per_block,
                "num_padding_layers": self.num_padding_layers}

    def summary(self) -> str:
        """E.g. '6 x sliding_window(1024) + 1 x full_attention'."""
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.kind] = counts.get(g.kind, 0) + 1
        return " + ".join(f"{n} x {kind}" for kind, n in counts.items())


def group_layers(layer_windows: list[int], disable_hybrid: bool = False, chunked: bool = False) -> KVCacheGroups:
    """The KV-cache groups of a model whose layer i attends `layer_windows[i]` tokens (0: all;
    `chunked`: the tokens of its own chunk of that many; LINEAR_ATTENTION: none, a state)."""
    windows = list(layer_windows)
    if disable_hybrid and 0 in windows and any(w > 0 for w in windows):
        windows = [min(w, 0) for w in windows]  # mixed types: sliding layers allocate like full attention
    buckets: dict[int, int] = {}
    for w in windows:
        buckets[w] = buckets.get(w, 0) + 1
    if len(buckets) == 1:
        (w, n), = buckets.items()
        return KVCacheGroups((_group(w, n, chunked),), n)
    smallest, largest = min(buckets.values()), max(buckets.values())
    size = largest if largest < smallest * 1.5 else smallest
    groups = []
    for w, n in buckets.items():
        num_groups = -(-n // size)
        # layers[i::num_groups] go to group i: sizes differ by at most one
        groups += [_group(w, len(range(i, n, num_groups)), chunked) for i in range(num_groups)]
    return KVCacheGroups(tuple(groups), size)


def _group(window: int, num_layers: int, chunked: bool) -> KVCacheGroupSpec:
    if window == LINEAR_ATTENTION:
        return KVCacheGroupSpec(0, num_layers, linear=True)
    return KVCacheGroupSpec(window, num_layers, chunked and window > 0)


def admission_cap_blocks(span: int, chunked: bool, max_in_flight_tokens: int, max_model_len: int,
                         block_size: int) -> int:
    """Blocks a local group holds for one request at most (vLLM's max_admission_blocks_per_request):
    a sliding window of `span` keeps its last span - 1 tokens and the tokens in flight, plus a block
    for a window that starts inside one; an attention chunk of `span` its chunk and the tokens in
    flight."""
    if chunked:
        return -(-min(span + max_in_flight_tokens, max_model_len) // block_size)
    return -(-min(span - 1 + max_in_flight_tokens, max_model_len) // block_size) + 1


def reachable_window_blocks(start: int, end: int, need: int, block_size: int, alignment: int,
                            retention: int | None, boundaries, final_end: int | None = None) -> list[int] | None:
    """The blocks in [start, end) of a sliding-window group that a later prefix hit can end at
    (vLLM's SlidingWindowManager.reachable_block_mask, without EAGLE's shift), in order; None:
    every block. A hit needs the `need` blocks before its end, and ends on a multiple of
    `alignment` tokens (the block for the GPU prefix cache, the chunk for KV offloading).
    `retention` (vLLM's prefix_cache_retention_interval): None, a hit at every alignment
    boundary; R > 0, the tails before every multiple of R; 0, none of those. With a retention
    the tails before `boundaries` (token positions: the prompt's last token, a shared-prefix
    junction) are kept; without one, the tail of the final segment ending at block `final_end`."""
    segment = alignment if retention is None else retention or None
    keep: set[int] = set()
    if segment is not None:
        per_segment = segment // block_size
        if need >= per_segment:
            return None
        keep.update(i for i in range(start, end) if i % per_segment >= per_segment - need)
        if final_end is not None and final_end % per_segment:
            keep.update(range(max(start, final_end - final_end % per_segment, final_end - need), min(end, final_end)))
    if retention is not None:
        for boundary in boundaries:
            stop = boundary // alignment * alignment // block_size
            keep.update(range(max(start, stop - need), min(end, stop)))
    return sorted(keep)
