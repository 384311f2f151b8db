"""Piecewise CUDA graphs for steps with prefill chunks, as vLLM v1 runs mixed batches.

vLLM's default `cudagraph_mode` (FULL_AND_PIECEWISE) replays decode-only batches from full CUDA
graphs (`gpu_backend/decode_graphs.py` here) and every other batch of up to a few hundred
tokens from *piecewise* graphs: the model is cut at each attention, the pieces between
attentions (norms, projections, rotary, MLP) are captured once per padded token count, and
attention runs eagerly in between, because its launch depends on the batch's sequences and
lengths, not only on its token count. A step then issues one graph replay per piece and the
attention launches, instead of about ten kernels per layer.

Here the pieces are the lean forward's own (`LeanLlama.embed_tokens` + `attention_inputs`,
`after_attention` + `attention_inputs`, ..., `after_attention`), over one `Activations` set
of the largest size; a batch of n tokens runs on its first b rows, b the next captured size.
Pad rows compute on stale inputs that no real row reads (every operation of a piece works row
by row; the pads' KV slots are -1, so nothing is written, and the attention kernel leaves rows
past the batch's last query unwritten). Logits are computed eagerly from the sampling rows.

`capture=False` runs the same pieces on the same padded buffers eagerly: on CPU this checks
the padding and buffer handling (tests/gpu_backend/test_piecewise_graphs.py); the graphs
themselves need CUDA (a test marked cuda compares their logits with the eager forward).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from gpu_backend.decode_graphs import capture_graph, load_static, upload
from gpu_backend.model import AttentionInputs
from simkv.calibration.costmodel import padded_size


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token counts captured: vLLM's ladder (1, 2, 4, then every 8 up to 256, every 16 above)
    up to the first size that holds `max_tokens`."""
    ladder = [1, 2, 4] + list(range(8, 257, 8))
    ladder += list(range(272, max(max_tokens, 256) + 16, 16))
    out = [s for s in ladder if s < max_tokens]
    return out + [next(s for s in ladder if s >= max_tokens)]


def capture_order(sizes: list[int]) -> list[int]:
    """The largest size, then the powers of two, then the rest, each group largest first: a
    capture cut short by its budget still covers every step, at a coarser padding."""
    largest = max(sizes)
    twos = sorted((s for s in sizes if s != largest and s & (s - 1) == 0), reverse=True)
    rest = sorted((s for s in sizes if s != largest and s & (s - 1) != 0), reverse=True)
    return [largest] + twos + rest


class PiecewiseGraphs:
    """The forward's pieces between attentions, replayed from CUDA graphs (or run eagerly)."""

    def __init__(self, runner, max_tokens: int, capture: bool = True, sizes: list[int] | None = None,
                 capture_budget_s: float | None = None) -> None:
        """`capture_budget_s` (default: $SIMKV_GRAPH_CAPTURE_BUDGET_S, else none) stops capturing
        once spent: the largest size first, then the powers of two, then the rest; `sizes` then
        lists the captured ones, and a step pads to the next of them (slower, not wrong)."""
        self.runner = runner
        self.sizes = sorted(sizes) if sizes else piecewise_sizes(max_tokens)
        if capture_budget_s is None and os.environ.get("SIMKV_GRAPH_CAPTURE_BUDGET_S"):
            capture_budget_s = float(os.environ["SIMKV_GRAPH_CAPTURE_BUDGET_S"])
        self.capture_budget_s = capture_budget_s
        self.cut_short = False
        size = self.sizes[-1]
        dev = runner.device
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.act = runner.model.new_activations(size, zeroed=True)
        self.captured = capture
        self.graphs: dict[int, list] = {}
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int | None:
        """The captured size a batch of n tokens is padded to (None: larger than any)."""
        return padded_size(self.sizes, n) or None

    def fits(self, batch) -> bool:
        return 0 < len(batch.input_ids) <= self.sizes[-1]

    def _pieces(self, b: int) -> list:
        """The callables between attentions for a batch of b rows: before layer 0's attention,
        between layer i-1's and layer i's, after the last one."""
        model, ops, act = self.runner.model, self.runner.ops, self.act.head(b)
        ids, pos, layers = self.input_ids[:b], self.positions[:b], model.layers

        def first() -> None:
            model.embed_tokens(ids, pos, act)
            model.attention_inputs(layers[0], act, ops, first=True)

        def between(i: int):
            def piece() -> None:
                model.after_attention(layers[i - 1], act, ops)
                model.attention_inputs(layers[i], act, ops, first=False)
            return piece

        def last() -> None:
            model.after_attention(layers[-1], act, ops)

        return [first] + [between(i) for i in range(1, len(layers))] + [last]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for b in capture_order(self.sizes):  # largest first: smaller sizes reuse its memory
            if self.graphs and self.capture_budget_s is not None and time.perf_counter() - t0 > self.capture_budget_s:
                break
            pieces = self._pieces(b)
            for piece in pieces:  # compiles this size's kernels outside the capture
                piece()
            torch.cuda.synchronize(self.runner.device)
            self.graphs[b] = [capture_graph(piece, pool)[0] for piece in pieces]
        self.cut_short = len(self.graphs) < len(self.sizes)
        self.sizes = sorted(self.graphs)
        upload([g for graphs in self.graphs.values() for g in graphs], self.runner.device)

    @torch.inference_mode()
    def run(self, batch, attn: AttentionInputs, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] of a StepBatch of n tokens (`fits(batch)`); `attn`
        holds the batch's metadata on the device (its slot mapping is replaced by the padded one)."""
        r = self.runner
        n = len(batch.input_ids)
        b = self.bucket(n)
        slots = np.full(b, -1, dtype=np.int64)
        slots[:n] = batch.slot_mapping
        load_static(((self.input_ids, batch.input_ids), (self.positions, batch.positions), (self.slot_mapping, slots)))
        padded = AttentionInputs(self.slot_mapping[:b], attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                 attn.max_query_len, attn.max_seq_len)
        act = self.act.head(b)
        steps = self.graphs[b] if self.captured else self._pieces(b)
        run = (lambda s: s.replay()) if self.captured else (lambda s: s())
        run(steps[0])
        plan = None
        for i in range(len(r.model.layers)):
            plan = r.model.attend(i, act, padded, r.kv_caches, r.ops, plan)
            run(steps[i + 1])
        return r.model.logits(act, logits_indices, r.ops)
