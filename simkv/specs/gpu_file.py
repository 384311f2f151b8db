"""`--gpu FILE.yaml|FILE.json`: an accelerator that simkv's catalogue (gpus.yaml) lacks, described
by the same fields as a catalogue entry, from its datasheet:

    # a10.yaml: NVIDIA A10 (datasheet: 24 GB GDDR6, 600 GB/s, 125 TFLOP/s dense bf16, PCIe 4.0)
    memory_gib: 22.5          # the memory the driver reports (GiB), which vLLM's fraction applies to
    mem_bandwidth_gbs: 600
    bf16_tflops: 125          # dense (no sparsity) tensor-core peak
    fp8_tflops: 0             # 0 or left out: no fp8 tensor cores
    fp4_tflops: 0             # 0 or left out: no fp4 tensor cores (NVFP4 weights run at the bf16 rate)
    interconnect_gbs: 32      # GPU to GPU, per direction (NVLink, or the PCIe link)
    compute_capability: 8.6   # CUDA's (which attention backends vLLM picks); AMD's gfx version
    platform: cuda            # or rocm; left out: cuda

JSON takes the same fields. The file's path is the GPU's name in every output, and a replay's
summary records the numbers read (cost_model.gpu_spec). vLLM's batch defaults go by its memory
(`simkv.config.vllm_batch_defaults`; their A100 exception keys on the catalogue's name).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

GPU_FILE_SUFFIXES = (".yaml", ".yml", ".json")
REQUIRED = ("memory_gib", "mem_bandwidth_gbs", "bf16_tflops", "interconnect_gbs", "compute_capability")
OPTIONAL = {"fp8_tflops": 0.0, "fp4_tflops": 0.0, "platform": "cuda"}
PLATFORMS = ("cuda", "rocm")


class GPUFileError(ValueError):
    """A GPU file that cannot be read, naming the file and the field."""


def is_gpu_file(name: str) -> bool:
    return str(name).lower().endswith(GPU_FILE_SUFFIXES)


@lru_cache(maxsize=None)
def gpu_fields_from_file(path: str) -> dict:
    """The GPUSpec fields (name excluded) of the GPU file at `path`."""
    where = f"GPU file {path}"
    try:
        raw = yaml.safe_load(Path(path).read_text())  # (JSON is YAML)
    except FileNotFoundError:
        raise GPUFileError(f"{where}: no such file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise GPUFileError(f"{where}: not readable YAML or JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(raw, dict):
        raise GPUFileError(f"{where}: expected a mapping of {', '.join(REQUIRED)} (and {', '.join(OPTIONAL)})")
    unknown = sorted(str(k) for k in raw if k not in REQUIRED and k not in OPTIONAL)
    if unknown:
        raise GPUFileError(f"{where}: unknown field(s) {', '.join(unknown)}; a GPU file takes "
                           f"{', '.join((*REQUIRED, *OPTIONAL))}")
    fields = dict(OPTIONAL)
    for name in REQUIRED:
        if name not in raw:
            raise GPUFileError(f"{where}: field '{name}' is missing")
    for name in (*REQUIRED, "fp8_tflops", "fp4_tflops"):
        if name not in raw:
            continue
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GPUFileError(f"{where}: field '{name}' must be a number, got {value!r}")
        optional = name in OPTIONAL
        if not (value >= 0 if optional else value > 0):
            raise GPUFileError(f"{where}: field '{name}' must be {'>= 0' if optional else '> 0'}, got {value!r}")
        fields[name] = float(value)
    if "platform" in raw:
        if raw["platform"] not in PLATFORMS:
            raise GPUFileError(f"{where}: field 'platform' must be one of {', '.join(PLATFORMS)}, got {raw['platform']!r}")
        fields["platform"] = raw["platform"]
    return fields
