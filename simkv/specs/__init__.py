"""Model and GPU specs shipped with simkv (YAML beside this file)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

_HERE = Path(__file__).parent


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
    # Mixture of experts (0: a dense gated MLP): every layer has `num_experts` gated MLPs of
    # `intermediate_size` and a router; each token runs `num_experts_per_tok` of them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
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
    # Bytes per weight of the decoder layers' linear layers outside the experts (attention, the
    # dense MLP or the router): 2 (bf16), 1 (FP8 checkpoints). Embeddings, LM head and norms: bf16.
    linear_weight_bytes: float = 2.0

    def layer_windows(self, sliding_window: int | None = None, full_attention_interval: int | None = None) -> list[int]:
        """Each decoder layer's attention window (0: full attention), in layer order; the
        arguments override the spec's (None: the spec's own)."""
        window = self.sliding_window if sliding_window is None else sliding_window
        interval = self.full_attention_interval if full_attention_interval is None else full_attention_interval
        if not window:
            return [0] * self.num_layers
        return [0 if interval and (i + 1) % interval == 0 else window for i in range(self.num_layers)]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def simulated_only(self) -> str | None:
        """Why the GPU backend cannot run this model (None: it can): it runs dense
        Llama-architecture decoders that attend the whole context."""
        if self.is_moe:
            return "a mixture of experts"
        if self.sliding_window:
            return "sliding-window layers"
        return None

    @property
    def expert_params(self) -> int:
        """Parameters of one expert's gated MLP (or of the dense MLP)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        """Parameters of a Llama-architecture decoder (attention + gated MLP or experts and
        router + embeddings), all of them (what memory holds)."""
        return self.num_layers * self.num_layer_expert_params + self.num_dense_params

    @property
    def num_layer_expert_params(self) -> int:
        """Expert parameters of one layer (0 for a dense model)."""
        return self.num_experts * self.expert_params

    @property
    def embedding_params(self) -> int:
        """The input embedding and the LM head (one matrix if tied)."""
        return (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size

    @property
    def num_layer_linear_params(self) -> int:
        """One decoder layer's linear parameters outside the experts: attention, and the dense
        MLP or the router."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) + (self.num_heads * d) * h
        return attn + (h * self.num_experts if self.is_moe else self.expert_params)

    @property
    def num_dense_params(self) -> int:
        """Every parameter outside the experts: attention, the dense MLP or the router, norms,
        embeddings."""
        norms = 2 * self.hidden_size
        return self.num_layers * (self.num_layer_linear_params + norms) + self.embedding_params + self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through (a dense model: all of them)."""
        return self.num_dense_params + self.num_layers * self.num_experts_per_tok * self.expert_params

    @property
    def layer_weight_bytes(self) -> float:
        """Bytes of the decoder layers' weights outside the experts: the linear ones at
        `linear_weight_bytes`, the norms bf16."""
        return self.num_layers * (self.linear_weight_bytes * self.num_layer_linear_params + 2.0 * 2 * self.hidden_size)

    @property
    def weight_bytes(self) -> float:
        """Bytes of the weights: the layers' (`layer_weight_bytes`), the experts at
        `expert_weight_bytes`, the embeddings, LM head and final norm bf16."""
        return (self.layer_weight_bytes + 2.0 * (self.embedding_params + self.hidden_size)
                + self.expert_weight_bytes * self.num_layers * self.num_layer_expert_params)

    def experts_touched(self, num_tokens):
        """Expected distinct experts a layer runs for `num_tokens` tokens (routing taken as
        uniform and independent): E * (1 - (1 - k / E) ** T). Works on numpy arrays too."""
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """K and V of one token over all layers, per GPU under tensor parallelism."""
        kv_heads = max(self.num_kv_heads // tensor_parallel_size, 1)
        return 2 * self.num_layers * kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    memory_gib: float
    mem_bandwidth_gbs: float
    bf16_tflops: float
    interconnect_gbs: float

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
    table = _load("gpus.yaml")
    if name not in table:
        raise ValueError(f"unknown GPU '{name}'; known GPUs: {', '.join(sorted(table))}")
    return GPUSpec(name=name, **table[name])


def canonical_gpu(name: str | None) -> str | None:
    """A CUDA device name mapped onto simkv's GPU spec names (None when unknown)."""
    if not name:
        return None
    n = name.upper()
    if "H200" in n:
        return "H200"
    if "H100" in n:
        return "H100-SXM"
    if "A100" in n and "80" in n:
        return "A100-80GB"
    return None
