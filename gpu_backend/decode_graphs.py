"""CUDA graphs for decode-only steps, one per padded batch size, as vLLM captures them.

A decode step of an 8B model issues about a thousand kernels; launched one by one from
Python, the host takes longer to issue them than the GPU takes to run them (the first H200
calibration fitted a 21.5 ms intercept for a step whose weights read in about 4 ms). vLLM
captures the decode forward in CUDA graphs for a ladder of batch sizes and pads each batch up
to the next size; this module does the same for the lean forward of `gpu_backend/model.py`.

Static buffers hold the inputs of the largest size; a graph of size b reads their first b
rows. A batch of n decodes is copied in and padded to b: pad rows write no KV (slot -1),
attend to one slot of the null block 0, and their logits are dropped. The attention kernels'
tile configuration is fixed at capture for the longest context the model allows (for decode
the kernels only split keys into more segments than a short context needs; empty segments
are skipped and merged away), so one graph serves every context length.

`capture=False` runs the same padded static-buffer forward eagerly: on CPU this checks the
padding and the buffer handling (tests/gpu_backend/test_decode_graphs.py); the graphs
themselves need CUDA (tests marked cuda compare their logits with the eager forward).
"""

from __future__ import annotations

import gc

import numpy as np
import torch

from gpu_backend.model import AttentionInputs
from simkv.calibration.costmodel import padded_size

def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes captured: vLLM's default ladder (1, 2, 4, then every 8) up to the first size
    that holds `max_batch` decodes."""
    ladder = [1, 2, 4] + list(range(8, max(max_batch, 8) + 8, 8))
    out = [s for s in ladder if s < max_batch]
    return out + [next(s for s in ladder if s >= max_batch)]


def capture_graph(fn, pool):
    """(graph, what `fn` returned): `fn` captured into a CUDA graph drawing on memory `pool`.
    Python's gc.collect and torch.cuda.empty_cache are suspended meanwhile: torch's capture calls
    both each time, which costs minutes over the ~1,700 captures of piecewise graphs with a
    replay's heap and caches (vLLM suspends them during its captures too)."""
    collect, gc.collect = gc.collect, (lambda *args, **kwargs: 0)
    empty_cache, torch.cuda.empty_cache = torch.cuda.empty_cache, (lambda: None)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            result = fn()
    finally:
        gc.collect = collect
        torch.cuda.empty_cache = empty_cache
    return graph, result


def upload(graphs, device) -> None:
    """Replay each graph once (the first replay uploads it: not in a timed step)."""
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize(device)


def load_static(pairs) -> None:
    """Copy host arrays into the leading rows of static device buffers: (buffer, array) pairs."""
    for static, host in pairs:
        static[:len(host)].copy_(torch.from_numpy(np.ascontiguousarray(host)), non_blocking=True)


class DecodeGraphs:
    """Decode-only forwards on static buffers, replayed from CUDA graphs (or run eagerly)."""

    def __init__(self, runner, max_batch: int, capture: bool = True) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_batch)
        size = self.sizes[-1]
        dev = runner.device
        self.max_seq_len = runner.max_positions
        self.max_blocks = -(-self.max_seq_len // runner.block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((size, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(size, dtype=torch.int64, device=dev)
        self.captured = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int | None:
        """The captured size a batch of n decodes is padded to (None: larger than any)."""
        return padded_size(self.sizes, n) or None

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        attn = AttentionInputs(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                               self.query_start_loc[:b + 1], 1, self.max_seq_len)
        return r.model.forward(self.input_ids[:b], self.positions[:b], attn, r.kv_caches, self.logits_indices[:b], r.ops)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._forward(b)  # compiles the kernels of this size outside the capture
            torch.cuda.synchronize(self.runner.device)
            self.graphs[b], self.outputs[b] = capture_graph(lambda: self._forward(b), pool)
        upload(self.graphs.values(), self.runner.device)

    def fits(self, batch) -> bool:
        return (batch.max_query_len == 1 and len(batch.seq_lens) <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks and len(batch.logits_indices) == len(batch.seq_lens))

    def stage(self, batch) -> tuple[int, int]:
        """Copy a decode-only StepBatch of n sequences into the static buffers, padded to the
        captured size b; returns (n, b). Block-table columns past the batch's longest table keep
        what earlier steps left there: no sequence reads past its own blocks, and a pad row reads
        only its column 0, which is zeroed here (the null block)."""
        n = len(batch.seq_lens)
        b = self.bucket(n)
        ids = np.zeros(b, dtype=np.int64)
        ids[:n] = batch.input_ids
        pos = np.zeros(b, dtype=np.int64)
        pos[:n] = batch.positions
        slots = np.full(b, -1, dtype=np.int64)
        slots[:n] = batch.slot_mapping
        lens = np.ones(b, dtype=np.int32)
        lens[:n] = batch.seq_lens
        qsl = np.arange(b + 1, dtype=np.int32)  # one query token per row, pads included
        width = batch.block_tables.shape[1]
        tables = np.zeros((b, width), dtype=np.int32)
        tables[:n] = batch.block_tables
        load_static(((self.input_ids, ids), (self.positions, pos), (self.slot_mapping, slots),
                     (self.seq_lens, lens), (self.query_start_loc, qsl)))
        self.block_tables[:b, :width].copy_(torch.from_numpy(tables), non_blocking=True)
        return n, b

    def run(self, batch) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only StepBatch of n sequences (`fits(batch)`)."""
        n, b = self.stage(batch)
        if self.captured:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._forward(b)[:n]
