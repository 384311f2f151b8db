"""GPU utilisation as an autoscaler reads it (`--autoscale-metric gpu_util=0.7`): NVIDIA DCGM's
`DCGM_FI_DEV_GPU_UTIL`, the share of the last sample period in which a kernel ran on the GPU,
which dcgm-exporter reports every WINDOW_S seconds (its default collection interval) and HPA
or KEDA average over the pods.

A replica's GPUs are taken as busy while its engine runs a step (the steps' durations in its
step log, as they end strictly before the decision instant; a step still running counts from
the next decision on), so a replica with any request running reads close to 1 whether it
serves one request or a full batch. Summed over the replicas up and aimed at `target` each
(an AverageValue target, 0.7 by default), as vLLM's gauges are. Not modelled: the host's
share of a step where the GPU idles (under synchronous scheduling a few percent of a step),
pipeline stages (each stage's GPUs busy in turn: refused).
"""

from __future__ import annotations

from collections import deque

from simkv.clock import to_ticks

WINDOW_S = 30.0  # dcgm-exporter's default collection interval (-c 30000 ms)


class BusyWindow:
    """One replica's busy share over the WINDOW_S seconds before an instant, read from its step
    log at instants that never decrease."""

    def __init__(self, steps, window_s: float = WINDOW_S) -> None:
        self.steps = steps
        self.window = max(1, to_ticks(window_s))
        self.cursor = (0, 0)  # (StepLog.ended_steps': the steps read)
        self.spans: deque[tuple[int, int]] = deque()  # (start, end) ticks of the steps ended lately

    def share(self, tick: int) -> float:
        """The share of [tick - window, tick) in which the replica ran steps."""
        ended, self.cursor = self.steps.ended_steps(self.cursor, tick)
        self.spans.extend((end - ticks, end) for _, end, ticks, _ in ended)
        low = tick - self.window
        while self.spans and self.spans[0][1] <= low:
            self.spans.popleft()
        busy = sum(min(end, tick) - max(start, low) for start, end in self.spans)
        return min(1.0, busy / self.window)
