import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
CI_TRACE = DATA / "ci80.parquet"


@pytest.fixture(autouse=True)
def _cpu_runner_env(monkeypatch):
    # The CPU runner uses the torch reference kernels whatever TRITON_INTERPRET says.
    monkeypatch.delenv("SIMKV_KERNEL_BACKEND", raising=False)
    yield


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
