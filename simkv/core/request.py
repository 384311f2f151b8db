"""A request as the engine core sees it: token counts chasing each other, never token ids."""

from __future__ import annotations

import enum

import numpy as np


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    REJECTED = 4
    WAITING_FOR_REMOTE_KVS = 5  # P/D: blocks allocated, its prompt's KV being pulled (core/remote_kv.py)
    ABORTED = 6  # vLLM's FINISHED_ABORTED: its client went away (Scheduler.abort_request)


# P/D disaggregation roles (Request.kv_role; core/remote_kv.py)
KV_SEND = 1  # prefill side: keep the blocks after finishing until the decode side has read them
KV_PULL = 2  # decode side: pull the prompt's KV instead of computing it


class Request:
    """One request. `num_computed_tokens` chases `num_tokens` (prompt + outputs so far).

    Content is described, not materialised: position p carries the content
    (shared_hash_ids[p // hash_block_tokens], p % hash_block_tokens) while p is inside the
    hashed region; every other position is unique to this request. `num_shared_tokens` is the
    hashed part of the prompt; `num_content_tokens` >= it also counts the output positions the
    hash list reaches when it is longer than the prompt needs (a trace may describe a reply that
    a later prompt repeats: a chat's next turn). (`num_shared_tokens` may exceed
    `num_prompt_tokens` on a P/D prefill engine of a linear-attention model: its prompt lost its
    last token there, its block keys did not.)

    While the scheduler runs a request as a steady decoder it does not update
    `num_computed_tokens` every step: `decode_base` is set and the true value is
    `scheduler.current_step + decode_base`. Use `Scheduler.num_computed_tokens(req)` to read it.
    """

    __slots__ = (
        "request_id", "index", "arrival_time", "num_prompt_tokens", "max_tokens", "priority",
        "cache_salt", "shared_hash_ids", "hash_block_tokens", "num_shared_tokens", "num_content_tokens",
        "status", "num_computed_tokens", "num_output_tokens", "num_preemptions",
        "block_hashes", "seq", "decode_base", "decode_last_step", "decode_from_step", "is_finishing", "epoch",
        "window_below", "window_offset", "last_chunk_step", "last_chunk_tokens", "prev_chunk_step", "prev_chunk_tokens",
        "stall_step", "prev_stall_step", "stall_gap_from", "last_sched_step",
        "has_own_cached_blocks", "kv_role", "kv_loaded", "kv_pull_blocks",
        "spec_drafts", "spec_prefill_chunk", "prefill_chunk", "set_aside", "num_draft_tokens", "num_accepted_tokens",
        "num_output_placeholders", "num_in_flight_tokens", "num_cached_blocks", "num_stale_tokens", "next_decode_call",
        "last_token_step", "swapped_blocks", "num_samples", "parent", "forked", "group_remaining", "group_output_tokens",
        "lora_id", "class_code", "mm_items", "may_resend", "prompt_owner", "tie_rank", "members", "num_keyed_tokens",
        # metrics, filled by the scheduler (step indices) and the driver (times)
        "first_scheduled_step", "first_token_step", "finish_step", "num_prefix_hit_tokens",
        "num_total_prefix_hit_tokens", "first_scheduled_time", "first_token_time", "finish_time",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        arrival_time: float,
        num_prompt_tokens: int,
        max_tokens: int,
        priority: int = 0,
        cache_salt: str | None = None,
        shared_hash_ids: np.ndarray | None = None,
        hash_block_tokens: int = 0,
        num_samples: int = 1,
        lora_id: int = 0,
    ) -> None:
        self.request_id = request_id
        self.lora_id = lora_id  # its LoRA adapter (vLLM's lora_int_id; 0: the base model)
        # its trace row's request class, numbered (the replay's; 0 without classes): the tokens
        # it decodes count towards its class's inter-token latencies
        self.class_code = 0
        # multimodal items in its prompt, by offset: (offset, placeholder tokens = encoder
        # embeddings, mm_hash) each (core/encoder_cache.py); () for a text-only prompt
        self.mm_items: tuple[tuple[int, int, int], ...] = ()
        # its client may send the same prompt again (a retry after a time-out): its own full
        # blocks stay findable when it leaves, as vLLM's content hashes keep them
        self.may_resend = False
        self.index = index
        self.arrival_time = arrival_time
        self.num_prompt_tokens = num_prompt_tokens
        # the tokens vLLM keyed when the request arrived: its whole prompt, which stays keyed when a
        # P/D prefill engine drops the prompt's last tokens (NIXL's backoff)
        self.num_keyed_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.priority = priority
        self.cache_salt = cache_salt
        if shared_hash_ids is not None and len(shared_hash_ids) and hash_block_tokens > 0:
            self.shared_hash_ids = np.asarray(shared_hash_ids, dtype=np.int64)  # (a trace's rows are already)
            self.hash_block_tokens = hash_block_tokens
            covered = len(shared_hash_ids) * hash_block_tokens
            self.num_shared_tokens = min(covered, num_prompt_tokens)
            # A list longer than the prompt needs goes on over the reply (parallel sampling: the
            # sequences' replies differ, none is the trace's).
            describes_reply = covered >= num_prompt_tokens + hash_block_tokens and num_samples == 1
            self.num_content_tokens = min(covered, num_prompt_tokens + max_tokens) if describes_reply \
                else self.num_shared_tokens
        else:
            self.shared_hash_ids = None
            self.hash_block_tokens = 0
            self.num_shared_tokens = 0
            self.num_content_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self.seq = -1
        self.decode_base: int | None = None
        self.decode_last_step = -1  # while decoding steadily: the step after which it finishes
        self.decode_from_step = -1  # the first step of its current decoding stint
        self.is_finishing = False  # async scheduling: its last token is in flight (core/async_scheduling.py)
        self.epoch = 0
        # a steady decoder of a model with sliding-window layers that attends fewer tokens than
        # the window (its window layers' cost still grows with it: core/steady_decoders.py)
        self.window_below = False
        self.window_offset = 0  # chunked local attention: the start of its current chunk
        # async scheduling with sliding-window layers: vLLM releases a window's blocks on the
        # tokens whose step output was processed (core/async_scheduling.py): the step and size of
        # its latest scheduled chunk, and the latest step a budget left it out of
        self.last_chunk_step = -1
        self.last_chunk_tokens = 0
        self.prev_chunk_step = -1  # (the chunk before: async scheduling may have two in flight)
        self.prev_chunk_tokens = 0
        self.stall_step = -1
        self.prev_stall_step = -1  # (the stall before: async scheduling asks about the last two steps)
        # a steady decoder left out of steps by the budget: the step of its last token before
        # them (its next token's gap spans them), until it decodes again; -1 otherwise
        self.stall_gap_from = -1
        # async scheduling (core/async_scheduling.py): the latest step that ran it as a chunk
        self.last_sched_step = -1
        self.has_own_cached_blocks = False
        self.kv_role = 0  # KV_SEND / KV_PULL under P/D disaggregation
        self.kv_loaded = False  # KV_PULL: its pull has ended
        self.kv_pull_blocks = 0  # KV_PULL: blocks it pulled (those its local prefix cache lacked)
        # Speculative decoding (core/spec_decode.py): drafts proposed after its last step, not
        # yet verified; whether its latest scheduled chunk left prompt to compute; its totals.
        self.spec_drafts = 0
        self.prefill_chunk = True  # prefill cadence: its last chunk left prompt to compute (vLLM's is_prefill_chunk)
        self.set_aside = False  # prefill cadence: skipped at a step while waiting, until admitted (deferred_waiting)
        self.spec_prefill_chunk = False
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # ... under async scheduling too (vLLM's counters): tokens sampled or drafted by steps
        # scheduled but not yet processed (counted in num_computed_tokens), tokens of scheduled
        # steps not yet processed, and the full blocks whose KV vLLM has cached.
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_cached_blocks = 0
        # tokens of steps in flight when it was last preempted: their output, when it comes, is
        # delivered but changes no counter (vLLM's num_stale_output_tokens)
        self.num_stale_tokens = 0
        # pipeline parallelism under async scheduling: the schedule() call from which it may run
        # again after sampling (vLLM's next_decode_eligible_step: a call every pp_size)
        self.next_decode_call = 0
        self.last_token_step = -1
        self.swapped_blocks = 0  # blocks of KV held in CPU swap space while preempted by swapping
        # Parallel sampling: the request is fanned out into `num_samples` requests when it arrives
        # (vLLM v1), or forks into as many sequences after its prefill (v0); the extra ones point
        # at it as `parent`. The group finishes when all sequences have.
        self.num_samples = num_samples
        self.prompt_owner = index  # (fanned out: the first member, whose prompt's keys it shares and behind which it queues)
        # (fanned out: its place among its group's ids in string order, vLLM's tie-break of equal
        # priority and arrival: the children "0_id", "10_id", "11_id", "1_id", "2_id", ...)
        self.tie_rank = 0
        self.members: tuple = ()  # (fanned out, the first member: the others)
        self.parent: Request | None = None
        self.forked = False
        self.group_remaining = num_samples
        self.group_output_tokens = 0
        self.first_scheduled_step = -1
        self.first_token_step = -1
        self.finish_step = -1
        self.num_prefix_hit_tokens = 0
        self.num_total_prefix_hit_tokens = 0
        self.first_scheduled_time = float("nan")
        self.first_token_time = float("nan")
        self.finish_time = float("nan")

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}/{self.max_tokens}, status={self.status.name})")
