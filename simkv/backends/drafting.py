"""The drafter's share of a step under speculative decoding, added to any cost model's.

After the target model's forward pass, the drafter proposes K tokens (under dynamic speculation,
the K of the step's number of requests) for every request that sampled in the step:
- ngram: prompt lookup on the host, `spec_ngram_us_per_request` per such request;
- EAGLE family and draft models: K forward passes of the draft network (one target-shaped
  decoder layer and the LM head for the EAGLE family, `spec_draft_model`'s spec for a draft
  model). The first pass runs over every token of the step (the drafter keeps its own KV of the
  whole sequence), the K - 1 others over one token per sampling request. Each pass is timed
  by the roofline (simkv/backends/roofline.py) on the replay's GPU, plus
  `spec_draft_pass_overhead_ms`.
The drafts' own logits in the target's verification pass are not counted (2 * hidden * vocab
FLOPs per draft, a few per cent of a token's).
"""

from __future__ import annotations

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
        self.per_request_s = spec.spec_ngram_us_per_request * 1e-6
        self.network = None
        if self.method != "ngram":
            draft = spec.draft_spec(get_model_spec(hw.model))
            self.network = RooflineCostModel(draft, get_gpu_spec(hw.gpu), hw.tensor_parallel_size,
                                             config.cache.kv_dtype_bytes,
                                             step_overhead_s=spec.spec_draft_pass_overhead_ms * 1e-3,
                                             seq_overhead_s=0.0, num_speculative_tokens=self.k)

    def seconds(self, output: SchedulerOutput) -> float:
        sampling = context = 0
        for chunk in output.chunks:
            end = chunk.num_computed_tokens + chunk.num_new_tokens
            if end >= chunk.request.num_tokens:
                sampling += 1
                context += end
        k = output.num_spec_tokens_to_schedule  # (the scheduler's K for this step)
        if not sampling or not k:
            return 0.0  # (vLLM skips drafting when no request can use the drafts)
        if self.network is None:
            return sampling * self.per_request_s
        net = self.network
        if net.mla:
            tokens, pairs, latent_pairs, kv_read, upproj = net.mla_chunk_work(output.chunks)
            first = net._time(tokens + output.num_decode_reqs, sampling, pairs, kv_read, max, latent_pairs, upproj)
        else:
            tokens, pairs, kv_read = prefill_work(output)
            first = net._time(tokens + output.num_decode_reqs, sampling, pairs, kv_read, max)
        return first + (k - 1) * net.decode_pass_seconds(sampling, context)

    def describe(self) -> dict:
        out = {"method": self.method, "num_speculative_tokens": self.k}
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

    def execute(self, output: SchedulerOutput) -> float:
        if self.drafter is None:
            return self.inner.execute(output)
        draft = self.drafter.seconds(output)
        self.draft_seconds += draft
        return self.inner.execute(output) + draft

    def describe(self) -> dict:
        if self.drafter is None:
            return self.inner.describe()
        return self.inner.describe() | {"drafter": self.drafter.describe()}
