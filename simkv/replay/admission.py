"""vLLM's API-server admission control (`--max-num-queued-reqs`, `--max-num-queued-tokens`):
before a request reaches the engine, vLLM 0.33's front end (AsyncLLM.check_admission) refuses it
with HTTP 503 when
- its unfinished requests (waiting and running; a request asking for n sequences counts n)
  would exceed `max_num_queued_reqs`, or
- the prompt tokens of its requests still in prefill (no token delivered yet; the whole
  prompt, whatever chunks or prefix hits it already has, as vLLM's front end counts it) have
  reached `max_num_queued_tokens`.
The replay checks each request when it is delivered (at the step boundary its arrival falls
in, when the front end's counts are the engine's); a refused request is `rejected` in
requests.parquet, unless its client retries (`--client-max-retries`: after the OpenAI client's
back-off, as after a time-out; simkv/replay/client_timeouts.py). In a fleet each replica's front
end counts its own requests; data-parallel ranks have one front end, which counts over all
ranks (`DPRouting`). A fleet's router routes a refused attempt's retry like any other
(ReplicaClientFeed._refused); data-parallel ranks whose clients retry are refused.
"""

from __future__ import annotations


class QueueLimits:
    """The front end's two limits and what they refused, by reason."""

    def __init__(self, max_num_queued_reqs: int | None, max_num_queued_tokens: int | None) -> None:
        self.max_reqs = max_num_queued_reqs
        self.max_tokens = max_num_queued_tokens
        self.rejected = {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}

    def admits(self, scheduler, num_sequences: int) -> bool:
        """Whether a request of `num_sequences` sequences gets in, given the engine's requests."""
        return self.admits_counts(lambda: len(scheduler.running) + scheduler.num_waiting(),
                                  lambda: queued_prompt_tokens(scheduler), num_sequences)

    def admits_counts(self, unfinished, queued_tokens, num_sequences: int) -> bool:
        """The same given the front end's counts (callables: only the limits set are counted):
        its unfinished sequences and the prompt tokens of those without a token yet."""
        if self.max_reqs is not None and unfinished() + num_sequences > self.max_reqs:
            self.rejected["max_num_queued_reqs"] += 1
            return False
        if self.max_tokens is not None and queued_tokens() >= self.max_tokens:
            self.rejected["max_num_queued_tokens"] += 1
            return False
        return True

    def summary(self) -> dict:
        return {"max_num_queued_reqs": self.max_reqs, "max_num_queued_tokens": self.max_tokens,
                "rejected": dict(self.rejected)}


def queued_prompt_tokens(scheduler) -> int:
    """The prompt tokens of the engine's requests that have no token yet (running or waiting)."""
    total = 0
    for queue in (scheduler.running, scheduler.waiting, scheduler.kv_holding):
        for request in queue:
            if request.first_token_step < 0:
                total += request.num_prompt_tokens
    return total


def merged_summary(limits: list[QueueLimits]) -> dict:
    """summary.json's `admission_control` over several front ends (a fleet's replicas)."""
    section = limits[0].summary()
    section["rejected"] = {k: sum(q.rejected[k] for q in limits) for k in section["rejected"]}
    return section


def queue_limits(config) -> QueueLimits | None:
    sc = config.scheduler
    if sc.max_num_queued_reqs is None and sc.max_num_queued_tokens is None:
        return None
    return QueueLimits(sc.max_num_queued_reqs, sc.max_num_queued_tokens)
