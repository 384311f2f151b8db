"""The vLLM side that the step-mode oracles share (oracle_spec.py, oracle_pd.py): vLLM 0.33's
`Scheduler` built from a case's flat options (speculative decoding included), and the model
runner's part played by hand (sampled tokens, accepted drafts, the drafter's proposals), and
rows for n sequences fanned out as vLLM's front end does (--parallel: `sample_ids`).
Runs in the oracle's venv (../shared/tools/vllm_oracle); `random_spec_options` runs on simkv's.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORACLE_DIR = ROOT.parent / "shared" / "tools" / "vllm_oracle"
SPEC_METHODS = ("ngram", "eagle", "draft_model")


# Parallel sampling (--parallel): a row asking for n sequences is n vLLM requests, added one
# after the other as vLLM v1's front end adds a parent's children. simkv numbers the later
# members from 2**40 in the order they arrive (Scheduler._next_child_index); the fake model's
# tokens and the acceptance draws are keyed by those numbers on both sides.
CHILD_BASE = 1 << 40
_indexes: dict[str, int] = {}


def request_index(rid: str) -> int:
    """The simkv request index behind a vLLM request id."""
    index = _indexes.get(rid)
    return int(rid) if index is None else index


def with_samples(rng, requests: list[dict], max_n: int = 4) -> None:
    """About a third of the rows ask for 2 to `max_n` sequences (`n`)."""
    for r in requests:
        if rng.random() < 0.35:
            r["n"] = int(rng.integers(2, max_n + 1))


def parallel_cases(args, rng, cases: list[dict]) -> None:
    """With --parallel, give the cases' rows their n (drawn after the cases, so that the cases
    are those of the same seed without it). Not with --aborts or --replies (a front end aborts a
    parent's children together; replies are one sequence's)."""
    if not getattr(args, "parallel", False):
        return
    if getattr(args, "aborts", False) or getattr(args, "replies", False):
        raise SystemExit("--parallel is checked without --aborts and --replies")
    for case in cases:
        with_samples(rng, case["requests"], args.max_n)


def sample_ids(requests: list[dict]) -> dict[int, list[str]]:
    """Each row's vLLM request ids in the order they are added: the row's number, or for n > 1
    its members' ids as vLLM's front end names a parent's children, `k_row` (vLLM breaks ties of
    priority and arrival by request id, as strings: 0, 1, 2 ... or from n = 11 on 0, 10, 1, 2 ...),
    keyed to simkv's indexes (the first member's is the row's)."""
    _indexes.clear()
    out, child = {}, CHILD_BASE
    for r in sorted(requests, key=lambda r: (r["arrival_step"], r["row"])):
        n = r.get("n", 1)
        if n == 1:
            out[r["row"]] = [str(r["row"])]
            continue
        ids = [f"{k}_{r['row']}" for k in range(n)]
        _indexes[ids[0]] = r["row"]
        for rid in ids[1:]:
            _indexes[rid] = child
            child += 1
        out[r["row"]] = ids
    return out


def row_steps(requests: list[dict], ids: dict[int, list[str]], first_token: dict, finish: dict) -> dict:
    """Per row [first token step, finish step]: a row with n sequences has its first member's
    first token and its last member's finish (-1 where it had none)."""
    out = {}
    for r in requests:
        ends = [finish.get(rid, -1) for rid in ids[r["row"]]]
        out[str(r["row"])] = [first_token.get(ids[r["row"]][0], -1), -1 if -1 in ends else max(ends)]
    return out


def random_spec_options(rng, opts: dict) -> None:
    """Speculative decoding options for a random case (`opts` gains them): any method the oracle's
    config-only model can stand in for, K from 1 to 5, acceptance 0 to 1."""
    opts["speculative_method"] = str(rng.choice(SPEC_METHODS))
    opts["num_speculative_tokens"] = int(rng.choice([1, 2, 3, 5]))
    opts["spec_acceptance_rate"] = float(rng.choice([0.0, 0.5, 0.8, 1.0]))
    opts["spec_seed"] = int(rng.integers(0, 1000))
    if opts["speculative_method"] == "draft_model":
        opts["spec_draft_model"] = "tiny-llama"
    opts["max_num_batched_tokens"] = max(opts["max_num_batched_tokens"], opts["num_speculative_tokens"] + 1)


def suffix_drafter(rng, opts: dict) -> None:
    """Suffix decoding for a case (`opts` gains it): K 4 to 12, proposals of 1.5 to K - 1 drafts
    on average, matches at a rate of 0.5, 0.8 or 1 (the oracle's n-gram config stands in for the
    suffix proposer, which needs Arctic Inference)."""
    k = int(rng.integers(4, 13))
    opts |= {"speculative_method": "suffix", "num_speculative_tokens": k,
             "spec_mean_draft_tokens": round(float(rng.uniform(1.5, k - 1)), 2),
             "spec_ngram_match_rate": float(rng.choice([0.5, 0.8, 1.0])),
             "max_num_batched_tokens": max(opts["max_num_batched_tokens"], k + 1)}
    for key in ("spec_draft_model", "spec_tokens_per_batch_size"):
        opts.pop(key, None)


def ngram_miss_drafter(rng, opts: dict) -> None:
    """ngram drafts for a case whose prompt lookup finds a match at a rate of 0, 0.3 or 0.7."""
    opts |= {"speculative_method": "ngram", "spec_ngram_match_rate": float(rng.choice([0.0, 0.3, 0.7]))}
    opts.pop("spec_draft_model", None)


def runner_cases(a, cases: list[dict]) -> None:
    """--model-runner: every case's model_runner (absent: the cases' own)."""
    if getattr(a, "model_runner", None):
        for case in cases:
            case["opts"]["model_runner"] = a.model_runner


def option_cases(a, cases: list[dict]) -> None:
    """The cases' options as the flags of `mtp_modules_flag`, `dflash_flag` and
    `parallel_drafting_flag` ask (each absent where the oracle has none): prefix caching first,
    which the drafters' K and groups depend on, then the drafters, then the token budget and the
    model runner."""
    _caching_cases(a, cases)
    drafter_cases(a, cases)
    _budget_cases(a, cases)
    runner_cases(a, cases)


def _caching_cases(a, cases: list[dict]) -> None:
    """--no-prefix-caching: every case runs without prefix caching (before drafter_cases, which
    sizes a drafter's groups and K by it)."""
    if getattr(a, "no_prefix_caching", False):
        for case in cases:
            case["opts"]["enable_prefix_caching"] = False


def _budget_cases(a, cases: list[dict]) -> None:
    """--scheduled-tokens: every case's max_num_scheduled_tokens (vLLM's token budget) is drawn at a
    quarter to all of its max_num_batched_tokens (the batch's rows), from a generator of its own
    (the cases are those of the same seed without the flag)."""
    if not getattr(a, "scheduled_tokens", False):
        return
    import numpy as np

    rng = np.random.default_rng(a.seed + 7919)
    for case in cases:
        opts = case["opts"]
        opts["max_num_scheduled_tokens"] = max(1, int(opts["max_num_batched_tokens"] * float(rng.choice([0.25, 0.5, 0.75, 1.0]))))


def _regroup(case: dict) -> None:
    """A case with KV-cache groups (oracle_hybrid.py's, --hybrid): its groups and pool again, from
    simkv's config of its options as they are now (a drafter with more layers joins the groups)."""
    sys.path.insert(0, str(ROOT))
    from simkv.capacity import group_blocks_per_request
    from simkv.config import EngineConfig

    opts = {("scheduler_reserve_full_isl" if k == "reserve_full_isl" else k): v  # (oracle_pd.py's name)
            for k, v in case["opts"].items()}
    config = EngineConfig.from_flat(opts)
    case["group_windows"] = list(config.kv_cache_groups.windows)
    fits = group_blocks_per_request(config, case["opts"]["max_model_len"], startup=True) + 1
    case["opts"]["num_gpu_blocks"] = max(case["opts"]["num_gpu_blocks"], fits)


def drafter_cases(a, cases: list[dict]) -> None:
    """--dflash: every speculative case's drafter is dflash (its K + 1 slots within the budget);
    --parallel-drafting: the EAGLE and draft-model cases draft in parallel; --mtp-modules N: every
    speculative case's drafter is MTP with N modules (`a`: the oracle's arguments, any flag absent
    where the oracle has none)."""
    for case in cases:
        opts = case["opts"]
        if getattr(a, "mtp_modules", 1) > 1 and opts.get("speculative_method"):
            opts |= {"speculative_method": "mtp", "spec_mtp_modules": a.mtp_modules}
            opts.pop("spec_draft_model", None)
            opts.pop("spec_ngram_match_rate", None)
            if opts["enable_prefix_caching"]:
                opts["num_speculative_tokens"] = min(opts["num_speculative_tokens"], opts["block_size"])
            if case.get("group_windows") is not None:  # (the KV-cache groups hold every module's layer)
                _regroup(case)
        if getattr(a, "dflash", False) and opts.get("speculative_method"):
            opts["speculative_method"] = "dflash"
            opts.pop("spec_draft_model", None)
            opts["max_num_batched_tokens"] = max(opts["max_num_batched_tokens"], opts["num_speculative_tokens"] + 2)
        if getattr(a, "parallel_drafting", False) and opts.get("speculative_method") in ("eagle", "eagle3", "draft_model"):
            opts["spec_parallel_drafting"] = True


def dflash_draft(fake: str) -> str:
    """A config-only DFlash drafter beside the fake target (its shape, two layers tapping both of
    the target's, a mask token): the folder vLLM's SpeculativeConfig(method='dflash') reads."""
    import json
    import tempfile

    folder = Path(tempfile.gettempdir()) / "simkv-oracle-dflash-draft"
    folder.mkdir(exist_ok=True)
    config = json.loads((Path(fake) / "config.json").read_text())
    config |= {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 1]}}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def build_scheduler(o: dict, reserve_full_isl: bool, kv_transfer_config=None, async_scheduling: bool = False):
    """vLLM's Scheduler (its AsyncScheduler with `async_scheduling`) for the case's options;
    returns (scheduler, vllm_config)."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)
    from vllm.v1.structured_output import StructuredOutputManager

    import oracle
    fake = oracle.ensure_fake_model(str(ORACLE_DIR / "fake_model"))
    model_config = ModelConfig(model=fake, dtype="float16", seed=0, skip_tokenizer_init=True,
                               max_model_len=o["max_model_len"])
    spec = None
    if o.get("speculative_method"):
        # (MTP schedules as EAGLE does: the config-only model stands in with an EAGLE draft)
        # (suffix decoding's proposer needs Arctic Inference; its scheduling is the n-gram
        # proposer's, drafts of any length up to K handed over after each step: ngram stands in)
        method = {"mtp": "eagle", "suffix": "ngram"}.get(o["speculative_method"], o["speculative_method"])
        spec_kw = dict(method=method, num_speculative_tokens=o["num_speculative_tokens"])
        spec_kw |= dict(prompt_lookup_max=3, prompt_lookup_min=1) if method == "ngram" else dict(model=fake)
        if method == "dflash":  # (a config-only DFlash drafter: the fake model's shape, a mask token)
            spec_kw["model"] = dflash_draft(fake)
        if o.get("spec_parallel_drafting"):
            spec_kw["parallel_drafting"] = True
        if o.get("spec_tokens_per_batch_size"):
            spec_kw["num_speculative_tokens_per_batch_size"] = [
                [int(x) for x in part.replace(":", "-").split("-")] for part in o["spec_tokens_per_batch_size"].split(",")]
        spec = SpeculativeConfig(target_model_config=model_config, target_parallel_config=ParallelConfig(), **spec_kw)
        if o["speculative_method"] == "mtp" and o.get("spec_mtp_modules", 1) > 1:
            # (multi-module MTP: the EAGLE stand-in becomes an MTP drafter whose checkpoint has that
            # many modules, which is all vLLM's use_multi_module_mtp reads)
            spec.method = "mtp"
            spec.draft_model_config.hf_config.num_nextn_predict_layers = o["spec_mtp_modules"]
    scheduler_config = SchedulerConfig(
        max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
        max_model_len=o["max_model_len"], enable_chunked_prefill=o["enable_chunked_prefill"],
        long_prefill_token_threshold=o["long_prefill_token_threshold"], is_encoder_decoder=False,
        policy=o["scheduling_policy"], watermark=o["watermark"], scheduler_reserve_full_isl=reserve_full_isl,
        disable_hybrid_kv_cache_manager=True, max_num_active_seqs=o.get("max_num_active_seqs"),
        prefill_schedule_interval=o.get("prefill_schedule_interval", 1))
    cache_config = CacheConfig(block_size=o["block_size"], enable_prefix_caching=o["enable_prefix_caching"],
                               prefix_cache_retention_interval=o.get("prefix_cache_retention_interval", 0))
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"),
                             speculative_config=spec, kv_transfer_config=kv_transfer_config)
    for key in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"):
        setattr(vllm_config.scheduler_config, key, o[key])
    if o.get("max_num_scheduled_tokens"):  # (--scheduled-tokens: a token budget below the batch's rows)
        vllm_config.scheduler_config.max_num_scheduled_tokens = o["max_num_scheduled_tokens"]
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    # (pipeline parallelism: set after the config is built, which would look for the stages' GPUs)
    vllm_config.parallel_config.pipeline_parallel_size = o.get("pipeline_parallel_size", 1)
    vllm_config.cache_config.enable_prefix_caching = o["enable_prefix_caching"]
    vllm_config.cache_config.num_gpu_blocks = o["num_gpu_blocks"]
    # KV-cache groups: one full-attention group, or (`group_windows`: simkv's groups of a model with
    # sliding-window layers, 0 = full attention; with `group_chunked` the windows are attention chunks)
    # one group per entry, as vLLM's hybrid manager forms them.
    groups = []
    linear = o.get("group_linear") or []
    align = o.get("mamba_cache_mode") == "align"
    if align:
        vllm_config.cache_config.mamba_cache_mode = "align"
    for i, window in enumerate(o.get("group_windows") or [0]):
        kw = dict(block_size=o["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float32)
        if i < len(linear) and linear[i] and align:  # (a linear-attention group with prefix caching:
            # mamba_cache_mode "align", blocks of the attention block size; with `mamba_prefill_checkpoints`
            # the backend exports a state from inside a prefill chunk, as Mamba2's and FlashInfer's GDN do)
            checkpoints = bool(o.get("mamba_prefill_checkpoints"))
            spec = MambaSpec(block_size=o["block_size"], shapes=((1,),), dtypes=(torch.float32,),
                             mamba_cache_mode="align", num_speculative_blocks=o.get("num_speculative_tokens", 0),
                             num_prefill_checkpoint_blocks=int(checkpoints),
                             prefill_checkpoint_alignment=o["block_size"] if checkpoints else None)
        elif i < len(linear) and linear[i]:  # (`group_linear`: a linear-attention group, without prefix caching
            # a state block per request: vLLM's mamba_cache_mode "none", blocks of max_model_len tokens)
            spec = MambaSpec(block_size=o["max_model_len"], shapes=((1,),), dtypes=(torch.float32,),
                             mamba_cache_mode="none", num_speculative_blocks=o.get("num_speculative_tokens", 0))
        elif not window:
            spec = FullAttentionSpec(**kw)
        elif o.get("group_chunked"):  # (chunked local attention: the window is the chunk)
            spec = ChunkedLocalAttentionSpec(attention_chunk_size=window, **kw)
        else:
            spec = SlidingWindowSpec(sliding_window=window, **kw)
        groups.append(KVCacheGroupSpec([f"layer{i}"], spec))
        # (an EAGLE layer attends the whole context: vLLM flags the full-attention group holding it)
        # (`eagle_group`: a model's one group, holding the EAGLE layer as vLLM's planner flags it)
        groups[-1].is_eagle_group = (bool(o.get("group_windows")) or bool(o.get("eagle_group"))) and not window and \
            not isinstance(spec, MambaSpec) and o.get("speculative_method") in ("eagle", "eagle3", "mtp")
    kv_cache_config = KVCacheConfig(num_blocks=o["num_gpu_blocks"], kv_cache_tensors=[], kv_cache_groups=groups,
                                    prefix_cache_retention_interval=cache_config.prefix_cache_retention_interval)
    cls = AsyncScheduler if async_scheduling else Scheduler
    # (the scheduler's block size is the groups' LCM: vLLM's resolve_kv_cache_block_sizes)
    import math
    scheduler_block_size = math.lcm(*(g.kv_cache_spec.block_size for g in groups))
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=scheduler_block_size,
                log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config))
    return sched, vllm_config


def block_hasher(vllm_config, block_size: int):
    """vLLM's request block hasher (lookahead keys where vLLM uses them: EAGLE without a connector)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn, vllm_config.num_hash_lookahead_tokens)


def acceptance(o: dict):
    """simkv's own acceptance draws (both schedulers see the same), or None without speculation."""
    if not o.get("speculative_method"):
        return None
    sys.path.insert(0, str(ROOT))
    from simkv.core.spec_decode import AcceptanceModel

    return AcceptanceModel((o["spec_acceptance_rate"],) * o["num_speculative_tokens"], o["spec_seed"],
                           o.get("spec_ngram_match_rate", 1.0), o.get("spec_mean_draft_tokens"), device_ngram(o))


def device_ngram(o: dict) -> bool:
    """The case's n-gram drafter runs on the device (vLLM's V2 model runner, its default; simkv's
    EngineConfig.ngram_drafts_on_device): K drafts after every step, whose ids the engine core never
    sees (-1 each), a lookup without a match giving drafts that are all rejected."""
    return o.get("speculative_method") == "ngram" and o.get("model_runner", "auto") != "v1"


def sampled_tokens(sched, so, req_ids: list[str], accept) -> tuple[list[list[int]], int]:
    """The model runner's sampled tokens for the step: none for a prompt chunk that leaves prompt
    to compute; otherwise one, and under speculative decoding the accepted drafts before it (the
    placeholders of padding are never accepted). Returns them and the drafts accepted."""
    import oracle
    sampled, accepted = [], 0
    # (the requests admitted or resumed this step: their drafts are padding; those of a running request
    # are -1 too where the drafter runs on the device)
    admitted = {r.req_id for r in so.scheduled_new_reqs} | set(so.scheduled_cached_reqs.resumed_req_ids)
    for rid in req_ids:
        req = sched.requests[rid]
        if req.is_prefill_chunk:
            sampled.append([])
        elif accept is None:
            sampled.append([oracle.fake_output_token(request_index(rid), req.num_computed_tokens)])
        else:
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            n_acc = accept.num_accepted(request_index(rid), len(req.output_token_ids), len(drafts)) \
                if drafts and rid not in admitted else 0
            accepted += n_acc
            base = req.num_prompt_tokens + len(req.output_token_ids)
            sampled.append([oracle.fake_output_token(request_index(rid), base + j) for j in range(1 + n_acc)])
    return sampled, accepted


def async_sampled(sched, so, meta: dict, accept) -> tuple[list[list[int]], int]:
    """Under async scheduling, when a step's output is processed: the tokens each of its requests
    sampled. `meta` (taken when the step was scheduled): request id -> (whether it samples, whether
    its drafts are padding). Under speculative decoding, 1 + the accepted drafts, drawn at the
    output's position. Returns them and the drafts accepted."""
    import oracle
    sampled, accepted = [], 0
    for rid in so.num_scheduled_tokens:
        samples, padded = meta[rid]
        req = sched.requests.get(rid)
        if not samples or req is None:
            sampled.append([])
            continue
        drafts = so.scheduled_spec_decode_tokens.get(rid, [])
        n_acc = accept.num_accepted(request_index(rid), len(req.output_token_ids), len(drafts)) \
            if accept is not None and drafts and not padded else 0
        accepted += n_acc
        base = req.num_prompt_tokens + len(req.output_token_ids)
        sampled.append([oracle.fake_output_token(request_index(rid), base + j) for j in range(1 + n_acc)])
    return sampled, accepted


def async_step_meta(sched, so, running_before: set) -> dict:
    """What `async_sampled` needs to know of a step when it is scheduled."""
    return {rid: (not sched.requests[rid].is_prefill_chunk,
                  rid not in running_before and rid in so.scheduled_spec_decode_tokens)
            for rid in so.num_scheduled_tokens}


def vllm_request(r: dict, rid: str, hasher):
    """vLLM's Request for the case's row `r` (its prompt ids from the oracle's token maker),
    greedy, ignoring EOS, `r["output"]` tokens long."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    import oracle
    tr = {"prompt_tokens": r["prompt"], "prefix_group": None, "row": r["row"],
          "block_hashes": r.get("block_hashes"), "hash_block_tokens": 8}
    ids = oracle.make_prompt_ids(tr, 0, 0, {})
    sp = SamplingParams(max_tokens=r["output"], ignore_eos=True, temperature=0.0)
    return Request(request_id=rid, prompt_token_ids=ids, sampling_params=sp, pooling_params=None,
                   arrival_time=r["arrival_step"] + r["row"] * 1e-9, priority=r["priority"], block_hasher=hasher,
                   mm_features=mm_features(r))


# ---- image items (--images: oracle_spec.py, oracle_spec_async.py) ----------------------------------
def mm_features(r: dict):
    """vLLM's mm_features of a case's row with image items (`r["mm"]`: [offset, length, identifier]
    each, sorted by offset), one MultiModalFeatureSpec per item as scripts/oracle_mm.py gives them
    (no data: the fake model computes nothing); None for a row without."""
    if not r.get("mm"):
        return None
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=str(h),
                                  mm_position=PlaceholderRange(offset=o, length=n)) for o, n, h in r["mm"]]


def mm_budget(sched, vllm_config, mm: dict | None) -> None:
    """The encoder compute budget and cache a multimodal model's scheduler gets (vLLM's
    compute_mm_encoder_budget for `mm`'s max_tokens_per_item, and its disable_chunked_mm_input),
    as scripts/oracle_mm.py patches them in; nothing without `mm`."""
    if not mm:
        return
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager, compute_mm_encoder_budget

    config = vllm_config.scheduler_config
    config.disable_chunked_mm_input = bool(mm["disable_chunked_mm_input"])
    compute, size = compute_mm_encoder_budget(config, {"image": mm["max_tokens_per_item"]})
    sched.max_num_encoder_input_tokens = compute
    sched.encoder_cache_manager = EncoderCacheManager(cache_size=size)


class StoreConnector:
    """The scheduler side of an encoder-cache connector over shared storage (vLLM's
    ECExampleConnector, --ec-store): the items `stored` lists are in the store from the start,
    loads are synchronous (nothing waits in transit), and an encode instance (`producer`) adds
    what each step encodes once the step ran (note_encoded)."""

    def __init__(self, stored, producer: bool = False) -> None:
        self.stored = {str(h) for h in stored}
        self.is_producer, self.is_consumer = producer, not producer

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self.stored

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        return True

    def update_state_after_alloc(self, request, index: int) -> None:
        pass

    def update_state_after_free(self, request, index: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output):
        return None

    def update_connector_output(self, connector_output) -> None:
        pass

    def request_finished(self, request):
        return False, None

    def take_unavailable_requests(self) -> set:
        return set()

    def has_pending_push_work(self) -> bool:
        return False

    def get_ec_connector_stats(self):
        return None

    def note_encoded(self, sched, so) -> None:
        """An encode instance: the items `so` encoded are in the store once its step ran."""
        if self.is_producer:
            for rid, inputs in (so.scheduled_encoder_inputs or {}).items():
                for i in inputs:
                    self.stored.add(sched.requests[rid].mm_features[i].identifier)


def ec_store(sched, case: dict):
    """--ec-store: the scheduler given a StoreConnector over the case's stored items (and its
    producer role); None without."""
    if case.get("ec_store") is None:
        return None
    sched.ec_connector = StoreConnector(case["ec_store"], case.get("ec_producer", False))
    return sched.ec_connector


def record_outputs(engine_core_outputs: dict, step: int, prefix: list, first_token: dict, finish: dict) -> None:
    """update_from_output's results for `step`: the prefix-cache counts (queried, hit) added to
    `prefix`, each request's first token and finish step."""
    for eco in engine_core_outputs.values():
        stats = eco.scheduler_stats.prefix_cache_stats if eco.scheduler_stats is not None else None
        if stats is not None:
            prefix[0] += stats.queries + stats.preempted_queries
            prefix[1] += stats.hits + stats.preempted_hits
        for out in eco.outputs:
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = step
            if out.finish_reason is not None:
                finish[out.request_id] = step


def schedule_async_step(sched, step: int, outputs: dict, usable: int):
    """schedule() a step that runs ahead of earlier outputs (async scheduling, a batch queue):
    its row (tokens, running, waiting, blocks in use), or None when it ran nothing; `outputs`
    keeps (scheduler output, `async_step_meta`) by step for `process_async_output`."""
    running_before = {r.request_id for r in sched.running}
    so = sched.schedule()
    if so.total_num_scheduled_tokens == 0:
        return None
    n_running, n_waiting = sched.get_request_counts()
    outputs[step] = (so, async_step_meta(sched, so, running_before))
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return [so.total_num_scheduled_tokens, n_running, n_waiting, usable - free]


def process_async_output(sched, so, meta: dict, accept, step: int, aborts: list, prefix: list, first_token: dict,
                         finish: dict) -> int:
    """A step's output under async scheduling or a batch queue: the front end's aborts due then,
    the model runner's tokens (`async_sampled`), update_from_output and its results recorded
    (`record_outputs`). Returns the drafts accepted."""
    from vllm.v1.outputs import ModelRunnerOutput

    take_aborts(sched, aborts, step, "output")
    req_ids = list(so.num_scheduled_tokens)
    sampled, accepted = async_sampled(sched, so, meta, accept)
    mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                            sampled_token_ids=sampled)
    record_outputs(sched.update_from_output(so, mro), step, prefix, first_token, finish)
    return accepted


def random_aborts(rng, requests: list[dict]) -> list[dict]:
    """Aborts of about a third of the requests (a front end whose clients gave up), each at a
    random step up to 40 after its arrival, taken before that step is scheduled or after it ran
    and before its output is processed (vLLM's engine core takes aborts at both points)."""
    out = []
    for r in requests:
        if rng.random() < 0.35:
            out.append({"row": r["row"], "step": r["arrival_step"] + int(rng.integers(0, 40)),
                        "when": "before" if rng.random() < 0.5 else "output"})
    return out


def take_aborts(sched, aborts: list[dict], step: int, when: str) -> None:
    """vLLM's finish_requests(FINISHED_ABORTED), one id at a time as a front end sends them, for
    the requests `aborts` names at (`step`, `when`) that are still in the engine."""
    from vllm.v1.request import RequestStatus

    for a in aborts:
        if a["step"] == step and a["when"] == when:
            rid = str(a["row"])
            if rid in sched.requests and not sched.requests[rid].is_finished():
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


def propose_drafts(sched, so, req_ids: list[str], accept=None) -> None:
    """The drafter proposes for every request of the step (K, or dynamic speculation's K for its
    batch size), as the engine core hands them over; vLLM drops those of prompt chunks and
    finished requests. An n-gram proposer that finds no match (simkv's draw, `accept.proposes`,
    at the request's output count) proposes none; suffix decoding proposes as many as simkv's
    draw of the proposal's length (`accept.num_proposed`)."""
    import oracle
    from vllm.v1.outputs import DraftTokenIds

    n = so.num_spec_tokens_to_schedule
    on_device = accept is not None and accept.drafts_on_miss

    def drafts(rid):
        req = sched.requests.get(rid)
        if on_device:  # (vLLM's V2 runner: DraftTokensHandler hands the engine core K placeholders)
            return [-1] * n
        k = n
        if accept is not None and req is not None:
            k = accept.num_proposed(request_index(rid), len(req.output_token_ids), n)
        return [oracle.fake_output_token(request_index(rid), 10_000 + j) for j in range(k)]

    sched.update_draft_token_ids(DraftTokenIds(req_ids, [drafts(rid) for rid in req_ids]))


# ---- the two-venv dance of an oracle's main() -------------------------------------------------------
# ---- replies the next turn repeats (--replies) -----------------------------------------------------
def reply_sessions(rng, max_model_len: int) -> list[dict]:
    """Chat sessions of 8-token hash blocks: turn k's prompt = turn k-1's prompt + reply + new
    tokens; most rows' lists go on over their reply. Each row notes its previous turn's row."""
    requests = []
    for session in range(int(rng.integers(2, 8))):
        stream = [int(rng.integers(0, 3))] + [int(x) for x in rng.integers(10 + 1000 * session, 10 + 1000 * (session + 1), 80)]
        prompt, step, previous = 0, int(rng.integers(0, 20)), -1
        for turn in range(int(rng.integers(1, 6))):
            prompt += int(rng.integers(8 if turn == 0 else 1, 40))
            output = int(rng.integers(1, 40))
            if prompt >= max_model_len:
                break
            covered = prompt + output if rng.random() < 0.8 else prompt
            row = len(requests)
            requests.append({"row": row, "arrival_step": step, "prompt": prompt, "output": output,
                             "priority": int(rng.integers(0, 3)), "block_hashes": stream[:-(-covered // 8)],
                             "previous": previous})
            prompt, previous, step = prompt + output, row, step + int(rng.integers(0, 4))
    requests.sort(key=lambda r: (r["arrival_step"], r["row"]))
    return requests


def after_previous_turns(case: dict, run_simkv) -> None:
    """Push each turn's arrival past its previous turn's finish step in simkv's run (`run_simkv`,
    whose result has per-request [first token, finish] steps; vLLM's run is checked in
    `late_turns`), by a step more under async scheduling: its client has the reply once the
    finishing step's output is processed, a batch later."""
    lag = 2 if case["opts"].get("async_scheduling") else 1
    for _ in range(30):
        finish = {int(row): v[1] for row, v in run_simkv(case)["requests"].items()}
        late = [r for r in case["requests"] if r["previous"] >= 0 and r["arrival_step"] < finish[r["previous"]] + lag]
        if not late:
            return
        for r in late:
            r["arrival_step"] = finish[r["previous"]] + lag
        case["requests"].sort(key=lambda r: (r["arrival_step"], r["row"]))
    raise RuntimeError("arrivals did not settle after their previous turns")


def late_turns(case: dict, theirs: dict) -> list[str]:
    """Turns that arrived in vLLM's run before their previous turn finished there."""
    finish = {int(row): v[1] for row, v in theirs["requests"].items()}
    late = [r for r in case["requests"] if r["previous"] >= 0 and r["arrival_step"] <= finish.get(r["previous"], -1)]
    return [f"{len(late)} turns arrived before their previous turn finished in vLLM's run"] if late else []


def sample_reply_content(case: dict) -> None:
    """(vLLM's side) The fake model samples a row's content token where its hash list describes
    the reply (a list longer than its prompt needs), so vLLM hashes the reply as the next
    prompt has it."""
    import oracle

    rows = {r["row"]: r for r in case["requests"]}
    # (the fake model's own sampling, not an earlier case's: the cases run in one process)
    plain = oracle.__dict__.setdefault("plain_fake_output_token", oracle.fake_output_token)

    def sample(row: int, position: int) -> int:
        r = rows.get(row)
        ids = r.get("block_hashes") if r else None
        if ids and len(ids) * 8 >= r["prompt"] + 8 and position < len(ids) * 8:
            return oracle.hashed_token_id(int(ids[position // 8]), 8, position % 8)
        return plain(row, position)

    oracle.fake_output_token = sample


def oracle_args(description: str, speculative_flag: bool = False, hybrid_flag: bool = False,
                async_flag: bool = False, chunked_flag: bool = False, linear_flag: bool = False,
                align_flag: bool = False, offload_flag: bool = False, replies_flag: bool = False,
                aborts_flag: bool = False, parallel_flag: bool = False, ngram_misses_flag: bool = False,
                pd_flag: bool = False, pp_flag: bool = False, roles_flag: bool = False,
                parallel_drafting_flag: bool = False, dflash_flag: bool = False, mtp_modules_flag: bool = False,
                images_flag: bool = False):
    """An oracle's command line (the hidden --vllm-side is how it calls itself in vLLM's venv)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--oracle-python", default="/tmp/vllm-oracle-venv/bin/python")
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    if speculative_flag:
        ap.add_argument("--speculative", action="store_true", help="speculative decoding in 60 %% of the cases")
    if hybrid_flag:
        ap.add_argument("--hybrid", action="store_true",
                        help="sliding-window models' KV-cache groups (oracle_hybrid.py's cases), EAGLE in all")
    if chunked_flag:
        ap.add_argument("--chunked", action="store_true",
                        help="chunked local attention (Llama 4's) instead of sliding windows")
    if linear_flag:
        ap.add_argument("--linear", action="store_true",
                        help="linear-attention models' KV-cache groups (oracle_linear.py's cases; "
                             "oracle_spec_async.py: MTP in all; oracle_offload.py: prefix caching on, no drafts)")
    if align_flag:
        ap.add_argument("--align", action="store_true",
                        help="prefix caching on: vLLM's Mamba prefix caching (mamba_cache_mode 'align')")
    if offload_flag:
        ap.add_argument("--policy", choices=["lru", "arc"], default=None, help="the CPU tier's eviction policy")
        ap.add_argument("--store-threshold", action="store_true",
                        help="the connector's store_threshold (2 or 3) and, in some cases, a small max_tracker_size")
        ap.add_argument("--chunks", action="store_true",
                        help="the connector's non-default settings: blocks_per_chunk 1 to 4, offload_prompt_only off in 60 %% of the cases")

    if offload_flag or replies_flag:
        ap.add_argument("--replies", action="store_true",
                        help="chat sessions whose hash lists describe the replies the next turns repeat "
                             "(oracle_fuzz.py --replies; with offloading, offload_prompt_only off in 60 %% of them)")
    if async_flag:
        ap.add_argument("--async-scheduling", action="store_true",
                        help="vLLM's AsyncScheduler, driven two batches deep as its batch queue does")
    if aborts_flag:
        ap.add_argument("--aborts", action="store_true",
                        help="a front end aborts some requests (clients that gave up), before a step is "
                             "scheduled or before its output is processed")
    if parallel_flag:
        ap.add_argument("--parallel", action="store_true",
                        help="about a third of the requests ask for n = 2-4 sequences (parallel sampling), "
                             "fanned out as vLLM v1's front end does")
        ap.add_argument("--max-n", type=int, default=4,
                        help="with --parallel, the largest n (from 11 on, vLLM's request ids order a group's "
                             "members as strings: 0, 1, 10, 2, ...)")
    if pd_flag:
        ap.add_argument("--pd", action="store_true",
                        help="oracle_pd.py's cases: pulls and sends through a KV connector (P/D disaggregation)")
        ap.add_argument("--offload", action="store_true",
                        help="oracle_offload.py's cases: a CPU tier through vLLM's OffloadingConnector")
    if roles_flag:
        ap.add_argument("--pd", action="store_true",
                        help="P/D roles beside the CPU tier: plain requests, sends and pulls (oracle_pd.py's), "
                             "vLLM's MultiConnector with NIXL first")
        ap.add_argument("--no-tier", action="store_true", help="with --pd: NIXL alone, no CPU tier")
        ap.add_argument("--lora", action="store_true",
                        help="requests name LoRA adapters (or the base model); vLLM's max_loras 1 to 3")
        ap.add_argument("--draft-model", action="store_true",
                        help="with --speculative: a draft model (tiny-llama's layers) in every speculative case")
    if pp_flag:
        ap.add_argument("--pp", action="store_true",
                        help="pipeline parallelism: 2 to 4 stages, the engine's batch queue that many batches deep "
                             "(one more under async scheduling)")
    if ngram_misses_flag:
        ap.add_argument("--ngram-misses", action="store_true",
                        help="every case's drafter is ngram, whose prompt lookup finds a match at a rate of 0, "
                             "0.3 or 0.7 (spec_ngram_match_rate): without one a request proposes no drafts "
                             "(--model-runner v1) or K that are all rejected (v2, vLLM's default)")
        ap.add_argument("--model-runner", choices=["v1", "v2"], default=None,
                        help="every case's model_runner: v1 proposes n-grams on the host (real draft ids, none "
                             "without a match), v2 on the device (K placeholders after every step) [default: "
                             "the cases' own, auto]")
        ap.add_argument("--suffix", action="store_true",
                        help="every case's drafter is suffix decoding: K 4 to 12, proposals of drawn lengths "
                             "(spec_mean_draft_tokens), matches at a rate of 0.5, 0.8 or 1")
    if dflash_flag:
        ap.add_argument("--dflash", action="store_true",
                        help="every speculative case's drafter is dflash (K + 1 lookahead slots, no batch slots, "
                             "max_num_active_seqs capped at max_num_batched_tokens // (K + 1))")
    if mtp_modules_flag:
        ap.add_argument("--no-prefix-caching", action="store_true", help="prefix caching off in every case")
        ap.add_argument("--scheduled-tokens", action="store_true",
                        help="vLLM's max_num_scheduled_tokens in every case, a quarter to all of max_num_batched_tokens")
        ap.add_argument("--mtp-modules", type=int, default=1, metavar="N",
                        help="every speculative case's drafter is MTP with N modules (N > 1 and K > 1: vLLM's "
                             "multi-module MTP, K tokens of prefill runway; K cut to the block size under prefix "
                             "caching, which vLLM requires)")
    if parallel_drafting_flag:
        ap.add_argument("--parallel-drafting", action="store_true",
                        help="vLLM's parallel_drafting in every EAGLE and draft-model case (K - 1 or K more batch "
                             "slots per request)")
    if images_flag:
        ap.add_argument("--images", action="store_true",
                        help="image items in the prompts (scripts/oracle_mm.py's content: items repeated across and "
                             "within requests, up to 2 x max_num_batched_tokens), vLLM's encoder budget and cache")
        ap.add_argument("--disable-chunked-mm-input", action="store_true",
                        help="with --images: disable_chunked_mm_input in every case (items within the token budget "
                             "and the long-prefill threshold)")
        ap.add_argument("--method", default=None,
                        help="every speculative case's method: ngram, eagle, eagle3, mtp or draft_model")
        ap.add_argument("--ec-store", action="store_true",
                        help="with --images: encoder disaggregation's embedding store (vLLM's ec_connector over "
                             "shared storage): half the images stored from the start, loaded instead of encoded; "
                             "in half the cases the engine also stores what it encodes")
        ap.add_argument("--encode-only", action="store_true",
                        help="with --images: every case as an encode instance runs it (vLLM's mm_encoder_only: "
                             "no prefix caching, drafts or KV limits; a request ends once its prompt is consumed)")
    ap.add_argument("--save", type=Path, help="write the cases and vLLM's results to this JSON file")
    ap.add_argument("--vllm-side", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args()


def serve_vllm_side(args, run_vllm) -> bool:
    """In vLLM's venv (--vllm-side CASES OUT): run every case there; True if this was that call."""
    import json

    if not args.vllm_side:
        return False
    sys.path.insert(0, str(ORACLE_DIR))
    cases = json.loads(Path(args.vllm_side[0]).read_text())
    Path(args.vllm_side[1]).write_text(json.dumps([run_vllm(c) for c in cases]))
    return True


def vllm_results(script: str, cases: list, args) -> list:
    """Run `script` on the cases in vLLM's venv; its results (also written to --save with the cases)."""
    import json
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "cases.json"), Path(tmp, "vllm.json")
        src.write_text(json.dumps(cases))
        env = dict(os.environ, PYTHONPATH=str(Path(script).parent), VLLM_LOGGING_LEVEL="ERROR")
        subprocess.run([args.oracle_python, script, "--vllm-side", str(src), str(dst)], check=True, env=env)
        theirs = json.loads(dst.read_text())
    if args.save:
        args.save.write_text(json.dumps([{"case": c, "vllm": t} for c, t in zip(cases, theirs)]))
    return theirs
