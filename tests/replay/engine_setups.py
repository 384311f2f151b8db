"""The ways a replay serves its requests, for tests that check one rule on each: one engine, a
fleet of three behind a least-outstanding router, two data-parallel ranks of deepseek-v2-lite
(vLLM's DP ranks are a mixture of experts' engine), and a P/D pair."""

from simkv.replay.api import FleetSpec

KINDS = ("one engine", "fleet", "data-parallel ranks", "P/D")


def engine_setup(kind: str, options: dict) -> tuple[dict, dict]:
    """`options` for `kind`, and the keywords `replay()` then takes. Data-parallel ranks run
    deepseek-v2-lite and size their own KV cache (num_gpu_blocks is dropped)."""
    if kind == "data-parallel ranks":
        return {k: v for k, v in options.items() if k != "num_gpu_blocks"} | {
            "model": "deepseek-v2-lite", "data_parallel_size": 2}, {}
    if kind == "fleet":
        return options, {"fleet": FleetSpec(3, "least_outstanding")}
    if kind == "P/D":
        from simkv.replay.disaggregated import DisaggregationSpec

        return options, {"disaggregation": DisaggregationSpec(num_prefill=1, num_decode=1)}
    assert kind == "one engine", kind
    return options, {}
