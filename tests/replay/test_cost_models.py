"""Pure-decode steps are timed by each backend's decode line (in clock ticks), which equals its
`execute` to within the clock's resolution; the clock's closed forms equal summing step by
step: the replay jumps over decode runs only because of this."""

from hypothesis import given, settings
from hypothesis import strategies as st

from simkv.backends.factory import make_backend
from simkv.clock import TICKS_PER_SECOND, line_ticks, run_shape, run_ticks, steps_to_reach
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
                           ("mistral-7b", "A100-80GB", 2), ("deepseek-v3", "H200", 8),
                           ("deepseek-v2-lite", "A100-80GB", 1)):  # (latent attention: the absorbed path's pairs)
        out.append(make_backend("roofline", EngineConfig.from_flat(
            {"model": model, "gpu": gpu, "tensor_parallel_size": tp})))
    out.append(make_backend("roofline", EngineConfig.from_flat(  # (linear attention: state traffic per sequence)
        {"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 4, "enable_prefix_caching": False})))
    out.append(CalibratedCostModel({"c0": 2e-3, "cT": 3e-6, "cH": 9e-6, "cS": 1e-6, "cP": 1e-10, "cKp": 2e-9,
                                    "cKd": 4e-9}, knee=96.0))
    return out


BACKENDS = _backends()


def _line_seconds(backend, n: int, context: int) -> float:
    return line_ticks(backend.decode_step_line(n), context) / TICKS_PER_SECOND


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(BACKENDS) - 1), st.integers(1, 1024), st.integers(1, 2_000_000))
def test_decode_line_equals_execute(which, n, context):
    backend = BACKENDS[which]
    line = backend.decode_step_line(n)
    assert all(type(x) is int and x >= 0 for x in line)
    exact = backend.execute(_decode_step(n, context))
    # rounding: half a tick for each fixed part and half a tick per context token
    slack = (1 + 0.5 * context) / TICKS_PER_SECOND + 1e-12 * exact
    assert abs(_line_seconds(backend, n, context) - exact) <= slack


def test_roofline_decode_line_crosses_from_compute_to_memory_bound():
    """Large batches at short context are compute-bound, long contexts memory-bound: a run over
    the crossover still sums to its steps."""
    backend = make_backend("roofline", EngineConfig())
    n = 1024
    a0, a1, b0, b1 = backend.decode_step_line(n)
    assert a0 > b0 and b1 > a1  # compute-bound at no context, memory grows faster
    crossover = (a0 - b0) // (b1 - a1)
    first = crossover - 50 * n
    steps = [max(a0 + a1 * (first + j * n), b0 + b1 * (first + j * n)) for j in range(100)]
    assert steps[0] == a0 + a1 * first and steps[-1] == b0 + b1 * (first + 99 * n)
    shape = run_shape(a0 + a1 * first, a1 * n, b0 + b1 * first, b1 * n)
    assert run_ticks(shape, 100) == sum(steps)
    assert steps_to_reach(shape, sum(steps[:60]), 100) == 60


@settings(max_examples=500, deadline=None)
@given(st.tuples(st.integers(0, 10**12), st.integers(0, 10**9), st.integers(0, 10**12), st.integers(0, 10**9)),
       st.integers(1, 300), st.integers(1, 10**14))
def test_clock_closed_forms_equal_step_by_step(lines, limit, ticks):
    a0, a1, b0, b1 = lines
    steps = [max(a0 + a1 * j, b0 + b1 * j) for j in range(limit)]
    totals = [sum(steps[:k]) for k in range(limit + 1)]
    shape = run_shape(*lines)
    for k in (0, 1, limit // 2, limit):
        assert run_ticks(shape, k) == totals[k]
    reach = next((k for k in range(1, limit + 1) if totals[k] >= ticks), limit)
    assert steps_to_reach(shape, ticks, limit) == reach
