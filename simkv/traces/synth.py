"""Seeded, deterministic workload generators: lognormal (seed article 002), its fast numpy variant.

``lognormal`` reproduces the seed article's generator draw for draw: Python ``random.Random(seed)``,
and for each request first the prompt, then the output:
    prompt = max(min(int(lognormvariate(6.0, 0.7)), 1800), 8)
    output = max(min(int(lognormvariate(4.8, 0.9)), 900), 8)
With n=400 and seed 20261013 this is the ``req400`` workload (276,007 tokens, mean 690.0, longest
request 2,219). ``fast=True`` draws the same distributions with numpy's Generator: vectorised and
suitable for millions of requests, but NOT bit-identical to the Python-random sequence.
Arrival times come from a separate numpy stream, so changing the arrival process never changes sizes.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from simkv.traces.arrivals import ArrivalProcess, arrival_rng
from simkv.traces.build import build_trace
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

REQ400_SEED = 20261013
REQ400_REQUESTS = 400


@dataclass(frozen=True)
class ClippedLognormal:
    """``max(min(int(lognormal(mu, sigma)), high), low)``."""

    mu: float
    sigma: float
    low: int
    high: int

    def check(self, name: str) -> None:
        if not (self.sigma >= 0 and 1 <= self.low <= self.high):
            raise TraceError(f"{name}: need sigma >= 0 and 1 <= min <= max, got {self}")

    def draw_python(self, rng: random.Random) -> int:
        return max(min(int(rng.lognormvariate(self.mu, self.sigma)), self.high), self.low)

    def draw_numpy(self, rng: np.random.Generator, count: int) -> np.ndarray:
        raw = rng.lognormal(self.mu, self.sigma, count)
        return np.clip(np.floor(np.minimum(raw, float(self.high))), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class LognormalSizes:
    """Prompt and output length distributions; defaults are seed article 002's."""

    prompt: ClippedLognormal = ClippedLognormal(6.0, 0.7, 8, 1800)
    output: ClippedLognormal = ClippedLognormal(4.8, 0.9, 8, 900)

    def draw(self, count: int, seed: int, fast: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, output) arrays of ``count`` requests."""
        self.prompt.check("prompt length")
        self.output.check("output length")
        if count < 1:
            raise TraceError(f"need at least 1 request, got {count}")
        if fast:
            rng = np.random.default_rng(seed)
            return self.prompt.draw_numpy(rng, count), self.output.draw_numpy(rng, count)
        return self._draw_exact(count, seed)

    def _draw_exact(self, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = random.Random(seed)
        prompts = np.empty(count, np.int64)
        outputs = np.empty(count, np.int64)
        draw_prompt, draw_output = self.prompt.draw_python, self.output.draw_python
        for i in range(count):
            prompts[i] = draw_prompt(rng)
            outputs[i] = draw_output(rng)
        return prompts, outputs


def lognormal(
    n_requests: int = REQ400_REQUESTS,
    seed: int = REQ400_SEED,
    sizes: LognormalSizes = LognormalSizes(),
    arrival: ArrivalProcess = ArrivalProcess(),
    fast: bool = False,
) -> Trace:
    """The seed-article workload; defaults give req400 (all requests at t=0)."""
    prompts, outputs = sizes.draw(n_requests, seed, fast)
    times = arrival.times(n_requests, arrival_rng(seed))
    return build_trace(f"synth:lognormal(seed={seed})", arrival_time_s=times, prompt_tokens=prompts, output_tokens=outputs)
