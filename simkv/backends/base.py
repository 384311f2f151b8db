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
