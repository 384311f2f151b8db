"""A model spec from a Hugging Face `config.json` (`--model path/to/config.json`): a model
simkv does not ship, sized from its own config, nothing downloaded.

The fields read (a multimodal wrapper's `text_config` if it has one):
- num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads (default: the
  attention heads), head_dim (default: hidden_size / num_attention_heads), intermediate_size,
  vocab_size, max_position_embeddings, tie_word_embeddings (default: the architecture's, tied
  for Gemma, untied otherwise);
- mixtures of experts: num_local_experts or num_experts, num_experts_per_tok, and each
  expert's width (moe_intermediate_size where the config has it, else intermediate_size);
- quantization_config: gpt-oss's MXFP4 experts ("mxfp4") at 0.53125 bytes a weight; FP8
  checkpoints ("fp8", or compressed-tensors with 8-bit float weights) with every linear layer
  at 1 byte (embeddings, LM head and norms stay bf16; the roofline still computes at the bf16
  rate);
- sliding windows: sliding_window with layer_types (sliding_attention / full_attention), or
  sliding_window_pattern (Gemma 3: every 6th layer is full), or Gemma 2's alternation; a
  window on every layer otherwise (Mistral 7B v0.1), none when use_sliding_window is false.

Refused with the file and field named: multi-head latent attention (kv_lora_rank: DeepSeek),
chunked local attention (attention_chunk_size: Llama 4), other quantization methods (INT4,
INT8, ...: their weights would be sized wrong), layer patterns other than one periodic
full-attention layer.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

_GEMMA2_INTERVAL = 2  # Gemma 2 alternates sliding-window and full-attention layers


class ModelConfigError(ValueError):
    """A config.json that cannot be turned into a model spec (the message names file and field)."""


def is_config_path(name: str) -> bool:
    return name.endswith(".json")


@lru_cache(maxsize=None)
def spec_fields_from_config(path: str) -> dict:
    """The ModelSpec fields (name excluded) of the config at `path`."""
    file = Path(path)
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"model config {path}: no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"model config {path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"model config {path}: expected a JSON object")
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    where = f"model config {path}" + (" (text_config)" if cfg is not raw else "")

    def get(name: str):
        value = cfg.get(name)
        return raw.get(name) if value is None else value  # (a wrapper may hold some at its top level)

    def need(key: str, *alternatives: str) -> int:
        for name in (key, *alternatives):
            value = get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ModelConfigError(f"{where}: field '{name}' must be a positive whole number, got {value!r}")
                return value
        raise ModelConfigError(f"{where}: field '{key}' is missing")

    for key, what in (("kv_lora_rank", "multi-head latent attention (DeepSeek's MLA)"),
                      ("attention_chunk_size", "chunked local attention (Llama 4)")):
        if cfg.get(key):
            raise ModelConfigError(f"{where}: field '{key}': {what} is not modelled")
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    fields = {
        "num_layers": need("num_hidden_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": need("num_key_value_heads") if get("num_key_value_heads") is not None else heads,
        "head_dim": need("head_dim") if get("head_dim") is not None else hidden // heads,
        "vocab_size": need("vocab_size"),
        "max_position_embeddings": need("max_position_embeddings"),
        "tie_word_embeddings": _tied(cfg, raw),
    }
    experts = get("num_local_experts") or get("num_experts") or 0
    if experts:
        fields["num_experts"] = need("num_local_experts", "num_experts")
        fields["num_experts_per_tok"] = need("num_experts_per_tok")
        fields["intermediate_size"] = need("moe_intermediate_size", "intermediate_size")
    else:
        fields["intermediate_size"] = need("intermediate_size")
    quant = raw.get("quantization_config") or cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method == "mxfp4" and experts:
            fields["expert_weight_bytes"] = 0.53125  # 4 bits and one 8-bit scale per 32 weights
        elif method == "fp8" or (method == "compressed-tensors" and _fp8_weights(quant)):
            fields["linear_weight_bytes"] = 1.0  # (the scales are negligible)
            if experts:
                fields["expert_weight_bytes"] = 1.0
        else:
            raise ModelConfigError(f"{where}: field 'quantization_config': quant_method {method!r} is not modelled "
                                   "(simkv sizes bf16, FP8 and MXFP4-expert weights); drop the field to size the "
                                   "model at bf16")
    fields.update(_windows(cfg, where, fields["num_layers"]))
    return fields


def _fp8_weights(quant: dict) -> bool:
    """A compressed-tensors config whose weight groups are all 8-bit floats (FP8-dynamic and the like)."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
    return bool(weights) and all(w.get("num_bits") == 8 and w.get("type") == "float" for w in weights)


def _tied(cfg: dict, raw: dict) -> bool:
    """tie_word_embeddings as the config says, else the architecture's default (Gemma: tied)."""
    for source in (cfg, raw):
        if "tie_word_embeddings" in source:
            return bool(source["tie_word_embeddings"])
    return str(cfg.get("model_type") or raw.get("model_type") or "").startswith("gemma")


def _windows(cfg: dict, where: str, num_layers: int) -> dict:
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelConfigError(f"{where}: field 'sliding_window' must be a positive whole number, got {window!r}")
    types = cfg.get("layer_types")
    if types is not None:
        full = [t == "full_attention" for t in types]
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown or len(types) != num_layers:
            raise ModelConfigError(f"{where}: field 'layer_types' must name each of the {num_layers} layers "
                                   f"full_attention or sliding_attention (got {unknown or len(types)})")
        if not any(full):
            return {"sliding_window": window, "full_attention_interval": 0}
        interval = full.index(True) + 1
        if full != [(i + 1) % interval == 0 for i in range(num_layers)]:
            raise ModelConfigError(f"{where}: field 'layer_types': simkv models one full-attention layer every k "
                                   "layers (the last of each k), not this pattern")
        return {"sliding_window": window, "full_attention_interval": interval}
    if cfg.get("sliding_window_pattern"):
        return {"sliding_window": window, "full_attention_interval": int(cfg["sliding_window_pattern"])}
    if cfg.get("model_type") == "gemma2":
        return {"sliding_window": window, "full_attention_interval": _GEMMA2_INTERVAL}
    if cfg.get("max_window_layers") is not None and cfg.get("use_sliding_window"):
        raise ModelConfigError(f"{where}: field 'max_window_layers': windows on only some layers (Qwen2's) are "
                               "not modelled")
    return {"sliding_window": window, "full_attention_interval": 0}
