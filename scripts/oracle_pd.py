"""P/D disaggregation in the engine core, step by step against the real vLLM scheduler.

vLLM 0.33's `Scheduler` (../shared/tools/vllm_oracle's venv) is given a KV connector of this
file's own (`FakePDConnector`) that behaves, towards the scheduler, as the NIXL connector does
in pull mode: a "pull" request (decode side) gets its whole prompt's KV from outside,
asynchronously; a "send" request (prefill side) keeps its blocks after finishing until told
they were read. simkv's `Scheduler` runs the same random cases (mixing plain, send and pull
requests in one engine, small pools, shared prompt content, priorities, watermarks; with
`--speculative`, speculative decoding in 60 % of the cases, as scripts/oracle_spec.py plays it;
with `--hybrid`, the KV-cache groups of models with sliding-window layers, as
scripts/oracle_hybrid.py forms them, with a connector that supports vLLM's hybrid manager as
NIXL does, and ngram as the speculative method; with `--linear`, oracle_linear.py's models with
linear-attention layers, the connector backing off the prompt's last token as NIXL does for
Mamba layers, drafts ngram or MTP; with `--suffix`, suffix decoding in every case, proposals of
drawn lengths, as oracle_linear.py draws it; with `--ngram-misses`, ngram drafts found at a rate
of 0, 0.3 or 0.7). Each
pull's read ends in the output of the step `latency - 1` after the one that admitted it, and
each send is released `latency` steps after its finish, on both sides. Every step's scheduled
tokens, running and waiting requests and blocks in use, and every request's first-token and
finish step, must be equal.

--images (with any of the above but --replies): every case's prompts redrawn with image items as
oracle_spec.py --images draws them, vLLM's encoder budget and cache (a pull whose prompt ends
with an image encodes it again: the decode side computes the prompt's last token itself).

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_pd.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 50 [--speculative]
    .venv/bin/python scripts/oracle_pd.py --hybrid --cases 150 --seed 1
    .venv/bin/python scripts/oracle_pd.py --linear --cases 100 --seed 4 [--speculative] [--async-scheduling]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAIN, SEND, PULL = 0, 1, 2


# ---- cases ------------------------------------------------------------------------------------
def make_case(rng, speculative: bool = False, hybrid: bool = False, async_scheduling: bool = False,
              linear: bool = False, align: bool = False, replies: bool = False, chunked: bool = False,
              drafter: str | None = None) -> dict:
    """`drafter`: "suffix" (--suffix) or "ngram_misses" (--ngram-misses) drafts in every case."""
    case = _make_case(rng, speculative, hybrid or chunked, async_scheduling, linear, align, chunked, drafter)
    if replies:  # (chat sessions whose next turns repeat the replies; plain and pulled, after the other draws)
        import oracle_vllm

        case["requests"] = oracle_vllm.reply_sessions(rng, case["opts"]["max_model_len"])
        for r in case["requests"]:
            r["role"] = int(rng.choice([PLAIN, PULL, PULL]))
            r["latency"] = int(rng.integers(1, 6))
        case["replies"] = True
        oracle_vllm.after_previous_turns(case, run_simkv)
    return case


def _make_case(rng, speculative: bool, hybrid: bool, async_scheduling: bool, linear: bool, align: bool,
               chunked: bool = False, drafter: str | None = None) -> dict:
    block_size = int(rng.choice([16, 32] if linear else [4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    n = int(rng.integers(3, 50))
    requests = []
    prefixes = [[int(x) for x in rng.integers(0, 4, 40)] for _ in range(3)] if rng.random() < 0.6 else None
    for i in range(n):
        role = int(rng.choice([PLAIN, SEND, PULL, PULL]))
        prompt = int(rng.integers(1, max_model_len))
        r = {"row": i, "arrival_step": int(rng.integers(0, 40)), "prompt": prompt,
             "output": 1 if role == SEND else int(rng.integers(1, 40)), "role": role,
             "latency": int(rng.integers(1, 6)), "priority": int(rng.integers(0, 3))}
        if prefixes is not None:
            r["block_hashes"] = prefixes[int(rng.integers(0, 3))][:-(-prompt // 8)]
        requests.append(r)
    requests.sort(key=lambda r: (r["arrival_step"], r["row"]))
    from oracle_fuzz import random_engine_options  # (simkv's side only: it imports simkv)

    opts = random_engine_options(rng, block_size, max_model_len)
    opts["reserve_full_isl"] = bool(rng.random() < 0.7)
    if drafter is not None:  # (every case: suffix decoding as oracle_linear.py draws it, or ngram's misses)
        from oracle_linear import ngram_miss_options, suffix_options

        (suffix_options if drafter == "suffix" else ngram_miss_options)(rng, opts)
    elif speculative and rng.random() < 0.6:  # speculative decoding on the engine (as oracle_spec.py's)
        from oracle_vllm import random_spec_options

        random_spec_options(rng, opts)
        if hybrid and opts["speculative_method"] == "draft_model":  # (refused with sliding windows)
            opts["speculative_method"] = "eagle"
            opts.pop("spec_draft_model", None)
        if async_scheduling and opts["speculative_method"] == "ngram":  # (vLLM refuses it under async)
            opts["speculative_method"] = "eagle"
    if async_scheduling:
        opts["async_scheduling"] = True
    if linear:
        return _linear_case(rng, opts, requests, speculative, async_scheduling, align, drafter is not None)
    if not hybrid:
        return {"opts": opts, "requests": requests}
    # sliding-window layers (oracle_hybrid.py's layer patterns): vLLM's hybrid manager with NIXL (HMA)
    from simkv.capacity import group_blocks_per_request
    from simkv.config import EngineConfig

    opts["model"] = str(rng.choice(["tiny-llama", "llama-3-8b", "gemma-2-9b"]))
    opts["sliding_window"] = int(rng.choice([2, 3, 5, 8, 16, 17, 33, 40]))
    opts["full_attention_interval"] = int(rng.choice([2, 3, 6]))
    retention = rng.choice(["zero", "zero", "dense", "periodic"])
    opts["prefix_cache_retention_interval"] = (None if retention == "dense" else
                                               block_size * int(rng.integers(1, 9)) if retention == "periodic" else 0)
    if chunked:  # (chunked local attention, Llama 4's: --chunked)
        opts["attention_chunk_size"] = int(opts.pop("sliding_window"))
        opts["full_attention_interval"] = 2 if opts["model"] == "tiny-llama" else int(rng.choice([2, 3, 6]))
        opts["prefix_cache_retention_interval"] = 0
    flat = dict(opts, scheduler_reserve_full_isl=opts["reserve_full_isl"])
    flat.pop("reserve_full_isl")
    config = EngineConfig.from_flat(flat)
    fits = group_blocks_per_request(config, max_model_len, startup=True) + 1
    opts["num_gpu_blocks"] = max(opts["num_gpu_blocks"], fits) + int(rng.integers(0, 60))
    return {"opts": opts, "requests": requests, "group_windows": list(config.kv_cache_groups.windows),
            "group_chunked": config.kv_cache_groups.chunked}


def _linear_case(rng, opts: dict, requests: list, speculative: bool, async_scheduling: bool, align: bool,
                 drafter_given: bool = False) -> dict:
    """oracle_linear.py's models (Mamba groups beside a full-attention group) and, with `align`,
    its prefix-caching options; drafts are ngram or MTP (MTP alone under async scheduling), or
    the drafter `make_case` was given."""
    from oracle_linear import MODELS, prefix_caching_options
    from simkv.capacity import group_blocks_per_request

    opts["model"] = str(rng.choice(MODELS))
    prefix_caching_options(rng, opts, align)
    if opts.get("speculative_method") and not drafter_given:  # (ngram or MTP; MTP alone under async scheduling)
        opts["speculative_method"] = "mtp" if async_scheduling else str(rng.choice(["ngram", "mtp"]))
        opts.pop("spec_draft_model", None)
    flat = dict(opts, scheduler_reserve_full_isl=opts["reserve_full_isl"])
    flat.pop("reserve_full_isl")
    config = linear_config(opts, flat, async_scheduling)
    fits = group_blocks_per_request(config, opts["max_model_len"], startup=True) + 1
    opts["num_gpu_blocks"] = fits + int(rng.integers(0, 40))
    opts["block_size"] = config.cache.block_size
    groups = config.kv_cache_groups
    case = {"opts": opts, "requests": requests, "group_windows": list(groups.windows),
            "group_linear": [g.linear for g in groups.groups]}
    if align:
        case |= {"mamba_cache_mode": "align", "mamba_prefill_checkpoints": config.mamba_prefill_checkpoints}
    return case


def linear_config(opts: dict, flat: dict, async_scheduling: bool):
    """simkv's EngineConfig of a linear-attention case (`flat`: the options as EngineConfig
    reads them); an MTP layer that splits the attention layers in two groups is refused, and
    the case then drafts with ngram, or without drafts under async scheduling (both dicts change)."""
    from simkv.config import ConfigError, EngineConfig

    try:
        return EngineConfig.from_flat(flat)
    except ConfigError:
        if opts.get("speculative_method") != "mtp":
            raise
    if async_scheduling:
        for key in [k for k in opts if k.startswith(("spec", "num_speculative"))]:
            opts.pop(key)
            flat.pop(key, None)
    else:
        opts["speculative_method"] = flat["speculative_method"] = "ngram"
    return EngineConfig.from_flat(flat)


def _step_loop(requests, schedule_step, max_steps: int = 5000) -> dict:
    """The shared driver: arrivals by step, then `schedule_step(k, arrived)` until all is done."""
    pending = list(requests)
    rows = []
    for k in range(max_steps):
        arrived = []
        while pending and pending[0]["arrival_step"] <= k:
            arrived.append(pending.pop(0))
        row, done = schedule_step(k, arrived)
        rows.append(row)
        if done and not pending:
            return {"steps": rows}
    return {"steps": rows, "error": "max steps"}


# ---- vLLM side (runs in the oracle's venv) --------------------------------------------------------
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    class FakePDConnector(KVConnectorBase_V1, SupportsHMA):
        """Towards the scheduler, NIXL's pull mode: "pull" requests load their whole prompt
        asynchronously; "send" requests delay freeing their blocks. It supports the hybrid
        manager (HMA) as NIXL does: a send holds the blocks of every group. With Mamba layers
        (multi-module MTP: K - 1 tokens), as NIXL's _prefill_backoff: a send drops its prompt's
        last token when it arrives, a pull loads the prompt less that token (the decode side
        computes it); and like NIXL it lets
        a pull's local hit be the full-attention group's (supports_divergent_local_hybrid_hits)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            # (NIXL's _prefill_backoff: Mamba's one token, multi-module MTP's lookahead less one)
            self.backoff = max(int(kv_cache_config is not None and kv_cache_config.has_mamba_layers),
                               vllm_config.num_prefill_lookahead_tokens - 1)

        @property
        def supports_divergent_local_hybrid_hits(self) -> bool:
            return True

        def on_new_request(self, request):
            params = request.kv_transfer_params or {}
            b = self.backoff
            if b and params.get("send") and not params.get("truncated") and request.num_prompt_tokens > b:
                del request.prompt_token_ids[-b:]
                del request._all_token_ids[-b:]
                request.num_prompt_tokens -= b
                request.max_tokens = 1
                params["truncated"] = True

        def request_finished_all_groups(self, request, block_ids):
            return _holds_for_sending(request) and any(len(ids) > 0 for ids in block_ids), None

        admitted: list = []

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            params = request.kv_transfer_params or {}
            if params.get("pull"):
                n, b = len(request.prompt_token_ids), self.backoff
                count = (n - b if b and n > b else n) - num_computed_tokens
                if count > 0:
                    return count, True
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            params = request.kv_transfer_params or {}
            if params.get("pull"):
                if num_external_tokens > 0:
                    FakePDConnector.admitted.append(request.request_id)
                params["pull"] = False  # one transfer per request

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished(self, request, block_ids):
            return _holds_for_sending(request) and len(block_ids) > 0, None

        # worker side: unused
        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

    def _holds_for_sending(request) -> bool:
        """As NIXL: a send that finished (not one aborted: its blocks go at once) keeps its blocks."""
        from vllm.v1.request import RequestStatus

        return bool((request.kv_transfer_params or {}).get("send")) and request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
except ImportError:  # simkv's venv
    pass


def _by_row(ids):
    """Transfers ending in the same step, in row order: vLLM iterates the sets it is given, and a
    set of strings iterates in an order that changes with PYTHONHASHSEED (the order in which
    finished sends free their blocks decides which blocks later requests hit)."""
    return None if ids is None else dict.fromkeys(sorted(ids, key=int))


class _VllmPD:
    """vLLM's scheduler for a case with the fake connector (kv_both, as NIXL runs on both pools),
    and what both drivers note about it: the transfers due in each step's (or batch's) output,
    and each request's first-token and finish step."""

    def __init__(self, case: dict, async_scheduling: bool) -> None:
        import oracle_vllm
        from vllm.config import KVTransferConfig

        o = case["opts"] | {key: case.get(key) for key in (  # (--hybrid and --linear cases have groups)
            "group_windows", "group_chunked", "group_linear", "mamba_cache_mode", "mamba_prefill_checkpoints")}
        connector = KVTransferConfig(kv_connector="FakePDConnector", kv_role="kv_both",
                                     kv_connector_module_path="oracle_pd")
        self.sched, vllm_config = oracle_vllm.build_scheduler(o, o["reserve_full_isl"], connector,
                                                              async_scheduling=async_scheduling)
        oracle_vllm.mm_budget(self.sched, vllm_config, case.get("mm"))  # (--images)
        if case.get("replies"):  # (the fake model samples the replies' content: --replies)
            oracle_vllm.sample_reply_content(case)
        import oracle_pd  # the connector's class as the scheduler loaded it
        self.admitted = oracle_pd.FakePDConnector.admitted  # pulls each schedule() admits
        self.admitted.clear()
        self.block_hasher = oracle_vllm.block_hasher(vllm_config, o["block_size"])
        self.accept = oracle_vllm.acceptance(o)  # (None without drafts)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.info = {r["row"]: r for r in case["requests"]}
        self.first_token, self.finish = {}, {}
        self.due_recv: dict[int, set] = {}
        self.due_send: dict[int, set] = {}

    def make(self, r: dict):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        import oracle
        import oracle_vllm
        tr = {"prompt_tokens": r["prompt"], "prefix_group": None, "row": r["row"],
              "block_hashes": r.get("block_hashes"), "hash_block_tokens": 8}
        ids = oracle.make_prompt_ids(tr, 0, 0, {})
        params = {"pull": True} if r["role"] == PULL else {"send": True} if r["role"] == SEND else None
        sp = SamplingParams(max_tokens=r["output"], ignore_eos=True, temperature=0.0)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": params}
        req = Request(request_id=str(r["row"]), prompt_token_ids=ids, sampling_params=sp, pooling_params=None,
                      arrival_time=r["arrival_step"] + r["row"] * 1e-9, priority=r["priority"],
                      block_hasher=self.block_hasher, mm_features=oracle_vllm.mm_features(r))
        req.kv_transfer_params = params
        return req

    def note_pulls(self, k: int) -> None:
        """The pulls step (or batch) `k` admitted end in the output of k + latency - 1."""
        for rid in self.admitted:
            self.due_recv.setdefault(k + self.info[int(rid)]["latency"] - 1, set()).add(rid)
        self.admitted.clear()

    def row(self, so) -> list[int]:
        n_running, n_waiting = self.sched.get_request_counts()
        used = self.pool.num_gpu_blocks - 1 - self.pool.get_num_free_blocks()
        return [so.total_num_scheduled_tokens, n_running, n_waiting, used]

    def process(self, so, sampled, k: int, step) -> None:
        """Step (or batch) `k`'s output: its sampled tokens and the transfers that ended in it; a
        request's first token and finish are noted at `step`, and a finished send is released in
        the output of k + latency."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        connector = KVConnectorOutput(finished_recving=_by_row(self.due_recv.pop(k, None)),
                                      finished_sending=_by_row(self.due_send.pop(k, None)))
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=connector)
        for eco in self.sched.update_from_output(so, mro).values():
            for out in eco.outputs:
                rid = out.request_id
                if out.new_token_ids and rid not in self.first_token:
                    self.first_token[rid] = step
                if out.finish_reason is not None:
                    self.finish[rid] = step
                    if self.info[int(rid)]["role"] == SEND:
                        self.due_send.setdefault(k + self.info[int(rid)]["latency"], set()).add(rid)

    def requests(self) -> dict:
        return {rid: [self.first_token.get(rid, -1), self.finish.get(rid, -1)] for rid in map(str, self.info)}


def run_vllm(case: dict) -> dict:
    import oracle_vllm
    pd = _VllmPD(case, async_scheduling=False)
    sched = pd.sched

    aborts = case.get("aborts", [])

    def step(k, arrived):
        for r in arrived:
            sched.add_request(pd.make(r))
        oracle_vllm.take_aborts(sched, aborts, k, "before")
        so = sched.schedule()
        if os.environ.get("ORACLE_PD_DEBUG"):
            print(k, dict(so.num_scheduled_tokens), list(pd.admitted), file=sys.stderr)
        pd.note_pulls(k)
        row = pd.row(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled, _ = oracle_vllm.sampled_tokens(sched, so, req_ids, pd.accept)
        oracle_vllm.take_aborts(sched, aborts, k, "output")
        pd.process(so, sampled, k, k)
        if pd.accept is not None:  # (an ngram miss proposes none, a suffix proposal its drawn length)
            oracle_vllm.propose_drafts(sched, so, req_ids, pd.accept)
        return row, not sched.has_requests() and not pd.due_send

    result = _step_loop(case["requests"], step)
    result["requests"] = pd.requests()
    return result


def run_vllm_async(case: dict) -> dict:
    """vLLM's AsyncScheduler with the connector, driven as EngineCore.step_with_batch_queue drives
    it, two batches deep: every call schedules a batch while the scheduler has requests (vLLM's
    has_requests: unfinished ones, finished ones not yet reported, ones held for sending), empty
    batches included (they carry the connector's output), and processes the oldest batch when
    the queue is full or nothing more can be scheduled. A pull admitted by batch b ends in the
    output of batch b + latency - 1; a send finished in the output of batch b is released in
    that of b + latency. Rows are the batches that ran tokens (and idle steps); a request's
    first-token and finish steps are the rows of the batches whose outputs gave them."""
    from collections import deque

    import oracle_vllm
    pd = _VllmPD(case, async_scheduling=True)
    sched = pd.sched
    pending = sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))
    rows, queue = [], deque()
    accepted = [0]
    num_batches = 0
    error = None
    aborts = case.get("aborts", [])
    while True:
        if len(rows) >= 5000 or num_batches >= 20000:  # (drive_pd_async's limits)
            error = "max steps"
            break
        while pending and pending[0]["arrival_step"] <= len(rows):
            sched.add_request(pd.make(pending.pop(0)))
        oracle_vllm.take_aborts(sched, aborts, len(rows), "before")
        if sched.has_requests():
            running_before = {r.request_id for r in sched.running}
            so = sched.schedule()
            b = num_batches
            num_batches += 1
            if os.environ.get("ORACLE_PD_DEBUG"):
                print(b, dict(so.num_scheduled_tokens), list(pd.admitted), file=sys.stderr)
            pd.note_pulls(b)
            ran = so.total_num_scheduled_tokens > 0
            row = None
            if ran:
                rows.append(pd.row(so))
                row = len(rows) - 1
            queue.appendleft((b, row, so, oracle_vllm.async_step_meta(sched, so, running_before)))
            if len(queue) < 2 and (ran or sched.has_requests()):
                continue
        elif not queue:
            if not pending:
                break
            rows.append([0, 0, 0, 0])  # idle
            continue
        b, row, so, meta = queue.pop()
        if row is not None:
            oracle_vllm.take_aborts(sched, aborts, row, "output")
        sampled, n_acc = oracle_vllm.async_sampled(sched, so, meta, pd.accept)
        accepted[0] += n_acc
        pd.process(so, sampled, b, row)
    result = {"steps": rows, "accepted": accepted[0], "requests": pd.requests()}
    if error:
        result["error"] = error
    return result


def run_vllm_any(case: dict) -> dict:
    return run_vllm_async(case) if case["opts"].get("async_scheduling") else run_vllm(case)


# ---- simkv side -----------------------------------------------------------------------------------
def run_simkv(case: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.core.helpers import drive_pd, drive_pd_async

    result = drive_pd_async(case) if case["opts"].get("async_scheduling") else drive_pd(case)
    sched = result.pop("scheduler")
    if case["opts"].get("async_scheduling"):
        result["accepted"] = sched.spec_stats["num_accepted_tokens"] if sched.num_spec_tokens else 0
    return result


def _trim(rows: list) -> list:
    """Without the trailing idle steps (vLLM's engine steps once more to report finished requests)."""
    end = len(rows)
    while end and not any(rows[end - 1]):
        end -= 1
    return rows[:end]


def differences(theirs: dict, ours: dict) -> list[str]:
    out = []
    # (simkv stops a livelock it detects, vLLM's run goes on to its max steps: equal up to there)
    livelock = ours.get("error") == "livelock" and theirs.get("error") == "max steps"
    if theirs.get("error") != ours.get("error") and not livelock:
        out.append(f"vLLM {theirs.get('error')}, simkv {ours.get('error')}")
    a, b = _trim(theirs["steps"]), _trim(ours["steps"])
    if livelock:
        a = a[:len(b)]
    bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if bad or len(a) != len(b):
        i = bad[0] if bad else min(len(a), len(b))
        out.append(f"steps differ from step {i} (of {len(a)} / {len(b)}): "
                   f"vLLM {a[i] if i < len(a) else None}, simkv {b[i] if i < len(b) else None}")
    # (both stuck at the same step: a request that arrived after simkv's driver stopped has no
    # first token in vLLM's run either)
    stuck = ours.get("error") == "stuck" == theirs.get("error")
    for rid, v in theirs["requests"].items():
        unseen = rid not in ours["requests"] and (livelock or (stuck and v == [-1, -1]))
        if ours["requests"].get(rid) != v and not unseen:
            out.append(f"request {rid}: vLLM first token/finish step {v}, simkv {ours['requests'].get(rid)}")
            break
    if theirs.get("accepted", 0) != ours.get("accepted", 0) and not livelock:
        out.append(f"accepted drafts: vLLM {theirs.get('accepted')}, simkv {ours.get('accepted')}")
    return out


def main() -> None:
    import oracle_vllm

    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], speculative_flag=True, hybrid_flag=True, async_flag=True,
                                linear_flag=True, align_flag=True, replies_flag=True, aborts_flag=True,
                                chunked_flag=True, dflash_flag=True, mtp_modules_flag=True, ngram_misses_flag=True,
                                images_flag=True)
    if oracle_vllm.serve_vllm_side(a, run_vllm_any):
        return
    if a.aborts and a.replies:  # (a turn given up on has no reply for its next turn to repeat)
        sys.exit("--aborts with --replies: an aborted turn's conversation ends (oracle_fuzz.py --timeouts --replies)")
    import numpy as np
    rng = np.random.default_rng(a.seed)
    if (a.suffix or a.ngram_misses) and a.async_scheduling:
        sys.exit("--suffix, --ngram-misses: vLLM refuses host-proposed drafts under async scheduling")
    drafter = "suffix" if a.suffix else "ngram_misses" if a.ngram_misses else None
    cases = [make_case(rng, a.speculative, a.hybrid, a.async_scheduling, a.linear, a.align, a.replies, a.chunked,
                       drafter) for _ in range(a.cases)]
    if a.dflash and (a.hybrid or a.linear or a.chunked):
        sys.exit("--dflash: dflash is modelled with standard-attention targets")
    if a.images and a.replies:
        sys.exit("--images with --replies: not drawn (the images redraw every prompt)")
    from oracle_spec import image_cases, method_cases

    method_cases(a, cases)  # (--method: with --speculative)
    oracle_vllm.option_cases(a, cases)
    image_cases(a, cases)  # (--images: after the options, whose token budget sizes the items)
    if a.aborts:  # (a front end aborts some requests, on either side: clients that gave up)
        for case in cases:
            case["aborts"] = oracle_vllm.random_aborts(rng, case["requests"])
    theirs = oracle_vllm.vllm_results(__file__, cases, a)
    failures = 0
    totals = dict(requests=0, pulls=0, sends=0, steps=0, aborted=0)
    for i, (case, t) in enumerate(zip(cases, theirs)):
        ours = run_simkv(case)
        totals["requests"] += len(case["requests"])
        totals["pulls"] += sum(r["role"] == PULL for r in case["requests"])
        totals["sends"] += sum(r["role"] == SEND for r in case["requests"])
        totals["steps"] += len(t["steps"])
        totals["aborted"] += ours.get("aborted", 0)
        diff = differences(t, ours) + (oracle_vllm.late_turns(case, t) if case.get("replies") else [])
        if diff:
            failures += 1
            print(f"case {i} {case['opts']}: " + "; ".join(diff))
    print(f"{len(cases) - failures} of {len(cases)} cases equal "
          f"({totals['requests']} requests: {totals['pulls']} pulls, {totals['sends']} sends; {totals['steps']} steps"
          + (f"; {totals['aborted']} requests aborted" if totals["aborted"] else "") + ")")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
