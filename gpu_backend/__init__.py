"""The real execution backend: a lean Llama runner over the paged KV kernels of `kernels/`.

`make_gpu_backend(config, device, dtype)` builds a `GpuBackend` whose KV pool has exactly the
scheduler's `num_gpu_blocks` blocks; `simkv replay --backend gpu` uses it.
"""

from gpu_backend.backend import DeviceOOMError, GpuBackend
from gpu_backend.runner import ModelRunner

__all__ = ["DeviceOOMError", "GpuBackend", "ModelRunner"]
