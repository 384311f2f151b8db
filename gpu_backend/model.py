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
        # each position's rotary cos/sin rows, [n, d], computed in fp32 and kept in the model dtype
        self.cos_table, self.sin_table = emb.cos().to(dtype), emb.sin().to(dtype)

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
    def new_activations(self, num_tokens: int, zeroed: bool = False) -> "Activations":
        """Activation tensors for `num_tokens` rows. A forward writes every row before reading
        it, so they start uninitialised; `zeroed` for buffers whose pad rows are read stale
        (piecewise graphs), so that they hold finite values from the start."""
        h, nh, nkv, d = self.spec.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        make = torch.zeros if zeroed else torch.empty

        def new(*shape: int) -> torch.Tensor:
            return make(shape, dtype=self.dtype, device=self.device)

        return Activations(new(num_tokens, h), new(num_tokens, h), new(num_tokens, nh + 2 * nkv, d),
                           new(num_tokens, nh, d), new(num_tokens, d), new(num_tokens, d))

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, act: "Activations") -> None:
        """The token embeddings into `act.residual`, each token's cos/sin rows into `act.cos/sin`."""
        torch.index_select(self.embed, 0, input_ids, out=act.residual)
        torch.index_select(self.cos_table, 0, positions, out=act.cos)
        torch.index_select(self.sin_table, 0, positions, out=act.sin)

    def attention_inputs(self, lw: LayerWeights, act: "Activations", ops: LayerOps, first: bool) -> None:
        """A layer up to its attention: the previous sub-layer's output added to the residual
        stream (the first layer has none), the input norm, the q/k/v projection into `act.qkv`,
        and q and k rotated there."""
        if first:
            x = ops.rms_norm(act.residual, lw.input_norm, self.eps)
        else:
            x, _ = ops.fused_add_rms_norm(act.hidden, act.residual, lw.input_norm, self.eps)
        qkv = act.qkv.view(act.qkv.shape[0], -1)
        if lw.qkv_bias is None:
            torch.mm(x, lw.qkv.t(), out=qkv)
        else:
            torch.addmm(lw.qkv_bias, x, lw.qkv.t(), out=qkv)
        ops.rotary_embedding(act.qkv, act.cos, act.sin, self.num_heads + self.num_kv_heads)

    def after_attention(self, lw: LayerWeights, act: "Activations", ops: LayerOps) -> None:
        """A layer after its attention: o-projection, residual add + post norm, the SwiGLU MLP,
        whose output goes to `act.hidden` (added to the residual by the next norm)."""
        hidden = F.linear(act.attn_out.view(act.attn_out.shape[0], -1), lw.o)
        x, _ = ops.fused_add_rms_norm(hidden, act.residual, lw.post_norm, self.eps)
        torch.mm(ops.silu_and_mul(F.linear(x, lw.gate_up)), lw.down.t(), out=act.hidden)

    def logits(self, act: "Activations", logits_indices: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """Final residual add + norm and the lm_head, on the sampling rows only."""
        last, _ = ops.fused_add_rms_norm(act.hidden.index_select(0, logits_indices),
                                         act.residual.index_select(0, logits_indices), self.final_norm, self.eps)
        return F.linear(last, self.lm_head)

    def attend(self, i: int, act: "Activations", attn: AttentionInputs, kv_caches, ops: LayerOps, plan=None):
        """Layer i's KV write and attention (`act.qkv` -> `act.attn_out`). `plan` is the step's
        (write, attention) launch pair; None plans it here (once per step: every layer shares
        the step's block tables, lengths and shapes). Returns the plan."""
        nh, nkv = self.num_heads, self.num_kv_heads
        q, k, v = act.qkv[:, :nh], act.qkv[:, nh:nh + nkv], act.qkv[:, nh + nkv:]
        key_cache, value_cache = kv_caches[i]
        if plan is None:
            plan = (ops.plan_write_cache(k, v, key_cache, value_cache, attn.slot_mapping),
                    ops.plan_attention(q, key_cache, value_cache, attn.block_tables, attn.seq_lens,
                                       attn.query_start_loc, self.scale, max_query_len=attn.max_query_len,
                                       max_seq_len=attn.max_seq_len))
        plan[0](k, v, key_cache, value_cache)
        plan[1](q, key_cache, value_cache, out=act.attn_out, key=k, value=v)
        return plan

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                ops: LayerOps) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] of the selected rows of a flat batch.

        `ops` is the set of kernels (`kernels.layer_ops.layer_ops`): the paged KV write and
        attention, and the element-wise work, torch operators or fused Triton kernels. The
        residual stream is added inside the next norm (`fused_add_rms_norm`), as vLLM does.
        The pieces between attentions (`embed_tokens` + `attention_inputs`, `after_attention`
        + `attention_inputs`, ...) read and write only `Activations`, so piecewise CUDA graphs
        (`gpu_backend/piecewise_graphs.py`) can replay them around eager attention."""
        act = self.new_activations(input_ids.shape[0])
        self.embed_tokens(input_ids, positions, act)
        plan = None
        for i, lw in enumerate(self.layers):
            self.attention_inputs(lw, act, ops, first=i == 0)
            plan = self.attend(i, act, attn, kv_caches, ops, plan)
            self.after_attention(lw, act, ops)
        return self.logits(act, logits_indices, ops)


@dataclass
class Activations:
    """What a forward passes from layer to layer, one row per token. The eager forward makes
    them per step; piecewise CUDA graphs keep one set of the largest size and run a batch of
    any size on its leading rows (`Activations.head`)."""

    hidden: torch.Tensor  # [T, H] the last sub-layer's output, not yet added to the residual stream
    residual: torch.Tensor  # [T, H] the residual stream
    qkv: torch.Tensor  # [T, nh + 2 nkv, d] this layer's q, k (rotated) and v
    attn_out: torch.Tensor  # [T, nh, d]
    cos: torch.Tensor  # [T, d] each token's rotary tables
    sin: torch.Tensor  # [T, d]

    def head(self, n: int) -> "Activations":
        """Views of the first n rows."""
        return Activations(*(t[:n] for t in (self.hidden, self.residual, self.qkv, self.attn_out, self.cos, self.sin)))
