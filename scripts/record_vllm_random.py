"""Record vLLM 0.33's own draws of `vllm bench serve`'s synthetic datasets (random's lengths:
get_sampling_params; send times: get_request, its sleeps on a fake clock; prefix_repetition's
order: its sample() with a tokenizer that round-trips exactly) into
tests/traces/data/vllm_random_recorded.json, which tests/traces/test_vllm_random.py checks
simkv/traces/vllm_random.py against. A development aid, run in the vLLM oracle's environment:
`/tmp/vllm-oracle-venv/bin/python scripts/record_vllm_random.py`."""

import asyncio
import json
import math
import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np  # noqa: E402
import vllm.benchmarks.serve as bench_serve  # noqa: E402
from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset  # noqa: E402
from vllm.benchmarks.datasets.utils import get_sampling_params  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "traces", "data",
                   "vllm_random_recorded.json")
LENGTHS = {"a": dict(n=8, seed=0, ratio=0.0, input_len=1024, output_len=128, special=1),
           "b": dict(n=8, seed=7, ratio=0.5, input_len=300, output_len=50, special=1),
           "c": dict(n=8, seed=3, ratio={"input": 0.2, "output": 0.9}, input_len=2000, output_len=400, special=0)}
PREFIX_REPETITION = [(4, 10, 3), (0, 20, 4)]  # (seed, num_prompts, num_prefixes)
SENDS = {"poisson": (8, 0, 4.0, 1.0), "gamma": (8, 5, 10.0, 0.5), "uniform": (5, 0, 2.0, math.inf),
         "linear": (6, 1, 1.0, 1.0, "linear", 1, 9), "exp": (6, 2, 1.0, 2.0, "exponential", 2, 8)}


class Tokenizer:
    """What get_sampling_params asks of a tokenizer."""

    vocab_size = 128256

    def __init__(self, special: int) -> None:
        self.special = special

    def num_special_tokens_to_add(self) -> int:
        return self.special


class ExactTokenizer:
    """Decodes token ids to a text that encodes back to the same ids."""

    vocab_size = 1000

    def decode(self, tokens) -> str:
        return json.dumps([int(t) for t in tokens])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return json.loads(text)


def prefix_groups(seed: int, n: int, k: int) -> list[int]:
    """The prefix (in the order the dataset makes them) of each request, in the order sent."""
    def sample(shuffle: bool):
        dataset = PrefixRepetitionRandomDataset(random_seed=seed, disable_shuffle=not shuffle)
        return dataset.sample(ExactTokenizer(), n, prefix_len=8, suffix_len=3, num_prefixes=k, output_len=5)

    made = []
    for request in sample(shuffle=False):
        prefix = tuple(json.loads(request.prompt)[:8])
        if prefix not in made:
            made.append(prefix)
    return [made.index(tuple(json.loads(r.prompt)[:8])) for r in sample(shuffle=True)]


async def send_times(n, seed, rate, burstiness, ramp=None, start=None, end=None) -> list[float]:
    """get_request's send times, its sleeps advancing a fake clock (after the client's seeding)."""
    np.random.seed(seed)
    clock = [0.0]

    async def sleep(seconds):
        clock[0] += seconds

    bench_serve.time.time = lambda: clock[0]
    bench_serve.asyncio.sleep = sleep
    return [clock[0] async for _ in bench_serve.get_request(list(range(n)), rate, burstiness, ramp, start, end)]


def main() -> None:
    out = {}
    for name, c in LENGTHS.items():
        sampled, output, _ = get_sampling_params(np.random.default_rng(c["seed"]), c["n"], c["ratio"],
                                                 c["input_len"], c["output_len"], Tokenizer(c["special"]))
        out[name] = {"input": sampled.tolist(), "output": output.tolist()}
    for seed, n, k in PREFIX_REPETITION:
        out[f"prefix_repetition_{seed}_{n}_{k}"] = prefix_groups(seed, n, k)
    for name, args in SENDS.items():
        out["t_" + name] = asyncio.run(send_times(*args))
    with open(OUT + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(OUT + ".tmp", OUT)
    print(OUT)


if __name__ == "__main__":
    main()
