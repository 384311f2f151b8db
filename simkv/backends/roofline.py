"""Roofline cost model: a step takes the longer of its compute and its memory traffic.

Per GPU under tensor parallelism (TP), for a step with T scheduled tokens over S sequences
(P_layers: the layer parameters a token runs through; a mixture of experts counts k of its E
experts in the FLOPs and the expected number of experts its T tokens touch in the bytes):
  FLOPs = 2 * P_layers * T + 2 * hidden * vocab * S            (matmuls; logits for one token per sequence)
        + 4 * layers * heads * head_dim * A                      (attention; A = query-key pairs)
  bytes = dtype_bytes * (P_layers + hidden * vocab)              (weights, read once per step; an FP8
                                                                 checkpoint's linear layers at 1 byte)
        + expert bytes * layers * E * (1 - (1 - k/E)^T)          (mixture of experts: the experts routed to)
        + kv_bytes_per_token * (K + T)                           (K/V read for attended context K, written for T)
  time  = max(FLOPs / (peak_flops * compute_efficiency), bytes / (bandwidth * memory_efficiency))
        (peak_flops: the bf16 peak; the matmuls of fp8 weights run at the fp8 peak on GPUs with
        fp8 tensor cores: vLLM's W8A8 fp8 GEMMs; weight-only at the bf16 rate on Ampere)
        + TP all-reduce time (2 per layer, ring; 1 per Nemotron-H block) + step_overhead_s + seq_overhead_s * S
        (a TP group larger than a node all-reduces over the network: HardwareConfig.link_gbs)
        (+ under decode context parallelism, DCP: K/V bytes / DCP, and its collectives:
        `dcp_seconds`)
With sliding-window layers (or chunked local attention), A and K count each layer's window (its
chunk's tokens), averaged over the layers. Linear-attention layers (Gated DeltaNet, Mamba2) attend
nothing and hold no K/V: they add their recurrence's FLOPs per token and a read and a write of
each sequence's state per step, and under speculative decoding a write after each draft token
verified (`linear_attention_work`). All quantities are divided by TP
except the overheads and a latent-attention cache (below), which every GPU reads whole.

Multi-head latent attention (DeepSeek) runs a sequence's query tokens one of two ways, as vLLM's
MLA backends do. Decodes and chunks of up to `mla_decode_query_len` tokens (FlashAttention MLA
on Hopper: 512; FlashMLA with an fp8 cache: 128; FlashInfer MLA on Blackwell and Triton MLA
elsewhere: 1; at least 1 + K under speculative decoding) take the absorbed path: every head
attends the cached latent directly, 2 * heads * (2 * kv_lora_rank + qk_rope_head_dim) FLOPs per
query-key pair and layer. Longer chunks take the expanded path:
2 * heads * (head_dim + v_head_dim) per pair, after the chunk's cached context is up-projected
to keys and values (2 * kv_up_params FLOPs per cached token and layer).

Data-parallel ranks of a mixture of experts step in lockstep (`dp_step_seconds`,
simkv/replay/data_parallel.py): each rank's time counts its own attention and dense work and
1 / data_parallel_size of the routed experts over every rank's tokens, plus the expert layers'
all-gather and reduce-scatter; the step lasts as long as the slowest rank.

The expert layers' exchange between lockstep ranks is gathered (vLLM's default) or all-to-all
(expert parallelism with DeepEP and kin): simkv/backends/expert_exchange.py. Under dual batch
overlap a step with enough tokens on every rank runs as two microbatches (`dp_time`).

Prefill context parallelism (PCP, latent attention: vLLM's PCPManager) runs a step on PCP
copies of the TP group in lockstep the same way, their experts split over all of them: each
copy runs its share of the step's tokens (`pcp_rank_works`), attending the whole cache it holds,
and all-gathers every layer's new latents and the final hidden states (`pcp_gather_seconds`).

Efficiencies and overheads are defaults until `simkv calibrate` fits them on real hardware.

The overheads are the host's share of a step (scheduling, input preparation, output
processing): `host_seconds`. Under async scheduling the host prepares the next step while the
device runs this one, and the engine makes a step last max(device time, host time).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from simkv.backends.base import layer_window_counts, prefill_work, windowed_prefill_work
from simkv.backends.expert_exchange import all_to_all_exchange, gather_exchange
from simkv.backends.pcp_split import split_step
from simkv.core.outputs import SchedulerOutput
from simkv.clock import per_token_ticks, to_ticks
from simkv.specs import NVFP4_WEIGHT_BYTES, GPUSpec, ModelSpec
from simkv.specs.gpu_file import is_gpu_file


class RooflineCostModel:
    name = "roofline"
    supports_decode_runs = True
    needs_request_detail = False

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        tensor_parallel_size: int = 1,
        kv_dtype_bytes: int | str = 2,
        compute_efficiency: float = 0.6,
        memory_efficiency: float = 0.8,
        step_overhead_s: float = 1.0e-3,
        seq_overhead_s: float = 5.0e-6,
        allreduce_latency_s: float = 8.0e-6,
        layer_windows: list[int] | None = None,
        attention_chunked: bool = False,
        num_speculative_tokens: int = 0,
        data_parallel_size: int = 1,
        block_size: int = 16,
        decode_context_parallel_size: int = 1,
        lora_rank: int = 0,
        lora_kernel_s: float = 3.0e-6,
        tp_link_gbs: float | None = None,
        dp_link_gbs: float | None = None,
        indexer_tp_shard_min_rows: int = 65536,
        weight_offload_shares: tuple[float, float] = (0.0, 0.0),
        pcie_gbs: float = 63.0,
        prefill_context_parallel_size: int = 1,
        pcp_link_gbs: float | None = None,
        all_to_all: bool = False,
        round_robin_experts: bool = False,
        gpus_per_node: int = 8,
        inter_node_gbs: float = 50.0,
        ubatching: tuple[int, int, int] | None = None,
    ) -> None:
        """`tp_link_gbs`, `dp_link_gbs`: the bandwidth of the TP group's all-reduce and of the
        expert layers' collectives over the data-parallel ranks (None: the GPU's interconnect;
        HardwareConfig.link_gbs gives the network's for groups larger than a node).
        `pcp_link_gbs`: the bandwidth of the PCP group's all-gathers (None: the GPU's interconnect).
        `all_to_all`: the expert layers exchange tokens all-to-all (expert parallelism with an
        all-to-all backend) over GPUs `gpus_per_node` to a node, `inter_node_gbs` between nodes,
        instead of gathering them (simkv/backends/expert_exchange.py), the experts laid out round robin
        over the GPUs with `round_robin_experts` (else in order). `ubatching`: vLLM's
        microbatching (dual batch overlap, --ubatch-size): (microbatches, the tokens a rank's
        decode-only step needs, those a step with a prefill needs) (`dp_time`).
        `weight_offload_shares`: the shares of each GPU's weights vLLM's --cpu-offload-gb keeps in
        host memory (of those outside the routed experts, of the experts); the kernels read that
        share of every weight read over the host link (`pcie_gbs`) instead of from GPU memory
        (`_offload_weights`)."""
        tp = tensor_parallel_size
        self.model, self.gpu, self.tp = model, gpu, tp
        self.params = dict(compute_efficiency=compute_efficiency, memory_efficiency=memory_efficiency,
                           step_overhead_s=step_overhead_s, seq_overhead_s=seq_overhead_s,
                           allreduce_latency_s=allreduce_latency_s)
        h, v = model.hidden_size, model.vocab_size
        embeddings = model.embedding_params + h  # (and the final norm)
        self.flops_per_token = 2.0 * (model.num_active_params - embeddings) / tp
        self.flops_per_seq = 2.0 * h * v / tp
        self.flops_per_pair = 4.0 * model.num_attention_layers * model.num_heads * model.head_dim / tp
        # Linear-attention layers (Gated DeltaNet, Mamba2): per token the recurrence's FLOPs, per
        # sequence and step a read and a write of its state, per draft verified a write more
        # (`linear_attention_work`).
        self.flops_per_token_linear, self.state_bytes_per_seq, self.state_bytes_per_draft = \
            linear_attention_work(model, tp, num_speculative_tokens)
        self.mla = model.is_mla
        if self.mla:  # (the expanded path's pairs; the absorbed path's and the up-projection below)
            heads_layers = model.num_layers * model.num_heads
            self.flops_per_pair = 2.0 * heads_layers * (model.head_dim + model.v_head_dim) / tp
            self.flops_per_latent_pair = 2.0 * heads_layers * (2 * model.kv_lora_rank + model.qk_rope_head_dim) / tp
            self.flops_per_upproj_token = 2.0 * model.num_layers * model.kv_up_params / tp
            self.mla_decode_query_len = mla_decode_query_len(gpu, num_speculative_tokens, kv_dtype_bytes in (1, "fp8_ds_mla"),
                                                             block_size)
        # FLOPs are counted at the bf16 rate: a matmul vLLM runs in fp8 (ModelSpec.fp8_matmul_params,
        # on a GPU with fp8 tensor cores) counts bf16_tflops / fp8_tflops of its FLOPs.
        self.fp8_discount = 1.0 - gpu.bf16_tflops / gpu.fp8_tflops if gpu.runs_fp8_matmuls else 0.0
        # (NVFP4 weights: fp4 x fp4 matmuls where the GPU has fp4 tensor cores, vLLM's W4A4 kernels)
        self.fp4_discount = (1.0 - gpu.bf16_tflops / gpu.fp4_tflops
                             if gpu.fp4_tflops > 0 and not model.fp4_weight_only else 0.0)
        for weight_bytes in (1.0, NVFP4_WEIGHT_BYTES):
            discount, params = self.matmul_discount(weight_bytes), model.matmul_params_at(weight_bytes)
            if discount and params:
                self.flops_per_token -= discount * 2.0 * params / tp
                if self.mla and model.attn_weight_bytes == weight_bytes:  # (kv_b_proj, a quantized linear layer)
                    self.flops_per_upproj_token *= 1.0 - discount
        self.flops_per_decode_pair = self.flops_per_latent_pair if self.mla else self.flops_per_pair
        self.weight_bytes = (model.layer_weight_bytes + 2.0 * h * v) / tp  # (the LM head's read; not the embedding's)
        self.sparse_topk = model.index_topk
        if self.sparse_topk:
            # (vLLM splits the prefill rows over TP ranks on CUDA, without DCP or PCP)
            shard = (tp > 1 and gpu.platform == "cuda" and decode_context_parallel_size == 1
                     and prefill_context_parallel_size == 1)
            self._sparse_setup(kv_dtype_bytes, num_speculative_tokens, indexer_tp_shard_min_rows if shard else None,
                               tp_link_gbs, allreduce_latency_s)
        # Mixture of experts: a step reads the experts its tokens were routed to (expected count
        # per layer under uniform routing, ModelSpec.experts_touched), each of them once.
        self.moe = model if model.is_moe else None
        self.expert_bytes = model.expert_weight_bytes * model.expert_params * model.num_moe_layers / tp
        self.kv_bytes_per_token = float(model.kv_bytes_per_token(kv_dtype_bytes, tp))
        dcp = decode_context_parallel_size
        if dcp > 1:  # (each GPU of a DCP group stores, writes and reads 1 / DCP of the tokens)
            self.kv_bytes_per_token /= dcp
        self.flops_per_token += self.flops_per_token_linear
        self.flop_rate = gpu.bf16_tflops * 1e12 * compute_efficiency
        self.byte_rate = gpu.mem_bandwidth_gbs * 1e9 * memory_efficiency
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp
            self.comm_per_token = model.num_tp_allreduces * ring * h * 2 / ((tp_link_gbs or gpu.interconnect_gbs) * 1e9)
            self.comm_fixed = model.num_tp_allreduces * allreduce_latency_s
        else:
            self.comm_per_token = 0.0
            self.comm_fixed = 0.0
        self.fixed_s = step_overhead_s + self.comm_fixed
        self.dcp = dcp
        if dcp > 1:
            # Every query token (latent attention: on the absorbed path) all-gathers over the DCP
            # group and its partial outputs reduce-scatter with their log-sum-exp (2 collectives a
            # layer): a GPU runs DCP x its TP share of the heads over 1 / DCP of the context, the
            # same FLOPs as without DCP. Latent attention's expanded path all-gathers the latents
            # of the chunk and of its cached context instead.
            share = (dcp - 1) / dcp / (gpu.interconnect_gbs * 1e9)
            heads = model.num_heads * dcp / tp
            if self.mla:
                latent = model.kv_lora_rank + model.qk_rope_head_dim
                self.dcp_per_query = model.num_layers * share * heads * (latent + model.kv_lora_rank) * 2
                self.dcp_per_gathered = model.num_layers * share * latent * kv_dtype_bytes
            else:
                self.dcp_per_query = model.num_layers * share * heads * 2 * model.head_dim * 2
                self.dcp_per_gathered = 0.0
            self.dcp_fixed = 2 * model.num_layers * allreduce_latency_s
        self.dp, self.pcp = data_parallel_size, prefill_context_parallel_size
        shards = self.dp * self.pcp  # (the lockstep ranks whose GPUs the routed experts are split over)
        if shards > 1:  # (dp_step_seconds: the experts' share of a lockstep step over every rank's tokens)
            g = shards * tp  # the GPUs the expert layers span
            routed_flops = 2.0 * model.num_moe_layers * model.num_experts_per_tok * model.expert_params / tp
            routed_flops *= 1.0 - self.matmul_discount(model.expert_weight_bytes)
            self.flops_per_token_local = self.flops_per_token - routed_flops
            self.expert_flops_per_group_token = routed_flops / shards
            self.expert_bytes_per_rank = self.expert_bytes / shards
            # the expert layers' exchange of the ranks' tokens (simkv/backends/expert_exchange.py):
            # all-to-all, or gathered over the data-parallel ranks (vLLM's default; PCP ranks'
            # own gather: `pcp_gather_seconds`)
            if all_to_all:
                self.dp_comm_per_token, self.dp_comm_fixed = all_to_all_exchange(
                    model, g, gpus_per_node, gpu.interconnect_gbs, inter_node_gbs, allreduce_latency_s,
                    round_robin_experts)
            elif self.dp > 1:
                self.dp_comm_per_token, self.dp_comm_fixed = gather_exchange(
                    model, g, dp_link_gbs or gpu.interconnect_gbs, allreduce_latency_s)
            else:
                self.dp_comm_per_token = self.dp_comm_fixed = 0.0
            self.ubatching = ubatching
            self.dbo_steps = [0, 0]  # (lockstep steps run as microbatches, lockstep steps)
        if self.pcp > 1:
            if not self.mla:
                raise ValueError("prefill context parallelism is priced for latent attention (vLLM runs it there)")
            # over the PCP group: every layer all-gathers the step's new latents (bf16, before the
            # cache write; and the indexer's keys under sparse attention); every expert layer
            # all-gathers the ranks' hidden states to route them and reduce-scatters its output
            # (vLLM's MoE runner without expert parallelism); the last layer's hidden states come
            # back to every rank before sampling
            share = (self.pcp - 1) / self.pcp / ((pcp_link_gbs or gpu.interconnect_gbs) * 1e9)
            latent = model.kv_lora_rank + model.qk_rope_head_dim + (model.index_head_dim if self.sparse_topk else 0)
            moe_gathers = 0 if all_to_all else 2 * model.num_moe_layers  # (all-to-all: the exchange above instead)
            self.pcp_gather_per_token = share * 2 * (model.num_layers * latent + moe_gathers * h + h)
            if self.sparse_topk:  # (the rank steps' decodes are shares: price every decode step as a step)
                self.supports_decode_runs = False
            self.pcp_gather_fixed = (model.num_layers + moe_gathers + 1) * allreduce_latency_s
        self._decode_lines: dict[int, tuple[int, int, int, int]] = {}
        self.seq_overhead_s = seq_overhead_s
        # Sliding-window layers attend (and read) at most their window (None: every layer attends all).
        self.window_counts = layer_window_counts(layer_windows) if layer_windows and any(layer_windows) else None
        self.attention_chunked = attention_chunked  # (the windows are attention chunks: Llama 4)
        self._lora_setup(lora_rank, lora_kernel_s)
        self.weight_offload: dict | None = None
        if any(weight_offload_shares):
            self._offload_weights(*weight_offload_shares, pcie_gbs)

    def matmul_discount(self, weight_bytes: float) -> float:
        """The share of its bf16-rate FLOPs a matmul of weights stored at `weight_bytes` saves: fp8
        (one byte) at the fp8 peak, NVFP4 at the fp4 peak, where the GPU has them; 0 otherwise."""
        return {1.0: self.fp8_discount, NVFP4_WEIGHT_BYTES: self.fp4_discount}.get(weight_bytes, 0.0)

    def _offload_weights(self, share: float, expert_share: float, pcie_gbs: float) -> None:
        """vLLM's UVA weight offloading (--cpu-offload-gb): the kernels read the offloaded share
        of the weights from pinned host memory over the host link, once per forward pass (taken
        as once: a large prefill's matmul may read a weight tile more than once, so steps that
        are long in tokens may cost more). Priced as weight bytes at the host link's rate in
        place of the GPU memory's: each weight read's bytes count (1 - share) + share x
        (GPU memory rate / host link rate) times in the memory term. `share`: of the weights
        outside the routed experts, `expert_share`: of the experts (only the experts a step's
        tokens are routed to are read, over the link too)."""
        ratio = self.byte_rate / (pcie_gbs * 1e9)
        factor = 1.0 - share + share * ratio
        expert_factor = 1.0 - expert_share + expert_share * ratio
        self.weight_offload = {"share": share, "pcie_gbs": pcie_gbs, "weight_read_factor": factor}
        if expert_share != share:
            self.weight_offload |= {"expert_share": expert_share, "expert_read_factor": expert_factor}
        self.weight_bytes *= factor
        self.expert_bytes *= expert_factor
        if self.dp > 1:
            self.expert_bytes_per_rank *= expert_factor

    def _sparse_setup(self, kv_dtype_bytes: int | str, num_speculative_tokens: int, shard_min_rows: int | None,
                      tp_link_gbs: float | None, allreduce_latency_s: float) -> None:
        """DeepSeek sparse attention (`sparse_work`). Every GPU runs the whole indexer (vLLM
        replicates its projections): its weights and per-token FLOPs are not split by TP, and
        its logits cost 2 x index heads x index dim FLOPs per query-key pair and layer, in fp8
        where the GPU has fp8 tensor cores; every GPU scores every row, but for a step of at
        least `shard_min_rows` prefill tokens under TP on CUDA, whose prefill rows the ranks
        split (vLLM's indexer_tp_shard_min_rows). The KV tuple's reads are in cache tokens
        (latent and indexer key): a pair of reads, top-k latents and every indexer key, is
        priced at each one's bytes."""
        model, tp = self.model, self.tp
        replicated = 1.0 - 1.0 / tp  # (of the indexer: what the TP split above took off)
        self.flops_per_token += 2.0 * model.indexer_params * replicated
        self.weight_bytes += model.indexer_weight_bytes * replicated
        index_pair = 2.0 * model.num_layers * model.index_n_heads * model.index_head_dim * (1.0 - self.fp8_discount)
        self.indexer_pair_ratio = index_pair / self.flops_per_latent_pair
        latent, index = model.latent_bytes_per_token(kv_dtype_bytes), model.indexer_bytes_per_token()
        self.latent_read_share, self.indexer_read_share = latent / (latent + index), index / (latent + index)
        self.sparse_decode_query_len = 1 + num_speculative_tokens  # (vLLM's decode threshold: a verification)
        self.indexer_shard_min_rows = shard_min_rows  # (None: every rank scores every row)
        link = (tp_link_gbs or self.gpu.interconnect_gbs) * 1e9
        self.indexer_exchange_per_row = model.num_layers * model.index_topk * 4 * (tp - 1) / tp / link
        self.indexer_exchange_fixed = model.num_layers * allreduce_latency_s

    def sparse_work(self, output: SchedulerOutput) -> tuple:
        """`step_work` under sparse attention. A query at position p attends min(p, top-k) tokens
        down the latent (absorbed) path, and the indexer scores all p of them (its pairs ride on
        the latent path's at their FLOPs' ratio). vLLM 0.33 sends a step's prefills down the
        dense expanded path instead when none of them is longer than top-k (then every query
        attends all it sees anyway; then, with no decode in the step, the indexer writes its keys
        and scores nothing). A decode (or a verification chunk of 1 + K tokens) reads each
        query's top-k latents and every indexer key; a prefill chunk reads its context's latents
        and keys once."""
        k, q = self.sparse_topk, self.sparse_decode_query_len
        dense, prefill_share, _ = self._indexer_plan(output)
        tokens = pairs = upproj = attended = scored = reads = 0.0
        for chunk in output.chunks:
            n, c = chunk.num_new_tokens, chunk.num_computed_tokens
            tokens += n
            causal = n * c + n * (n + 1) // 2
            scored += causal * prefill_share if n > q else causal
            if dense and n > q:
                pairs += causal
                upproj += c
                reads += c + n
                continue
            capped = capped_pairs(c, n, k)
            attended += capped
            if n > q:  # (a sparse prefill gathers its context once into the kernel's workspace)
                reads += c + n
            else:  # (a decode or verification: each query gathers its own top-k, the keys are read once)
                reads += capped * self.latent_read_share + (c + n) * self.indexer_read_share
        n = output.num_decode_reqs
        if n:  # (the scheduler sums the decoders' contexts, whole and capped at top-k)
            full, capped = output.decode_context_tokens, output.decode_capped_context_tokens
            if not capped:
                raise RuntimeError("sparse attention prices decodes by their capped context: the scheduler "
                                   "must count it (decode_capped_context_tokens)")
            attended += capped
            scored += full
            reads += self._decode_reads(full, capped)
        return (tokens + n, len(output.chunks) + n, pairs, reads, attended + scored * self.indexer_pair_ratio, upproj)

    def _decode_reads(self, scored: int, attended: int) -> float:
        """Decodes' cache reads, in cache tokens: each query's top-k latents (`attended`) and
        every indexer key of its context (`scored`)."""
        return attended * self.latent_read_share + scored * self.indexer_read_share

    def _indexer_plan(self, output: SchedulerOutput) -> tuple[bool, float, int]:
        """(the step's prefills run as dense MHA, the share of the prefill rows' indexer scores
        each GPU computes, the prefill rows the TP ranks split): the share is 0 where dense MHA
        runs alone (vLLM's indexer then leaves the top-k undone), 1 / TP where the ranks split
        the rows, else 1."""
        q = self.sparse_decode_query_len
        rows = last = 0
        for chunk in output.chunks:
            if chunk.num_new_tokens > q:
                rows += chunk.num_new_tokens
                last = max(last, chunk.num_computed_tokens + chunk.num_new_tokens)
        dense = 0 < last <= self.sparse_topk
        if dense and not output.num_decode_reqs and all(c.num_new_tokens > q for c in output.chunks):
            return True, 0.0, 0
        if self.indexer_shard_min_rows is not None and rows >= self.indexer_shard_min_rows:
            return dense, 1.0 / self.tp, rows
        return dense, 1.0, 0

    def indexer_exchange_seconds(self, output: SchedulerOutput) -> float:
        """The ranks' exchange of the top-k indices (int32) of the prefill rows they split, an
        all-gather over the TP group in every layer; 0 where they do not split them."""
        split_rows = self._indexer_plan(output)[2] if self.sparse_topk else 0
        return self.indexer_exchange_per_row * split_rows + self.indexer_exchange_fixed if split_rows else 0.0

    def sparse_decode_pass_work(self, contexts: list[int]) -> tuple:
        """`decode_pass_work` under sparse attention: one new token for each sequence, after
        `contexts` cached tokens each (a drafter's later passes)."""
        k = self.sparse_topk
        scored = sum(contexts) + len(contexts)
        attended = sum(min(c + 1, k) for c in contexts)
        n = len(contexts)
        return n, n, 0, self._decode_reads(scored, attended), attended + scored * self.indexer_pair_ratio, 0

    def _lora_setup(self, rank: int, kernel_s: float) -> None:
        """LoRA (vLLM's punica Triton kernels, `lora_seconds`): per token, the shrink (x @ A) and
        the expand (@ B) of every linear layer the adapters cover, at the slots' width
        (`max_lora_rank`); per adapter in the step, a read of its A and B; per token, the
        kernels' reads of the layer's input (once per slice) and the expand's read and write of
        the output it adds to; per step with any LoRA token, three launches (the shrink buffer's
        zeroing, shrink, expand) for each of the four linear groups of a layer (qkv, o, gate_up,
        down), each at least `lora_kernel_s`. A step without LoRA tokens launches none (vLLM's
        no-LoRA flag)."""
        shapes = self.model.lora_linear_shapes(self.tp) if rank else None
        self.lora_modelled = shapes is not None
        if shapes is None:
            self.lora_flops_per_token = self.lora_bytes_per_adapter = self.lora_bytes_per_token = 0.0
            self.lora_fixed_s = 0.0
            return
        layers = self.model.num_layers
        width = sum(i + o for i, o in shapes)  # A and B elements per rank unit
        self.lora_flops_per_token = 2.0 * rank * width * layers
        self.lora_bytes_per_adapter = 2.0 * rank * width * layers  # (bf16 slots)
        self.lora_bytes_per_token = 2.0 * sum(i + 2 * o for i, o in shapes) * layers
        self.lora_fixed_s = 3 * 4 * layers * kernel_s
        self.params["lora_kernel_s"] = kernel_s

    def lora_seconds(self, num_lora_tokens: int, num_active_loras: int) -> float:
        """The LoRA kernels of a step that runs `num_lora_tokens` tokens of requests with an
        adapter, `num_active_loras` distinct adapters among them; 0 without LoRA tokens."""
        if not num_lora_tokens or not self.lora_modelled:
            return 0.0
        flops = self.lora_flops_per_token * num_lora_tokens
        traffic = self.lora_bytes_per_adapter * num_active_loras + self.lora_bytes_per_token * num_lora_tokens
        return max(flops / self.flop_rate, traffic / self.byte_rate) + self.lora_fixed_s

    def _time(self, tokens, num_seqs, pairs, kv_read, maximum=np.maximum, latent_pairs=0, upproj_tokens=0,
              draft_tokens=0):
        """One formula for Python numbers (maximum=max) and numpy arrays (np.maximum): every
        operation is the same IEEE operation in the same order, so results are identical.
        Latent attention: `pairs` are the expanded path's, `latent_pairs` the absorbed path's,
        `upproj_tokens` the cached tokens the expanded path up-projects. `draft_tokens`: the
        drafts the step verifies (linear-attention layers write a state after each)."""
        flops = self.flops_per_token * tokens + self.flops_per_seq * num_seqs + self.flops_per_pair * pairs
        if self.mla:
            flops = flops + self.flops_per_latent_pair * latent_pairs + self.flops_per_upproj_token * upproj_tokens
        if self.moe is None:
            traffic = self.weight_bytes + self.kv_bytes_per_token * (kv_read + tokens)
        else:
            traffic = (self.weight_bytes + self.expert_bytes * self.moe.experts_touched(tokens)
                       + self.kv_bytes_per_token * (kv_read + tokens))
        if self.state_bytes_per_seq:
            traffic = traffic + self.state_bytes_per_seq * num_seqs
            if draft_tokens:
                traffic = traffic + self.state_bytes_per_draft * draft_tokens
        busy = maximum(flops / self.flop_rate, traffic / self.byte_rate)
        return busy + self.comm_per_token * tokens + self.fixed_s + self.seq_overhead_s * num_seqs

    def execute(self, output: SchedulerOutput) -> float:
        if self.dp > 1:
            raise RuntimeError("a data-parallel roofline times lockstep steps of all ranks (dp_step_seconds)")
        if self.pcp > 1:  # (the PCP ranks' lockstep step; LoRA, DCP and sparse attention are refused with PCP)
            return self.dp_step_seconds([output])
        tokens, seqs, pairs, kv_read, latent_pairs, upproj = self.step_work(output)
        seconds = self._time(tokens, seqs, pairs, kv_read, max, latent_pairs, upproj, output.num_draft_tokens)
        if output.num_lora_tokens:
            seconds += self.lora_seconds(output.num_lora_tokens, output.num_active_loras)
        if self.sparse_topk:
            seconds += self.indexer_exchange_seconds(output)
        return seconds + self.dcp_seconds(output) if self.dcp > 1 else seconds

    def dcp_seconds(self, output: SchedulerOutput) -> float:
        """Decode context parallelism's collectives in a step: the absorbed path's per query token
        (decodes, short chunks), the expanded path's per latent gathered (its chunks and their
        cached context)."""
        queries = output.num_decode_reqs
        gathered = 0
        for chunk in output.chunks:
            if not self.mla or chunk.num_new_tokens <= self.mla_decode_query_len:
                queries += chunk.num_new_tokens
            else:
                gathered += chunk.num_computed_tokens + chunk.num_new_tokens
        return self.dcp_per_query * queries + self.dcp_per_gathered * gathered + self.dcp_fixed

    def step_work(self, output: SchedulerOutput) -> tuple:
        """(tokens, sequences, query-key pairs, KV tokens read, latent-path pairs, cached tokens
        up-projected) of a step, as `_time` takes them (the last two: latent attention only)."""
        if self.sparse_topk:
            return self.sparse_work(output)
        n = output.num_decode_reqs
        ctx = output.decode_context_tokens
        if self.mla:
            tokens, pairs, latent_pairs, kv_read, upproj = self.mla_chunk_work(output.chunks)
            return tokens + n, len(output.chunks) + n, pairs, kv_read + ctx, latent_pairs + ctx, upproj
        if self.window_counts is not None:
            p_tokens, p_pairs, p_read = windowed_prefill_work(output, self.window_counts, self.model.num_layers,
                                                               self.attention_chunked)
            ctx = ctx / self.model.num_layers  # (layer-tokens: per layer on average, as the chunks' work)
        else:
            p_tokens, p_pairs, p_read = prefill_work(output)
        return p_tokens + n, len(output.chunks) + n, p_pairs + ctx, p_read + ctx, 0, 0

    def dp_step_seconds(self, outputs: list[SchedulerOutput], num_dummy: int = 0, extra_s: float = 0.0,
                        overlap_host: bool = False) -> float:
        """A lockstep step of data-parallel ranks: the outputs of the ranks that ran, and
        `num_dummy` ranks that run a dummy pass. Each rank's GPUs run its attention and dense
        layers on its own tokens, and their share (1 / data_parallel_size) of the routed experts
        on every rank's tokens, reading the experts those tokens touch; the expert layers'
        all-gather and reduce-scatter carry every rank's tokens. The step lasts as long as its
        slowest rank. `extra_s`: device time every rank adds (a drafter's); `overlap_host`
        (async scheduling): each rank's step lasts max(device time, host time), as one engine's."""
        if self.pcp > 1:  # (each rank's PCP ranks: its step split between them, gathered in every layer)
            works, collectives = [], []
            for out in outputs:
                works += self.pcp_rank_works(out)
                collectives += [self.pcp_gather_seconds(out.total_num_scheduled_tokens)] * self.pcp
            return self.dp_time(works, num_dummy, extra_s, overlap_host, collectives)
        # (decode context parallelism: each rank's DCP collectives within its TP group; a dummy
        # pass builds no attention metadata, so it runs no attention and gathers nothing)
        collectives = ([self.dcp_seconds(out) for out in outputs] if self.dcp > 1
                       else [self.indexer_exchange_seconds(out) for out in outputs] if self.sparse_topk else None)
        return self.dp_time([self.step_work(out) for out in outputs], num_dummy, extra_s, overlap_host, collectives,
                            [out.num_draft_tokens for out in outputs])

    def dp_time(self, works: list[tuple], num_dummy: int = 0, extra_s: float = 0.0,
                overlap_host: bool = False, collectives: list[float] | None = None,
                draft_tokens: list[int] | None = None) -> float:
        """`dp_step_seconds` for the ranks' `step_work` tuples (a drafter's passes too);
        `collectives`: each work's rank's own collective seconds on top (DCP's); `draft_tokens`:
        the drafts each rank verifies (`_time`)."""
        works = works + [(0, 0, 0, 0, 0, 0)] * min(num_dummy, 1)
        if collectives is not None:
            collectives = collectives + [0.0] * (len(works) - len(collectives))
        total = sum(w[0] for w in works)
        expert_flops = self.expert_flops_per_group_token * total
        touched = self.moe.experts_touched(total) if total and self.moe is not None else 0.0
        expert_traffic = self.expert_bytes_per_rank * touched
        comm = self.dp_comm_per_token * total + self.dp_comm_fixed
        microbatched = self._microbatched(works)
        if self.ubatching is not None:
            self.dbo_steps[0] += microbatched
            self.dbo_steps[1] += 1
        longest = 0.0
        for i, (tokens, seqs, pairs, kv_read, latent_pairs, upproj) in enumerate(works):
            flops = self.flops_per_token_local * tokens + self.flops_per_seq * seqs + self.flops_per_pair * pairs
            if self.mla:
                flops += self.flops_per_latent_pair * latent_pairs + self.flops_per_upproj_token * upproj
            traffic = (self.weight_bytes + expert_traffic + self.kv_bytes_per_token * (kv_read + tokens)
                       + self.state_bytes_per_seq * seqs)
            if draft_tokens is not None and i < len(draft_tokens):
                traffic += self.state_bytes_per_draft * draft_tokens[i]
            if microbatched:  # (n microbatches: each reads the weights; one's exchange under another's work)
                n = self.ubatching[0]
                busy = max((flops + expert_flops) / self.flop_rate,
                           (traffic + (n - 1) * (self.weight_bytes + expert_traffic)) / self.byte_rate)
                overlapped = max(busy, comm) + min(busy, comm) / (n * max(1, self.model.num_moe_layers))
                seconds = overlapped + self.comm_per_token * tokens + self.fixed_s + self.seq_overhead_s * seqs
            else:
                busy = max((flops + expert_flops) / self.flop_rate, traffic / self.byte_rate)
                seconds = busy + self.comm_per_token * tokens + self.fixed_s + self.seq_overhead_s * seqs + comm
            if collectives is not None:
                seconds += collectives[i]
            if overlap_host:
                host = self.host_seconds(seqs)
                seconds = max(seconds + extra_s - host, host)
            longest = max(longest, seconds)
        return longest

    def _microbatched(self, works: list[tuple]) -> bool:
        """Microbatching (dual batch overlap, --ubatch-size) runs this lockstep step as
        microbatches: every rank (a dummy pass has no tokens) has at least the threshold's tokens,
        the decode threshold where its step is decodes only (a token per sequence), else the
        prefill one (vLLM's ranks agree)."""
        if self.ubatching is None:
            return False
        _, decode, prefill = self.ubatching
        return all(tokens >= (decode if tokens == seqs else prefill) for tokens, seqs, *_ in works)

    def pcp_rank_works(self, output: SchedulerOutput) -> list[tuple]:
        """The `step_work` of each PCP rank, its share as vLLM's PCPManager splits the step
        (simkv/backends/pcp_split.py): prefill pieces down the expanded path, their context
        up-projected, decode rows down the absorbed path (under sparse attention `sparse_work`
        of the rank's rows: an indexer on each rank scores its own rows). Every rank writes the
        whole step's latents into the cache it holds (counted with the reads), and computes
        every sequence's logits on the hidden states gathered back (vLLM samples the whole
        batch on each)."""
        steps = split_step(output, self.pcp)
        works = [list(self.sparse_work(step) if self.sparse_topk else self._pcp_mla_work(step)) for step in steps]
        total = sum(work[0] for work in works)
        seqs = len(output.chunks) + output.num_decode_reqs
        for work in works:
            work[1] = seqs
            work[3] += total - work[0]  # (the other ranks' tokens' latents, written here too)
        return [tuple(work) for work in works]

    @staticmethod
    def _pcp_mla_work(step) -> tuple:
        """A PCP rank's `step_work` (its sequences left to `pcp_rank_works`)."""
        tokens = pairs = latent_pairs = kv_read = upproj = 0
        for piece in step.chunks:
            m, c = piece.num_new_tokens, piece.num_computed_tokens
            causal = m * c + m * (m + 1) // 2
            tokens += m
            kv_read += c + m
            if piece.prefill:
                pairs += causal
                upproj += c
            else:
                latent_pairs += causal
        d, context = step.num_decode_reqs, step.decode_context_tokens
        return tokens + d, 0, pairs, kv_read + context, latent_pairs + context, upproj

    def pcp_gather_seconds(self, num_tokens: int) -> float:
        """A PCP rank's all-gathers in a step of `num_tokens` tokens: each layer's new latents
        and the last hidden states."""
        return self.pcp_gather_per_token * num_tokens + self.pcp_gather_fixed

    def mla_chunk_work(self, chunks) -> tuple[int, int, int, int, int]:
        """Latent attention: (tokens, expanded-path pairs, absorbed-path pairs, KV tokens read,
        cached tokens up-projected) of prefill chunks, each down the path vLLM sends it."""
        tokens = pairs = latent_pairs = kv_read = upproj = 0
        for chunk in chunks:
            n, c = chunk.num_new_tokens, chunk.num_computed_tokens
            tokens += n
            kv_read += c + n
            if n <= self.mla_decode_query_len:
                latent_pairs += n * c + n * (n + 1) // 2
            else:
                pairs += n * c + n * (n + 1) // 2
                upproj += c
        return tokens, pairs, latent_pairs, kv_read, upproj

    def decode_pass_work(self, num_seqs: int, context: int) -> tuple:
        """The `step_work` of a pass of one new token for each of `num_seqs` sequences, `context`
        tokens cached over them all (a drafter's later passes)."""
        if self.mla:
            return num_seqs, num_seqs, 0, context, context + num_seqs, 0
        return num_seqs, num_seqs, context + num_seqs, context, 0, 0

    def decode_pass_seconds(self, num_seqs: int, context: int) -> float:
        tokens, seqs, pairs, kv_read, latent_pairs, upproj = self.decode_pass_work(num_seqs, context)
        return self._time(tokens, seqs, pairs, kv_read, max, latent_pairs, upproj)

    def host_seconds(self, num_seqs: int) -> float:
        """The part of a step of `num_seqs` sequences (prefill chunks and decodes) spent on the
        host: the per-step and per-sequence overheads."""
        return self.params["step_overhead_s"] + self.seq_overhead_s * num_seqs

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        """`execute` for an [N, 5] array of step features (T, S, Pp, Kp, Kd), as
        `simkv.calibration.costmodel.step_features` gives them: measured steps."""
        f = np.asarray(features, dtype=np.int64)
        if self.mla:  # (chunk pairs taken as the expanded path's, without up-projection)
            return self._time(f[:, 0], f[:, 1], f[:, 2], f[:, 3] + f[:, 4], np.maximum, latent_pairs=f[:, 4])
        return self._time(f[:, 0], f[:, 1], f[:, 2] + f[:, 4], f[:, 3] + f[:, 4], np.maximum)

    def decode_step_line(self, num_decodes: int) -> tuple[int, int, int, int]:
        """A pure-decode step in ticks: max(compute, memory) + overheads, both affine in the
        context attended (attention FLOPs per query-key pair; K/V bytes per token)."""
        line = self._decode_lines.get(num_decodes)
        if line is None and self.pcp > 1:
            line = self._decode_lines[num_decodes] = self._pcp_decode_line(num_decodes)
        if line is None:
            n = num_decodes
            overhead = self.comm_per_token * n + self.fixed_s + self.seq_overhead_s * n
            if self.dcp > 1:
                overhead += self.dcp_per_query * n + self.dcp_fixed
            compute = (self.flops_per_token * n + self.flops_per_seq * n) / self.flop_rate
            weights = self.weight_bytes if self.moe is None else self.weight_bytes + self.expert_bytes * self.moe.experts_touched(n)
            memory = (weights + (self.kv_bytes_per_token + self.state_bytes_per_seq) * n) / self.byte_rate
            # per context token; with sliding-window layers per layer-token (SchedulerOutput); under
            # sparse attention per token its indexer scores (`capped_line_slopes`: per token attended)
            per = self.model.num_layers if self.window_counts is not None else 1
            pair, token = self.flops_per_decode_pair / per, self.kv_bytes_per_token / per
            if self.sparse_topk:
                pair, token = pair * self.indexer_pair_ratio, token * self.indexer_read_share
            line = self._decode_lines[n] = (
                to_ticks(compute + overhead), per_token_ticks(pair / self.flop_rate),
                to_ticks(memory + overhead), per_token_ticks(token / self.byte_rate))
        return line

    def _pcp_decode_line(self, n: int) -> tuple[int, int, int, int]:
        """`decode_step_line` under PCP: the step of PCP rank 0, which takes the most decodes
        (ceil(n / PCP)) and their share of the context (`pcp_rank_works`); the others take
        no more of anything, and every rank computes all n logits."""
        own = n // self.pcp + (n % self.pcp > 0)
        overhead = (self.comm_per_token * own + self.fixed_s + self.seq_overhead_s * n
                    + self.dp_comm_per_token * n + self.dp_comm_fixed + self.pcp_gather_seconds(n))
        expert_traffic = self.expert_bytes_per_rank * self.moe.experts_touched(n) if self.moe is not None else 0.0
        compute = (self.flops_per_token_local * own + self.flops_per_seq * n
                   + self.expert_flops_per_group_token * n) / self.flop_rate
        memory = (self.weight_bytes + expert_traffic + self.kv_bytes_per_token * n
                  + self.state_bytes_per_seq * n) / self.byte_rate
        share = own / n
        return (to_ticks(compute + overhead), per_token_ticks(self.flops_per_decode_pair * share / self.flop_rate),
                to_ticks(memory + overhead), per_token_ticks(self.kv_bytes_per_token * share / self.byte_rate))

    @property
    def capped_line_slopes(self) -> tuple[int, int] | None:
        """Sparse attention: the decode line's compute and memory ticks per token a query attends
        (its latent), beside `decode_step_line`'s per token scored; None otherwise."""
        if not self.sparse_topk:
            return None
        return (per_token_ticks(self.flops_per_latent_pair / self.flop_rate),
                per_token_ticks(self.kv_bytes_per_token * self.latent_read_share / self.byte_rate))

    fitted_from: dict | None = None  # (a fit file's name, warnings and front-end latency: simkv/backends/roofline_fit.py)
    ubatching: tuple[int, int, int] | None = None  # (microbatching: set with lockstep ranks)

    @property
    def frontend_latency_s(self) -> float:
        """What a fit says the server's front end adds to every request's TTFT and E2E (else 0)."""
        return self.fitted_from["frontend_latency_s"] if self.fitted_from else 0.0

    def describe(self) -> dict:
        out = {"cost_model": "roofline", "model": self.model.name, "gpu": self.gpu.name,
               "tensor_parallel_size": self.tp, **self.params, **(self.fitted_from or {}),
               **({"weight_offload": self.weight_offload} if self.weight_offload else {})}
        if is_gpu_file(self.gpu.name):  # (a GPU file's numbers, as read: the file may change later)
            out["gpu_spec"] = {k: v for k, v in dataclasses.asdict(self.gpu).items() if k != "name"}
        if self.ubatching is not None:
            n, decode, prefill = self.ubatching
            out["dual_batch_overlap"] = {"microbatches": n, "decode_token_threshold": decode,
                                         "prefill_token_threshold": prefill,
                                         "microbatched_steps": self.dbo_steps[0], "lockstep_steps": self.dbo_steps[1]}
        return out


_LINEAR_CHUNK = 64  # the chunk of vLLM's chunked Gated DeltaNet and Mamba2 (SSD) prefill kernels


def linear_attention_work(model: ModelSpec, tensor_parallel_size: int = 1,
                          num_speculative_tokens: int = 0) -> tuple[float, float, float]:
    """(FLOPs per token, state bytes per sequence and step, state bytes per draft verified) of a
    model's linear-attention layers on one GPU; zeros without. A token's FLOPs per layer and value
    head: reading and updating the key-dim x value-dim state (4 x dk x dv) and, in the chunked
    prefill algorithm, attending the other tokens of its 64-token chunk (2 x 64 x (dk + dv));
    decodes are counted alike. A sequence reads its state and writes it back once a step (the
    convolution state too, which keeps K more inputs under speculative decoding); a sequence that
    verifies d drafts writes the state after each of its 1 + d tokens (into its K scratch state
    blocks), so each draft adds a write (a proposer that finds nothing, or proposes fewer than K,
    writes fewer)."""
    if not model.linear_attention:
        return 0.0, 0.0, 0.0
    dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
    heads = model.linear_num_value_heads / tensor_parallel_size
    per_token = model.num_linear_attention_layers * heads * (4.0 * dk * dv + 2.0 * _LINEAR_CHUNK * (dk + dv))
    state = model.linear_state_bytes(tensor_parallel_size, num_speculative_tokens)
    per_state = model.num_linear_attention_layers * state
    return per_token, 2.0 * per_state, per_state if num_speculative_tokens else 0.0


def mla_decode_query_len(gpu: GPUSpec, num_speculative_tokens: int = 0, fp8_kv_cache: bool = False,
                         block_size: int = 16) -> int:
    """The longest query chunk vLLM 0.33's latent-attention backend runs down its decode
    (absorbed) path. On Hopper: FlashAttention MLA (a bf16 cache) takes chunks of up to 512
    tokens; with an fp8 cache FlashMLA takes over, up to 128, if the block size is a multiple of
    64 (vLLM's default there); otherwise, as on Ampere and Ada, Triton MLA takes single tokens.
    Blackwell's FlashInfer MLA (and CUTLASS MLA) take single tokens too, and so does Triton MLA
    on ROCm (vLLM's default there, without AITER). All take a verification chunk of 1 + K tokens."""
    if gpu.cuda_major != 9:
        threshold = 1
    elif not fp8_kv_cache:
        threshold = 512
    else:
        threshold = 128 if block_size % 64 == 0 else 1
    return max(threshold, 1 + num_speculative_tokens) if num_speculative_tokens else threshold


def capped_pairs(num_computed: int, num_new: int, cap: int) -> int:
    """Query-key pairs of `num_new` queries at positions num_computed + 1 ... num_computed +
    num_new when each attends at most `cap` tokens (sparse attention's top-k)."""
    first, last = num_computed + 1, num_computed + num_new
    below = max(0, min(last, cap) - first + 1)  # queries that attend all they see
    low = first if below else 0
    return (below * (low + low + below - 1)) // 2 + (num_new - below) * cap
