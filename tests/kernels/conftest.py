"""Kernel tests: run the Triton kernels under the CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is defined, i.e. before
``kernels.triton_*`` is imported, so it is decided here, at conftest import time.  An explicit
value in the environment is honoured.
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
