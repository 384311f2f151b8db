"""NVIDIA ModelOpt's MIXED_PRECISION checkpoints: each quantized module names its own format.

The checkpoint's `quantized_layers` maps module names (`model.layers.3.self_attn.q_proj`,
`model.layers.3.mlp.experts.7.up_proj`, ...) to a ModelOpt algorithm; a module it does not
name, or one its `exclude_modules` names, stays in the model's dtype (vLLM's
ModelOptMixedPrecisionConfig: UnquantizedLinearMethod). simkv sizes a decoder in three parts,
each at one weight size (ModelSpec): the attention projections (`attention_weight_bytes`), the
routed experts (`expert_weight_bytes`) and the other linear layers (`linear_weight_bytes`: dense
MLPs, shared experts, linear attention's projections). So the modules are sorted into five kinds:
attention, routed experts, dense MLPs, shared experts and linear attention; each kind must name
every layer that has it in one format, or none (bf16), and the last three one format between
them. A mix simkv cannot size that way (FP8 attention in some layers only, say) is refused with
the module named, not sized wrong. The LM head, embeddings, a vision tower and routers are
sized as simkv sizes them for every checkpoint (bf16), whatever the mapping says; layers past
the decoder's (an MTP module's) are not the decoder's.

FP8 formats (FP8, per-channel, 128x128 blocks, MXFP8) weigh one byte a weight, NVFP4 and
W4A16_NVFP4 NVFP4_WEIGHT_BYTES; W4A4 NVFP4 multiplies at the fp4 peak, W4A16 in bf16 (one
checkpoint may not mix the two: ModelSpec.fp4_weight_only is the model's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from simkv.specs import NVFP4_WEIGHT_BYTES
from simkv.specs.hf_config import MODELOPT_FP4_ALGOS, MODELOPT_FP8_ALGOS, ModelConfigError, _inside_decoder

# vLLM's block-FP8 MoE names (FP8_PB_WO's older alias): one byte a weight too
_FP8_ALGOS = (*MODELOPT_FP8_ALGOS, "FP8_BLOCK_SCALES")
KINDS = ("attention", "experts", "dense_mlp", "shared_experts", "linear_attention")
_LINEAR_KINDS = ("dense_mlp", "shared_experts", "linear_attention")  # (at linear_weight_bytes)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ATTENTION_PROJ = re.compile(r"\.(q|k|v|o|qkv|q_a|q_b|kv_a|kv_b|kv_a_proj_with_mqa|q_a_proj|q_b_proj|kv_b_proj)(_proj)?$")


@dataclass
class MixedPrecision:
    """Each kind's format and the layers that name it (KINDS; a kind no module names: absent)."""

    where: str
    algos: dict[str, str] = field(default_factory=dict)
    layers: dict[str, set[int]] = field(default_factory=dict)
    example: dict[str, str] = field(default_factory=dict)  # (a module of each kind, for messages)

    def bytes_of(self, kind: str) -> float:
        algo = self.algos.get(kind)
        if algo is None:
            return 2.0
        return NVFP4_WEIGHT_BYTES if algo in MODELOPT_FP4_ALGOS else 1.0

    def fields(self) -> dict:
        """ModelSpec's weight sizes (and fp4_weight_only) for the checkpoint."""
        named = [k for k in _LINEAR_KINDS if k in self.algos]
        linear = {self.bytes_of(k) for k in named}
        if len(linear) > 1:
            shown = ", ".join(f"{self.example[k]} {self.algos[k]}" for k in named)
            raise ModelConfigError(f"{self.where}: field 'quantized_layers': {shown}: simkv sizes dense MLPs, shared "
                                   "experts and linear attention's projections in one format; this mix is not modelled")
        fp4 = {a for a in self.algos.values() if a in MODELOPT_FP4_ALGOS}
        if len(fp4) > 1:
            raise ModelConfigError(f"{self.where}: field 'quantized_layers': both NVFP4 and W4A16_NVFP4 modules: one "
                                   "checkpoint's fp4 weights multiply one way in simkv; this mix is not modelled")
        out = {"linear_weight_bytes": linear.pop() if linear else 2.0,
               "attention_weight_bytes": self.bytes_of("attention"),
               "expert_weight_bytes": self.bytes_of("experts")}
        if fp4 == {"W4A16_NVFP4"}:
            out["fp4_weight_only"] = True
        return out

    def check_layers(self, spec_fields: dict) -> None:
        """Each kind named must be named for every layer that has it (the model's spec fields)."""
        from simkv.specs import ModelSpec

        spec = ModelSpec(name="(quantized_layers)", **spec_fields)
        has = {"attention": spec.num_attention_layers, "experts": spec.num_moe_layers,
               "dense_mlp": spec.num_dense_mlp_layers,
               "shared_experts": spec.num_moe_layers if spec.shared_expert_intermediate_size else 0,
               "linear_attention": spec.num_linear_attention_layers}
        named = [k for k in _LINEAR_KINDS if k in self.algos]
        bare = [k for k in _LINEAR_KINDS if has[k] and k not in self.algos]
        if named and bare:  # (a kind no module names stays bf16, beside the named ones' format)
            raise ModelConfigError(
                f"{self.where}: field 'quantized_layers': {self.example[named[0]]} in {self.algos[named[0]]}, and no "
                f"module of the model's {bare[0].replace('_', ' ')} is named (bf16): simkv sizes dense MLPs, shared "
                "experts and linear attention's projections in one format; this mix is not modelled")
        if spec.index_topk and spec.attn_weight_bytes != spec.linear_weight_bytes:
            raise ModelConfigError(f"{self.where}: field 'quantized_layers': attention in another format than the "
                                   "other linear layers is not modelled with sparse attention's indexers")
        for kind, layers in self.layers.items():
            if len(layers) != has[kind]:
                raise ModelConfigError(
                    f"{self.where}: field 'quantized_layers': {kind.replace('_', ' ')} of {len(layers)} layers "
                    f"({self.example[kind]}, ...) in {self.algos[kind]}, and the model has {has[kind]} such layers: "
                    "a format for some layers of a kind only is not modelled")


def _kind(name: str) -> str | None:
    """A quantized module's kind (KINDS), or None for what simkv sizes alike in every checkpoint
    (LM head, embeddings, vision tower, routers); "" for a decoder module it cannot place."""
    low = name.lower()
    if not _inside_decoder(low):  # (the LM head, embeddings, a vision tower, routers)
        return None
    if "shared_expert" in low:
        return "shared_experts"
    if ".experts." in low or low.endswith(".experts"):
        return "experts"
    if "linear_attn" in low or ".mamba." in low or (".mixer." in low and not _ATTENTION_PROJ.search(low)):
        return "linear_attention"
    if "self_attn" in low or ".attn." in low or ".attention." in low or ".mixer." in low:
        return "attention"
    if ".mlp." in low or "feed_forward" in low or low.endswith(".mlp"):
        return "dense_mlp"
    return ""


def mixed_precision_layers(quant: dict, where: str, num_layers: int) -> MixedPrecision:
    """The kinds and formats of a MIXED_PRECISION checkpoint's `quantized_layers` (in either of
    ModelOpt's layouts) in the decoder's `num_layers` layers, less the modules its
    exclude_modules keep out."""
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
    table = inner.get("quantized_layers") or quant.get("quantized_layers")
    if not isinstance(table, dict) or not table:
        raise ModelConfigError(f"{where}: field 'quantization_config': MIXED_PRECISION without a 'quantized_layers' "
                               "mapping (vLLM refuses it too)")
    excluded = [p for p in (*(quant.get("exclude_modules") or []), *(inner.get("exclude_modules") or []))
                if isinstance(p, str)]
    out = MixedPrecision(where)
    for name, recipe in table.items():
        algo = str((recipe or {}).get("quant_algo", "") if isinstance(recipe, dict) else "").upper()
        if any(fnmatchcase(name, p) for p in excluded):
            continue  # (vLLM checks exclusions first)
        kind = _kind(name)
        if kind is None:
            continue
        if not kind:
            raise ModelConfigError(f"{where}: field 'quantized_layers': {name!r}: a decoder module simkv cannot place "
                                   "(attention, experts, MLP, shared experts or linear attention)")
        if algo not in _FP8_ALGOS and algo not in MODELOPT_FP4_ALGOS:
            raise ModelConfigError(f"{where}: field 'quantized_layers': {name!r}: quant_algo {algo or None!r} is not "
                                   f"modelled (simkv sizes {', '.join((*_FP8_ALGOS, *MODELOPT_FP4_ALGOS))})")
        layer = _LAYER.search(name)
        if layer is None:
            raise ModelConfigError(f"{where}: field 'quantized_layers': {name!r}: no layer number (layers.N.)")
        if int(layer.group(1)) >= num_layers:
            continue  # (an MTP module's layer: not the decoder's)
        known = out.algos.setdefault(kind, algo)
        if known != algo and not _same_size(known, algo):
            raise ModelConfigError(f"{where}: field 'quantized_layers': {out.example[kind]} in {known} and {name} in "
                                   f"{algo}: one kind of module ({kind.replace('_', ' ')}) in two formats is not "
                                   "modelled")
        out.example.setdefault(kind, name)
        out.layers.setdefault(kind, set()).add(int(layer.group(1)))
    return out


def _same_size(a: str, b: str) -> bool:
    """Two FP8 formats: one byte a weight each, multiplied at the fp8 peak alike."""
    return a in _FP8_ALGOS and b in _FP8_ALGOS
