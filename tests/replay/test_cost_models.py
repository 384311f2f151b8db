"""Decode-run durations (numpy and Python-float paths) equal stepping one by one, bit for bit:
the replay jumps over decode runs only because of this."""

from hypothesis import given, settings
from hypothesis import strategies as st

from simkv.backends.factory import make_backend
from simkv.calibration.costmodel import CalibratedCostModel
from simkv.config import EngineConfig
from simkv.core.outputs import SchedulerOutput


def _decode_step(n: int, context: int) -> SchedulerOutput:
    return SchedulerOutput(step=0, chunks=[], num_decode_reqs=n, decode_context_tokens=context, decodes=None,
                           preempted=[], num_running=n, num_waiting=0, num_blocks_used=0,
                           prefix_query_tokens=0, prefix_hit_tokens=0)


def _backends():
    out = [make_backend("unit", EngineConfig()),
           make_backend("linear", EngineConfig(), step_base_s=0.003, step_per_token_s=1.7e-5)]
    for model, gpu, tp in (("llama-3-8b", "H100-SXM", 1), ("llama-3-70b", "H200", 4), ("tiny-llama", "A100-80GB", 1),
                           ("mistral-7b", "A100-80GB", 2)):
        out.append(make_backend("roofline", EngineConfig.from_flat(
            {"model": model, "gpu": gpu, "tensor_parallel_size": tp})))
    out.append(CalibratedCostModel({"c0": 2e-3, "cT": 3e-6, "cH": 9e-6, "cS": 1e-6, "cP": 1e-10, "cKp": 2e-9,
                                    "cKd": 4e-9}, knee=96.0))
    return out


BACKENDS = _backends()


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(BACKENDS) - 1), st.integers(1, 1024), st.integers(1, 2_000_000), st.integers(1, 80))
def test_run_durations_equal_steps(which, n, first_context, steps):
    backend = BACKENDS[which]
    as_list = backend.decode_run_durations_list(n, first_context, steps)
    as_array = backend.decode_run_durations(n, first_context, steps).tolist()
    one_by_one = [backend.execute(_decode_step(n, first_context + j * n)) for j in range(steps)]
    assert as_list == as_array == one_by_one
    assert all(type(x) is float for x in as_list)


def test_roofline_crosses_from_compute_to_memory_bound():
    """Large batches at short context are compute-bound, long contexts memory-bound: a run that
    spans the crossover still matches step by step."""
    backend = make_backend("roofline", EngineConfig())
    n = 1024
    crossover = backend._decode_constants(n)[3]
    assert 0 < crossover < float("inf")
    first = max(1, int(crossover) - 50 * n)
    steps = 100
    one_by_one = [backend.execute(_decode_step(n, first + j * n)) for j in range(steps)]
    assert backend.decode_run_durations_list(n, first, steps) == one_by_one
