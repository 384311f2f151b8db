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
    here = str(Path(__file__).parent)
    for item in items:  # only this folder's tests: other suites decide for themselves
        if "cuda" in item.keywords and str(item.path).startswith(here):
            item.add_marker(skip)
