"""Parallel sampling's sequences: a request for n sequences made into n requests (vLLM v1's
fan-out, `fan_out`), or the extra sequences forked after its prompt (v0, `Scheduler._fork`).

The scheduler fans a request out when it is added (`Scheduler._fan_out`); under data-parallel
ranks vLLM's front end fans out first and routes each member on its own, so the replay's
balancer calls `fan_out` itself (simkv/replay/data_parallel.py).
"""

from __future__ import annotations

from simkv.core.request import Request

FIRST_SEQUENCE_INDEX = 1 << 40  # a sequence's request index: beyond any trace row


def sequence_of(root: Request, k: int, index: int) -> Request:
    """Sequence `k` of parallel-sampling request `root`, a request of its own numbered `index`,
    whose reply is not the trace's."""
    child = Request(f"{root.request_id}#{k}", index, root.arrival_time, root.num_prompt_tokens, root.max_tokens,
                    root.priority, root.cache_salt, root.shared_hash_ids, root.hash_block_tokens, lora_id=root.lora_id)
    child.parent = root
    child.class_code = root.class_code
    child.mm_items = root.mm_items  # (the prompt's images: fanned out, each member encodes or finds them)
    child.num_content_tokens = child.num_shared_tokens
    return child


def fan_out(root: Request, first_index: int) -> tuple[Request, ...]:
    """Make `root`, a request for n sequences, the first of n requests that sample one each, and
    return the other n - 1 (numbered from `first_index`), to be added after it in order. They
    share its prompt through the prefix cache (keyed by `prompt_owner`: every full block is
    findable once scheduled, as every prompt's is in vLLM) and its arrival time, as vLLM's front
    end gives its children the parent's; equal priority and arrival then order them by request
    id, a string (`tie_rank`). `root` stands for the group: it completes with its last member
    (`Scheduler._finish`)."""
    n = root.group_remaining
    root.num_samples = 1  # (it samples one sequence: no fork after its prompt)
    root.num_shared_tokens = root.num_prompt_tokens  # (its prompt's blocks are its siblings' too)
    # (vLLM names the members "0_id", "1_id", ... and ties sort by id: "10_id" < "1_id")
    rank = {k: r for r, k in enumerate(sorted(range(n), key=lambda k: f"{k}_"))}
    members = []
    for k in range(1, n):
        child = sequence_of(root, k, first_index + k - 1)
        child.prompt_owner = root.index
        child.tie_rank = rank[k]
        child.num_shared_tokens = root.num_prompt_tokens
        child.may_resend = root.may_resend
        members.append(child)
    root.members = tuple(members)
    return root.members
