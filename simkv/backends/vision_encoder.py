"""The vision encoder's share of a step (multimodal models): a roofline over the items it encodes.

vLLM runs the encoder inside the step whose prefill chunk first reaches an item
(simkv/core/encoder_cache.py), before the decoder's forward pass, so its time adds to the
step's. Per GPU under tensor parallelism (vLLM shards the ViT's weights like the decoder's), for
an item of E embeddings made of N = E x patches_per_embed patches:
  FLOPs = 2 x P_layer x layers x N                     (the ViT's matmuls, P_layer = 4 h^2 + 3 h i)
        + 2 x P_merger x E                             (the merger MLP: (p h)^2 + p h x hidden)
        + 4 x h x (pairs over the layers)              (attention: N x min(N, window) per windowed
                                                        layer, N^2 per full-attention layer)
  bytes = 2 x (P_layer x layers + P_merger)            (bf16 weights, read once a step that encodes)
  comm  = TP > 1: the all-reduces of the sharded layers, two a layer over N x h and the merger's
          one over E x hidden x mergers (bf16, a ring's 2 (TP - 1) / TP of them over the TP
          link), each also its latency, as the decoder roofline's
  time  = max(FLOPs / (peak x compute_efficiency), bytes / (bandwidth x memory_efficiency)) + comm
Under mm_encoder_tp_mode "data" (vLLM's --mm-encoder-tp-mode data) each TP GPU holds the whole
encoder: a step's items are dealt out by size (the largest first, each to the GPU with the
fewest patches so far, as vLLM's get_load_balance_assignment), each GPU encodes its own at the
whole encoder's FLOPs and bytes with no all-reduce, and the step waits for the slowest; then the
embeddings are all-gathered (each GPU's padded to the largest share: TP x that x the decoder's
width in bf16, a ring's (TP - 1) / TP of it over the link, plus its latency).
The efficiencies are the decoder roofline's defaults: nobody has measured a ViT here yet, and
the patch embedding, norms and activations' traffic are left out (each under 1 % of the FLOPs).
"""

from __future__ import annotations

from simkv.specs import GPUSpec, ModelSpec


class VisionEncoderCost:
    def __init__(self, model: ModelSpec, gpu: GPUSpec, tensor_parallel_size: int = 1,
                 compute_efficiency: float = 0.6, memory_efficiency: float = 0.8, tp_link_gbs: float | None = None,
                 allreduce_latency_s: float = 8.0e-6, data_parallel: bool = False) -> None:
        h = model.vision_hidden_size
        self.patches_per_embed = model.vision_patches_per_embed
        self.num_layers = model.vision_num_layers
        self.num_full_layers = model.vision_full_attention_layers
        self.window = model.vision_window_patches
        layer_params, merger_params = model.vision_layer_params, model.vision_merger_params
        tp = tensor_parallel_size
        self.tp = tp
        self.data_parallel = data_parallel and tp > 1  # (mm_encoder_tp_mode "data": whole encoders, items dealt out)
        split = 1 if self.data_parallel else tp
        self.flops_per_patch = 2 * layer_params * self.num_layers / split
        self.flops_per_embed = 2 * merger_params / split
        self.flops_per_pair = 4 * h / split
        self.weight_bytes = model.vision_weight_bytes / split
        self.flop_rate = gpu.bf16_tflops * 1e12 * compute_efficiency
        self.byte_rate = gpu.mem_bandwidth_gbs * 1e9 * memory_efficiency
        # TP: seconds of all-reduce per patch (the layers') and per embedding (the merger's), and per
        # step; under "data" none, but an all-gather of the embeddings (per embedding, and its latency)
        link = (tp_link_gbs or gpu.interconnect_gbs) * 1e9
        ring = 2.0 * (tp - 1) / tp
        embed_bytes = model.vision_embed_bytes
        if self.data_parallel:
            self.comm_per_patch = self.comm_per_embed = 0.0
            self.comm_fixed = 0.0
            self.gather_per_embed = (tp - 1) * embed_bytes / link  # (TP x the largest share, (TP - 1) / TP of it)
            self.gather_fixed = allreduce_latency_s
        else:
            self.comm_per_patch = 2 * self.num_layers * ring * h * 2 / link
            self.comm_per_embed = ring * embed_bytes / link
            self.comm_fixed = (2 * self.num_layers + 1) * allreduce_latency_s if tp > 1 else 0.0

    def attention_pairs(self, patches: int) -> int:
        """Query-key pairs of one item over the encoder's layers."""
        windowed = self.num_layers - self.num_full_layers
        window = min(patches, self.window) if self.window else patches
        return windowed * patches * window + self.num_full_layers * patches * patches

    def seconds(self, item_embeds: tuple[int, ...]) -> float:
        """The encoder's time for a step that encodes items of these embeddings (0 for none)."""
        if not item_embeds:
            return 0.0
        if self.data_parallel:
            shares = _deal_out(item_embeds, self.tp)
            slowest = max(self._roofline(share) for share in shares if share)
            return slowest + self.gather_per_embed * max(sum(share) for share in shares) + self.gather_fixed
        return self._roofline(item_embeds)

    def _roofline(self, item_embeds) -> float:
        embeds = sum(item_embeds)
        patches = embeds * self.patches_per_embed
        pairs = sum(self.attention_pairs(e * self.patches_per_embed) for e in item_embeds)
        flops = self.flops_per_patch * patches + self.flops_per_embed * embeds + self.flops_per_pair * pairs
        comm = self.comm_per_patch * patches + self.comm_per_embed * embeds + self.comm_fixed
        return max(flops / self.flop_rate, self.weight_bytes / self.byte_rate) + comm

    def describe(self) -> dict:
        return {"form": "roofline over the ViT's matmuls, merger and attention (simkv/backends/vision_encoder.py)",
                "gflops_per_embed": round((self.flops_per_patch * self.patches_per_embed + self.flops_per_embed)
                                          / 1e9, 3),
                "weight_gb": round(self.weight_bytes / 1e9, 3)}


def _deal_out(item_embeds, num_gpus: int) -> list[list[int]]:
    """vLLM's get_load_balance_assignment: the items, largest first, each to the GPU with the
    fewest patches so far (the first such GPU on a tie)."""
    shares: list[list[int]] = [[] for _ in range(num_gpus)]
    loads = [0] * num_gpus
    for embeds in sorted(item_embeds, reverse=True):
        gpu = loads.index(min(loads))
        shares[gpu].append(embeds)
        loads[gpu] += embeds
    return shares


def vision_encoder_cost(config) -> VisionEncoderCost | None:
    """The encoder cost of `config`'s model and GPU, None if its spec has no vision encoder (or it
    is served as text only)."""
    from simkv.specs import get_gpu_spec

    hw = config.hardware
    model = hw.model_spec()
    if not hw.has_vision_encoder:
        return None
    return VisionEncoderCost(model, get_gpu_spec(hw.gpu), hw.tensor_parallel_size,
                             tp_link_gbs=hw.link_gbs(hw.tensor_parallel_size),
                             data_parallel=hw.mm_encoder_tp_mode == "data")
