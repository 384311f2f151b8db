"""LoRA adapters in a trace (the optional `lora_name` column) and what they change downstream.

vLLM serves a request with a LoRA adapter when it names one (`LoRARequest`); the scheduler admits
it only while at most `max_loras` distinct adapters are in the running batch (simkv/core/
scheduler.py), and its block hashes carry the adapter's name, so prompts share cached blocks only
under the same adapter (and cache_salt).
"""
from __future__ import annotations

import numpy as np

from simkv.core.block_hashing import content_namespace
from simkv.traces.schema import Trace


def has_adapters(trace: Trace) -> bool:
    return trace.lora_name is not None and any(name is not None for name in trace.lora_name)


def named_adapters(trace: Trace) -> list[str]:
    """The adapter of every row that names one, in row order."""
    return [name for name in trace.lora_name.tolist() if name is not None] if trace.lora_name is not None else []


def lora_ids(trace: Trace) -> np.ndarray | None:
    """Per row, its adapter as vLLM's lora_int_id: 1, 2, ... in order of first appearance, 0 for
    the base model; None when no row names one."""
    if not has_adapters(trace):
        return None
    ids: dict[str, int] = {}
    return np.array([0 if name is None else ids.setdefault(name, len(ids) + 1) for name in trace.lora_name],
                    dtype=np.int64)


def content_namespaces(trace: Trace) -> np.ndarray | None:
    """Per row, what its blocks are shared within (cache_salt and adapter); None when all rows
    share one namespace."""
    salts, loras = trace.cache_salt, trace.lora_name if has_adapters(trace) else None
    if loras is None:
        return salts
    if salts is None:
        salts = np.full(len(trace), None, dtype=object)
    return np.array([content_namespace(s, name) for s, name in zip(salts, loras)], dtype=object)


def assign_adapters(trace: Trace, num_adapters: int, zipf_s: float, seed: int) -> Trace:
    """A copy of `trace` whose requests name adapters lora-0 .. lora-(N-1), drawn with Zipf
    popularity (adapter k with weight 1 / (k + 1)^s; s = 0: uniform); a session's turns keep
    one adapter."""
    from dataclasses import replace

    from simkv.traces.errors import TraceError

    if num_adapters < 1:
        raise TraceError(f"--lora-adapters must be >= 1, got {num_adapters}")
    if zipf_s < 0:
        raise TraceError(f"--lora-zipf must be >= 0, got {zipf_s}")
    weights = 1.0 / np.arange(1, num_adapters + 1, dtype=np.float64) ** zipf_s
    rng = np.random.default_rng(seed)
    if trace.session_id is not None:
        keys = np.array([f"s:{s}" if s is not None else f"r:{i}" for i, s in enumerate(trace.session_id)], dtype=object)
        _, group = np.unique(keys.astype(str), return_inverse=True)
    else:
        group = np.arange(len(trace))
    drawn = rng.choice(num_adapters, size=int(group.max(initial=-1)) + 1, p=weights / weights.sum())
    names = np.array([f"lora-{k}" for k in drawn[group]], dtype=object)
    return replace(trace, lora_name=names)
