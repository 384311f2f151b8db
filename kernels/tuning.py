"""Measured tile choices for a device: the config sweep's winners, read by the launcher.

The attention launcher picks its tiles with a heuristic (``choose_config``). A GPU run of
``bench/kernels.py`` times alternatives on representative cases and writes the fastest that
agree with the default's output into ``kernel_tuning.json``: one set of overrides for decode
launches and one for prefill launches, with the timings that justify them. This is how vLLM
ships tuned Triton configs per device (its fused-MoE JSON files), without a search at start-up.

Where a tuning applies (``active_tuning``):
- ``SIMKV_KERNEL_TUNING=PATH``: that file, on any device (the GPU check hands the file its own
  benchmark just wrote to the rest of its run);
- ``SIMKV_KERNEL_TUNING=off``: none, the heuristic alone;
- unset: the file committed for the device in ``kernels/tuned/<device-name>.json``, if any.

The overrides apply to fp16/bf16 launches only (the sweep measures bf16); fp32 launches, very
wide heads and short chunks keep the heuristic. The module itself uses no torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "simkv-kernel-tuning"
FORMAT_VERSION = 1
ENV_VAR = "SIMKV_KERNEL_TUNING"
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
# the AttentionConfig fields each launch class may override
CLASS_KEYS = {
    "decode": ("tile_n", "num_warps", "num_stages", "prefetch_ids", "tma_paged"),
    "prefill": ("block_m", "tile_n", "num_warps", "num_stages", "prefetch_ids", "new_kv", "tma_new_kv"),
}
_BOUNDS = {"block_m": (16, 256), "tile_n": (16, 256), "num_warps": (1, 16), "num_stages": (1, 8)}


class TuningError(ValueError):
    """A tuning file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class KernelTuning:
    """Overrides of the tile heuristic per launch class, and where they came from."""

    decode: dict = field(default_factory=dict)
    prefill: dict = field(default_factory=dict)
    device: str = ""
    source: str = ""  # the file it was read from
    record: dict = field(default_factory=dict)  # the whole file as read (evidence, versions)

    @property
    def fingerprint(self) -> str:
        """8 hex digits of the overrides alone: two runs with equal fingerprints ran the same tiles."""
        text = json.dumps({"decode": self.decode, "prefill": self.prefill}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    @property
    def label(self) -> str:
        parts = [f"{kind} " + "/".join(f"{k}={v}" for k, v in sorted(over.items()))
                 for kind, over in (("decode", self.decode), ("prefill", self.prefill)) if over]
        return f"tuned tiles {self.fingerprint} ({'; '.join(parts) or 'no overrides'})"


def device_slug(name: str) -> str:
    """The file name a device's tuning is committed under: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _check_class(kind: str, over, where: str) -> dict:
    if not isinstance(over, dict):
        raise TuningError(f"{where}: '{kind}' must be an object of overrides, got {type(over).__name__}")
    allowed = CLASS_KEYS[kind]
    for key, value in over.items():
        if key not in allowed:
            raise TuningError(f"{where}: '{kind}.{key}' is not a tunable field (one of {', '.join(allowed)})")
        if key in ("prefetch_ids", "new_kv", "tma_new_kv", "tma_paged"):
            if not isinstance(value, bool):
                raise TuningError(f"{where}: '{kind}.{key}' must be true or false, got {value!r}")
            continue
        lo, hi = _BOUNDS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise TuningError(f"{where}: '{kind}.{key}' must be an integer in [{lo}, {hi}], got {value!r}")
        if key != "num_stages" and value & (value - 1):
            raise TuningError(f"{where}: '{kind}.{key}' must be a power of two, got {value}")
    if over.get("tma_new_kv") and not over.get("new_kv"):
        raise TuningError(f"{where}: '{kind}.tma_new_kv' reads the new_kv tiles: it needs '{kind}.new_kv' true")
    return dict(over)


def tuning_from_dict(data, where: str = "kernel tuning") -> KernelTuning:
    """Validate a tuning record (as ``kernel_tuning.json`` holds it)."""
    if not isinstance(data, dict):
        raise TuningError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise TuningError(f"{where}: 'format' must be '{FORMAT}', got {data.get('format')!r}")
    if data.get("format_version") != FORMAT_VERSION:
        raise TuningError(f"{where}: 'format_version' {data.get('format_version')!r} is not supported "
                          f"(this simkv reads {FORMAT_VERSION})")
    classes = {kind: _check_class(kind, data.get(kind) or {}, where) for kind in CLASS_KEYS}
    return KernelTuning(classes["decode"], classes["prefill"], str(data.get("device", "")), where, dict(data))


def load_tuning(path: str | Path) -> KernelTuning:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TuningError(f"{path}: cannot read the kernel tuning ({exc.strerror or exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TuningError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    return tuning_from_dict(data, str(path))


def write_tuning(path: str | Path, record: dict) -> None:
    """Validate and write a tuning record atomically (a temporary name, then a rename)."""
    tuning_from_dict(record, str(path))
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_cache: dict[tuple[str, str], KernelTuning | None] = {}


def active_tuning(device_name: str) -> KernelTuning | None:
    """The tuning that applies to launches on the device called ``device_name`` (see the module
    docstring), or None for the heuristic alone (also when the file adopted nothing: its runs
    then carry no tuning fingerprint, like any heuristic run). Read once per (setting, device)."""
    setting = os.environ.get(ENV_VAR, "").strip()
    key = (setting, device_name)
    if key not in _cache:
        if setting.lower() in ("off", "none", "0", "heuristic"):
            _cache[key] = None
        elif setting:
            if not Path(setting).is_file():
                raise TuningError(f"{ENV_VAR}={setting}: no such file (unset it, or set it to 'off')")
            _cache[key] = load_tuning(setting)
        else:
            shipped = TUNED_DIR / f"{device_slug(device_name)}.json"
            _cache[key] = load_tuning(shipped) if shipped.is_file() else None
        if _cache[key] is not None and not (_cache[key].decode or _cache[key].prefill):
            _cache[key] = None
    return _cache[key]


def describe_tuning(tuning: KernelTuning | None) -> dict | None:
    """What summary.json and calib.json record of the tiles a run used (None: the heuristic)."""
    if tuning is None:
        return None
    return {"fingerprint": tuning.fingerprint, "source": tuning.source, "device": tuning.device,
            "decode": dict(tuning.decode), "prefill": dict(tuning.prefill)}
