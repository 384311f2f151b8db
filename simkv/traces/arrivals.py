"""Arrival processes shared by all generators: all at once, Poisson, Gamma (bursty)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkv.traces.errors import TraceError

ARRIVAL_KINDS = ("all-at-once", "poisson", "gamma")


@dataclass(frozen=True)
class ArrivalProcess:
    """``kind`` one of ARRIVAL_KINDS; ``rate`` in requests/s; ``cv`` the Gamma gaps' coefficient of variation.

    The first arrival is at 0 s; arrival i is the sum of i independent gaps of mean 1/rate.
    Poisson = exponential gaps (CV 1); Gamma with shape 1/cv^2 is burstier when cv > 1.
    """

    kind: str = "all-at-once"
    rate: float | None = None
    cv: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise TraceError(f"arrival: unknown process {self.kind!r} (choose from {', '.join(ARRIVAL_KINDS)})")
        if self.kind != "all-at-once" and not (self.rate is not None and 0 < self.rate < float("inf")):
            raise TraceError(f"arrival: process {self.kind!r} needs a rate > 0 (--rate)")
        if self.kind == "gamma" and not (0 < self.cv < float("inf")):
            raise TraceError("arrival: the gamma process needs a burstiness --cv > 0")

    def times(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` non-decreasing arrival times in seconds, the first at 0."""
        if count <= 0:
            return np.zeros(0, np.float64)
        if self.kind == "all-at-once":
            return np.zeros(count, np.float64)
        gaps = self.gaps(count - 1, rng)
        return np.concatenate(([0.0], np.cumsum(gaps)))

    def gaps(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` inter-arrival gaps (zeros for all-at-once)."""
        if self.kind == "all-at-once":
            return np.zeros(count, np.float64)
        mean = 1.0 / float(self.rate)
        if self.kind == "poisson":
            return rng.exponential(mean, count)
        shape = 1.0 / (self.cv * self.cv)
        return rng.gamma(shape, mean / shape, count)


def arrival_rng(seed: int, stream: int = 1) -> np.random.Generator:
    """The numpy generator used for arrival times: independent of the size draws of the same seed."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, stream])
