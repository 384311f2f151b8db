"""A lean Llama-architecture decoder over the paged KV cache of `kernels/`.

Why our own forward and not `transformers.LlamaForCausalLM`: the engine hands us a flat,
ragged batch (prefill chunks and decodes of many requests, positions and block tables of
their own) and the KV cache is a pool of physical blocks shared by all requests. A forward
written for exactly that shape is short, has no padding, and depends on no internals of a
particular transformers release (the GPU host's version is unknown). The math is that of
transformers' Llama (RMSNorm, rotary embedding with `rotate_half`, grouped-query attention,
SwiGLU MLP, untied lm_head) and `tests/gpu_backend/test_model.py` checks it against
`LlamaForCausalLM` built from the same weights.

Weights are random (nothing can be downloaded; step timing does not depend on weight values).
They are drawn on the target device directly, so building llama-3-8b on a GPU takes seconds.
Qwen2.5 adds a bias to the q/k/v projections; rope scaling variants (Llama 3.1) are not
modelled: they change values, not cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.layer_ops import LayerOps
from simkv.specs import ModelSpec

#: Per-model details that the shape table does not carry: (rope_theta, qkv_bias, rms_norm_eps).
MODEL_DETAILS = {
    "llama-3-8b": (500000.0, False, 1e-5),
    "llama-3-70b": (500000.0, False, 1e-5),
    "llama-2-7b": (10000.0, False, 1e-5),
    "qwen2.5-7b": (1000000.0, True, 1e-6),
    "mistral-7b": (1000000.0, False, 1e-5),
    "tiny-llama": (10000.0, False, 1e-5),
}


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(nh + 2 nkv) d, H]
    qkv_bias: torch.Tensor | None  # [(nh + 2 nkv) d]
    o: torch.Tensor  # [H, nh d]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class AttentionInputs:
    """The ragged batch as the kernels want it (all on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32 (cached + new)
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    max_seq_len: int


class LeanLlama:
    """Weights + a forward over a flat token batch. Not an nn.Module: no autograd, no hooks."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, init_std: float = 0.02, max_positions: int | None = None) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        theta, bias, eps = MODEL_DETAILS.get(spec.name, (10000.0, False, 1e-5))
        self.rope_theta, self.has_qkv_bias, self.eps = theta, bias, eps
        h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        self.scale = d ** -0.5
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=self.device).normal_(0.0, init_std, generator=gen)

        def norm_weight() -> torch.Tensor:  # around 1, so that norms are not trivial
            return 1.0 + rand(h)

        self.embed = rand(spec.vocab_size, h)
        self.layers = [
            LayerWeights(norm_weight(), rand(self.q_size + 2 * self.kv_size, h),
                         rand(self.q_size + 2 * self.kv_size) if bias else None,
                         rand(h, self.q_size), norm_weight(), rand(2 * inter, h), rand(h, inter))
            for _ in range(spec.num_layers)
        ]
        self.final_norm = norm_weight()
        self.lm_head = rand(spec.vocab_size, h)
        n = max_positions or spec.max_position_embeddings
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=self.device).float() / d))
        freqs = torch.arange(n, device=self.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache, self.sin_cache = emb.cos(), emb.sin()  # fp32 [n, d]; cast per use

    def copy_weights_from(self, other: "LeanLlama") -> None:
        """Take another instance's weights (cast to this one's dtype and device). Weights drawn on
        different devices differ (each device has its own generator); tests that compare devices
        copy them."""
        def take(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> None:
            if mine is not None:
                mine.copy_(theirs.to(device=mine.device, dtype=mine.dtype))

        for name in ("embed", "final_norm", "lm_head"):
            take(getattr(self, name), getattr(other, name))
        for mine, theirs in zip(self.layers, other.layers):
            for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down"):
                take(getattr(mine, name), getattr(theirs, name))

    # ---- weights exchange with transformers (tests) --------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under `LlamaForCausalLM`'s parameter names."""
        sd = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm,
              "lm_head.weight": self.lm_head}
        q, kv = self.q_size, self.kv_size
        inter = self.spec.intermediate_size
        for i, lw in enumerate(self.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = lw.input_norm
            sd[p + "post_attention_layernorm.weight"] = lw.post_norm
            sd[p + "self_attn.q_proj.weight"] = lw.qkv[:q]
            sd[p + "self_attn.k_proj.weight"] = lw.qkv[q:q + kv]
            sd[p + "self_attn.v_proj.weight"] = lw.qkv[q + kv:]
            if lw.qkv_bias is not None:
                sd[p + "self_attn.q_proj.bias"] = lw.qkv_bias[:q]
                sd[p + "self_attn.k_proj.bias"] = lw.qkv_bias[q:q + kv]
                sd[p + "self_attn.v_proj.bias"] = lw.qkv_bias[q + kv:]
            sd[p + "self_attn.o_proj.weight"] = lw.o
            sd[p + "mlp.gate_proj.weight"] = lw.gate_up[:inter]
            sd[p + "mlp.up_proj.weight"] = lw.gate_up[inter:]
            sd[p + "mlp.down_proj.weight"] = lw.down
        return sd

    def hf_config_kwargs(self) -> dict:
        s = self.spec
        return dict(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                    num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                    num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                    max_position_embeddings=s.max_position_embeddings, rms_norm_eps=self.eps,
                    rope_theta=self.rope_theta, attention_bias=self.has_qkv_bias, tie_word_embeddings=False)

    # ---- forward ------------------------------------------------------------------------------
    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position, [T, d] in the model dtype (once per step)."""
        return self.cos_cache[positions].to(self.dtype), self.sin_cache[positions].to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                ops: LayerOps) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] of the selected rows of a flat batch.

        `ops` is the set of kernels (`kernels.layer_ops.layer_ops`): the paged KV write and
        attention (planned once per step: every layer shares the step's block tables, lengths
        and shapes), and the element-wise work, torch operators or fused Triton kernels. The
        residual stream is added inside the next norm (`fused_add_rms_norm`), as vLLM does;
        the fused kernels overwrite their inputs, so every tensor is used once."""
        num_tokens = input_ids.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        hidden = F.embedding(input_ids, self.embed)
        residual = write_cache = attention = None
        cos, sin = self.rope_tables(positions)
        for lw, (key_cache, value_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = hidden, ops.rms_norm(hidden, lw.input_norm, self.eps)
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, lw.input_norm, self.eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias).view(num_tokens, nh + 2 * nkv, d)
            # q and k rotated together; both kernels take strided q/k/v views, so nothing is
            # copied to make them contiguous
            qk, v = ops.rotary_embedding(qkv, cos, sin, nh + nkv)
            q, k = qk[:, :nh], qk[:, nh:]
            if attention is None:  # checked and configured at the first layer; the others only launch
                write_cache = ops.plan_write_cache(k, v, key_cache, value_cache, attn.slot_mapping)
                attention = ops.plan_attention(q, key_cache, value_cache, attn.block_tables, attn.seq_lens,
                                               attn.query_start_loc, self.scale, max_query_len=attn.max_query_len,
                                               max_seq_len=attn.max_seq_len)
            write_cache(k, v, key_cache, value_cache)
            o = attention(q, key_cache, value_cache)
            hidden = F.linear(o.reshape(num_tokens, nh * d), lw.o)
            x, residual = ops.fused_add_rms_norm(hidden, residual, lw.post_norm, self.eps)
            hidden = F.linear(ops.silu_and_mul(F.linear(x, lw.gate_up)), lw.down)
        last, _ = ops.fused_add_rms_norm(hidden.index_select(0, logits_indices),
                                         residual.index_select(0, logits_indices), self.final_norm, self.eps)
        return F.linear(last, self.lm_head)
