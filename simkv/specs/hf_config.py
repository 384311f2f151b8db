"""A model spec from a Hugging Face `config.json` (`--model path/to/config.json`): a model
simkv does not ship, sized from its own config, nothing downloaded.

The fields read (a multimodal wrapper's `text_config` if it has one; the vision encoder of a Qwen
VL config from its `vision_config`: depth, widths, spatial_merge_size, Qwen2.5-VL's windows
(window_size / patch_size squared patches, all layers but fullatt_block_indexes) and Qwen3-VL's
DeepStack mergers, with the processors' default of at most 16,384 embeddings an image; another
wrapper's vision tower is left out, its decoder sized alone):
- num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads (default: the
  attention heads), head_dim (default: hidden_size / num_attention_heads), intermediate_size,
  vocab_size, max_position_embeddings, tie_word_embeddings (default: the architecture's, tied
  for Gemma, untied otherwise);
- mixtures of experts: num_local_experts, num_experts or n_routed_experts, num_experts_per_tok,
  and each expert's width (moe_intermediate_size where the config has it, else
  intermediate_size); DeepSeek's layout (V2, V3, Kimi K2, GLM-4.5): first_k_dense_replace
  leading layers with a dense MLP of intermediate_size, and n_shared_experts shared experts of
  moe_intermediate_size (Qwen2-MoE: one of shared_expert_intermediate_size) in every expert layer;
  group-limited routing (n_group, topk_group: DeepSeek-V3's 8 and 4) where topk_group < n_group;
- multi-head latent attention (kv_lora_rank: DeepSeek V2/V3, Kimi K2): kv_lora_rank,
  qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank (null: a direct query projection);
- quantization_config: gpt-oss's MXFP4 experts ("mxfp4") at 0.53125 bytes a weight; FP8
  checkpoints ("fp8", compressed-tensors with 8-bit float weights, or NVIDIA ModelOpt's FP8
  formats, also from an hf_quant_config.json beside the config) with every linear layer at
  1 byte (embeddings, LM head and norms stay bf16; the roofline multiplies them at the fp8
  peak on GPUs with fp8 tensor cores); every layer's attention kept out of the format
  (ignored_layers, ignore, exclude_modules: `model.layers.*.self_attn*`) stays bf16
  (ModelSpec.attention_weight_bytes), other decoder modules kept out are refused, the LM head, a
  vision tower and routers kept out change nothing; a ModelOpt checkpoint's KV-cache algorithm
  (kv_cache_scheme or kv_cache_quant_algo), which vLLM runs `--kv-cache-dtype auto` as
  (fp8_e4m3 or nvfp4: ModelSpec.checkpoint_kv_cache_dtype); ModelOpt's NVFP4 (every linear
  layer at 0.5625 bytes, multiplied at the GPU's fp4 peak where it has one) and W4A16_NVFP4
  (the same bytes, multiplied in bf16); ModelOpt's MIXED_PRECISION, each module in the format its
  quantized_layers entry names, sized by kind (attention, routed experts, the other linear
  layers: simkv/specs/mixed_precision.py);
- partial_rotary_factor (or rope_parameters'; Qwen3-Next and Qwen3.5's config classes default
  to 0.25), which vLLM's Octave KV cache reads;
- sliding windows: sliding_window with layer_types (sliding_attention / full_attention), or
  sliding_window_pattern (Gemma 3: every 6th layer is full), or Gemma 2's alternation; a
  window on every layer otherwise (Mistral 7B v0.1), none when use_sliding_window is false;
- chunked local attention (Llama 4): attention_chunk_size, the full-attention layers from
  no_rope_layers (default: every 4th); its experts on every interleave_moe_layer_step-th layer
  with a shared expert of intermediate_size, dense layers of intermediate_size_mlp between.

- linear attention beside full attention (Qwen3-Next and Qwen3.5's Gated DeltaNet, Granite
  4.0-H's Mamba2): layer_types or full_attention_interval, the state's shape fields and
  mamba_ssm_dtype (_linear_attention); Nemotron-H's one-block layers (hybrid_override_pattern:
  _nemotron_h).

Refused with the file and field named: DeepSeek's sparse attention (index_topk: V3.2), other
layer types (LFM2's conv), Nemotron 3 Super's latent experts, expert layers on only
some layers after the dense ones (moe_layer_freq, decoder_sparse_step, mlp_only_layers), other
quantization methods (INT4, INT8, ...: their weights would be sized wrong), window patterns
other than one periodic full-attention layer (no_rope_layers likewise).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from simkv.specs import NVFP4_WEIGHT_BYTES

_GEMMA2_INTERVAL = 2  # Gemma 2 alternates sliding-window and full-attention layers


class ModelConfigError(ValueError):
    """A config.json that cannot be turned into a model spec (the message names file and field)."""


# model types whose transformers config class sets a partial_rotary_factor the file may leave out
_PARTIAL_ROTARY_DEFAULTS = {"qwen3_next": 0.25, "qwen3_5": 0.25, "qwen3_5_moe": 0.25}


def _partial_rotary_factor(cfg: dict, raw: dict, where: str) -> float:
    """The share of a head's dims rotary embeddings turn: partial_rotary_factor (or rope_parameters'),
    else the config class's default (Qwen3-Next and Qwen3.5: 0.25), else 1."""
    value = cfg.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if value is None and isinstance(cfg.get("rope_parameters"), dict):
        value = cfg["rope_parameters"].get("partial_rotary_factor")
    if value is None:
        return _PARTIAL_ROTARY_DEFAULTS.get(_model_type(cfg, raw), 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ModelConfigError(f"{where}: field 'partial_rotary_factor' must be a number in (0, 1], got {value!r}")
    return float(value)


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

    if cfg.get("hybrid_override_pattern"):
        return _nemotron_h(cfg, raw, where)
    linear = _is_linear_hybrid(cfg, raw)
    known = _LINEAR_LAYER_TYPES if linear else ("full_attention", "sliding_attention")
    other_layers = sorted({t for t in cfg.get("layer_types") or () if t not in known})
    if other_layers:
        raise ModelConfigError(f"{where}: field 'layer_types': layers of type {', '.join(map(str, other_layers))} "
                               "are not modelled (simkv models attention layers, full or sliding-window, and "
                               "Gated DeltaNet or Mamba2 linear attention beside full attention)")
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
    rotary = _partial_rotary_factor(cfg, raw, where)
    if rotary != 1.0:
        fields["partial_rotary_factor"] = rotary
    for name in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):  # (MTP modules: DeepSeek's name, Qwen's)
        if get(name):
            fields["num_nextn_predict_layers"] = need(name)
            break
    if get("kv_lora_rank"):  # multi-head latent attention
        rope = need("qk_rope_head_dim")
        fields.update(kv_lora_rank=need("kv_lora_rank"), qk_rope_head_dim=rope, v_head_dim=need("v_head_dim"),
                      head_dim=need("qk_nope_head_dim") + rope, num_kv_heads=heads,
                      q_lora_rank=need("q_lora_rank") if get("q_lora_rank") is not None else 0)
        if get("index_topk"):  # DeepSeek sparse attention (V3.2's indexer)
            fields.update(index_topk=need("index_topk"), index_n_heads=need("index_n_heads"),
                          index_head_dim=need("index_head_dim"))
    elif get("index_topk"):
        raise ModelConfigError(f"{where}: field 'index_topk': sparse attention without latent attention "
                               "(kv_lora_rank) is not modelled")
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 0
    if experts:
        fields["num_experts"] = need("num_local_experts", "num_experts", "n_routed_experts")
        fields["num_experts_per_tok"] = need("num_experts_per_tok")
        if (get("n_group") or 1) > 1 and (get("topk_group") or 1) < get("n_group"):  # (DeepSeek-V3's grouped_topk)
            fields.update(n_group=need("n_group"), topk_group=need("topk_group"))
        fields["intermediate_size"] = need("moe_intermediate_size", "intermediate_size")
        if get("interleave_moe_layer_step") is not None:  # Llama 4
            fields.update(_llama4_experts(get, need, where, fields["num_layers"]))
        else:
            fields.update(_expert_layout(get, need, where, fields["num_layers"]))
    elif _model_type(cfg, raw) == "granitemoehybrid" and get("shared_intermediate_size"):
        fields["intermediate_size"] = need("shared_intermediate_size")  # (a dense Granite 4.0-H's one MLP: shared_mlp)
    else:
        fields["intermediate_size"] = need("intermediate_size")
    quant = raw.get("quantization_config") or cfg.get("quantization_config") or _hf_quant_config(file)
    mixed = None
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        modelopt = _modelopt(quant, where)
        if method == "mxfp4" and experts:
            fields["expert_weight_bytes"] = 0.53125  # 4 bits and one 8-bit scale per 32 weights
        elif modelopt and modelopt[0] == MIXED_PRECISION:
            from simkv.specs.mixed_precision import mixed_precision_layers

            mixed = mixed_precision_layers(quant, where, fields["num_layers"])
            fields.update(mixed.fields())
            if modelopt[1]:
                fields["checkpoint_kv_cache_dtype"] = modelopt[1]
        elif method == "fp8" or (method == "compressed-tensors" and _fp8_weights(quant)) or modelopt:
            attention_kept_out = _check_fp8_exclusions(quant, where)
            fp4 = bool(modelopt) and modelopt[0] in MODELOPT_FP4_ALGOS
            weight_bytes = NVFP4_WEIGHT_BYTES if fp4 else 1.0  # (fp8: the scales are negligible)
            fields["linear_weight_bytes"] = weight_bytes
            if attention_kept_out:
                if get("index_topk"):
                    raise ModelConfigError(f"{where}: field 'quantization_config': attention kept out of the "
                                           "quantized format is not modelled with sparse attention's indexers")
                fields["attention_weight_bytes"] = 2.0  # (the model's dtype, bf16)
            if fp4 and modelopt[0] == "W4A16_NVFP4":
                fields["fp4_weight_only"] = True
            if experts:
                fields["expert_weight_bytes"] = weight_bytes
            if modelopt and modelopt[1]:
                fields["checkpoint_kv_cache_dtype"] = modelopt[1]
        else:
            raise ModelConfigError(f"{where}: field 'quantization_config': quant_method {method!r} is not modelled "
                                   "(simkv sizes bf16, FP8 and MXFP4-expert weights); drop the field to size the "
                                   "model at bf16")
    # (a wrapper may hold the window fields at its top level too; the text config's win)
    merged = cfg if cfg is raw else {k: v for k, v in raw.items() if k != "text_config"} | {
        k: v for k, v in cfg.items() if v is not None}
    if linear:
        fields.update(_linear_attention(cfg, raw, get, need, where, fields["num_layers"]))
    elif get("attention_chunk_size"):
        fields.update(_chunks(get, need, where, fields["num_layers"]))
    else:
        fields.update(_windows(merged, where, fields["num_layers"]))
    fields.update(_vision(raw, f"model config {path}"))
    if mixed is not None:  # (its layers checked against the model's: every one of a kind, or none)
        mixed.check_layers(fields)
    return fields


# The most embeddings the Qwen VL processors make of one image by default: max_pixels (Qwen2-VL,
# Qwen2.5-VL: 12,845,056; Qwen3-VL: 16,777,216) over one embedding's pixels (28 x 28; 32 x 32)
_QWEN_VL_MAX_EMBEDS = 16384


def _vision(raw: dict, where: str) -> dict:
    """The vision encoder fields of a Qwen VL config's `vision_config` (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL and its MoE): none for other configs (their decoder alone is sized)."""
    vision = raw.get("vision_config")
    kind = raw.get("model_type")
    if not isinstance(vision, dict) or kind not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        return {}
    where = f"{where} (vision_config)"

    def need(name: str) -> int:
        value = vision.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{where}: field '{name}' must be a positive whole number, got {value!r}")
        return value

    def indexes(name: str) -> list:
        value = vision.get(name) or []
        if not isinstance(value, list) or not all(isinstance(i, int) and 0 <= i < depth for i in value):
            raise ModelConfigError(f"{where}: field '{name}' must list layers below depth ({depth}), got {value!r}")
        return value

    depth = need("depth")
    merge = need("spatial_merge_size")
    fields = {"vision_num_layers": depth, "vision_patches_per_embed": merge * merge,
              "vision_full_attention_layers": depth, "mm_max_tokens_per_item": _QWEN_VL_MAX_EMBEDS,
              "vision_patch_size": need("patch_size")}
    if kind == "qwen2_vl":  # (embed_dim wide, an MLP of mlp_ratio x that with two projections)
        width = need("embed_dim")
        ratio = vision.get("mlp_ratio", 4)
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio <= 0:
            raise ModelConfigError(f"{where}: field 'mlp_ratio' must be a positive number, got {ratio!r}")
        return fields | {"vision_hidden_size": width, "vision_intermediate_size": int(width * ratio),
                         "vision_gated_mlp": False}
    fields |= {"vision_hidden_size": need("hidden_size"), "vision_intermediate_size": need("intermediate_size")}
    if kind == "qwen2_5_vl":  # (a gated MLP; windows of window_size pixels but in the fullatt_block_indexes layers)
        side = need("window_size") // need("patch_size")
        return fields | {"vision_window_patches": side * side,
                         "vision_full_attention_layers": len(indexes("fullatt_block_indexes"))}
    return fields | {"vision_gated_mlp": False, "vision_num_mergers": 1 + len(indexes("deepstack_visual_indexes"))}


def _llama4_experts(get, need, where: str, num_layers: int) -> dict:
    """Llama 4's experts: every interleave_moe_layer_step-th layer has them (and a shared expert
    of intermediate_size), the others a dense MLP of intermediate_size_mlp; counted as dense
    layers and expert layers (their order does not change their cost)."""
    step = need("interleave_moe_layer_step")
    out = {"shared_expert_intermediate_size": need("intermediate_size")}
    num_expert_layers = num_layers // step
    if num_expert_layers < num_layers:
        out["num_dense_layers"] = num_layers - num_expert_layers
        out["dense_intermediate_size"] = need("intermediate_size_mlp")
    return out


def _chunks(get, need, where: str, num_layers: int) -> dict:
    """Chunked local attention (Llama 4): the layers without rotary embeddings (no_rope_layers 0,
    by default every no_rope_layer_interval-th, 4) attend everything, the others their chunk."""
    chunk = need("attention_chunk_size")
    layers = get("no_rope_layers")
    interval = get("no_rope_layer_interval") or 4
    if layers:
        if len(layers) != num_layers:
            raise ModelConfigError(f"{where}: field 'no_rope_layers' must name each of the {num_layers} layers "
                                   f"(it has {len(layers)})")
        full = [i for i, uses_rope in enumerate(layers) if not uses_rope]
        interval = full[0] + 1 if full else 0
        if not full or full != list(range(interval - 1, num_layers, interval)):
            raise ModelConfigError(f"{where}: field 'no_rope_layers': simkv models one full-attention layer every "
                                   "k layers (the others chunked), not this pattern")
    return {"attention_chunk_size": chunk, "full_attention_interval": interval}


def _expert_layout(get, need, where: str, num_layers: int) -> dict:
    """Leading dense layers and shared experts of a mixture of experts; refuses expert layers
    interleaved with dense ones."""
    for key, every_layer in (("moe_layer_freq", 1), ("decoder_sparse_step", 1)):
        if get(key) not in (None, every_layer):
            raise ModelConfigError(f"{where}: field '{key}': experts on only some layers are not modelled "
                                   f"(simkv models leading dense layers, then experts on every layer)")
    if get("mlp_only_layers"):
        raise ModelConfigError(f"{where}: field 'mlp_only_layers': dense layers among the expert layers are not "
                               "modelled")
    out = {}
    dense = get("first_k_dense_replace") or 0
    if dense:
        out["num_dense_layers"] = need("first_k_dense_replace")
        if dense >= num_layers:
            raise ModelConfigError(f"{where}: field 'first_k_dense_replace' ({dense}) leaves no expert layer of "
                                   f"the {num_layers}")
        out["dense_intermediate_size"] = need("intermediate_size")
    if get("n_shared_experts"):
        out["shared_expert_intermediate_size"] = need("n_shared_experts") * need("moe_intermediate_size")
    elif get("shared_expert_intermediate_size") or get("shared_intermediate_size"):
        out["shared_expert_intermediate_size"] = need("shared_expert_intermediate_size", "shared_intermediate_size")
    return out


_LINEAR_LAYER_TYPES = ("full_attention", "attention", "linear_attention", "mamba")
_STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def _model_type(cfg: dict, raw: dict) -> str:
    return str(cfg.get("model_type") or raw.get("model_type") or "")


def _is_linear_hybrid(cfg: dict, raw: dict) -> bool:
    """Qwen3-Next / Qwen3.5 (Gated DeltaNet) or Granite 4.0-H (Mamba2) beside full attention (a
    Qwen3-Next or Qwen3.5 config may give only full_attention_interval)."""
    types = set(cfg.get("layer_types") or ())
    model_type = _model_type(cfg, raw)
    return bool(types & {"linear_attention", "mamba"}) or model_type == "qwen3_next" or model_type.startswith("qwen3_5")


def _linear_attention(cfg: dict, raw: dict, get, need, where: str, num_layers: int) -> dict:
    """Linear-attention layers beside full-attention ones. Gated DeltaNet (Qwen3-Next, Qwen3.5):
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
    linear_conv_kernel_dim, the gated query (attn_output_gate, on unless the config says false, as
    vLLM's Qwen3-Next layers read it), Qwen3.5's mamba_ssm_dtype (the only architecture whose
    state dtype vLLM takes from its config; the others keep it bf16). Mamba2 (Granite 4.0-H):
    mamba_n_heads, mamba_d_head, mamba_d_state, mamba_n_groups, mamba_d_conv. The attention layers are layer_types' full_attention (or
    attention) ones, or every full_attention_interval-th; they need not sit at the end of each
    period (the KV-cache groups and the costs depend only on their number and on the first layer
    being linear), but must divide the layers into equal periods."""
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ModelConfigError(f"{where}: field 'layer_types' must name each of the {num_layers} layers "
                                   f"(it has {len(types)})")
        num_attention = sum(t in ("full_attention", "attention") for t in types)
        if not num_attention or num_layers % num_attention or types[0] in ("full_attention", "attention"):
            raise ModelConfigError(f"{where}: field 'layer_types': simkv models one attention layer in every k "
                                   "layers, the first of them linear, not this pattern")
        interval = num_layers // num_attention
    else:
        interval = need("full_attention_interval")
    out = {"full_attention_interval": interval}
    if get("mamba_n_heads") is not None:
        out.update(linear_attention="mamba2", linear_num_value_heads=need("mamba_n_heads"),
                   linear_value_head_dim=need("mamba_d_head"), linear_key_head_dim=need("mamba_d_state"),
                   linear_num_key_heads=need("mamba_n_groups"), linear_conv_kernel_dim=need("mamba_d_conv"))
    else:
        out.update(linear_attention="gated_deltanet", linear_num_key_heads=need("linear_num_key_heads"),
                   linear_num_value_heads=need("linear_num_value_heads"),
                   linear_key_head_dim=need("linear_key_head_dim"), linear_value_head_dim=need("linear_value_head_dim"),
                   linear_conv_kernel_dim=need("linear_conv_kernel_dim"))
        gate = get("attn_output_gate")
        out["attention_output_gate"] = True if gate is None else bool(gate)
    dtype = get("mamba_ssm_dtype") if _model_type(cfg, raw).startswith("qwen3_5") else None
    if dtype is not None:
        if dtype not in _STATE_DTYPE_BYTES:
            raise ModelConfigError(f"{where}: field 'mamba_ssm_dtype': {dtype!r} is not one of "
                                   f"{', '.join(_STATE_DTYPE_BYTES)}")
        out["linear_state_dtype_bytes"] = _STATE_DTYPE_BYTES[dtype]
        out["linear_state_dtype_pinned"] = True
    return out


def _nemotron_h(cfg: dict, raw: dict, where: str) -> dict:
    """Nemotron-H (and Nemotron Nano / Nemotron 3): hybrid_override_pattern gives each layer one
    block (M Mamba2, * attention, - a squared-ReLU MLP of intermediate_size, E experts of
    moe_intermediate_size with n_shared_experts shared ones of moe_shared_expert_intermediate_size);
    the Mamba2 state from mamba_num_heads, mamba_head_dim, ssm_state_size, n_groups, conv_kernel,
    its recurrent part float32 unless mamba_ssm_cache_dtype says otherwise (vLLM's default for
    these models); head_dim or attention_head_dim."""
    def need(*names: str) -> int:
        for name in names:
            value = cfg.get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ModelConfigError(f"{where}: field '{name}' must be a positive whole number, got {value!r}")
                return value
        raise ModelConfigError(f"{where}: field '{names[0]}' is missing")

    pattern = cfg["hybrid_override_pattern"]
    layers = need("num_hidden_layers")
    if not isinstance(pattern, str) or len(pattern) != layers or set(pattern) - set("M*-E"):
        raise ModelConfigError(f"{where}: field 'hybrid_override_pattern' must give each of the {layers} layers one "
                               f"of M, *, -, E (got {pattern!r})")
    if cfg.get("moe_latent_size"):
        raise ModelConfigError(f"{where}: field 'moe_latent_size': latent experts (Nemotron 3 Super's) are not "
                               "modelled")
    if raw.get("quantization_config") or cfg.get("quantization_config"):
        raise ModelConfigError(f"{where}: field 'quantization_config': quantized Nemotron-H checkpoints are not "
                               "modelled; drop the field to size the model at bf16")
    if isinstance(cfg.get("intermediate_size"), list):
        raise ModelConfigError(f"{where}: field 'intermediate_size': MLPs of different widths are not modelled")
    heads, hidden = need("num_attention_heads"), need("hidden_size")
    out = {"num_layers": layers, "hidden_size": hidden, "num_heads": heads,
           "num_kv_heads": need("num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads,
           "head_dim": need("head_dim", "attention_head_dim") if (cfg.get("head_dim") or cfg.get("attention_head_dim"))
           else hidden // heads,
           "vocab_size": need("vocab_size"), "max_position_embeddings": need("max_position_embeddings"),
           "tie_word_embeddings": _tied(cfg, raw), "layer_pattern": pattern, "gated_mlp": False,
           "intermediate_size": need("intermediate_size") if "-" in pattern or "E" not in pattern else 1}
    if "M" in pattern:
        dtype = cfg.get("mamba_ssm_cache_dtype") or "float32"
        if dtype not in _STATE_DTYPE_BYTES:
            raise ModelConfigError(f"{where}: field 'mamba_ssm_cache_dtype': {dtype!r} is not one of "
                                   f"{', '.join(_STATE_DTYPE_BYTES)}")
        out.update(linear_attention="mamba2", linear_num_value_heads=need("mamba_num_heads"),
                   linear_value_head_dim=need("mamba_head_dim"), linear_key_head_dim=need("ssm_state_size"),
                   linear_num_key_heads=need("n_groups", "mamba_num_groups"), linear_conv_kernel_dim=need("conv_kernel"),
                   linear_state_dtype_bytes=_STATE_DTYPE_BYTES[dtype], linear_state_dtype_pinned=True)
    if "E" in pattern:
        if "-" in pattern:
            out["dense_intermediate_size"] = out["intermediate_size"]
        out.update(num_experts=need("n_routed_experts"), num_experts_per_tok=need("num_experts_per_tok"),
                   intermediate_size=need("moe_intermediate_size"))
        if cfg.get("n_shared_experts"):
            out["shared_expert_intermediate_size"] = need("n_shared_experts") * need("moe_shared_expert_intermediate_size")
    return out


# NVIDIA ModelOpt's FP8 weight formats (vLLM's modelopt LINEAR_ALGOS of one byte a weight), and its
# KV-cache algorithms as vLLM resolves --kv-cache-dtype auto from them (MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP)
MODELOPT_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8")
# ... and its NVFP4 (W4A4: fp4 weights and activations, NVFP4_WEIGHT_BYTES a weight; W4A16: the
# same weights, multiplied in bf16)
MODELOPT_FP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
MODELOPT_ALGOS = (*MODELOPT_FP8_ALGOS, *MODELOPT_FP4_ALGOS)
# ... and a checkpoint whose layers each name their own format (quantized_layers: simkv/specs/mixed_precision.py)
MIXED_PRECISION = "MIXED_PRECISION"
MODELOPT_KV_CACHE_DTYPES = {"FP8": "fp8_e4m3", "NVFP4": "nvfp4"}


def _hf_quant_config(config_file: Path) -> dict | None:
    """A ModelOpt checkpoint's hf_quant_config.json beside its config.json (older exports keep the
    quantization there), as vLLM reads it: a quantization_config of quant_method modelopt."""
    side = config_file.parent / "hf_quant_config.json"
    if not side.is_file():
        return None
    try:
        raw = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{side}: not readable JSON ({exc})") from None
    return raw | {"quant_method": "modelopt"} if isinstance(raw, dict) else None


def _modelopt(quant: dict, where: str) -> tuple[str, str] | None:
    """A ModelOpt checkpoint's (weight algorithm, KV dtype vLLM runs `auto` as, "" for the model's),
    in either of its layouts (vLLM's ModelOptQuantConfigBase.from_config); None if not ModelOpt."""
    method = str(quant.get("quant_method", ""))
    if not method.startswith("modelopt"):
        return None
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
    algo = str(inner.get("quant_algo") or "").upper()
    # (vLLM's get_kv_cache_quant_algo_string: the scheme, else the algorithm; what it does not know: auto)
    kv = (inner.get("kv_cache_scheme") or quant.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
          or quant.get("kv_cache_quant_algo"))
    if isinstance(kv, dict):
        floats = kv.get("type") == "float"
        kv = "FP8" if floats and kv.get("num_bits") == 8 and kv.get("dynamic") is False else \
            "NVFP4" if floats and kv.get("num_bits") == 4 else None
    if algo not in MODELOPT_ALGOS and algo != MIXED_PRECISION:
        raise ModelConfigError(f"{where}: field 'quantization_config': ModelOpt quant_algo {algo or None!r} is not "
                               f"modelled (simkv sizes {', '.join(MODELOPT_ALGOS)} and {MIXED_PRECISION}); drop the "
                               "field to size the model at bf16")
    kv_dtype = MODELOPT_KV_CACHE_DTYPES.get(kv.upper(), "") if isinstance(kv, str) else ""
    return algo, kv_dtype


def _check_fp8_exclusions(quant: dict, where: str) -> bool:
    """A quantized checkpoint's modules kept out of its format (vLLM's fp8 ignored_layers,
    compressed-tensors' ignore, ModelOpt's exclude_modules): the LM head, a vision tower and the
    MoE routers change nothing simkv sizes (they are bf16 in it anyway); every layer's attention
    (`model.layers.*.self_attn*`, as NVIDIA's NVFP4 exports of DeepSeek keep it) stays bf16, and
    the result says so; other decoder layers' linear layers (one layer's, one projection's, an
    MLP's) would change what simkv sizes, and are refused."""
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else {}
    excluded = [*(quant.get("ignored_layers") or []), *(quant.get("ignore") or []),
                *(quant.get("exclude_modules") or []), *(inner.get("exclude_modules") or [])]
    inside = [p for p in excluded if isinstance(p, str) and _inside_decoder(p)]
    attention = [p for p in inside if _every_layers_attention(p)]
    rest = [p for p in inside if p not in attention]
    if rest:
        raise ModelConfigError(f"{where}: field 'quantization_config': {', '.join(rest)} kept out of the "
                               "quantized format is not modelled (simkv sizes every decoder linear layer in it but "
                               "whole attention modules: model.layers.*.self_attn*)")
    return bool(attention)


def _every_layers_attention(pattern: str) -> bool:
    """Whether a pattern names the whole attention module (`self_attn`, every projection in it)
    of every decoder layer: nothing after `self_attn` but wildcards, no layer number before it."""
    name = pattern.lower()
    at = name.find("self_attn")
    if at < 0 or re.search(r"layers?\.\d", name[:at]) or any(part in name for part in ("mlp", "expert")):
        return False
    return all(c in "*.$)" for c in name[at + len("self_attn"):])


def _inside_decoder(pattern: str) -> bool:
    """Whether a module name or pattern (regex 're:...' or glob) names a decoder layer's linear
    layers: not the LM head, embeddings, a vision tower, or a router (mlp.gate, shared_expert_gate)."""
    name = pattern.lower()
    if any(part in name for part in ("visual", "vision", "mm_projector", "multi_modal", "lm_head", "embed")):
        return False
    tail = name.rstrip("*$)")
    if tail.endswith(".gate") or tail.endswith("expert_gate"):
        return False
    return any(part in name for part in ("layers", "self_attn", "attn", "mlp", "expert", "proj"))


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
