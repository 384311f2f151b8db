"""`GpuBackend`: the StepBackend that runs each step for real and returns its measured duration.

The scheduler, KV-cache manager and block pool are the simulator's own objects (the replay
engine builds them; this backend only reads `SchedulerOutput`). Timing covers the whole step:
input preparation, host-to-device copies, forward, greedy sampling and the final
synchronisation. On CUDA it is measured with a pair of events around all of it (the start
event is recorded on an idle stream before input preparation, so host time counts); on CPU
with `time.perf_counter`.
"""

from __future__ import annotations

import gc
import os
import time

import torch

from gpu_backend.env import device_info, library_versions
from gpu_backend.runner import ModelRunner, dtype_name
from kernels.jit_stats import compiled_variant_count
from kernels.tuning import describe_tuning
from simkv.backends.base import prefill_work
from simkv.core.outputs import SchedulerOutput


class DeviceOOMError(RuntimeError):
    """The device ran out of memory on a step; carries the step's shape and a setting that fits."""

    def __init__(self, message: str, shape: dict, suggestion: str) -> None:
        super().__init__(message)
        self.shape = shape
        self.suggestion = suggestion


def step_shape(output: SchedulerOutput) -> dict:
    p_tokens, p_pairs, p_read = prefill_work(output)
    return {"step": output.step, "num_prefill_chunks": len(output.chunks), "num_prefill_tokens": p_tokens,
            "prefill_pairs": p_pairs, "prefill_kv_read": p_read, "num_decodes": output.num_decode_reqs,
            "decode_context_tokens": output.decode_context_tokens}


def _prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1) if n > 1 else 1


def oom_suggestion(shape: dict) -> str:
    tokens = shape["num_prefill_tokens"] + shape["num_decodes"]
    fit = _prev_pow2(max(tokens - 1, 1))
    return (f"--max-num-batched-tokens {fit} (this step scheduled {tokens} tokens), or a smaller KV pool "
            f"(--num-gpu-blocks / --gpu-memory-utilization) to leave room for activations")


def is_oom(exc: BaseException) -> bool:
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    return isinstance(exc, oom_types) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def cpu_clock_name() -> str:
    """`SIMKV_CPU_CLOCK`: `wall` (default, time.perf_counter) or `process` (time.process_time:
    CPU time of this process only, blind to other processes competing for a shared host)."""
    name = os.environ.get("SIMKV_CPU_CLOCK", "wall")
    if name not in ("wall", "process"):
        raise ValueError(f"SIMKV_CPU_CLOCK must be 'wall' or 'process', got '{name}'")
    return name


def timing_label(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda events"
    return "perf_counter wall clock" if cpu_clock_name() == "wall" else "process_time cpu clock"


class StepTimer:
    """Times a callable: CUDA events on a GPU, a host clock on CPU (see `cpu_clock_name`).

    Python's garbage collector is paused while the callable runs: a collection walks the
    whole heap of this process (the simulator's requests and logs included), and charging
    that to whichever step happened to trigger it would add spikes no real server step has.
    Collections run between steps instead, outside the timed region. Calibration and replay
    share this timer, so both measure steps the same way."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.clock = time.perf_counter if cpu_clock_name() == "wall" else time.process_time
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def time(self, fn, *args):
        collecting = gc.isenabled()
        gc.disable()
        try:
            if self.cuda:
                self.start.record()
                result = fn(*args)
                self.end.record()
                self.end.synchronize()
                return result, self.start.elapsed_time(self.end) / 1000.0
            clock = self.clock
            t0 = clock()
            result = fn(*args)
            return result, clock() - t0
        finally:
            if collecting:
                gc.enable()


#: vLLM's `cudagraph_mode` values this backend runs: decode-only steps from full graphs (and
#: every other step eagerly), or in addition steps with prefill chunks from piecewise graphs
CUDAGRAPH_MODES = ("full_decode_only", "full_and_piecewise")


def piecewise_max_tokens(max_num_seqs: int) -> int:
    """vLLM's default largest capture size: min(2 * max_num_seqs, 512)."""
    return min(2 * max_num_seqs, 512)


def prepare_for_timing(runner: ModelRunner, warmup_steps: int, max_num_seqs: int, enforce_eager: bool,
                       cudagraph_mode: str = "full_decode_only") -> str:
    """Before any timed step (replay and calibration alike): compile every kernel variant, then
    on CUDA capture the decode graphs up to `max_num_seqs` and, with `full_and_piecewise`, the
    piecewise graphs up to `piecewise_max_tokens` (unless `enforce_eager`, vLLM's name for
    running without graphs). Returns the decode graphs' status."""
    if cudagraph_mode not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph mode '{cudagraph_mode}' is not one of {', '.join(CUDAGRAPH_MODES)}")
    if warmup_steps:
        from gpu_backend.synthetic import warm_up

        warm_up(runner, warmup_steps)
    if runner.device.type == "cuda" and not enforce_eager:
        status = runner.enable_decode_graphs(max_num_seqs)
        if cudagraph_mode == "full_and_piecewise":
            runner.enable_piecewise_graphs(piecewise_max_tokens(max_num_seqs))
        return status
    why = "off: --enforce-eager" if enforce_eager else "off: not on CUDA"
    runner.decode_graphs_status = why
    if cudagraph_mode == "full_and_piecewise":
        runner.piecewise_status = why
    return runner.decode_graphs_status


class GpuBackend:
    """Executes scheduler outputs on a `ModelRunner`; `execute` returns seconds."""

    name = "gpu"
    supports_decode_runs = False
    needs_request_detail = True

    def __init__(self, runner: ModelRunner, warmup_steps: int = 3, max_num_seqs: int = 256,
                 enforce_eager: bool = False, cudagraph_mode: str = "full_decode_only") -> None:
        self.runner = runner
        self.timer = StepTimer(runner.device)
        self.measured: list[dict] = []  # one row per executed step (kept for partial saves)
        self.after_step = None  # called after each step, outside its timing (interleaved calibration)
        self.count_compiles = runner.kernel_backend == "triton"
        prepare_for_timing(runner, warmup_steps, max_num_seqs, enforce_eager, cudagraph_mode)

    def execute(self, output: SchedulerOutput) -> float:
        variants = compiled_variant_count() if self.count_compiles else None
        try:
            _, seconds = self.timer.time(self.runner.run, output)
        except Exception as exc:
            if not is_oom(exc):
                raise
            shape = step_shape(output)
            suggestion = oom_suggestion(shape)
            if self.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            raise DeviceOOMError(f"out of memory on {self.runner.device} at step {output.step} "
                                 f"({shape}); nearest setting that fits: {suggestion}", shape, suggestion) from exc
        row = step_shape(output)
        row["duration_s"] = seconds
        # where the time went on the host: input preparation, and the forward call (on CUDA the
        # time to enqueue its kernels: close to duration_s means the step is bound by the host)
        row["host_prepare_s"], row["host_forward_s"] = self.runner.last_host_times
        row["graph_batch"] = self.runner.last_graph_batch  # the decode graph's size, 0 if run eagerly
        row["graph_tokens"] = self.runner.last_piecewise_tokens  # the piecewise graphs' size, 0 if not
        if variants is not None:
            after = compiled_variant_count()
            row["jit_compiles"] = (after - variants) if after is not None else -1
        self.measured.append(row)
        if self.after_step is not None:
            self.after_step()
        return seconds

    def describe(self) -> dict:
        r = self.runner
        return {"cost_model": "gpu", "model": r.spec.name, "device": device_info(r.device),
                "dtype": dtype_name(r.dtype), "kernel_backend": r.kernel_backend,
                "layer_ops": r.ops.name, "kernel_tuning": describe_tuning(r.kernel_tuning),
                "timing": timing_label(r.device), **r.graph_fields(), "versions": library_versions()}
