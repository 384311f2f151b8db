"""Model and GPU specs shipped with simkv (YAML beside this file)."""

from __future__ import annotations

import math
import re

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import yaml

_HERE = Path(__file__).parent
LINEAR_ATTENTION_KINDS = ("gated_deltanet", "mamba2")
INDEXER_QUANT_BLOCK = 128  # the sparse-attention indexer's fp8 keys: one float32 scale per 128 values


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    # Sliding-window attention (0: none): layers attend only the last `sliding_window` tokens.
    sliding_window: int = 0
    # With a window: every `full_attention_interval`-th layer attends everything (Gemma 3: 6,
    # Gemma 2: 2); 0: every layer slides (Mistral 7B v0.1).
    full_attention_interval: int = 0
    # Chunked local attention (Llama 4; 0: none): the other layers attend only the tokens of their
    # own `attention_chunk_size`-token chunk of the sequence (every `full_attention_interval`-th
    # layer attends everything).
    attention_chunk_size: int = 0
    # Mixture of experts (0: a dense gated MLP): every layer has `num_experts` gated MLPs of
    # `intermediate_size` and a router; each token runs `num_experts_per_tok` of them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # Group-limited routing (DeepSeek-V3's n_group and topk_group, vLLM's grouped_topk): the experts
    # fall in n_group groups, and a token's experts come from its best topk_group of them (1, 1: none)
    n_group: int = 1
    topk_group: int = 1
    # Redundant copies of routed experts the GPUs hold besides the model's (vLLM's EPLB
    # num_redundant_experts, set as served: HardwareConfig.model_spec): memory, not parameters
    num_redundant_experts: int = 0
    # Bytes per expert weight in memory and in the step's reads: 2 (bf16), 0.53125 (MXFP4: 4 bits
    # and one 8-bit scale per 32, gpt-oss's checkpoints). Everything else is bf16.
    expert_weight_bytes: float = 2.0
    # The output projection (LM head) is the input embedding matrix (Gemma, Llama 3.2 1B/3B,
    # Qwen2.5 up to 3B): memory holds it once.
    tie_word_embeddings: bool = False
    # A mixture of experts whose published EAGLE-3 draft heads are dense layers: the gated MLP
    # width of that head (0: none known; the EAGLE layer is then shaped like one of the target's
    # layers, its experts included).
    eagle_head_intermediate_size: int = 0
    # MTP modules the checkpoint ships (num_nextn_predict_layers, Qwen's mtp_num_hidden_layers; 0:
    # none known, speculative_method 'mtp' then loads one): vLLM's MTP drafter loads them all.
    num_nextn_predict_layers: int = 0
    # Bytes per weight of the decoder layers' linear layers outside the experts (attention, the
    # dense MLP or the router): 2 (bf16), 1 (FP8 checkpoints). Embeddings, LM head and norms: bf16.
    linear_weight_bytes: float = 2.0
    # ... of the attention layers' projections where a checkpoint keeps them out of its format
    # (ModelOpt's exclude_modules "model.layers.*.self_attn*": bf16 beside NVFP4 or FP8 MLPs);
    # None: `linear_weight_bytes`.
    attention_weight_bytes: float | None = None
    # DeepSeek's layout of a mixture of experts: the first `num_dense_layers` layers have a dense
    # gated MLP of `dense_intermediate_size` instead of experts (first_k_dense_replace), and every
    # expert layer also runs a shared gated MLP of `shared_expert_intermediate_size` (all shared
    # experts together) for every token.
    num_dense_layers: int = 0
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Multi-head latent attention (DeepSeek V2/V3, Kimi K2; 0: none). The cache holds one latent of
    # `kv_lora_rank` plus a rotary key of `qk_rope_head_dim` per token and layer, shared by all
    # heads and not split by tensor parallelism; `head_dim` is the query-key width
    # (qk_nope_head_dim + qk_rope_head_dim), `v_head_dim` the value width; queries go through a
    # low-rank projection of `q_lora_rank` (0: a direct one).
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    # DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5; 0: none), on top of latent attention:
    # in every layer an indexer (`index_n_heads` heads of `index_head_dim`, fp8, one key a token
    # cached beside the latent) scores every cached token for every query, and the query attends
    # only the `index_topk` best.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # Linear attention (hybrid models; "": none): "gated_deltanet" (Qwen3-Next, Qwen3.5) or "mamba2"
    # (Granite 4.0-H). Every `full_attention_interval`-th layer attends the whole context; the others
    # keep a fixed-size state per request instead of K/V (vLLM's MambaSpec): a short convolution's
    # last `linear_conv_kernel_dim - 1` inputs of conv_dim channels (gated_deltanet: 2 x key heads x
    # key dim + value heads x value dim; mamba2: value heads x value dim + 2 x groups x state dim)
    # and a recurrent state of value heads x value dim x key dim. Mamba2 in these names: its heads
    # and head_dim are the value heads and dim, its n_groups the key heads, its d_state the key dim.
    linear_attention: str = ""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Bytes per element of the recurrent state (vLLM's mamba_ssm_cache_dtype: the model's dtype by
    # default, float32 where the checkpoint asks, Qwen3.5's mamba_ssm_dtype); the convolution
    # state is bf16.
    linear_state_dtype_bytes: int = 2
    # ... whether the checkpoint's config sets it (Nemotron-H, Qwen3.5's mamba_ssm_dtype: vLLM then
    # keeps it unless --mamba-ssm-cache-dtype is given), or it follows the state's dtype (the
    # model's, or --mamba-cache-dtype)
    linear_state_dtype_pinned: bool = False
    # Bytes per element of the convolution state (vLLM's mamba_cache_dtype: the model's bf16 by default)
    linear_conv_dtype_bytes: int = 2
    # Qwen3-Next's gated attention: the query projection also yields a gate per head (twice as wide).
    attention_output_gate: bool = False
    # NVFP4 weights dequantized to bf16 for their matmuls (ModelOpt's W4A16_NVFP4): the fp4 bytes
    # in memory and reads, the bf16 rate on every GPU
    fp4_weight_only: bool = False
    # The KV cache dtype the checkpoint asks for (NVIDIA ModelOpt's kv_cache_quant_algo: vLLM then
    # runs --kv-cache-dtype auto as this, fp8_e4m3 or nvfp4; "": the model's dtype)
    checkpoint_kv_cache_dtype: str = ""
    # The share of a head's dimensions that rotary embeddings turn (partial_rotary_factor: Qwen3-Next
    # 0.25, its first 64 of 256); vLLM's Octave KV cache stores those at more bits
    partial_rotary_factor: float = 1.0
    # Attention layers whose K and V a quantized KV cache keeps in the model's 2-byte dtype (vLLM's
    # --kv-cache-dtype-skip-layers; set as served: simkv.config.EngineConfig.kv_spec)
    kv_skip_layers: int = 0
    # Nemotron-H's layout (its hybrid_override_pattern; "": every layer a mixer and an MLP): one
    # letter a layer, each layer one block: M a Mamba2 mixer, * attention, - a dense MLP, E experts.
    layer_pattern: str = ""
    # The MLPs' and experts' form: gated (gate, up and down projections) or, False, two projections
    # (Nemotron-H's squared ReLU).
    gated_mlp: bool = True
    # A vision encoder (multimodal models; 0 layers: none): a ViT of `vision_num_layers` layers of
    # `vision_hidden_size` (an MLP of `vision_intermediate_size`, gated unless `vision_gated_mlp`
    # is False: Qwen3-VL's and Qwen2-VL's have two projections), whose patches are merged
    # `vision_patches_per_embed` to one embedding the decoder reads (Qwen2.5-VL: 2 x 2) by an MLP
    # of width vision_patches_per_embed x vision_hidden_size (`vision_num_mergers` of them:
    # Qwen3-VL's DeepStack merges three inner layers' patches too). Its layers attend windows of
    # `vision_window_patches` patches (0: the whole image), except `vision_full_attention_layers`.
    # `mm_max_tokens_per_item`: the most embeddings vLLM's processor makes of one item, which sizes
    # its encoder budget and cache.
    vision_num_layers: int = 0
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0
    vision_gated_mlp: bool = True
    vision_patches_per_embed: int = 1
    vision_num_mergers: int = 1
    vision_window_patches: int = 0
    vision_full_attention_layers: int = 0
    mm_max_tokens_per_item: int = 0
    # The side of a patch in pixels (Qwen2-VL, Qwen2.5-VL: 14; Qwen3-VL: 16): an image of H x W
    # pixels makes `image_embeddings(H, W)` embeddings
    vision_patch_size: int = 14

    def __post_init__(self) -> None:
        where = f"model '{self.name}'"
        if self.vision_num_layers and (min(self.vision_hidden_size, self.vision_intermediate_size,
                                           self.vision_patches_per_embed, self.vision_num_mergers,
                                           self.mm_max_tokens_per_item) <= 0
                                       or not 0 <= self.vision_full_attention_layers <= self.vision_num_layers):
            raise ValueError(f"{where}: a vision encoder needs positive vision_hidden_size, vision_intermediate_size, "
                             "vision_patches_per_embed, vision_num_mergers and mm_max_tokens_per_item, and at most "
                             "vision_num_layers full-attention layers")
        if self.is_mla:
            if not 0 < self.qk_rope_head_dim < self.head_dim or self.v_head_dim <= 0:
                raise ValueError(f"{where}: latent attention (kv_lora_rank) needs 0 < qk_rope_head_dim < head_dim "
                                 "(the query-key width) and v_head_dim > 0")
            if self.sliding_window:
                raise ValueError(f"{where}: latent attention with sliding windows is not modelled")
        if self.index_topk:
            if not self.is_mla:
                raise ValueError(f"{where}: sparse attention (index_topk) is modelled on latent attention only")
            if self.index_n_heads <= 0 or self.index_head_dim <= 0 or self.index_head_dim % INDEXER_QUANT_BLOCK:
                raise ValueError(f"{where}: sparse attention needs index_n_heads > 0 and index_head_dim a positive "
                                 f"multiple of {INDEXER_QUANT_BLOCK}")
        if self.sliding_window and self.attention_chunk_size:
            raise ValueError(f"{where}: sliding windows and chunked local attention in one model are not modelled")
        if self.num_dense_layers and not (self.is_moe and self.num_dense_layers < self.num_layers
                                          and self.dense_intermediate_size > 0):
            raise ValueError(f"{where}: num_dense_layers needs a mixture of experts with more layers than that "
                             "and a dense_intermediate_size")
        if self.shared_expert_intermediate_size and not self.is_moe:
            raise ValueError(f"{where}: shared_expert_intermediate_size needs a mixture of experts")
        if (self.n_group, self.topk_group) != (1, 1) and not (
                self.is_moe and 1 <= self.topk_group <= self.n_group and self.num_experts % self.n_group == 0):
            raise ValueError(f"{where}: n_group {self.n_group} and topk_group {self.topk_group} need a mixture of "
                             "experts whose experts split evenly into n_group groups, and 1 <= topk_group <= n_group")
        if self.layer_pattern:
            self._check_layer_pattern(where)
        if self.linear_attention:
            if self.linear_attention not in LINEAR_ATTENTION_KINDS:
                raise ValueError(f"{where}: linear_attention {self.linear_attention!r} is not modelled "
                                 f"(choose {' or '.join(LINEAR_ATTENTION_KINDS)})")
            if self.sliding_window or self.attention_chunk_size or self.is_mla:
                raise ValueError(f"{where}: linear attention with sliding windows, chunked local attention or "
                                 "latent attention is not modelled")
            if min(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                   self.linear_value_head_dim, self.linear_conv_kernel_dim) <= 0:
                raise ValueError(f"{where}: linear attention needs positive linear_num_key_heads, "
                                 "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim and "
                                 "linear_conv_kernel_dim")
            if not self.layer_pattern and not 0 < self.full_attention_interval <= self.num_layers:
                raise ValueError(f"{where}: linear attention needs a full_attention_interval (every K-th layer "
                                 "attends) of at most num_layers, or a layer_pattern")

    def _check_layer_pattern(self, where: str) -> None:
        p = self.layer_pattern
        bad = sorted(set(p) - set("M*-E"))
        if bad or len(p) != self.num_layers:
            raise ValueError(f"{where}: layer_pattern must give each of the {self.num_layers} layers one of M (Mamba2), "
                             f"* (attention), - (MLP), E (experts); got {len(p)} letters" + (f", {bad}" if bad else ""))
        if "*" not in p:
            raise ValueError(f"{where}: layer_pattern without an attention layer (*) is not modelled")
        if ("M" in p) != (self.linear_attention == "mamba2"):
            raise ValueError(f"{where}: layer_pattern's M layers need linear_attention mamba2 and its fields (and "
                             "mamba2 needs M layers)")
        if ("E" in p) != self.is_moe or self.num_dense_layers:
            raise ValueError(f"{where}: layer_pattern's E layers need num_experts (and num_experts E layers); "
                             "num_dense_layers does not apply")
        if self.sliding_window or self.attention_chunk_size or self.is_mla:
            raise ValueError(f"{where}: layer_pattern with local or latent attention is not modelled")

    def with_mamba_cache_dtypes(self, mamba_cache_dtype: str, mamba_ssm_cache_dtype: str) -> "ModelSpec":
        """The linear-attention states as vLLM 0.33 stores them under --mamba-cache-dtype (the
        convolution state, and the recurrent state unless the checkpoint pins that) and
        --mamba-ssm-cache-dtype (the recurrent state): MambaStateDtypeCalculator's rules."""
        if mamba_cache_dtype == mamba_ssm_cache_dtype == "auto":
            return self
        conv = MAMBA_DTYPE_BYTES[mamba_cache_dtype]
        if mamba_ssm_cache_dtype != "auto":
            state = MAMBA_DTYPE_BYTES[mamba_ssm_cache_dtype]
        else:
            state = self.linear_state_dtype_bytes if self.linear_state_dtype_pinned else conv
        return replace(self, linear_conv_dtype_bytes=conv, linear_state_dtype_bytes=state)

    def quantized(self, method: str | None) -> "ModelSpec":
        """The model as vLLM serves it under `--quantization METHOD` (None: the checkpoint as it is).
        fp8: vLLM quantizes a bf16 checkpoint as it loads it, every linear layer of the decoder
        (attention, MLPs, shared and routed experts) to one byte a weight with a per-tensor
        scale; embeddings, LM head, routers and norms stay bf16. An fp8 checkpoint is already
        that; a checkpoint quantized another way (gpt-oss's MXFP4 experts) is refused, as vLLM
        refuses a --quantization that differs from the checkpoint's."""
        if method is None:
            return self
        if method != "fp8":
            raise ValueError(f"quantization {method!r} is not modelled (choose fp8)")
        experts = self.expert_weight_bytes if self.is_moe else self.linear_weight_bytes
        if self.linear_weight_bytes == experts == 1.0:
            return self  # (an fp8 checkpoint)
        if self.linear_weight_bytes != 2.0 or experts != 2.0:
            raise ValueError(f"model '{self.name}': its checkpoint is quantized already (linear layers at "
                             f"{self.linear_weight_bytes:g}, experts at {experts:g} bytes a weight), and vLLM "
                             "refuses a --quantization that differs from the checkpoint's")
        return replace(self, linear_weight_bytes=1.0, expert_weight_bytes=1.0 if self.is_moe else self.expert_weight_bytes)

    @property
    def rotary_dim(self) -> int:
        """The dims of a head that rotary embeddings turn (vLLM's head_size x partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fp8_matmul_params(self) -> int:
        """Parameters per token whose matmuls run in fp8 where the GPU has fp8 tensor cores: the
        linear layers stored at one byte (attention, dense MLPs, shared experts; not the bf16
        routers) and the routed experts a token runs when they are."""
        return self.matmul_params_at(1.0)

    @property
    def fp4_matmul_params(self) -> int:
        """... that run in fp4 where the GPU has fp4 tensor cores: those stored as NVFP4."""
        return self.matmul_params_at(NVFP4_WEIGHT_BYTES)

    @property
    def attn_weight_bytes(self) -> float:
        """Bytes per weight of the attention projections (`attention_weight_bytes`, else the
        linear layers')."""
        return self.linear_weight_bytes if self.attention_weight_bytes is None else self.attention_weight_bytes

    @property
    def attention_linear_params(self) -> int:
        """The attention layers' projections over all layers (not linear attention's)."""
        return self.num_attention_layers * self.attention_params

    def matmul_params_at(self, weight_bytes: float) -> int:
        """Parameters per token whose weights are stored at `weight_bytes` a weight: the linear
        layers (attention, dense MLPs, shared experts; not the bf16 routers) and the routed
        experts a token runs."""
        n = 0
        apart = self.attn_weight_bytes != self.linear_weight_bytes  # (attention kept out of the format)
        if self.linear_weight_bytes == weight_bytes:
            n += self.num_linear_params - self.num_moe_layers * self.hidden_size * self.num_experts
            if self.is_sparse:  # (the indexers' bf16 key and head-weight projection)
                n -= self.num_layers * self.hidden_size * (self.index_head_dim + self.index_n_heads)
            if apart:
                n -= self.attention_linear_params
        if apart and self.attn_weight_bytes == weight_bytes:
            n += self.attention_linear_params
        if self.is_moe and self.expert_weight_bytes == weight_bytes:
            n += self.num_moe_layers * self.num_experts_per_tok * self.expert_params
        return n

    def layer_windows(self, sliding_window: int | None = None, full_attention_interval: int | None = None) -> list[int]:
        """Each decoder layer's attention window (0: full attention), in layer order; the
        arguments override the spec's (None: the spec's own). With chunked local attention: each
        local layer's chunk size (the window it attends is that chunk's tokens so far)."""
        window = (self.sliding_window or self.attention_chunk_size) if sliding_window is None else sliding_window
        interval = self.full_attention_interval if full_attention_interval is None else full_attention_interval
        if not window:
            return [0] * self.num_layers
        return [0 if interval and (i + 1) % interval == 0 else window for i in range(self.num_layers)]

    def linear_attention_layers(self) -> list[bool]:
        """Which decoder layers are linear attention (a state per request, no K/V), in layer order."""
        if self.layer_pattern:
            return [c == "M" for c in self.layer_pattern]
        if not self.linear_attention:
            return [False] * self.num_layers
        k = self.full_attention_interval
        return [(i + 1) % k != 0 for i in range(self.num_layers)]

    @property
    def num_linear_attention_layers(self) -> int:
        if self.layer_pattern:
            return self.layer_pattern.count("M")
        if not self.linear_attention:
            return 0
        return self.num_layers - self.num_layers // self.full_attention_interval

    @property
    def num_attention_layers(self) -> int:
        """Layers that attend and hold K/V (all of them but the linear-attention ones; with a
        layer_pattern its * layers)."""
        if self.layer_pattern:
            return self.layer_pattern.count("*")
        return self.num_layers - self.num_linear_attention_layers

    @property
    def num_dense_mlp_layers(self) -> int:
        """Layers with a dense MLP (with a layer_pattern its - layers)."""
        if self.layer_pattern:
            return self.layer_pattern.count("-")
        return self.num_layers - self.num_moe_layers

    @property
    def num_tp_allreduces(self) -> int:
        """All-reduces a token's hidden state takes per forward pass under tensor parallelism: one
        after each layer's mixer and one after its MLP (a layer_pattern's layers are one block each)."""
        return self.num_layers if self.layer_pattern else 2 * self.num_layers

    def linear_conv_dim(self, tensor_parallel_size: int = 1) -> int:
        """Channels of a linear-attention layer's convolution state on one GPU (vLLM's
        MambaStateShapeCalculator: Mamba2 replicates its groups to the TP size when they do
        not divide by it)."""
        nk, dk = self.linear_num_key_heads, self.linear_key_head_dim
        if self.linear_attention == "mamba2" and nk % tensor_parallel_size:
            nk = tensor_parallel_size  # (n_groups + tp - n_groups)
        dim = 2 * nk * dk + self.linear_num_value_heads * self.linear_value_head_dim
        if dim % tensor_parallel_size or self.linear_num_value_heads % tensor_parallel_size:
            raise ValueError(f"model '{self.name}': its linear-attention heads ({self.linear_num_value_heads}) "
                             f"and channels ({dim}) must divide by the tensor parallel size {tensor_parallel_size}")
        return dim // tensor_parallel_size

    def linear_state_bytes(self, tensor_parallel_size: int = 1, num_speculative_tokens: int = 0) -> int:
        """One linear-attention layer's state for one request on one GPU (vLLM's MambaSpec page
        before padding): the bf16 convolution state (its last kernel - 1 inputs, and under
        speculative decoding those of the K draft tokens too) and the recurrent state."""
        if not self.linear_attention:
            return 0
        taps = self.linear_conv_kernel_dim - 1 + num_speculative_tokens
        conv = self.linear_conv_dim(tensor_parallel_size) * taps * self.linear_conv_dtype_bytes
        heads = self.linear_num_value_heads // tensor_parallel_size
        recurrent = heads * self.linear_value_head_dim * self.linear_key_head_dim * self.linear_state_dtype_bytes
        return conv + recurrent

    @property
    def linear_attention_params(self) -> int:
        """One linear-attention layer's projections and convolution: Gated DeltaNet's q, k, v, z
        and its b, a gates; Mamba2's z, x, B, C and dt; the convolution; the output projection."""
        if not self.linear_attention:
            return 0
        h = self.hidden_size
        nk, dk = self.linear_num_key_heads, self.linear_key_head_dim
        nv, dv = self.linear_num_value_heads, self.linear_value_head_dim
        conv = (2 * nk * dk + nv * dv) * self.linear_conv_kernel_dim
        gates = 2 * nv if self.linear_attention == "gated_deltanet" else nv
        return h * (2 * nk * dk + 2 * nv * dv + gates) + conv + nv * dv * h

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_sparse(self) -> bool:
        """DeepSeek sparse attention (index_topk): each query attends its top-k cached tokens."""
        return self.index_topk > 0

    @property
    def indexer_params(self) -> int:
        """The sparse-attention indexers' projections over all layers (query from the query's
        low-rank latent, one key, a weight per head), which vLLM replicates on every GPU."""
        if not self.is_sparse:
            return 0
        h, n, d = self.hidden_size, self.index_n_heads, self.index_head_dim
        return self.num_layers * ((self.q_lora_rank or h) * n * d + h * d + h * n)

    @property
    def indexer_weight_bytes(self) -> float:
        """Bytes of the indexers' projections: the query's at `linear_weight_bytes`, the fused key
        and head-weight projection bf16 (vLLM loads it so)."""
        if not self.is_sparse:
            return 0.0
        h, n, d = self.hidden_size, self.index_n_heads, self.index_head_dim
        return self.num_layers * (self.linear_weight_bytes * (self.q_lora_rank or h) * n * d + 2.0 * h * (d + n))

    def indexer_bytes_per_token(self) -> int:
        """One token's indexer keys over all layers: fp8, with a float32 scale per 128."""
        d = self.index_head_dim
        return self.num_layers * (d + d // INDEXER_QUANT_BLOCK * 4) if self.is_sparse else 0

    def latent_bytes_per_token(self, dtype_bytes: int | str) -> int:
        """One token's latent and rotary key over all layers, at `dtype_bytes` an element, or in one
        of vLLM's sparse-MLA layouts (FlashMLA's, DS_MLA_KV_DTYPES): fp8_ds_mla, the latent in fp8
        with a float32 scale per 128 and the rotary key bf16 (656 B a layer at DeepSeek-V3.2's
        shape); nvfp4_ds_mla, the latent in fp4 with an fp8 scale per 16 and the rotary key fp8
        (352 B)."""
        r, rope = self.kv_lora_rank, self.qk_rope_head_dim
        if dtype_bytes == "fp8_ds_mla":
            return self.num_layers * (r + r // INDEXER_QUANT_BLOCK * 4 + 2 * rope)
        if dtype_bytes == "nvfp4_ds_mla":
            return self.num_layers * (r // 2 + r // 16 + rope)
        if isinstance(dtype_bytes, str):
            raise ValueError(f"{dtype_bytes}: a KV format with no latent-attention layout")
        return self.num_layers * (r + rope) * dtype_bytes

    @property
    def num_moe_layers(self) -> int:
        """Layers with experts (the rest have a dense MLP; with a layer_pattern its E layers)."""
        if self.layer_pattern:
            return self.layer_pattern.count("E")
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def widest_mlp(self) -> int:
        """The widest gated MLP a token runs through (the activation reserve's)."""
        return max(self.intermediate_size, self.dense_intermediate_size, self.shared_expert_intermediate_size)

    @property
    def simulated_only(self) -> str | None:
        """Why the GPU backend cannot run this model (None: it can): it runs dense
        Llama-architecture decoders that attend the whole context."""
        if self.is_mla:
            return "multi-head latent attention"
        if self.linear_attention:
            return "linear-attention layers"
        if self.is_moe:
            return "a mixture of experts"
        if self.sliding_window:
            return "sliding-window layers"
        if self.attention_chunk_size:
            return "chunked local attention"
        return None

    @property
    def mlp_matrices(self) -> int:
        """Projections of an MLP or expert: 3 gated, 2 not."""
        return 3 if self.gated_mlp else 2

    @property
    def expert_params(self) -> int:
        """Parameters of one expert's MLP (or of the dense MLP)."""
        return self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        """Parameters of the decoder (attention, dense MLPs, routers, shared and routed experts,
        norms, embeddings), all of them (what memory holds)."""
        return self.num_moe_layers * self.num_layer_expert_params + self.num_dense_params

    @property
    def num_layer_expert_params(self) -> int:
        """Routed-expert parameters of one expert layer (0 for a dense model)."""
        return self.num_experts * self.expert_params

    @property
    def embedding_params(self) -> int:
        """The input embedding and the LM head (one matrix if tied)."""
        return (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size

    @property
    def attention_params(self) -> int:
        """One attention layer's projections: grouped-query (q, k, v, o; a gated query twice q), or latent (the query's
        low-rank pair or direct projection, the joint KV down-projection with the rotary key, the
        KV up-projection of every head's key and value, o)."""
        h, d, heads = self.hidden_size, self.head_dim, self.num_heads
        if not self.is_mla:
            q = (2 if self.attention_output_gate else 1) * h * (heads * d)
            return q + 2 * h * (self.num_kv_heads * d) + (heads * d) * h
        q = h * self.q_lora_rank + self.q_lora_rank * heads * d if self.q_lora_rank else h * heads * d
        kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        return q + kv_down + self.kv_up_params + heads * self.v_head_dim * h

    @property
    def kv_up_params(self) -> int:
        """Latent attention: the up-projection of a cached latent to every head's key (without its
        rotary part) and value (0 otherwise)."""
        if not self.is_mla:
            return 0
        return self.kv_lora_rank * self.num_heads * (self.head_dim - self.qk_rope_head_dim + self.v_head_dim)

    @property
    def num_linear_params(self) -> int:
        """The decoder layers' linear parameters outside the routed experts: attention (or linear
        attention), and the dense MLP, or the router and the shared experts."""
        h, m = self.hidden_size, self.mlp_matrices
        dense_width = self.dense_intermediate_size if self.is_moe else self.intermediate_size
        dense_mlps = self.num_dense_mlp_layers * m * h * dense_width
        expert_layers = self.num_moe_layers * (h * self.num_experts + m * h * self.shared_expert_intermediate_size)
        mixers = self.attention_linear_params + self.num_linear_attention_layers * self.linear_attention_params
        return mixers + dense_mlps + expert_layers + self.indexer_params

    @property
    def num_norm_params(self) -> int:
        """The decoder layers' norms (two per layer, and latent attention's two low-rank ones)."""
        return self.num_layers * (2 * self.hidden_size + self.q_lora_rank + self.kv_lora_rank)

    @property
    def num_dense_params(self) -> int:
        """Every parameter outside the routed experts: attention, dense MLPs, routers, shared
        experts, norms, embeddings."""
        return self.num_linear_params + self.num_norm_params + self.embedding_params + self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through (a dense model: all of them)."""
        return self.num_dense_params + self.num_moe_layers * self.num_experts_per_tok * self.expert_params

    @property
    def layer_weight_bytes(self) -> float:
        """Bytes of the decoder layers' weights outside the routed experts: the linear ones at
        `linear_weight_bytes` (attention's at `attn_weight_bytes`), the norms bf16."""
        linear = self.num_linear_params - self.indexer_params - self.attention_linear_params
        return (self.linear_weight_bytes * linear + self.attn_weight_bytes * self.attention_linear_params
                + self.indexer_weight_bytes + 2.0 * self.num_norm_params)

    @property
    def weight_bytes(self) -> float:
        """Bytes of the weights: the layers' (`layer_weight_bytes`), the routed experts at
        `expert_weight_bytes`, the embeddings, LM head and final norm bf16."""
        return (self.layer_weight_bytes + 2.0 * (self.embedding_params + self.hidden_size) + self.routed_expert_bytes
                + self.vision_weight_bytes)

    def image_embeddings(self, height: int, width: int) -> int:
        """The embeddings (placeholder tokens) vLLM's Qwen VL processor makes of an image of
        height x width pixels: resized to multiples of an embedding's side (the patch times
        the merge), within the processor's pixel limits (the checkpoints' preprocessor configs:
        56 x 56 to 16,384 embeddings for 14-pixel patches, 256 x 256 to 16,384 for 16-pixel
        ones), as transformers' smart_resize does."""
        if not self.vision_num_layers:
            raise ValueError(f"model '{self.name}' has no vision encoder in its spec")
        factor = self.vision_patch_size * math.isqrt(self.vision_patches_per_embed)
        min_pixels = 56 * 56 if self.vision_patch_size == 14 else 256 * 256
        max_pixels = factor * factor * self.mm_max_tokens_per_item
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"an image of {height} x {width} pixels: its aspect ratio must be below 200 "
                             "(the processor's limit)")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return (h // factor) * (w // factor)

    @property
    def vision_weight_bytes(self) -> float:
        """Bytes of the vision encoder's matmul weights and its merger, bf16 (0 without one)."""
        return 2.0 * (self.vision_layer_params * self.vision_num_layers + self.vision_merger_params)

    @property
    def vision_embed_bytes(self) -> int:
        """One item embedding as the encoder hands it over: the decoder's width in bf16, for each
        merger's output (Qwen3-VL's DeepStack features travel with it)."""
        return 2 * self.hidden_size * self.vision_num_mergers

    @property
    def vision_layer_params(self) -> int:
        """A vision encoder layer's matmul parameters: attention's q, k, v and output, its MLP."""
        h = self.vision_hidden_size
        return 4 * h * h + (3 if self.vision_gated_mlp else 2) * h * self.vision_intermediate_size

    @property
    def vision_merger_params(self) -> int:
        """The merger MLPs' (0 without a vision encoder): merged patches to the decoder's width."""
        if not self.vision_num_layers:
            return 0
        merged = self.vision_patches_per_embed * self.vision_hidden_size
        return self.vision_num_mergers * (merged * merged + merged * self.hidden_size)

    @property
    def routed_expert_bytes(self) -> float:
        """Bytes of the routed experts (what expert or data parallelism spreads over its GPUs), the
        redundant copies of EPLB included."""
        return (self.expert_weight_bytes * self.num_moe_layers
                * (self.num_experts + self.num_redundant_experts) * self.expert_params)

    def weight_bytes_per_gpu(self, tensor_parallel_size: int = 1, expert_shards: int = 1) -> float:
        """Weights on one GPU: split by TP, and under data (or prefill context) parallelism the
        routed experts split over every rank's GPUs (expert_shards x TP: HardwareConfig's) while
        the rest is replicated on each rank."""
        replicated = self.indexer_weight_bytes  # (on every GPU whole)
        split = self.weight_bytes - replicated
        if expert_shards == 1:
            return split / tensor_parallel_size + replicated
        routed = self.routed_expert_bytes
        return ((split - routed) / tensor_parallel_size + routed / (tensor_parallel_size * expert_shards)
                + replicated)

    def experts_touched(self, num_tokens):
        """Expected distinct experts a layer runs for `num_tokens` tokens (routing taken as
        uniform and independent): E * (1 - (1 - k / E) ** T). Works on numpy arrays too."""
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def lora_linear_shapes(self, tensor_parallel_size: int = 1) -> list[tuple[int, int]] | None:
        """(input, output) widths on one GPU of each linear layer a decoder layer gives LoRA, as
        vLLM 0.33 shards them: q, k, v, gate and up are column-parallel (their outputs split over
        TP), o and down row-parallel (their inputs). Dense decoders with standard attention only:
        None for experts, latent or linear attention and layer patterns (not modelled)."""
        if self.is_moe or self.is_mla or self.linear_attention or self.layer_pattern:
            return None
        tp = tensor_parallel_size
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(h, q // tp), (h, kv // tp), (h, kv // tp), (q // tp, h),  # q, k, v, o
                (h, inter // tp), (h, inter // tp), (inter // tp, h)]  # gate, up, down

    def kv_bytes_per_layer_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """One attention layer's K and V (or latent) of one token on one GPU: a page's bytes per
        token."""
        return self.kv_bytes_per_token(dtype_bytes, tensor_parallel_size) // self.num_attention_layers

    def kv_bytes_per_token(self, dtype_bytes: int | str, tensor_parallel_size: int = 1) -> int:
        """K and V of one token over all attention layers, per GPU under tensor parallelism (latent
        attention: the latent and rotary key, which every GPU holds whole; linear-attention layers
        hold none). `dtype_bytes`: an element's bytes, or a packed KV format's name
        (`kv_head_token_bytes`; latent attention: `latent_bytes_per_token`)."""
        if self.is_mla:  # (sparse attention: the indexer's keys too)
            return self.latent_bytes_per_token(dtype_bytes) + self.indexer_bytes_per_token()
        kv_heads = max(self.num_kv_heads // tensor_parallel_size, 1)
        skipped = self.kv_skip_layers
        return kv_heads * ((self.num_attention_layers - skipped) * kv_head_token_bytes(dtype_bytes, self.head_dim)
                           + skipped * kv_head_token_bytes(2, self.head_dim))


# NVIDIA's NVFP4 weights (ModelOpt's NVFP4 checkpoints): 4 bits and an fp8 scale for every 16
NVFP4_WEIGHT_BYTES = 0.5625


# vLLM's MambaDType choices (--mamba-cache-dtype, --mamba-ssm-cache-dtype): bytes per element;
# auto is the model's bf16
MAMBA_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


# vLLM's per-token-head KV quantization (--kv-cache-dtype, its Triton attention backend): each KV
# head's K and V of a token quantized apiece with a float32 scale inline; bytes per element
PER_TOKEN_HEAD_KV_DTYPES = {"int8_per_token_head": 1.0, "fp8_per_token_head": 1.0, "int4_per_token_head": 0.5}


# vLLM's TurboQuant KV presets (--kv-cache-dtype turboquant_*): (key bits, value bits); 8-bit keys
# are fp8, fewer bits Lloyd-Max indices after a Hadamard rotation; values uniformly quantized
TURBOQUANT_KV_DTYPES = {"turboquant_k8v4": (8, 4), "turboquant_4bit_nc": (4, 4), "turboquant_k3v4_nc": (3, 4),
                        "turboquant_3bit_nc": (3, 3)}


# vLLM's NVFP4 KV cache (--kv-cache-dtype nvfp4, nvfp4_4over6; FlashInfer's): K and V each in a slot
# of their own, fp4 values (two a byte) and an fp8 scale for every 16 (nvfp4_kv_cache_full_dim)
NVFP4_KV_DTYPES = ("nvfp4", "nvfp4_4over6")


# vLLM's sparse-MLA KV layouts (--kv-cache-dtype, its FlashMLA sparse kernels; ModelSpec.latent_bytes_per_token):
# fp8_ds_mla is the layout its fp8 cache takes where FLASHMLA_SPARSE runs it (Hopper), nvfp4_ds_mla its
# Blackwell fp4 one
DS_MLA_KV_DTYPES = ("fp8_ds_mla", "nvfp4_ds_mla")


# vLLM's ROCm KV formats. UltraQuant (--kv-cache-dtype ultraquant_4bit): a head's K and V in one slot,
# fp4 values (two a byte) and a one-byte power-of-two scale for every 32 (ultraquant/format.py).
# Octave (octave_*): one slot of Hadamard-rotated Lloyd-Max codes (rocm_octave.py): V at its bits,
# K at 3 bits but its rotary 64-dim blocks at 4 (compact: all K at 3 bits, one scale), an fp16
# scale per 64-dim K block and one for V, the slot padded to 8 bytes (compact: 4).
ULTRAQUANT_KV_DTYPES = ("ultraquant_4bit",)
ULTRAQUANT_GROUP = 32
OCTAVE_KV_DTYPES = {"octave_k3v4": (4, False), "octave_k3v3": (3, False), "octave_k3v3_compact": (3, True)}
OCTAVE_BLOCK = 64  # (its Hadamard blocks; its kernels take head_dim 256 with 64 rotary dims only)
OCTAVE_HEAD_DIM, OCTAVE_ROTARY_DIM = 256, 64


def ultraquant_slot_bytes(head_dim: int) -> int:
    """One token's K and V in one KV head under UltraQuant: head_dim / 2 bytes of fp4 codes and
    head_dim / 32 scale bytes each (vLLM's ultraquant slot_size: 136 at head_dim 128)."""
    return 2 * (head_dim // 2 + head_dim // ULTRAQUANT_GROUP)


def octave_slot_bytes(kv_cache_dtype: str, head_dim: int, rotary_dim: int = OCTAVE_ROTARY_DIM) -> int:
    """One token's K and V in one KV head under an Octave preset (vLLM's OctaveFormat.slot_bytes):
    the rotary dims' 4-bit K codes (none when compact), the others' 3-bit ones, V's codes, and the
    fp16 scales, padded: 248 / 216 / 196 bytes for k3v4 / k3v3 / k3v3_compact at head_dim 256."""
    value_bits, compact = OCTAVE_KV_DTYPES[kv_cache_dtype]
    wide = 0 if compact else rotary_dim
    scales = (1 if compact else head_dim // OCTAVE_BLOCK) + 1
    raw = wide * 4 // 8 + (head_dim - wide) * 3 // 8 + head_dim * value_bits // 8 + 2 * scales
    align = 4 if compact else 8
    return -(-raw // align) * align


def turboquant_slot_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """One token's packed K and V in one KV head under a TurboQuant preset (vLLM's
    TurboQuantConfig.slot_size_aligned): the key (fp8: a byte an element; else its indices and an
    fp16 norm), the value (its bits and an fp16 scale and zero), rounded up to an even count."""
    key_bits, value_bits = TURBOQUANT_KV_DTYPES[kv_cache_dtype]
    key = head_dim if key_bits == 8 else -(-head_dim * key_bits // 8) + 2
    slot = key + -(-head_dim * value_bits // 8) + 4
    return slot + slot % 2


def kv_head_token_bytes(dtype_bytes: int | str, head_dim: int) -> int:
    """One token's K and V in one KV head: 2 x head_dim elements of `dtype_bytes` bytes, or under
    a per-token-head KV dtype (its name) the quantized K and V (int4: two values a byte) and a
    float32 scale each (vLLM's TritonAttentionBackend.customize_spec), a TurboQuant preset's
    packed slot (`turboquant_slot_bytes`), NVFP4's K and V slots (FlashInferBackend.customize_spec),
    or UltraQuant's or Octave's slot (`ultraquant_slot_bytes`, `octave_slot_bytes`)."""
    if isinstance(dtype_bytes, str):
        if dtype_bytes in TURBOQUANT_KV_DTYPES:
            return turboquant_slot_bytes(dtype_bytes, head_dim)
        if dtype_bytes in ULTRAQUANT_KV_DTYPES:
            return ultraquant_slot_bytes(head_dim)
        if dtype_bytes in OCTAVE_KV_DTYPES:
            return octave_slot_bytes(dtype_bytes, head_dim)
        if dtype_bytes in NVFP4_KV_DTYPES:
            return 2 * (head_dim // 2 + head_dim // 16)
        if dtype_bytes == "int4_per_token_head":
            return 2 * (head_dim // 2) + 8
        if dtype_bytes in PER_TOKEN_HEAD_KV_DTYPES:
            return 2 * head_dim + 8
        raise ValueError(f"unknown per-token-head KV dtype '{dtype_bytes}'")
    return 2 * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    memory_gib: float
    mem_bandwidth_gbs: float
    bf16_tflops: float
    interconnect_gbs: float
    compute_capability: float
    # Dense fp8 tensor-core peak (0: none; fp8 weights then run weight-only at the bf16 rate).
    fp8_tflops: float = 0.0
    # Dense fp4 tensor-core peak (0: none; NVFP4 weights then run weight-only at the bf16 rate,
    # vLLM's Marlin kernels).
    fp4_tflops: float = 0.0
    # "cuda" or "rocm" (AMD: compute_capability is then the gfx version torch reports, 9.4 for
    # gfx942, and names none of vLLM's CUDA attention backends)
    platform: str = "cuda"

    @property
    def cuda_major(self) -> int:
        """The CUDA compute capability's major version (8 Ampere and Ada, 9 Hopper, 10 Blackwell;
        0 on ROCm), which vLLM's attention backend priorities go by."""
        return int(self.compute_capability) if self.platform == "cuda" else 0

    @property
    def runs_fp8_matmuls(self) -> bool:
        """Whether vLLM's fp8 linear layers run fp8 x fp8 matmuls here (W8A8: Ada, Hopper,
        Blackwell, CDNA 3) rather than dequantizing the weights to bf16 (Marlin, on Ampere)."""
        return self.fp8_tflops > 0 and (self.platform == "rocm" or self.compute_capability >= 8.9)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * (1 << 30))


@lru_cache(maxsize=None)
def _load(name: str) -> dict:
    with open(_HERE / name) as f:
        return yaml.safe_load(f)


def model_names() -> list[str]:
    return sorted(_load("models.yaml"))


def gpu_names() -> list[str]:
    return sorted(_load("gpus.yaml"))


def get_model_spec(name: str) -> ModelSpec:
    """A shipped model (simkv/specs/models.yaml), or the model of a Hugging Face config.json
    given by its path (simkv/specs/hf_config.py)."""
    from simkv.specs.hf_config import is_config_path, spec_fields_from_config

    if is_config_path(name):
        return ModelSpec(name=name, **spec_fields_from_config(name))
    table = _load("models.yaml")
    if name not in table:
        raise ValueError(f"unknown model '{name}'; known models: {', '.join(sorted(table))} "
                         "(or the path of a Hugging Face config.json)")
    return ModelSpec(name=name, **table[name])


def get_gpu_spec(name: str) -> GPUSpec:
    """A catalogue GPU (simkv/specs/gpus.yaml), or one described by a YAML or JSON file given by
    its path (simkv/specs/gpu_file.py)."""
    from simkv.specs.gpu_file import gpu_fields_from_file, is_gpu_file

    if is_gpu_file(name):
        return GPUSpec(name=name, **gpu_fields_from_file(name))
    table = _load("gpus.yaml")
    if name not in table:
        raise ValueError(f"unknown GPU '{name}'; known GPUs: {', '.join(sorted(table))} (or the path of a "
                         "GPU file: .yaml or .json with a catalogue entry's fields, simkv/specs/gpu_file.py)")
    return GPUSpec(name=name, **table[name])


def canonical_gpu(name: str | None) -> str | None:
    """A CUDA device name mapped onto simkv's GPU spec names (None when unknown)."""
    if not name:
        return None
    n = name.upper()
    if "H100" in n and "PCIE" in n:
        return "H100-PCIe"
    for key, spec in (("MI300X", "MI300X"), ("MI325X", "MI325X"), ("MI355X", "MI355X"), ("GB200", "GB200"), ("B300", "B300"),
                      ("B200", "B200"), ("H200", "H200"), ("H100", "H100-SXM"), ("H20", "H20"), ("L40S", "L40S")):
        if key in n:
            return spec
    if "A100" in n and ("80" in n or "40" in n):
        return "A100-80GB" if "80" in n else "A100-40GB"
    if re.search(r"\bL4\b", n):
        return "L4"
    return None
