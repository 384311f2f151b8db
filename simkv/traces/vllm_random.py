"""The traffic of `vllm bench serve`'s synthetic datasets, drawn as vLLM 0.33's client draws it.

random (RandomDataset, get_sampling_params): numpy's default_rng(seed) draws every request's
sampled input length uniformly from [floor(r * (1 - ratio)), ceil(r * (1 + ratio))], where r is
--random-input-len less the special tokens the tokenizer adds (`num_special_tokens`: 1 for a
BOS token as Llama's, Mistral's, Gemma's and DeepSeek's tokenizers add; 0 for Qwen's), then
every output length from [floor(o * (1 - ratio)), ceil(o * (1 + ratio))] (at least 1). A prompt
is the --random-prefix-len tokens every request shares, then its own sampled tokens (a run
starting at a random vocabulary offset: no two prompts share a block past the prefix).

prefix_repetition (PrefixRepetitionRandomDataset): --prefix-repetition-num-prefixes prefixes of
--prefix-repetition-prefix-len tokens, each followed by num_prompts // num_prefixes suffixes of
--prefix-repetition-suffix-len random tokens (so the run may send fewer than --num-prompts),
every reply --prefix-repetition-output-len tokens, the rows shuffled by Python's random seeded
with the seed (unless --disable-shuffle).

The server adds the special tokens in front of every prompt, so it sees them, then the shared
tokens, then the prompt's own; the special tokens and the shared prefix are blocks every row
(random) or every row of the group (prefix_repetition) shares.

Send times (get_request): none at --request-rate inf (every request at once); else, from numpy's
global stream seeded with the seed, one gamma draw per request of shape --burstiness and scale
1 / (rate x burstiness) (exponential gaps at burstiness 1), summed and rescaled so that the last
request is sent at num_prompts / rate; with --ramp-up-strategy each gap's rate goes linearly or
exponentially from --ramp-up-start-rps to --ramp-up-end-rps (and no rescaling).

random's lengths and send times are vLLM's draw for draw (tests/traces/test_vllm_random.py
holds draws recorded from vLLM's own functions), and so is prefix_repetition's shuffle; not
prefix_repetition's send times: its prompts' tokens come from the same global stream first, as
many as the tokenizer's round trips ask for, so its send times follow the same process with
other draws. Not reproduced: the client's decode-and-re-encode of a prompt, which can shift a
length by a token or two with some tokenizers.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from simkv.traces._columns import offsets_of
from simkv.traces.build import build_trace
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

REQUEST_ID_PREFIX = "bench-"  # (as `simkv trace import vllm-bench` names a result's requests: compare pairs them)


@dataclass(frozen=True)
class Schedule:
    """When the client sends its requests (its flags' names)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    ramp_up_strategy: str | None = None  # "linear" or "exponential"
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None

    def check(self) -> None:
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

    def send_times(self, n: int, seed: int) -> np.ndarray:
        """When each of `n` requests is sent, in seconds from the start (before any
        --max-concurrency wait)."""
        rates = [self._rate(i, n) for i in range(n)]
        if all(math.isinf(r) for r in rates):
            return np.zeros(n)
        state = np.random.RandomState(seed)  # (np.random.seed(seed): the client's global stream)
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

    def _rate(self, i: int, n: int) -> float:
        if self.ramp_up_strategy is None:
            return self.request_rate
        progress = i / max(n - 1, 1)
        start, end = float(self.ramp_up_start_rps), float(self.ramp_up_end_rps)
        if self.ramp_up_strategy == "linear":
            return start + (end - start) * progress
        return start * (end / start) ** progress


@dataclass(frozen=True)
class RandomDataset:
    """vllm bench serve's random dataset (its flags' names)."""

    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    input_range_ratio: float = 0.0
    output_range_ratio: float = 0.0
    random_prefix_len: int = 0
    seed: int = 0
    num_special_tokens: int = 1
    schedule: Schedule = field(default_factory=Schedule)

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
        self.schedule.check()

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
        return self.schedule.send_times(self.num_prompts, self.seed)

    def trace(self, hash_block_tokens: int = 16) -> Trace:
        """The requests as the server sees them."""
        self.check()
        sampled, output = self.lengths()
        group = np.zeros(self.num_prompts, np.int64)
        return _trace("random", self.num_special_tokens + self.random_prefix_len, group, sampled, output,
                      self.send_times(), hash_block_tokens)


@dataclass(frozen=True)
class PrefixRepetitionDataset:
    """vllm bench serve's prefix_repetition dataset (its flags' names)."""

    num_prompts: int = 1000
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    seed: int = 0
    disable_shuffle: bool = False
    num_special_tokens: int = 1
    schedule: Schedule = field(default_factory=Schedule)

    def check(self) -> None:
        if self.num_prefixes < 1 or self.num_prompts < self.num_prefixes:
            raise TraceError(f"--num-prompts ({self.num_prompts}) must be >= --prefix-repetition-num-prefixes "
                             f"({self.num_prefixes}), which must be >= 1")
        if self.prefix_len < 0 or self.suffix_len < 0 or self.prefix_len + self.suffix_len < 1 or self.output_len < 1:
            raise TraceError("--prefix-repetition-prefix-len and -suffix-len must be >= 0 with a prompt of at least "
                             "a token, and --prefix-repetition-output-len >= 1")
        self.schedule.check()

    def groups(self) -> np.ndarray:
        """Each request's prefix, in the order the client sends them."""
        per_prefix = self.num_prompts // self.num_prefixes
        rows = [p for p in range(self.num_prefixes) for _ in range(per_prefix)]
        if not self.disable_shuffle:
            random.Random(self.seed).shuffle(rows)  # (random.seed(seed); random.shuffle(requests))
        return np.asarray(rows, np.int64)

    def trace(self, hash_block_tokens: int = 16) -> Trace:
        """The requests as the server sees them."""
        self.check()
        group = self.groups()
        n = len(group)
        return _trace("prefix_repetition", self.num_special_tokens + self.prefix_len, group,
                      np.full(n, self.suffix_len, np.int64), np.full(n, self.output_len, np.int64),
                      self.schedule.send_times(n, self.seed), hash_block_tokens)


def _trace(dataset: str, shared: int, group: np.ndarray, own: np.ndarray, output: np.ndarray, sent: np.ndarray,
           hbt: int) -> Trace:
    """Prompts of `shared` tokens common to their group (special tokens and prefix), then `own`
    tokens of their own: the group's full blocks as hash ids the group shares, the rest new."""
    n = len(group)
    prompt = shared + own
    shared_blocks = shared // hbt
    counts = -(-prompt // hbt)
    offsets = offsets_of(counts)
    values = np.empty(int(offsets[-1]), np.int64)
    next_id = (int(group.max()) + 1) * shared_blocks if n else 0
    for row in range(n):
        s, g = offsets[row], int(group[row])
        values[s:s + shared_blocks] = np.arange(g * shared_blocks, (g + 1) * shared_blocks)
        own_blocks = int(counts[row]) - shared_blocks
        values[s + shared_blocks:offsets[row + 1]] = np.arange(next_id, next_id + own_blocks)
        next_id += own_blocks
    return build_trace(f"vllm bench serve --dataset-name {dataset}", arrival_time_s=sent, prompt_tokens=prompt,
                       output_tokens=output, request_id=[f"{REQUEST_ID_PREFIX}{i}" for i in range(n)],
                       hash_ids=values, hash_offsets=offsets, hash_block_tokens=hbt)
