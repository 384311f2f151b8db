"""The backend interface: execute one scheduled step, say how long it took.

A backend never imports the scheduler; `SchedulerOutput` / `DecodeRun` are the contract.
Cost models compute durations; the GPU backend (gpu_backend/) runs the step for real.
"""

from __future__ import annotations

from typing import Protocol

from simkv.core.outputs import SchedulerOutput


class StepBackend(Protocol):
    name: str
    #: True if `decode_step_line` is available: the replay may then jump over runs of
    #: identical pure-decode steps. Backends that execute steps for real say False.
    supports_decode_runs: bool
    #: True if the backend needs every request of a step listed (block ids included).
    needs_request_detail: bool

    def execute(self, output: SchedulerOutput) -> float:
        """Run (or cost) one step; return its duration in seconds."""

    def decode_step_line(self, num_decodes: int) -> tuple[int, int, int, int]:
        """(a0, a1, b0, b1), integers in clock ticks (simkv.clock): a pure-decode step of
        `num_decodes` requests attending `ctx` context tokens in all lasts
        max(a0 + a1 * ctx, b0 + b1 * ctx) ticks (two lines: the roofline's compute and memory
        time; other models give one line twice). The replay times every pure-decode step with
        it, single steps and runs alike; it equals `execute` to within the clock's resolution
        (half a tick per coefficient)."""

    def describe(self) -> dict:
        """What the backend is, for summary.json."""

    # Optional: `host_seconds(num_seqs) -> float`, the host's share of a step of `num_seqs`
    # sequences, which async scheduling overlaps with the device (simkv/replay/engine.py).
    # Without it a step lasts as long under async scheduling as without.
    # Optional: `lora_seconds(num_lora_tokens, num_active_loras) -> float`, the LoRA kernels a
    # step adds (SchedulerOutput's two counts); the replay adds it to pure-decode steps' lines.


def prefill_work(output: SchedulerOutput) -> tuple[int, int, int]:
    """(prefill tokens, attention query-key pairs, KV tokens read) of the step's prefill chunks.

    A chunk of n new tokens after c cached ones attends c + i + 1 keys for its i-th token:
    n*c + n*(n+1)/2 pairs, and reads the c + n tokens of K/V once.
    """
    tokens = pairs = kv_read = 0
    for chunk in output.chunks:
        n, c = chunk.num_new_tokens, chunk.num_computed_tokens
        tokens += n
        pairs += n * c + n * (n + 1) // 2
        kv_read += c + n
    return tokens, pairs, kv_read


def window_pairs_and_reads(n: int, c: int, window: int) -> tuple[int, int]:
    """(query-key pairs, KV tokens read) of a chunk of n new tokens after c cached ones in a layer
    whose token at position p attends the last min(p + 1, window) tokens."""
    a, b = c + 1, c + n  # the new tokens attend a..b keys without the window
    top = min(b, window)
    pairs = (a + top) * (top - a + 1) // 2 if top >= a else 0
    over = b - max(a - 1, window)
    if over > 0:
        pairs += over * window
    return pairs, min(c + n, window - 1 + n)


def chunk_pairs_and_reads(n: int, c: int, chunk: int) -> tuple[int, int]:
    """(query-key pairs, KV tokens read) of a chunk of n new tokens after c cached ones in a layer
    of chunked local attention: the token at position p attends the tokens of its own chunk up
    to itself, p - floor(p / chunk) x chunk + 1 of them."""
    pairs = 0
    p = c
    while p < c + n:
        start = p // chunk * chunk
        end = min(c + n, start + chunk)  # this chunk's new tokens: [p, end)
        first, last = p - start + 1, end - start
        pairs += (first + last) * (last - first + 1) // 2
        p = end
    return pairs, c + n - c // chunk * chunk


def layer_window_counts(layer_windows: list[int]) -> tuple[tuple[int, int], ...]:
    """(window, number of layers with it) in order of first appearance (0: full attention)."""
    counts: dict[int, int] = {}
    for w in layer_windows:
        counts[w] = counts.get(w, 0) + 1
    return tuple(counts.items())


def windowed_prefill_work(output: SchedulerOutput, window_counts: tuple[tuple[int, int], ...],
                          num_layers: int, chunked: bool = False) -> tuple[int, float, float]:
    """`prefill_work` for a model with sliding-window layers (`window_counts`: layer_window_counts
    of its layers; `chunked`: the windows are attention chunks): pairs and KV reads are averaged
    over the layers (each layer's window applied), so that the per-layer-summed coefficients of a
    cost model apply unchanged."""
    tokens = 0
    pairs = kv_read = 0.0
    for chunk in output.chunks:
        n, c = chunk.num_new_tokens, chunk.num_computed_tokens
        tokens += n
        for w, k in window_counts:
            if not w:
                p, r = n * c + n * (n + 1) // 2, c + n
            elif chunked:
                p, r = chunk_pairs_and_reads(n, c, w)
            elif n == 1:  # a decode: it attends (and reads) its window, or all it has
                p = r = c + 1 if c < w else w
            else:
                p, r = window_pairs_and_reads(n, c, w)
            pairs += k * p / num_layers
            kv_read += k * r / num_layers
    return tokens, pairs, kv_read
