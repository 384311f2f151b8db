"""KV offloading to CPU memory in the engine core, step by step against the real vLLM scheduler.

vLLM 0.33's `Scheduler` (../shared/tools/vllm_oracle's venv) runs with its own native
OffloadingConnector (`--kv-offloading-size`: CPU tier, LRU policy, one GPU block a chunk,
prompt blocks only), whose scheduler side is vLLM's code; this script plays the worker: each
store job a step's connector metadata carries ends in the output of the step `store_latency`
after it, each load job in the output of the step `load_latency - 1` after it. simkv's
`Scheduler` with `num_offload_chunks` runs the same random cases (small GPU pools and CPU tiers,
shared prompt content, priorities, watermarks, chunked prefill on and off). Every step's
scheduled tokens, running and waiting requests and GPU blocks in use, every request's
first-token and finish step, and the loads and stores (their blocks) must be equal.

--aborts: a front end aborts about a third of the requests (clients that gave up), each at a
random step, before the step is scheduled or after it ran and before its output is processed.

--pp: 2 to 4 pipeline stages; vLLM's Scheduler (or AsyncScheduler) is driven as its batch queue
drives it, that many batches deep (one more under async scheduling), and simkv's the same way.

--linear: models with linear-attention layers (oracle_linear.py's tiny Gated DeltaNet and Mamba2
configs) under vLLM's Mamba prefix caching (mamba_cache_mode "align"); with --speculative, MTP or
ngram drafts (MTP alone under async scheduling) in 60 % of the cases.

--replies: chat sessions (a next turn's prompt repeats the previous reply) whose hash lists
describe the replies; vLLM's fake model samples the reply's content tokens, so vLLM keys the
reply's blocks (on the GPU and in the CPU tier) as the next turn's prompt has them. Each turn
arrives after its previous turn finished (simkv's run says when; vLLM's is checked too).

--pd: P/D disaggregation beside the CPU tier, vLLM's MultiConnector with NIXL first (oracle_pd.py's
FakePDConnector) and the OffloadingConnector second: each request is plain, a send (a prefill
engine's: one output token, its blocks held after its finish until read, `latency` steps later)
or a pull (a decode engine's: its prompt pulled, ending in the output of the step `latency - 1`
after the one that admitted it), mixed in one engine as oracle_pd.py mixes them. With
--no-tier, NIXL alone (no tier: P/D under pipeline stages, --pp).

--draft-model (with --speculative): a draft model (tiny-llama's layers) in every speculative case.
--suffix / --ngram-misses: suffix decoding (proposals of drawn lengths) or ngram drafts found at a
rate of 0, 0.3 or 0.7 in every case (synchronous engines: vLLM refuses them under async scheduling).

--images (with any of the above but --replies): every case's prompts redrawn with image items as
oracle_spec.py --images draws them, vLLM's encoder budget and cache; --disable-chunked-mm-input,
--method M as there.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_offload.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 50 --seed 1
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle_pd import _step_loop  # noqa: E402  (the shared per-step driver and comparison)
from oracle_pd import differences as pd_differences  # noqa: E402
from oracle_spec import image_cases, method_cases  # noqa: E402  (--images, --method)
_PAGE = 4096  # vLLM rounds a CPU chunk up to the host page size (the oracle's blocks are tiny)


def make_case(rng, async_scheduling: bool = False, chunks: bool = False, speculative: bool = False,
              policy: str | None = None, store_threshold: bool = False, replies: bool = False,
              aborts: bool = False, hybrid: bool = False, chunked: bool = False, pp: bool = False,
              linear: bool = False, pd: bool | str = False, draft_model: bool = False, lora: bool = False,
              drafter: str | None = None) -> dict:
    """A random case; `pd`: P/D roles beside the tier, "no-tier" without one; `lora`: requests
    name LoRA adapters (or the base model), max_loras 1 to 3; `drafter`: "suffix" (--suffix) or
    "ngram_misses" (--ngram-misses) drafts in every case."""
    block_size = int(rng.choice([4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    n = int(rng.integers(3, 60))
    prefixes = [[int(x) for x in rng.integers(0, 3, 40)] for _ in range(3)]
    requests = []
    for i in range(n):
        prompt = int(rng.integers(1, max_model_len))
        r = {"row": i, "arrival_step": int(rng.integers(0, 80)), "prompt": prompt,
             "output": int(rng.integers(1, 40)), "priority": int(rng.integers(0, 3))}
        if rng.random() < 0.85:
            r["block_hashes"] = prefixes[int(rng.integers(0, 3))][:-(-prompt // 8)]
        requests.append(r)
    requests.sort(key=lambda r: (r["arrival_step"], r["row"]))
    from oracle_fuzz import random_engine_options  # (simkv's side only: it imports simkv)

    opts = random_engine_options(rng, block_size, max_model_len)
    opts["enable_prefix_caching"] = True
    opts["reserve_full_isl"] = bool(rng.random() < 0.7)
    if async_scheduling:
        opts["async_scheduling"] = True
    if pp:  # (pipeline stages: drafts only under async scheduling, as vLLM's PP allows them)
        opts["pipeline_parallel_size"] = int(rng.choice([2, 3, 4]))
        speculative = speculative and async_scheduling
    if drafter is not None:  # (every case: suffix decoding as oracle_linear.py draws it, or ngram's misses)
        from oracle_linear import ngram_miss_options, suffix_options

        (suffix_options if drafter == "suffix" else ngram_miss_options)(rng, opts)
    elif speculative and rng.random() < 0.6:  # (as oracle_spec.py plays it; a draft model only with --draft-model)
        from oracle_vllm import random_spec_options
        random_spec_options(rng, opts)
        if draft_model:  # (--draft-model: a draft model in every speculative case)
            opts["speculative_method"], opts["spec_draft_model"] = "draft_model", "tiny-llama"
        elif opts["speculative_method"] == "draft_model" or (async_scheduling and opts["speculative_method"] == "ngram"):
            opts["speculative_method"] = "eagle"
            opts.pop("spec_draft_model", None)
    case = {"opts": opts, "requests": requests, "num_offload_chunks": int(rng.integers(1, 40)),
            "store_latency": int(rng.integers(1, 5)), "load_latency": int(rng.integers(1, 5))}
    if policy:  # (after the other draws: a seed's cases are those without it, with another policy)
        case["policy"] = policy
    if chunks:  # (the connector's non-default settings)
        case["blocks_per_chunk"] = int(rng.choice([1, 2, 3, 4]))
        case["prompt_only"] = bool(rng.random() < 0.4)
    if replies:  # (chat sessions instead of the random requests above)
        from oracle_vllm import after_previous_turns, reply_sessions

        case["requests"] = reply_sessions(rng, max_model_len)
        case["replies"] = True
        if "blocks_per_chunk" not in case:  # (the connector's settings travel together: tests/core/helpers.py)
            case["blocks_per_chunk"] = 1
            case["prompt_only"] = bool(rng.random() < 0.4)
        after_previous_turns(case, run_simkv)
    if store_threshold:  # (vLLM's admission filter: a chunk is stored at its Nth offer)
        case["store_threshold"] = int(rng.choice([2, 3]))
        if rng.random() < 0.4:
            case["max_tracker_size"] = int(rng.integers(1, 30))
        if replies:  # (each turn again after its previous one, under the threshold)
            from oracle_vllm import after_previous_turns

            after_previous_turns(case, run_simkv)
    if aborts:  # (a front end aborts some requests: clients that gave up)
        from oracle_vllm import random_aborts

        case["aborts"] = random_aborts(rng, case["requests"])
    if linear:  # (after the other draws: a seed's cases are those without it, on linear-attention models)
        _linear_groups(rng, case, keep_drafter=drafter is not None)
        if replies:
            from oracle_vllm import after_previous_turns

            after_previous_turns(case, run_simkv)
    if hybrid:  # (after the other draws: a seed's cases are those without it, on sliding-window models)
        pp = opts.pop("pipeline_parallel_size", 1)
        _hybrid_groups(rng, case, chunked)
        if pp > 1:  # (no more stages than the model's layers: tiny-llama has 2)
            opts["pipeline_parallel_size"] = min(pp, 2) if opts["model"] == "tiny-llama" else pp
        if replies:  # (each turn again after its previous one, on the hybrid model)
            from oracle_vllm import after_previous_turns

            after_previous_turns(case, run_simkv)
    if pd:  # (after the other draws: a seed's cases are those without it, with P/D roles)
        from oracle_pd import PULL, SEND

        if pd == "no-tier":  # (NIXL alone: what pipeline stages with P/D need checked without a tier)
            case["num_offload_chunks"] = 0
        for r in case["requests"]:
            r["role"] = int(rng.choice([0, SEND, PULL, PULL]))
            r["latency"] = int(rng.integers(1, 6))
            if r["role"] == SEND:
                r["output"] = 1
        case["pd"] = True
    if lora:  # (after the other draws: a seed's cases are those without it, with adapters)
        for r in case["requests"]:
            r["lora"] = [None, "a", "b", "c"][int(rng.integers(0, 4))]
        opts["enable_lora"], opts["max_loras"] = True, int(rng.integers(1, 4))
    return case


def _hybrid_groups(rng, case: dict, chunked: bool = False) -> None:
    """oracle_hybrid.py's layer patterns (full-attention and sliding-window groups, windows of 2 to
    40 tokens), prefix-cache retention 0, none or a multiple of the chunk, a pool that holds a
    max_model_len request; drafts ngram or EAGLE (the full-attention groups hold its layer).
    `chunked`: chunked local attention (Llama 4's) instead, attention chunks of 2 to 40 tokens
    beside full-attention layers (oracle_hybrid.py --chunked)."""
    from simkv.capacity import group_blocks_per_request
    from simkv.config import EngineConfig

    opts = case["opts"]
    opts["model"] = str(rng.choice(["tiny-llama", "llama-3-8b", "gemma-2-9b"]))
    opts["sliding_window"] = int(rng.choice([2, 3, 5, 8, 16, 17, 33, 40]))
    opts["full_attention_interval"] = int(rng.choice([0, 2, 3, 6]))
    retention = rng.choice(["zero", "zero", "dense", "periodic"])
    chunk_tokens = case.get("blocks_per_chunk", 1) * opts["block_size"]
    opts["prefix_cache_retention_interval"] = (None if retention == "dense" else
                                               chunk_tokens * int(rng.integers(1, 5)) if retention == "periodic" else 0)
    if chunked:
        opts["attention_chunk_size"] = int(opts.pop("sliding_window"))
        opts["full_attention_interval"] = 2 if opts["model"] == "tiny-llama" else int(rng.choice([2, 3, 6]))
        opts["prefix_cache_retention_interval"] = 0
    case.setdefault("blocks_per_chunk", 1)  # (the connector's settings travel together: tests/core/helpers.py)
    case.setdefault("prompt_only", True)
    flat = dict(opts, scheduler_reserve_full_isl=opts["reserve_full_isl"])
    flat.pop("reserve_full_isl")
    config = EngineConfig.from_flat(flat)
    fits = group_blocks_per_request(config, opts["max_model_len"], startup=True) + 1
    opts["num_gpu_blocks"] = max(opts["num_gpu_blocks"], fits) + int(rng.integers(0, 60))
    case["group_windows"] = list(config.kv_cache_groups.windows)
    if chunked:
        case["group_chunked"] = True


def _linear_groups(rng, case: dict, keep_drafter: bool = False) -> None:
    """oracle_linear.py --align's models and settings (its tiny Gated DeltaNet and Mamba2 configs,
    Mamba prefix caching: chunked prefill, GDN prefill on FlashInfer's kernel or Triton's), retention
    0, none or a multiple of the chunk, a pool that holds a max_model_len request; drafts MTP or ngram."""
    from oracle_linear import MODELS, prefix_caching_options
    from simkv.capacity import group_blocks_per_request
    from oracle_pd import linear_config
    from simkv.config import EngineConfig

    opts = case["opts"]
    if opts.get("speculative_method") and not keep_drafter:  # (--speculative: MTP, or ngram where vLLM takes it)
        opts["speculative_method"] = "mtp" if opts.get("async_scheduling") else str(rng.choice(["ngram", "mtp"]))
        opts.pop("spec_draft_model", None)
    opts["block_size"] = int(rng.choice([16, 32]))
    opts["model"] = str(rng.choice(MODELS))
    prefix_caching_options(rng, opts, True)
    case.setdefault("blocks_per_chunk", 1)  # (the connector's settings travel together: tests/core/helpers.py)
    case.setdefault("prompt_only", True)
    flat = dict(opts, scheduler_reserve_full_isl=opts["reserve_full_isl"], prefix_cache_retention_interval=0)
    flat.pop("reserve_full_isl")
    config = linear_config(opts, flat, bool(opts.get("async_scheduling")))
    opts["block_size"] = config.cache.block_size  # (grown to hold a state's page; FlashInfer's checkpoints: 64)
    if opts["prefix_cache_retention_interval"]:  # (a multiple of the chunk, as vLLM's connector asks)
        opts["prefix_cache_retention_interval"] = case["blocks_per_chunk"] * opts["block_size"] * int(rng.integers(1, 4))
    config = EngineConfig.from_flat(dict(flat, block_size=opts["block_size"],
                                         prefix_cache_retention_interval=opts["prefix_cache_retention_interval"]))
    fits = group_blocks_per_request(config, opts["max_model_len"], startup=True) + 1
    opts["num_gpu_blocks"] = max(opts["num_gpu_blocks"], fits) + int(rng.integers(0, 40))
    groups = config.kv_cache_groups
    case |= {"group_windows": list(groups.windows), "group_linear": [g.linear for g in groups.groups],
             "mamba_cache_mode": "align", "mamba_prefill_checkpoints": config.mamba_prefill_checkpoints}


# ---- vLLM side (runs in the oracle's venv) --------------------------------------------------------
class _Ordered(dict):
    """An insertion-ordered set for the scheduler's finished_req_ids (vLLM iterates a set of
    strings, whose order changes with PYTHONHASHSEED; simkv retires them in running order)."""

    def add(self, key) -> None:
        self[key] = None

    def discard(self, key) -> None:
        self.pop(key, None)


class _VllmOffload:
    """vLLM's scheduler (its AsyncScheduler with `async_scheduling`) with its OffloadingConnector
    for a case, and the worker this script plays: the jobs due in each step's (or batch's) output."""

    def __init__(self, case: dict, async_scheduling: bool) -> None:
        import oracle_vllm
        from vllm.config import KVTransferConfig

        o = dict(case["opts"], eagle_group=True)
        if case.get("group_windows"):  # (sliding-window models: --hybrid; chunked local attention: --chunked)
            o["group_windows"] = case["group_windows"]
            o["group_chunked"] = case.get("group_chunked", False)
            for key in ("group_linear", "mamba_cache_mode", "mamba_prefill_checkpoints"):  # (--linear)
                o[key] = case.get(key)
        else:
            o["prefix_cache_retention_interval"] = None
        # (a chunk: one block of every group's one layer, 8 bytes a token, a state 4 bytes, rounded up to the page)
        linear = case.get("group_linear") or []
        block_bytes = sum(4 if linear and linear[i] else 8 * o["block_size"]
                          for i in range(len(case.get("group_windows") or [0])))
        chunk_bytes = -(-block_bytes * case.get("blocks_per_chunk", 1) // _PAGE) * _PAGE
        extra = {"cpu_bytes_to_use": case["num_offload_chunks"] * chunk_bytes,
                 "blocks_per_chunk": case.get("blocks_per_chunk", 1), "offload_prompt_only": case.get("prompt_only", True),
                 "eviction_policy": case.get("policy", "lru"), "store_threshold": case.get("store_threshold", 0),
                 "max_tracker_size": case.get("max_tracker_size", 64_000)}
        if case.get("pd") and not case["num_offload_chunks"]:  # (--no-tier: NIXL alone)
            connector = KVTransferConfig(kv_connector="FakePDConnector", kv_role="kv_both",
                                         kv_connector_module_path="oracle_pd")
        elif case.get("pd"):  # (NIXL first, as llm-d's configurations list them)
            connector = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
                "connectors": [{"kv_connector": "FakePDConnector", "kv_connector_module_path": "oracle_pd",
                                "kv_role": "kv_both"},
                               {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": extra}]})
        else:
            connector = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                         kv_connector_extra_config=extra)
        self.sched, vllm_config = oracle_vllm.build_scheduler(o, o["reserve_full_isl"], connector,
                                                              async_scheduling=async_scheduling)
        oracle_vllm.mm_budget(self.sched, vllm_config, case.get("mm"))  # (--images)
        if case.get("replies"):
            oracle_vllm.sample_reply_content(case)
        sched = self.sched
        if o.get("enable_lora"):  # (--lora: the scheduler reads max_loras alone, as oracle_fuzz.py --lora gives it)
            from types import SimpleNamespace
            sched.lora_config = SimpleNamespace(max_loras=o["max_loras"])
        self.pd = bool(case.get("pd"))
        self.info = {r["row"]: r for r in case["requests"]}
        self.tier = bool(case["num_offload_chunks"])
        self.offloading = (sched.connector._connectors[1] if self.pd else sched.connector) if self.tier else None
        if self.pd:
            import oracle_pd  # the connector's class as the scheduler loaded it
            self.admitted = oracle_pd.FakePDConnector.admitted  # pulls each schedule() admits
            self.admitted.clear()
        assert not self.tier or self.offloading.connector_scheduler.manager._num_chunks == case["num_offload_chunks"]
        self.hasher = oracle_vllm.block_hasher(vllm_config, o["block_size"])
        self.pool = sched.kv_cache_manager.block_pool
        sched.finished_req_ids = _Ordered()
        if os.environ.get("ORACLE_OFFLOAD_DEBUG") and self.tier:
            lookup = self.offloading.get_num_new_matched_tokens
            cs = self.offloading.connector_scheduler
            handoffs = cs._build_aligned_boundary_store_jobs

            def traced_handoffs(offers):  # (--linear: the states vLLM's core hands over)
                print("  state offers", {rid: [(g, t) for g, _, t in e] for rid, e in offers.items()}, file=sys.stderr)
                for mgr in sched.kv_cache_manager.coordinator.single_type_managers:  # (their tables)
                    for rid in offers:
                        print("   ", type(mgr).__name__, rid, mgr.num_cached_block.get(rid), [(b.block_id, b.block_hash_num_tokens if b.block_hash else None)
                                                            for b in mgr.req_to_blocks.get(rid, ())], file=sys.stderr)
                return handoffs(offers)
            cs._build_aligned_boundary_store_jobs = traced_handoffs

            def traced(request, num_computed_tokens, *args):
                result = lookup(request, num_computed_tokens, *args)
                print("  lookup", request.request_id, num_computed_tokens, result, file=sys.stderr)
                return result
            self.offloading.get_num_new_matched_tokens = traced
        self.case = case
        self.ids_of = oracle_vllm.sample_ids(case["requests"])
        self.accept = oracle_vllm.acceptance(o)  # (None without drafts)
        self.first_token, self.finish = {}, {}
        self.due: dict[int, list] = {}
        self.due_send: dict[int, set] = {}  # (--pd: sends released in a step's output; pulls are in `due`)
        self.transfers = []

    def make(self, r: dict, rid: str):
        import oracle
        import oracle_vllm
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        tr = {"prompt_tokens": r["prompt"], "prefix_group": None, "row": r["row"],
              "block_hashes": r.get("block_hashes"), "hash_block_tokens": 8}
        ids = oracle.make_prompt_ids(tr, 0, 0, {})
        sp = SamplingParams(max_tokens=r["output"], ignore_eos=True, temperature=0.0)
        params = {"pull": True} if r.get("role") == 2 else {"send": True} if r.get("role") == 1 else None
        if params is not None:  # (--pd)
            sp.extra_args = {"kv_transfer_params": params}
        lora = None
        if r.get("lora"):  # (--lora: adapter ids a=1, b=2, c=3)
            from vllm.lora.request import LoRARequest
            lora = LoRARequest(r["lora"], "abc".index(r["lora"]) + 1, "/nonexistent")
        req = Request(request_id=rid, prompt_token_ids=ids, sampling_params=sp, pooling_params=None,
                      arrival_time=r["arrival_step"] + r["row"] * 1e-9, priority=r["priority"],
                      block_hasher=self.hasher, lora_request=lora, mm_features=oracle_vllm.mm_features(r))
        req.kv_transfer_params = params
        return req

    def add(self, r: dict) -> None:
        """Row `r`'s request, or with n > 1 its members one after the other (--parallel)."""
        for rid in self.ids_of[r["row"]]:
            self.sched.add_request(self.make(r, rid))

    def schedule(self, k: int, row_index: int):
        """schedule() as step (or batch) `k`; its jobs end in the outputs the latencies say."""
        so = self.sched.schedule()
        self.sched.finished_req_ids = _Ordered()
        meta = so.kv_connector_metadata
        case = self.case
        if self.pd:  # (the pulls it admitted end in the output of k + latency - 1, as loads do)
            meta = meta.metadata[1] if self.tier else None
            for rid in self.admitted:
                self.due.setdefault(k + self.info[request_index(rid)]["latency"] - 1, []).append(
                    (None, rid, False))
            self.admitted.clear()
            if meta is None:
                return so
        for jid, job in meta.load_jobs.items():
            self.due.setdefault(k + case["load_latency"] - 1, []).append((jid, job.req_id, False))
            self.transfers.append([row_index, request_index(job.req_id), len(job.dst_spec.block_ids), 0])
        for jid, job in meta.store_jobs.items():
            self.due.setdefault(k + case["store_latency"], []).append((jid, job.req_id, True))
            self.transfers.append([row_index, request_index(job.req_id), len(job.src_spec.block_ids), 1])
        if os.environ.get("ORACLE_OFFLOAD_DEBUG"):
            print(k, dict(so.num_scheduled_tokens), {j: t.req_id for j, t in meta.load_jobs.items()},
                  {j: t.req_id for j, t in meta.store_jobs.items()}, "preempted", sorted(so.preempted_req_ids or ()),
                  "free", self.pool.get_num_free_blocks(), file=sys.stderr)
            for jid, job in meta.store_jobs.items():  # (the groups each store reads from)
                print("  store", jid, job.req_id, list(job.src_spec.group_sizes), file=sys.stderr)
        return so

    def row(self, so) -> list[int]:
        n_running, n_waiting = self.sched.get_request_counts()
        return [so.total_num_scheduled_tokens, n_running, n_waiting,
                self.pool.num_gpu_blocks - 1 - self.pool.get_num_free_blocks()]

    def process(self, so, sampled, k: int, step) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        done = self.due.pop(k, [])
        worker = OffloadingWorkerMetadata()
        for jid, _, _ in done:
            if jid is not None:  # (None: a pull, --pd)
                worker.mark_completed(jid)
        recv = dict.fromkeys(rid for _, rid, is_store in done if not is_store)
        meta = worker if any(jid is not None for jid, _, _ in done) else None
        if self.pd and meta is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata
            meta = MultiKVConnectorWorkerMetadata(metadata=(None, meta))
        sent = self.due_send.pop(k, None)
        connector_output = KVConnectorOutput(finished_recving=recv or None, kv_connector_worker_meta=meta,
                                             finished_sending=dict.fromkeys(sorted(sent, key=int)) if sent else None)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=connector_output)
        for eco in self.sched.update_from_output(so, mro).values():
            for out in eco.outputs:
                rid = out.request_id
                if out.new_token_ids and rid not in self.first_token:
                    self.first_token[rid] = step
                if out.finish_reason is not None:
                    self.finish[rid] = step
                    if self.pd and self.info[request_index(rid)].get("role") == 1:
                        latency = self.info[request_index(rid)]["latency"]
                        self.due_send.setdefault(k + latency, set()).add(rid)

    def result(self, result: dict) -> dict:
        import oracle_vllm

        result["requests"] = oracle_vllm.row_steps(self.case["requests"], self.ids_of, self.first_token, self.finish)
        result["transfers"] = self.transfers
        return result


def request_index(rid: str) -> int:
    import oracle_vllm

    return oracle_vllm.request_index(rid)


def run_vllm(case: dict) -> dict:
    import oracle_vllm
    v = _VllmOffload(case, async_scheduling=False)

    aborts = case.get("aborts", [])

    def step(k, arrived):
        for r in arrived:
            v.add(r)
        oracle_vllm.take_aborts(v.sched, aborts, k, "before")
        so = v.schedule(k, k)
        row = v.row(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled, _ = oracle_vllm.sampled_tokens(v.sched, so, req_ids, v.accept)
        oracle_vllm.take_aborts(v.sched, aborts, k, "output")
        v.process(so, sampled, k, k)
        if v.accept is not None:  # (an ngram miss proposes none, a suffix proposal its drawn length)
            oracle_vllm.propose_drafts(v.sched, so, req_ids, v.accept)
        return row, not v.sched.has_requests() and not v.due

    return v.result(_step_loop(case["requests"], step))


def run_vllm_async(case: dict) -> dict:
    """The AsyncScheduler driven as oracle_pd.py's run_vllm_async drives it (EngineCore's batch
    queue, two deep, empty batches included: vLLM keeps scheduling while the connector has
    transfers in flight); with pipeline stages (--pp) the queue is P deep, P + 1 under async
    scheduling, and the Scheduler or the AsyncScheduler runs it."""
    from collections import deque

    import oracle_vllm
    async_scheduling = bool(case["opts"].get("async_scheduling"))
    depth = case["opts"].get("pipeline_parallel_size", 1) + async_scheduling
    v = _VllmOffload(case, async_scheduling=async_scheduling)
    assert v.sched.vllm_config.max_concurrent_batches == depth
    sched = v.sched
    pending = sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))
    rows, queue = [], deque()
    num_batches = 0
    error = None
    aborts = case.get("aborts", [])
    while True:
        if len(rows) >= 5000 or num_batches >= 20000:  # (drive_offload_async's limits)
            error = "max steps"
            break
        while pending and pending[0]["arrival_step"] <= len(rows):
            v.add(pending.pop(0))
        oracle_vllm.take_aborts(sched, aborts, len(rows), "before")
        if sched.has_requests():
            running_before = {r.request_id for r in sched.running}
            b = num_batches
            so = v.schedule(b, len(rows))
            num_batches += 1
            ran = so.total_num_scheduled_tokens > 0
            row = None
            if ran:
                rows.append(v.row(so))
                row = len(rows) - 1
            queue.appendleft((b, row, so, oracle_vllm.async_step_meta(sched, so, running_before)))
            if len(queue) < depth and (ran or sched.has_requests()):
                continue
        elif not queue:
            if not pending:
                break
            rows.append([0, 0, 0, 0])  # idle
            continue
        b, row, so, meta = queue.pop()
        if row is not None:
            oracle_vllm.take_aborts(sched, aborts, row, "output")
        sampled, _ = oracle_vllm.async_sampled(sched, so, meta, v.accept)
        v.process(so, sampled, b, row)
    result = {"steps": rows}
    if error:
        result["error"] = error
    return v.result(result)


def run_vllm_any(case: dict) -> dict:
    batch_queue = case["opts"].get("async_scheduling") or case["opts"].get("pipeline_parallel_size", 1) > 1
    return run_vllm_async(case) if batch_queue else run_vllm(case)


# ---- simkv side ---------------------------------------------------------------------------------
def run_simkv(case: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.core.helpers import offload_driver

    result = offload_driver(case)(case)
    result.pop("scheduler")
    return result


def differences(theirs: dict, ours: dict) -> list[str]:
    """oracle_pd.py's comparison (steps, requests), and the transfers."""
    out = [d for d in pd_differences(theirs, ours) if not d.startswith("accepted")]
    t, o = theirs.get("transfers", []), ours.get("transfers", [])
    if t != o:
        i = next((j for j, (x, y) in enumerate(zip(t, o)) if x != y), min(len(t), len(o)))
        out.append(f"transfers differ at {i} (of {len(t)} / {len(o)}) [step, row, blocks, store]: "
                   f"vLLM {t[i] if i < len(t) else None}, simkv {o[i] if i < len(o) else None}")
    return out


def main() -> None:
    import oracle_vllm

    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], speculative_flag=True, async_flag=True, offload_flag=True,
                                aborts_flag=True, parallel_flag=True, hybrid_flag=True, chunked_flag=True, pp_flag=True,
                                linear_flag=True, roles_flag=True, mtp_modules_flag=True, ngram_misses_flag=True,
                                images_flag=True)
    if oracle_vllm.serve_vllm_side(a, run_vllm_any):
        return
    if a.aborts and a.replies:  # (a turn given up on has no reply for its next turn to repeat)
        sys.exit("--aborts with --replies: an aborted turn's conversation ends (oracle_fuzz.py --timeouts --replies)")
    import numpy as np
    rng = np.random.default_rng(a.seed)
    if (a.suffix or a.ngram_misses) and (a.async_scheduling or a.pp):
        sys.exit("--suffix, --ngram-misses: vLLM refuses host-proposed drafts under async scheduling (and so PP)")
    drafter = "suffix" if a.suffix else "ngram_misses" if a.ngram_misses else None
    cases = [make_case(rng, a.async_scheduling, a.chunks, a.speculative, a.policy, a.store_threshold, a.replies,
                       a.aborts, a.hybrid or a.chunked, a.chunked, a.pp, a.linear,
                       "no-tier" if a.pd and a.no_tier else a.pd, a.draft_model, a.lora, drafter)
             for _ in range(a.cases)]
    if a.images and a.replies:
        sys.exit("--images with --replies: not drawn (the images redraw every prompt)")
    method_cases(a, cases)  # (--method: with --speculative)
    oracle_vllm.option_cases(a, cases)
    oracle_vllm.parallel_cases(a, rng, cases)
    image_cases(a, cases)  # (--images: after the options, whose token budget sizes the items)
    theirs = oracle_vllm.vllm_results(__file__, cases, a)
    failures = 0
    totals = dict(requests=0, steps=0, loads=0, stores=0, aborted=0)
    for i, (case, t) in enumerate(zip(cases, theirs)):
        ours = run_simkv(case)
        totals["requests"] += len(case["requests"])
        totals["steps"] += len(t["steps"])
        totals["loads"] += sum(1 for x in t.get("transfers", []) if not x[3])
        totals["stores"] += sum(1 for x in t.get("transfers", []) if x[3])
        totals["aborted"] += ours.get("aborted", 0)
        diff = differences(t, ours) + (oracle_vllm.late_turns(case, t) if case.get("replies") else [])
        if diff:
            failures += 1
            print(f"case {i} chunks={case['num_offload_chunks']}x{case.get('blocks_per_chunk', 1)}{'' if case.get('prompt_only', True) else ' +decode'} {case.get('policy', 'lru')} st={case.get('store_threshold', 0)}/{case.get('max_tracker_size', '-')} lat={case['store_latency']}/{case['load_latency']} "
                  f"{case['opts']}: " + "; ".join(diff))
    print(f"{len(cases) - failures} of {len(cases)} cases equal ({totals['requests']} requests, {totals['steps']} "
          f"steps, {totals['loads']} loads, {totals['stores']} stores"
          + (f", {totals['aborted']} requests aborted" if totals["aborted"] else "") + ")")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
