"""The drafter's share of a step under speculative decoding, added to any cost model's.

After the target model's forward pass, the drafter proposes K tokens (under dynamic speculation,
the K of the step's number of requests) for every request that sampled in the step:
- ngram, suffix: prompt lookup or suffix-tree lookup on the host, `spec_ngram_us_per_request`
  per such request;
- EAGLE family and draft models: K forward passes of the draft network (one target-shaped
  decoder layer and the LM head for the EAGLE family, `spec_draft_model`'s spec for a draft
  model). The first pass runs over every token of the step (the drafter keeps its own KV of the
  whole sequence), the K - 1 others over one token per sampling request. Each pass is timed
  by the roofline (simkv/backends/roofline.py) on the replay's GPU, plus
  `spec_draft_pass_overhead_ms`.
- dflash (block diffusion): one pass of K + 1 queries per sampling request (its bonus token
  and K masked positions, attending each other and the request's context) through
  `spec_draft_layers` target-shaped layers, logits for K of them; before it, the step's tokens'
  hidden states at as many tapped target layers are projected (`fc`, whole on every GPU) and
  into each layer's K and V, the drafter's KV of the context (`_dflash_context_seconds`).
Under multi-module MTP (more than one MTP module and K > 1, vLLM's MultiModuleMTPSpeculator)
every one of the K passes runs over all of the step's tokens, through module i for draft i
(the modules' rejected-token re-prefills are packed into the same query window).
A draft model's first pass has one more query per sampling request (vLLM keeps the input's last
token unsliced). Drafting in parallel (`spec_parallel_drafting`, vLLM's parallel_drafting:
P-EAGLE, PARD) is that first pass alone, with K - 1 masked query positions more per sampling
request for an EAGLE head and K for a draft model (`SpeculativeConfig.draft_slots`), each
attending the request's context.
The drafts' own logits in the target's verification pass are not counted (2 * hidden * vocab
FLOPs per draft, a few per cent of a token's).
"""

from __future__ import annotations

import dataclasses

from simkv.backends.base import prefill_work
from simkv.backends.roofline import RooflineCostModel
from simkv.config import EngineConfig
from simkv.core.outputs import SchedulerOutput
from simkv.specs import get_gpu_spec, get_model_spec


class Drafter:
    def __init__(self, config: EngineConfig) -> None:
        spec, hw = config.speculative, config.hardware
        self.method = spec.speculative_method
        self.k = spec.num_speculative_tokens
        self.parallel = spec.spec_parallel_drafting
        self.extra_queries = spec.draft_slots  # per sampling request, in the first pass
        self.per_request_s = spec.spec_ngram_us_per_request * 1e-6
        self.network = None
        self.dflash = self.method == "dflash"
        self.multi_module = spec.multi_module_mtp(config.hardware.model_spec())
        if not spec.proposes_on_host:
            draft = config.draft_network
            if self.method == "mtp":  # (a pass runs one MTP module; memory holds them all)
                draft = dataclasses.replace(draft, num_layers=1)
            self.network = RooflineCostModel(draft, get_gpu_spec(hw.gpu), hw.tensor_parallel_size,
                                             config.kv_element_for(draft),
                                             step_overhead_s=spec.spec_draft_pass_overhead_ms * 1e-3,
                                             seq_overhead_s=0.0, num_speculative_tokens=self.k,
                                             data_parallel_size=hw.data_parallel_size,
                                             block_size=config.cache.block_size,
                                             # (the drafter's attention is sharded as the target's: vLLM
                                             # gives its proposers the DCP groups' local lengths)
                                             decode_context_parallel_size=hw.decode_context_parallel_size,
                                             prefill_context_parallel_size=hw.prefill_context_parallel_size,
                                             pcp_link_gbs=hw.link_gbs(hw.tensor_parallel_size
                                                                      * hw.prefill_context_parallel_size))
        if self.dflash:
            tp, target = hw.tensor_parallel_size, get_model_spec(hw.model)
            fc = spec.dflash_fc_params(target, draft)
            kv_proj = draft.num_layers * draft.hidden_size * 2 * draft.num_kv_heads * draft.head_dim / tp
            self.context_flops_per_token = 2.0 * (fc + kv_proj)
            self.context_weight_bytes = 2.0 * (fc + kv_proj)  # (bf16)
            # per context token: its tapped hidden states in, its K and V in every layer out
            self.context_bytes_per_token = (2.0 * draft.num_layers * target.hidden_size
                                            + draft.kv_bytes_per_token(config.kv_element_for(draft), tp))

    @staticmethod
    def _sampling_contexts(output: SchedulerOutput) -> list[int]:
        """The tokens each request sampling in the step has then (a sparse drafter's top-k caps each)."""
        ends = (chunk.num_computed_tokens + chunk.num_new_tokens for chunk in output.chunks)
        return [end for chunk, end in zip(output.chunks, ends) if end >= chunk.request.num_tokens]

    @staticmethod
    def _sampling(output: SchedulerOutput) -> tuple[int, int]:
        """(requests sampling in the step, the tokens they have then): who gets drafts."""
        ends = Drafter._sampling_contexts(output)
        return len(ends), sum(ends)

    def _first_work(self, output: SchedulerOutput, sampling: int) -> tuple:
        """The network's first pass, over every token of the step and the extra queries of the
        sampling requests (its `step_work` tuple)."""
        net = self.network
        if net.sparse_topk:  # (DeepSeek-V3.2's MTP layer: sparse attention as the target's)
            tokens, _, pairs, kv_read, latent_pairs, upproj = net.sparse_work(output)
            work = tokens, sampling, pairs, kv_read, latent_pairs, upproj
        elif net.mla:
            tokens, pairs, latent_pairs, kv_read, upproj = net.mla_chunk_work(output.chunks)
            work = tokens + output.num_decode_reqs, sampling, pairs, kv_read, latent_pairs, upproj
        else:
            tokens, pairs, kv_read = prefill_work(output)
            work = tokens + output.num_decode_reqs, sampling, pairs, kv_read, 0, 0
        return self._with_extra_queries(work, output) if self.extra_queries else work

    def _with_extra_queries(self, work: tuple, output: SchedulerOutput) -> tuple:
        """`work` plus `extra_queries` query positions after each sampling request's tokens, each
        attending the request's tokens and the extra positions before it (decode-like queries:
        latent attention's absorbed path; under sparse attention capped at top-k)."""
        m = self.extra_queries
        tokens, seqs, pairs, kv_read, latent_pairs, upproj = work
        ends = self._sampling_contexts(output)
        cap = self.network.sparse_topk
        if cap:
            extra = sum(min(end + j, cap) for end in ends for j in range(1, m + 1))
        else:
            extra = m * sum(ends) + len(ends) * (m * (m + 1) // 2)
        if self.network.mla:
            latent_pairs += extra
        else:
            pairs += extra
        return tokens + m * len(ends), seqs, pairs, kv_read, latent_pairs, upproj

    def seconds(self, output: SchedulerOutput) -> float:
        sampling, context = self._sampling(output)
        k = output.num_spec_tokens_to_schedule  # (the scheduler's K for this step)
        if not sampling or not k:
            return 0.0  # (vLLM skips drafting when no request can use the drafts)
        if self.network is None:
            return sampling * self.per_request_s
        net = self.network
        if net.pcp > 1:
            return self._pcp_seconds(output, sampling, context, k)
        if self.dflash:
            tokens, seqs, pairs, kv_read, _, _ = self._dflash_query_work(sampling, context, k)
            return self._dflash_context_seconds(output) + net._time(tokens, seqs, pairs, kv_read, max)
        tokens, seqs, pairs, kv_read, latent_pairs, upproj = self._first_work(output, sampling)
        first = net._time(tokens, seqs, pairs, kv_read, max, latent_pairs, upproj)
        if self.parallel:
            return first  # (every draft from that one pass)
        if self.multi_module:
            return k * first  # (every module over the whole step)
        tokens, seqs, pairs, kv_read, latent_pairs, upproj = self._later_work(output, sampling, context)
        return first + (k - 1) * net._time(tokens, seqs, pairs, kv_read, max, latent_pairs, upproj)

    def _pcp_seconds(self, output: SchedulerOutput, sampling: int, context: int, k: int) -> float:
        """MTP under prefill context parallelism (vLLM runs single-module MTP with it): the first
        pass over the step's tokens is split over the PCP ranks as the target's step is (vLLM's
        draft prefill batch), with its own gathers; each later pass runs every sampling
        request's token on every rank (the whole batch, as vLLM's drafter keeps it), whose expert
        layer gathers the ranks' copies."""
        net, p = self.network, self.network.pcp
        firsts = [work[:1] + (sampling,) + work[2:] for work in net.pcp_rank_works(output)]
        seconds = net.dp_time(firsts, collectives=[net.pcp_gather_seconds(output.total_num_scheduled_tokens)] * p)
        if k > 1:
            later = net.decode_pass_work(sampling, context)
            seconds += (k - 1) * net.dp_time([later] * p, collectives=[net.pcp_gather_seconds(p * sampling)] * p)
        return seconds

    @staticmethod
    def _dflash_query_work(sampling: int, context: int, k: int) -> tuple:
        """dflash's pass (its `step_work` tuple): k + 1 queries for each sampling request (k: the
        step's drafts, vLLM's proposer takes the scheduler's), which attend the request's
        `context` tokens (summed over the requests) and each other, and logits for k of them."""
        q = k + 1
        return sampling * q, sampling * k, q * context + sampling * q * q, context, 0, 0

    def _dflash_context_seconds(self, output: SchedulerOutput) -> float:
        """dflash: the step's tokens' tapped hidden states projected to the drafter's width and
        into each layer's K and V, written to the drafter's cache (one fused GEMM, no CUDA graph)."""
        net = self.network
        tokens = output.num_chunk_tokens + output.num_decode_reqs
        return max(self.context_flops_per_token * tokens / net.flop_rate,
                   (self.context_weight_bytes + self.context_bytes_per_token * tokens) / net.byte_rate)

    def _later_work(self, output: SchedulerOutput, sampling: int, context: int) -> tuple:
        """Each of the network's later passes, one token for every request sampling (its
        `step_work` tuple; sparse attention caps each request's own context)."""
        net = self.network
        if net.sparse_topk:
            return net.sparse_decode_pass_work(self._sampling_contexts(output))
        return net.decode_pass_work(sampling, context)

    def dp_seconds(self, outputs: list[SchedulerOutput], num_dummy: int = 0) -> float:
        """Data-parallel ranks draft in lockstep too (the draft layer's experts span the ranks): each
        pass lasts as long as its slowest rank; a rank with no drafts to make, or fewer passes,
        runs dummy passes. ngram drafts on each rank's host: the slowest rank's time."""
        rows = []
        for out in outputs:
            sampling, context = self._sampling(out)
            if sampling and out.num_spec_tokens_to_schedule:
                rows.append((out, sampling, context, out.num_spec_tokens_to_schedule))
        if not rows:
            return 0.0
        if self.network is None:
            return max(sampling for _, sampling, _, _ in rows) * self.per_request_s
        net = self.network
        idle = num_dummy + len(outputs) - len(rows)
        if self.dflash:
            return (max(self._dflash_context_seconds(out) for out, *_ in rows)
                    + net.dp_time([self._dflash_query_work(sampling, context, k) for _, sampling, context, k in rows], idle))
        firsts = [self._first_work(out, sampling) for out, sampling, _, _ in rows]
        total = net.dp_time(firsts, idle)
        if self.parallel:
            return total
        if self.multi_module:  # (every module passes over its rank's whole step, as the first does)
            later = [(work, k) for work, (*_, k) in zip(firsts, rows)]
        else:
            later = [(self._later_work(out, sampling, context), k) for out, sampling, context, k in rows]
        for j in range(1, max(k for *_, k in rows)):  # (pass j: the ranks with more than j drafts to make)
            works = [work for work, k in later if k > j]
            total += net.dp_time(works, idle + len(rows) - len(works))
        return total

    def describe(self) -> dict:
        out = {"method": self.method, "num_speculative_tokens": self.k}
        if self.parallel:
            out["parallel_drafting"] = True
        if self.multi_module:
            out["multi_module_mtp"] = True
        if self.network is not None:
            out["draft_network"] = self.network.model.name
        return out


class SpeculativeBackend:
    """A cost model plus the drafter: what a step lasts under speculative decoding."""

    supports_decode_runs = False  # (decodes are chunks of 1 + K tokens: there are no decode runs)

    def __init__(self, inner, config: EngineConfig) -> None:
        self.inner = inner
        self.drafter = Drafter(config) if inner.name != "unit" else None  # (unit: time counts steps)
        self.name = inner.name
        self.needs_request_detail = inner.needs_request_detail
        self.draft_seconds = 0.0  # the drafter's share of all steps so far
        if hasattr(inner, "host_seconds"):  # (async scheduling overlaps the host's share with the device)
            self.host_seconds = inner.host_seconds
        self.frontend_latency_s = getattr(inner, "frontend_latency_s", 0.0)  # (a roofline fit's: results add it)

    def execute(self, output: SchedulerOutput) -> float:
        if self.drafter is None:
            return self.inner.execute(output)
        draft = self.drafter.seconds(output)
        self.draft_seconds += draft
        return self.inner.execute(output) + draft

    def dp_step_seconds(self, outputs: list[SchedulerOutput], num_dummy: int = 0, overlap_host: bool = False) -> float:
        """A lockstep step of data-parallel ranks, their drafting included (device time, which
        async scheduling's host overlap does not hide)."""
        draft = self.drafter.dp_seconds(outputs, num_dummy) if self.drafter is not None else 0.0
        self.draft_seconds += draft
        if overlap_host:
            return self.inner.dp_step_seconds(outputs, num_dummy, extra_s=draft, overlap_host=True)
        return self.inner.dp_step_seconds(outputs, num_dummy) + draft

    def describe(self) -> dict:
        if self.drafter is None:
            return self.inner.describe()
        return self.inner.describe() | {"drafter": self.drafter.describe()}
