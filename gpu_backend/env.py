"""What ran where: device, GPU name and library versions (for summary.json and calib.json)."""

from __future__ import annotations

import platform
from importlib import metadata

import torch

from simkv.specs import canonical_gpu  # noqa: F401 (re-exported: loop, calibration)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def library_versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "simkv": _version("simkv"),
    }


def device_info(device: str | torch.device) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        return {"type": "cuda", "name": props.name, "memory_gib": round(props.total_memory / (1 << 30), 2),
                "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count}
    return {"type": "cpu", "name": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads()}
