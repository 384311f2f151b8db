"""A roofline with fitted efficiencies and overheads (`--cost-model fit.json`).

The roofline (simkv/backends/roofline.py) has four numbers that are defaults until measured: the
share of the GPU's peak compute and bandwidth a step reaches, and the host's time per step and
per sequence. `simkv calibrate --from-bench` fits them to what a real vLLM server did with a
trace (simkv/calibration/from_bench.py) and writes them in this file:

    {"format": "simkv-roofline-fit", "format_version": 1, "model": ..., "gpu": ...,
     "tensor_parallel_size": ..., "params": {"compute_efficiency": ..., "memory_efficiency": ...,
     "step_overhead_s": ..., "seq_overhead_s": ...}, "frontend_latency_s": ..., "fit": {...},
     "source": {...}}

`frontend_latency_s` is not the engine's: it is what the server's API front end (HTTP, SSE,
detokenizing) and the network add to every request's TTFT and end-to-end latency as the client
measures them. A replay on the fit adds it to those two (the engine's schedule is unchanged:
shifting every arrival by one constant shifts the whole replay), so its latencies are the
client's, as the benchmark measured them.

Everything else the roofline knows (the model's FLOPs and bytes per token, the GPU's peaks, the
TP all-reduces) still comes from the specs, so a fit carries over to other engine settings
(max_num_seqs, token budget, block size, prefix caching) of the same model on the same GPU, which
is what it is for. Another model or GPU is refused; another TP degree is accepted with a warning.
"""
from __future__ import annotations

import json
from pathlib import Path

FORMAT = "simkv-roofline-fit"
FORMAT_VERSION = 1
PARAMS = ("compute_efficiency", "memory_efficiency", "step_overhead_s", "seq_overhead_s")
#: (lowest, highest) each parameter may take; a fit is searched within these
BOUNDS = {"compute_efficiency": (0.01, 1.0), "memory_efficiency": (0.01, 1.0),
          "step_overhead_s": (1e-6, 0.2), "seq_overhead_s": (1e-9, 1e-3)}
FRONTEND_MAX_S = 10.0


def is_roofline_fit(path: str | Path) -> bool:
    try:
        with open(path) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_roofline_fit(path: str | Path, model: str, gpu: str,
                      tensor_parallel_size: int) -> tuple[dict, float, list[str]]:
    """The fitted parameters for a replay of `model` on `gpu`, the front end's latency, and
    warnings; ValueError naming the file and the field when the fit is for another model or GPU,
    or malformed."""
    data = json.loads(Path(path).read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {data.get('format_version')!r}; this simkv reads {FORMAT_VERSION}")
    for key, here in (("model", model), ("gpu", gpu)):
        if data.get(key) != here:
            raise ValueError(f"{path}: fitted for {key} '{data.get(key)}', this replay runs '{here}' "
                             f"(fit again with `simkv calibrate --from-bench` on a run of {here})")
    params = data.get("params") or {}
    for name in PARAMS:
        value = params.get(name)
        low, high = BOUNDS[name]
        if not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"{path}: params.{name} = {value!r}, expected a number in [{low}, {high}]")
    frontend = data.get("frontend_latency_s", 0.0)
    if not isinstance(frontend, (int, float)) or not 0.0 <= frontend <= FRONTEND_MAX_S:
        raise ValueError(f"{path}: frontend_latency_s = {frontend!r}, expected a number in [0, {FRONTEND_MAX_S}]")
    warnings = []
    if data.get("tensor_parallel_size") != tensor_parallel_size:
        warnings.append(f"{path} was fitted at tensor_parallel_size {data.get('tensor_parallel_size')}, "
                        f"this replay runs {tensor_parallel_size}")
    return {name: float(params[name]) for name in PARAMS}, float(frontend), warnings


def fit_document(model: str, gpu: str, tensor_parallel_size: int, params: dict, frontend_latency_s: float,
                 fit: dict, source: dict) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model, "gpu": gpu,
            "tensor_parallel_size": tensor_parallel_size, "params": {k: params[k] for k in PARAMS},
            "frontend_latency_s": frontend_latency_s, "fit": fit, "source": source}
