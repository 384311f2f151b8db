"""The backend interface: execute one scheduled step, say how long it took.

A backend never imports the scheduler; `SchedulerOutput` / `DecodeRun` are the contract.
Cost models compute durations; the GPU backend (gpu_backend/) runs the step for real.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from simkv.core.outputs import SchedulerOutput


class StepBackend(Protocol):
    name: str
    #: True if `decode_run_durations` is available: the replay may then jump over runs of
    #: identical pure-decode steps. Backends that execute steps for real say False.
    supports_decode_runs: bool
    #: True if the backend needs every request of a step listed (block ids included).
    needs_request_detail: bool

    def execute(self, output: SchedulerOutput) -> float:
        """Run (or cost) one step; return its duration in seconds."""

    def decode_run_durations(self, num_decodes: int, first_context_tokens: int, num_steps: int) -> np.ndarray:
        """Durations of `num_steps` pure-decode steps of `num_decodes` requests; step j attends
        `first_context_tokens + j * num_decodes` tokens. Must equal calling `execute` on each
        step one by one, bit for bit."""

    def decode_run_durations_list(self, num_decodes: int, first_context_tokens: int, num_steps: int) -> list[float]:
        """The same durations as Python floats, for short runs (numpy's per-call overhead
        dominates below a few dozen steps). Bit for bit equal to `decode_run_durations`."""

    def describe(self) -> dict:
        """What the backend is, for summary.json."""


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
