"""What one `Scheduler.schedule()` call has handed out so far."""

from __future__ import annotations

from simkv.core.outputs import ScheduledChunk
from simkv.core.request import Request


class StepPlan:
    """What one schedule() call has handed out so far."""

    __slots__ = ("budget", "threshold", "chunks", "preempted", "scheduled_now", "query", "hit", "first_new_seq",
                 "swap_out_blocks", "swap_in_blocks", "moved_ahead", "kv_loads",
                 "input_budget", "draft_slots", "prefill_scheduled", "num_running_scheduled", "blocked",
                 "defer_prefills", "prefill_carried", "encoder_budget", "encoder_inputs", "encoder_loads",
                 "encoder_saves")

    def __init__(self, budget: int, threshold: int, draft_slots: int = 0, input_budget: int | None = None) -> None:
        self.budget = budget  # (vLLM's token budget: max_num_scheduled_tokens)
        # The batch's rows (vLLM's input budget, max_num_batched_tokens): the scheduled tokens and,
        # under speculative decoding with a draft model, `draft_slots` rows per scheduled request.
        self.input_budget = budget if input_budget is None else input_budget
        self.draft_slots = draft_slots
        self.prefill_scheduled = False  # a running request continuing its prompt was scheduled
        self.num_running_scheduled = 0
        self.threshold = threshold
        self.chunks: list[ScheduledChunk] = []
        self.preempted: list[Request] = []
        self.scheduled_now: dict[int, int] = {}  # seq -> tokens scheduled this step (explicitly)
        self.query = 0
        self.hit = 0
        self.first_new_seq = -1
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0
        self.moved_ahead = False  # a victim ahead of the current request left the running list
        self.kv_loads: list[Request] = []  # P/D: requests whose KV pull this step starts
        # P/D under async scheduling: the running requests stopped at one that needs blocks
        # whose victim ran in the step in flight (core/remote_kv.py)
        self.blocked = False
        # prefill cadence (prefill_schedule_interval): this step holds prefill back; it carried some
        self.defer_prefills = False
        self.prefill_carried = False
        # multimodal models (core/encoder_cache.py): the step's encoder budget left, in embeddings
        # (set by the scheduler) and the items each request encodes in it (seq -> each item's embeddings)
        self.encoder_budget = 0
        self.encoder_inputs: dict[int, list[int]] = {}
        # encoder disaggregation (Scheduler.ec_store): the items each request loads from the store
        # (seq -> each item's embeddings) and, on an encode instance, the identifiers it stores
        self.encoder_loads: dict[int, list[int]] = {}
        self.encoder_saves: dict[int, list[int]] = {}

    def schedule(self, request: Request, num_new: int) -> None:
        self.budget -= num_new
        self.input_budget -= num_new + self.draft_slots
        self.scheduled_now[request.seq] = num_new

    def request_budget(self) -> int:
        """Tokens the next request may take: vLLM's min(token budget, input budget - draft slots)."""
        return min(self.budget, self.input_budget - self.draft_slots)

    def unschedule(self, victim: Request, implicit: bool) -> int:
        """A victim scheduled earlier in this step gives its tokens back (`implicit`: a steady
        decoder counted in bulk, one token). Returns those tokens."""
        tokens = self.scheduled_now.pop(victim.seq, None)
        if tokens is None:
            if not implicit:
                return 0
            tokens = 1
        else:  # (victims are running requests: admissions come after them)
            self.input_budget += tokens + self.draft_slots
            self.num_running_scheduled -= 1
        self.budget += tokens
        self.chunks = [c for c in self.chunks if c.request is not victim]
        encoded = self.encoder_inputs.pop(victim.seq, None)
        if encoded is not None:  # (its items are not encoded after all: vLLM gives the budget back)
            self.encoder_budget += sum(encoded)
        self.encoder_loads.pop(victim.seq, None)
        self.encoder_saves.pop(victim.seq, None)
        return tokens
