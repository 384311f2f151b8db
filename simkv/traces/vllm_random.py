"""The traffic of `vllm bench serve --dataset-name random`, drawn as vLLM 0.33's client draws it.

Lengths (RandomDataset, get_sampling_params): numpy's default_rng(seed) draws every request's
sampled input length uniformly from [floor(r * (1 - ratio)), ceil(r * (1 + ratio))], where r is
--random-input-len less the special tokens the tokenizer adds (`num_special_tokens`: 1 for a
BOS token as Llama's, Mistral's, Gemma's and DeepSeek's tokenizers add; 0 for Qwen's), then
every output length from [floor(o * (1 - ratio)), ceil(o * (1 + ratio))] (at least 1). A prompt
is the --random-prefix-len tokens every request shares, then its own sampled tokens (a run
starting at a random vocabulary offset: no two prompts share a block past the prefix); the
server adds the special tokens in front, so it sees num_special_tokens + prefix + sampled
tokens, of which the first num_special_tokens + prefix are the same in every prompt.

Arrivals (get_request): none at --request-rate inf (every request at once); else, after
numpy's global np.random.seed(seed), one gamma draw per request of shape --burstiness and
scale 1 / (rate x burstiness) (exponential gaps at burstiness 1), summed and rescaled so that
the last request is sent at num_prompts / rate; with --ramp-up-strategy each gap's rate goes
linearly or exponentially from --ramp-up-start-rps to --ramp-up-end-rps (and no rescaling).

Both are checked against vLLM 0.33's own functions (tests/traces/test_vllm_random.py holds
draws recorded from them). Not reproduced: the client's decode-and-re-encode of a prompt, which
can shift a length by a token or two with some tokenizers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simkv.traces.build import build_trace, consecutive_ids
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

REQUEST_ID_PREFIX = "bench-"  # (as `simkv trace import vllm-bench` names a result's requests: compare pairs them)


@dataclass(frozen=True)
class RandomDataset:
    """vllm bench serve's random dataset and request schedule (its flags' names)."""

    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    input_range_ratio: float = 0.0
    output_range_ratio: float = 0.0
    random_prefix_len: int = 0
    seed: int = 0
    request_rate: float = math.inf
    burstiness: float = 1.0
    ramp_up_strategy: str | None = None  # "linear" or "exponential"
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    num_special_tokens: int = 1

    def check(self) -> None:
        if self.num_prompts < 1:
            raise TraceError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        for name in ("input_range_ratio", "output_range_ratio"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise TraceError(f"--random-range-ratio: {name.split('_')[0]} ratio must be in [0, 1), "
                                 f"got {getattr(self, name)}")
        if self.random_prefix_len < 0 or self.random_output_len < 0 or self.random_input_len < 0:
            raise TraceError("--random-input-len, --random-output-len and --random-prefix-len must be >= 0")
        if self.random_prefix_len + self._input_bounds()[0] < 1:
            raise TraceError("--random-input-len is too small: a prompt of the prefix and its sampled tokens "
                             "would be empty")
        if not self.burstiness > 0:
            raise TraceError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.ramp_up_strategy is not None:
            if self.ramp_up_strategy not in ("linear", "exponential"):
                raise TraceError(f"--ramp-up-strategy must be linear or exponential, got {self.ramp_up_strategy!r}")
            if self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
                raise TraceError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
            if not (self.ramp_up_start_rps > 0 and self.ramp_up_end_rps > 0):
                raise TraceError("--ramp-up-start-rps and --ramp-up-end-rps must be > 0 here (a rate of 0 sends "
                                 "nothing)")
        elif not self.request_rate > 0:
            raise TraceError(f"--request-rate must be > 0, got {self.request_rate}")

    def _input_bounds(self) -> tuple[int, int]:
        real = max(0, self.random_input_len - self.num_special_tokens)
        return (math.floor(real * (1 - self.input_range_ratio)), math.ceil(real * (1 + self.input_range_ratio)))

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(sampled input tokens, output tokens) of every request, as the client draws them."""
        rng = np.random.default_rng(self.seed)
        low, high = self._input_bounds()
        out_low = max(math.floor(self.random_output_len * (1 - self.output_range_ratio)), 1)
        out_high = max(math.ceil(self.random_output_len * (1 + self.output_range_ratio)), 1)
        sampled = rng.integers(low, high + 1, size=self.num_prompts)
        output = rng.integers(out_low, out_high + 1, size=self.num_prompts)
        return sampled.astype(np.int64), output.astype(np.int64)

    def send_times(self) -> np.ndarray:
        """When the client sends each request, in seconds from the start (before any
        --max-concurrency wait)."""
        n = self.num_prompts
        rates = [self._rate(i) for i in range(n)]
        if all(math.isinf(r) for r in rates):
            return np.zeros(n)
        state = np.random.RandomState(self.seed)  # (np.random.seed(seed): the client's global stream)
        delays = []
        for rate in rates:
            if math.isinf(rate):
                delays.append(0.0)
            elif math.isinf(self.burstiness):
                delays.append(1.0 / rate)
            else:
                delays.append(state.gamma(shape=self.burstiness, scale=1.0 / (rate * self.burstiness)))
        times = np.cumsum(np.asarray(delays, dtype=np.float64))
        if self.ramp_up_strategy is None and times[-1] != 0:
            times = times * ((n / self.request_rate) / times[-1])
        return times

    def _rate(self, i: int) -> float:
        if self.ramp_up_strategy is None:
            return self.request_rate
        progress = i / max(self.num_prompts - 1, 1)
        start, end = float(self.ramp_up_start_rps), float(self.ramp_up_end_rps)
        if self.ramp_up_strategy == "linear":
            return start + (end - start) * progress
        return start * (end / start) ** progress

    def trace(self, hash_block_tokens: int = 16) -> Trace:
        """The requests as the server sees them: the shared tokens (special tokens and prefix)
        as hash blocks every row shares, the rest as blocks of the row's own."""
        self.check()
        sampled, output = self.lengths()
        shared = self.num_special_tokens + self.random_prefix_len
        prompt = shared + sampled
        hbt = hash_block_tokens
        shared_blocks = shared // hbt
        own_blocks = -(-prompt // hbt) - shared_blocks
        ids, offsets = consecutive_ids(shared_blocks + np.concatenate(([0], np.cumsum(own_blocks)[:-1])), own_blocks)
        counts = shared_blocks + own_blocks
        values = np.empty(int(counts.sum()), np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        for row in range(self.num_prompts):  # (each row: the shared blocks 0..S-1, then its own)
            s = starts[row]
            values[s:s + shared_blocks] = np.arange(shared_blocks)
            values[s + shared_blocks:s + counts[row]] = ids[offsets[row]:offsets[row + 1]]
        return build_trace(
            "vllm bench serve --dataset-name random", arrival_time_s=self.send_times(), prompt_tokens=prompt,
            output_tokens=output, request_id=[f"{REQUEST_ID_PREFIX}{i}" for i in range(self.num_prompts)],
            hash_ids=values, hash_offsets=np.concatenate(([0], np.cumsum(counts))), hash_block_tokens=hbt)
