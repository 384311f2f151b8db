"""What kept a step's waiting requests waiting: the limit that ended its admissions.

vLLM's scheduler admits from the waiting queue, after the running requests, until the first
limit stops it; simkv records that limit for every step that left requests waiting, so that a
replay says which knob holds its queue back (steps.parquet's `admission_limit`, summary.json's
`admission_limits`). No clock here: the engine core's own vocabulary.
"""

from __future__ import annotations

# (index = the code the scheduler records; the names are the knobs or events that bind)
ADMISSION_LIMITS = (
    "none",                         # nothing waits after the step was scheduled
    "kv_cache",                     # the head's blocks do not fit (free blocks, watermark, the whole prompt's reserve)
    "max_num_seqs",                 # running requests at max_num_seqs (or max_num_active_seqs)
    "max_num_batched_tokens",       # the step's token budget is spent, or the head's next chunk does not fit it
    "preemption",                   # the step preempted: vLLM admits nothing in such a step
    "prefill_schedule_interval",    # a step that carries no prefill (the cadence, or data-parallel ranks' waves)
    "max_loras",                    # every waiting request's adapter lacks a slot
    "encoder",                      # an image does not fit the encoder's budget or cache
    "kv_transfer",                  # KV still on its way: P/D pulls, CPU-tier lookups and loads
    "pipeline",                     # a preempted request's output still in a pipeline stage
    "max_num_admissions_per_step",  # simkv's policy knob beyond vLLM
    "finishing",                    # async scheduling: only requests preempted with their last token in flight
)
(NONE, KV_CACHE, MAX_NUM_SEQS, TOKEN_BUDGET, PREEMPTION, PREFILL_CADENCE, MAX_LORAS, ENCODER, KV_TRANSFER,
 PIPELINE, ADMISSION_CAP, FINISHING) = range(len(ADMISSION_LIMITS))
