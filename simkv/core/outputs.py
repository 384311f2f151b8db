"""What the scheduler hands a backend: the contract between engine core and execution."""

from __future__ import annotations

from dataclasses import dataclass, field

from simkv.core.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """A prefill chunk: `num_new_tokens` tokens after `num_computed_tokens` cached ones.

    Covers new requests, resumed (recomputing) requests and continuing chunked prefills.
    `block_ids` is the request's whole block table after this step's allocation.
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    is_resumed: bool = False
    block_ids: list[int] | None = None
    num_spec_tokens: int = 0  # speculative decoding: draft tokens among the new ones, to verify
    spec_placeholder: bool = False  # ... padding rows (vLLM's -1 drafts): none is accepted
    samples: bool = False  # ... under async scheduling: the chunk ends at the request's end (it samples)


@dataclass(slots=True)
class ScheduledDecode:
    """One decode token (detail mode only): the request has `num_computed_tokens` cached."""

    request: Request
    num_computed_tokens: int
    block_ids: list[int] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step. Decodes are summarised (count and attended context); the
    per-request list is filled only when the scheduler runs in detail mode."""

    step: int
    chunks: list[ScheduledChunk]
    num_decode_reqs: int
    # sum over decodes of tokens attended (cached + the new one); with sliding-window layers,
    # summed over the layers too (layer-tokens: a window layer attends at most its window)
    decode_context_tokens: int
    decodes: list[ScheduledDecode] | None
    preempted: list[Request]
    num_running: int
    num_waiting: int
    num_blocks_used: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_swapped: int = 0  # requests whose KV sits in CPU swap space after this step's scheduling
    num_swap_out_blocks: int = 0
    num_swap_in_blocks: int = 0
    finished: list[Request] = field(default_factory=list)
    # detail mode: the requests aborted since the previous step (vLLM's finished_req_ids carries
    # them to the model runner, which drops their rows of the persistent batch)
    aborted: list[Request] | None = None
    num_blocks_used_end: int = -1  # after update_from_output (finished requests released)
    kv_loads: list[Request] | None = None  # P/D: requests admitted to pull their KV (the step starts the pulls)
    offload_jobs: list | None = None  # KV offloading: the transfers this step starts (core/kv_offload.py)
    # Speculative decoding: decodes are chunks of 1 + drafts tokens (they verify the drafts).
    num_verify_tokens: int = 0  # tokens of those chunks
    num_draft_tokens: int = 0  # drafts among them
    num_accepted_tokens: int = 0  # after update_from_output: drafts accepted
    # after update_from_output: decodes whose tokens follow the previous step's (pipeline
    # parallelism: every decode that sampled)
    num_spec_emissions: int = 0
    # request classes (Scheduler.track_classes): num_decode_reqs and num_spec_emissions per class
    decodes_by_class: list[int] | None = None
    spec_emissions_by_class: list[int] | None = None
    # drafts each request sampling in this step gets for its next one (vLLM's name): K, or under
    # dynamic speculation the K of the step's number of requests
    num_spec_tokens_to_schedule: int = 0
    # set by the replay: preemptions made by schedule() calls that ran nothing since the previous
    # step (a request that preempted itself); the step log counts them on this step
    earlier_preemptions: int = 0
    # LoRA (--enable-lora): the step's tokens of requests with an adapter, and their distinct adapters
    num_lora_tokens: int = 0
    num_active_loras: int = 0
    # DeepSeek sparse attention: sum over decodes of min(tokens attended, top-k), the tokens their
    # queries attend (decode_context_tokens: the tokens their indexer scores)
    decode_capped_context_tokens: int = 0
    lora_adapters: tuple[int, ...] = ()  # those adapters' ids, ascending
    # set by the replay: seconds the worker spends loading them (simkv/backends/lora_adapters.py)
    lora_load_s: float = 0.0
    # multimodal models (core/encoder_cache.py): the embeddings of each item the encoder computes
    # in this step, in scheduling order
    encoder_item_embeds: tuple[int, ...] = ()
    # encoder disaggregation: the embeddings of each item loaded from the store in this step
    encoder_loaded_embeds: tuple[int, ...] = ()
    # what kept the requests still waiting after this step was scheduled: an ADMISSION_LIMITS
    # code (core/admission_limits.py; 0 when none waits)
    admission_limit: int = 0

    @property
    def num_encoder_embeds(self) -> int:
        return sum(self.encoder_item_embeds)

    @property
    def num_decode_tokens(self) -> int:
        """Token gaps this step closes (the inter-token-latency weight): one per decoding
        request, and under speculative decoding one per verifying request, however many tokens
        it kept."""
        return self.num_decode_reqs + self.num_spec_emissions

    @property
    def num_chunk_tokens(self) -> int:
        chunks = self.chunks
        if len(chunks) == 1:
            return chunks[0].num_new_tokens
        return sum(c.num_new_tokens for c in chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_chunk_tokens - self.num_verify_tokens

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_chunk_tokens + self.num_decode_reqs

    @property
    def is_empty(self) -> bool:
        return not self.chunks and self.num_decode_reqs == 0


@dataclass(slots=True)
class DecodeRun:
    """`num_steps` consecutive pure-decode steps in which the same `num_decodes` requests
    each decode one token. Step j attends `first_context_tokens + j * context_per_step` tokens
    (`num_decodes` per step; layer-tokens with sliding-window layers: SchedulerOutput's unit).
    Nothing else happens in them except block-boundary allocations (and, with sliding-window
    layers, window releases): `allocation_counts` has each step's net change of blocks in use;
    after the last step, the requests in `finished` finish."""

    start_step: int
    num_steps: int
    num_decodes: int
    first_context_tokens: int
    num_running: int
    num_waiting: int
    first_num_blocks_used: int
    allocation_counts: list[int]
    finished: list[Request]
    last_num_blocks_used_end: int = -1
    num_swapped: int = 0  # after the run's finished requests released their blocks
    earlier_preemptions: int = 0  # as SchedulerOutput's, counted on the run's first step
    context_per_step: int = -1  # (-1: num_decodes)
    admission_limit: int = 0  # what keeps the waiting requests waiting in every step of the run (as SchedulerOutput's)
    decodes_by_class: list[int] | None = None  # request classes (Scheduler.track_classes): num_decodes per class

    def __post_init__(self) -> None:
        if self.context_per_step < 0:
            self.context_per_step = self.num_decodes
