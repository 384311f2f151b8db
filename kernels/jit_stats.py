"""How many compiled variants the Triton kernels hold (to spot compilation inside a timed step).

Triton compiles a kernel once per distinct specialisation (constexprs, dtypes, integer
arguments equal to 1 or divisible by 16, pointer alignment) and caches it per device. A
replay step that triggers a compilation is timed with it, so the GPU backend compares this
count before and after each step. Returns None where the Triton version keeps its cache
differently (the count is a diagnostic, never needed for correctness).
"""
from __future__ import annotations


def _kernels() -> list:
    from .triton_attention import _merge_segments_kernel, _paged_attention_kernel
    from .triton_cache import _reshape_and_cache_kernel
    from .triton_layer_ops import _rms_norm_kernel, _rotary_kernel, _silu_and_mul_kernel

    return [_paged_attention_kernel, _merge_segments_kernel, _reshape_and_cache_kernel,
            _rms_norm_kernel, _rotary_kernel, _silu_and_mul_kernel]


def compiled_variant_count() -> int | None:
    try:
        total = 0
        for fn in _kernels():
            caches = getattr(fn, "device_caches", None)
            if caches is None:
                return None
            total += sum(len(entry[0]) for entry in caches.values())
        return total
    except Exception:  # noqa: BLE001 - a diagnostic must not break a replay
        return None
