"""Kernel tests: run the Triton kernels under the CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is defined, i.e. before
``kernels.triton_*`` is imported, so it is decided here, at conftest import time.  An explicit
value in the environment is honoured.  If another test directory imported the kernel modules
earlier (compiled mode, unusable on CPU tensors), they are reloaded so that this directory's
tests get interpreted kernels.
"""
import importlib
import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    for _name, _kernel in (("kernels.triton_cache", "_reshape_and_cache_kernel"),
                           ("kernels.triton_attention", "_paged_attention_kernel"),
                           ("kernels.triton_layer_ops", "_rms_norm_kernel")):
        _mod = sys.modules.get(_name)
        if _mod is not None and type(getattr(_mod, _kernel)).__name__ != "InterpretedFunction":
            importlib.reload(_mod)
