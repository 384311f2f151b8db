"""Linear attention (Qwen3-Next's Gated DeltaNet, Mamba2) beside full attention: vLLM's Mamba
KV-cache groups without prefix caching (mamba_cache_mode "none"), the block size that grows until
an attention page holds a state, capacity, the roofline's state traffic, config.json import and
what is refused; the scheduler against vLLM 0.33's on recorded cases."""

import copy
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkv.backends.factory import make_backend
from simkv.backends.roofline import linear_attention_work
from simkv.capacity import compute_capacity, group_blocks_per_request
from simkv.clock import TICKS_PER_SECOND
from simkv.config import CacheConfig, ConfigError, EngineConfig, HardwareConfig
from simkv.core.kv_cache_manager import KVCacheManager
from simkv.specs import get_model_spec
from simkv.specs.hf_config import ModelConfigError
from simkv.traces.schema import trace_from_frame
from tests.core.helpers import (assert_decode_runs_change_nothing, assert_same_async_replay_as_vllm,
                                assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm, make_request)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "core" / "data"
QWEN3_NEXT = "qwen3-next-80b-a3b"


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": QWEN3_NEXT, "gpu": "H200", "enable_prefix_caching": False} | options)


def _rooted(case: dict) -> dict:
    """A recorded case with its model's config.json path made absolute (they are relative to the repo)."""
    case = copy.deepcopy(case)
    opts = case["case"]["opts"] if "case" in case else case["opts"]
    opts["model"] = str(ROOT / opts["model"])
    return case


@pytest.mark.parametrize("index", range(12))
def test_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_linear.py: vLLM 0.33's scheduler with MambaSpec groups
    (mamba_cache_mode "none") beside a full-attention group, pools that fill up: every step's
    scheduled tokens, running, waiting and blocks in use (state blocks included), every request's
    first-token and finish step; the last four with ngram or MTP drafts (K more state blocks per
    group, vLLM's num_speculative_blocks), their accepted drafts too."""
    case = _rooted(json.loads((DATA / "linear_vllm_cases.json").read_text())["cases"][index])
    assert any(case["case"]["group_linear"]) and not all(case["case"]["group_linear"])
    ours = assert_same_steps_as_vllm(case)
    num_blocks = case["case"]["opts"]["num_gpu_blocks"]
    assert max(row[3] for row in ours["steps"]) == num_blocks - 1  # (the pool filled: admission was tight)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]
    assert (index >= 8) == bool(case["case"]["opts"].get("speculative_method"))


@pytest.mark.parametrize("index", range(4))
def test_same_speculative_steps_as_vllm_async(index):
    """Recorded cases of scripts/oracle_spec_async.py --linear: vLLM 0.33's AsyncScheduler with MTP
    drafts (placeholders for the drafts of a step in flight) over Mamba groups: steps, requests,
    accepted drafts."""
    case = _rooted(json.loads((DATA / "linear_spec_async_vllm_cases.json").read_text())["cases"][index])
    assert case["case"]["opts"]["speculative_method"] == "mtp" and any(case["case"]["group_linear"])
    assert_same_async_spec_steps_as_vllm(case)


@pytest.mark.parametrize("index", range(6))
def test_same_steps_as_vllm_async(index, tmp_path):
    """Recorded cases of scripts/oracle_hybrid_async.py --linear (the 6 with the most preemptions
    of 30): vLLM 0.33's AsyncScheduler, two batches deep, 1 s steps."""
    case = _rooted(json.loads((DATA / "linear_async_vllm_cases.json").read_text())[index])
    config = assert_same_async_replay_as_vllm(case, tmp_path)
    assert config.kv_cache_groups.num_linear_groups > 0


SUFFIX_CASES = json.loads((DATA / "linear_suffix_vllm_cases.json").read_text())["cases"]


@pytest.mark.parametrize("index", range(len(SUFFIX_CASES)))
def test_suffix_decoding_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_linear.py --suffix [--align]: suffix decoding (K 4 to 10,
    proposals of drawn lengths, acceptance 0 to 1) over Mamba groups, each holding K state blocks
    more a request; the last four under prefix caching (mode "align"). Steps, requests, accepted
    drafts and prefix hits equal."""
    case = _rooted(SUFFIX_CASES[index])
    opts = case["case"]["opts"]
    assert opts["speculative_method"] == "suffix" and any(case["case"]["group_linear"])
    assert opts["enable_prefix_caching"] == (index >= 4)
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]
    if index >= 4:
        stats = ours["scheduler"].kv_cache_manager.prefix_cache_stats
        assert [stats.queries, stats.hits] == case["vllm"]["prefix"] and stats.hits > 0


def test_recorded_linear_suffix_cases_depend_on_the_proposal_lengths(monkeypatch):
    """K drafts at every match, instead of the drawn lengths, breaks all eight recorded cases."""
    from simkv.core.spec_decode import AcceptanceModel
    from tests.core.helpers import count_failing, k_drafts_at_every_match

    monkeypatch.setattr(AcceptanceModel, "num_proposed", k_drafts_at_every_match)
    failing = count_failing(lambda case: assert_same_steps_as_vllm(_rooted(case)), SUFFIX_CASES)
    assert failing == len(SUFFIX_CASES)


def test_suffix_decoding_sizes_the_states_for_its_default_k():
    """Suffix decoding without K takes vLLM's 24: on Qwen3-Next at TP 4 the convolution state keeps
    3 + 24 inputs (372,736 B a layer: 368-token blocks, not the 272 of no drafts) and each Mamba
    group holds 1 + 24 state blocks a request; a cap of K = 8 holds 9 (304-token blocks)."""
    opts = dict(tensor_parallel_size=4, max_model_len=32768, speculative_method="suffix",
                spec_mean_draft_tokens=4.0)
    config = _config(**opts)
    assert config.speculative.num_speculative_tokens == 24
    assert get_model_spec(QWEN3_NEXT).linear_state_bytes(4, 24) == 2048 * 27 * 2 + 8 * 128 * 128 * 2 == 372736
    assert config.cache.block_size == 368 and config.state_blocks_per_group == 25
    assert compute_capacity(config).blocks_per_request == -(-32768 // 368) + 3 * 25
    capped = _config(**opts, num_speculative_tokens=8)
    assert capped.cache.block_size == 304 and capped.state_blocks_per_group == 9
    assert _config(tensor_parallel_size=4).cache.block_size == 272


def test_capacity_of_suffix_decoding_needs_no_proposal_mean():
    """`simkv capacity` sizes suffix decoding's states without --spec-mean-draft-tokens (a replay's
    option: capacity schedules nothing) and says what a request holds: 3 groups x (1 + 24) state
    blocks without prefix caching, against 3 x 1 with no drafts, in the JSON and the table."""
    from click.testing import CliRunner

    from simkv.cli.main import main

    args = ["capacity", "--model", QWEN3_NEXT, "--gpu", "H200", "-tp", "4", "--no-enable-prefix-caching"]
    held = {}
    for extra in ([], ["--speculative-method", "suffix"]):
        res = CliRunner().invoke(main, args + extra + ["--json"])
        assert res.exit_code == 0, res.output
        rep = json.loads(res.output)
        held[bool(extra)] = rep["linear_attention"]["state_blocks_per_request"]
    assert held == {False: 3, True: 75} and rep["block_size"] == 368
    # a 1,370-token request: 4 attention blocks of 368 beside its 75 state blocks
    res = CliRunner().invoke(main, args + ["--speculative-method", "suffix", "--request-tokens", "1370", "--json"])
    short = json.loads(res.output)["request_concurrency"][0]
    assert short["blocks_per_request"] == 4 + 75
    assert short["max_concurrency"] == json.loads(res.output)["num_gpu_blocks"] / 79
    table = CliRunner().invoke(main, args + ["--speculative-method", "suffix"], env={"COLUMNS": "200"})
    assert rep["block_bytes_per_gpu"] == 12 * 368 * 1024  # (12 layers a block)
    assert f"75 ({75 * 12 * 368 * 1024 / 2**30:.2f} GiB)" == "75 (0.32 GiB)" and "75 (0.32 GiB)" in table.output


@pytest.mark.parametrize("tp, kv_cache_dtype, block_size, expected", [
    (1, "auto", None, 544), (2, "auto", None, 544), (4, "auto", None, 272), (8, "auto", None, 144),
    (4, "fp8", None, 544),  # (half the attention page: twice the tokens)
    (4, "auto", 32, 288),  # (a multiple of the block size asked for)
    (4, "auto", 1024, 1024)])  # (already large enough)
def test_block_size_grows_until_an_attention_page_holds_a_state(tp, kv_cache_dtype, block_size, expected):
    """Qwen3-Next: a Gated DeltaNet layer's state is 8,192 x 3 bf16 convolution inputs and 32 x 128 x
    128 bf16 recurrent entries (1,097,728 B at TP 1, a quarter at TP 4); an attention layer's page
    holds 2 KV heads x 256 x 2 (K and V) bf16 per token (one head per GPU from TP 2). Public vLLM
    logs of Qwen3-Next: "Setting attention block size to 544 tokens", "Padding mamba page size by
    1.49%"."""
    options = {"tensor_parallel_size": tp, "kv_cache_dtype": kv_cache_dtype}
    if block_size is not None:
        options["block_size"] = block_size
    config = _config(**options)
    assert config.cache.block_size == expected
    spec = get_model_spec(QWEN3_NEXT)
    state = spec.linear_state_bytes(tp)
    assert state == (8192 * 3 * 2 + 32 * 128 * 128 * 2) // tp
    page = config.cache.block_size * 2 * max(2 // tp, 1) * 256 * config.cache.kv_dtype_bytes
    assert page >= state and page - state < max(16, block_size or 16) * page // config.cache.block_size
    if (tp, kv_cache_dtype, block_size) == (2, "auto", None):
        assert f"{100 * (page - state) / state:.2f}%" == "1.49%"


def test_a_block_size_below_the_state_is_refused_when_built_directly():
    with pytest.raises(ConfigError, match="block_size 16 gives an attention page smaller than a linear-attention "
                                          "layer's state; vLLM raises it to 544 tokens"):
        EngineConfig(cache=CacheConfig(block_size=16, enable_prefix_caching=False),
                     hardware=HardwareConfig(model=QWEN3_NEXT, gpu="H200", tensor_parallel_size=2))


def test_groups_and_capacity_of_qwen3_next():
    """36 Gated DeltaNet and 12 attention layers: 3 Mamba groups and 1 full-attention group of 12
    layers each; a block of 272 tokens holds 12 layers' pages of 272 x 1,024 B, and a request of
    32,768 tokens holds ceil(32,768 / 272) = 121 attention blocks and 3 state blocks."""
    config = _config(tensor_parallel_size=4, max_model_len=32768)
    groups = config.kv_cache_groups
    assert groups.summary() == "3 x mamba + 1 x full_attention" and groups.layers_per_block == 12
    assert [g.linear for g in groups.groups] == [True, True, True, False]  # (layer 0 is linear: its groups first)
    cap = compute_capacity(config)
    assert cap.block_bytes == 12 * 272 * 1024
    assert cap.blocks_per_request == 121 + 3 == group_blocks_per_request(config, 32768, startup=True)
    assert cap.max_concurrency == pytest.approx(cap.num_gpu_blocks / 124)
    assert cap.kv_cache_tokens == int(cap.num_gpu_blocks / 124 * 32768)
    # the same memory as full attention on 12 layers would give, less the state blocks
    assert cap.kv_bytes_per_token == 12 * 2 * 1 * 256 * 2


def test_a_request_holds_one_state_block_per_linear_group():
    kv = KVCacheManager(100, 16, 256, enable_caching=False, num_state_blocks=3)
    request = make_request(0, 40, 5)
    assert kv.remaining_blocks(request, 40) == 3 + 3
    blocks = kv.allocate_slots(request, 0, 40)
    assert len(blocks) == 3 and kv.num_blocks_of(request) == 6
    assert kv.block_pool.free_block_queue.num_free_blocks == 99 - 6
    assert kv.allocate_slots(request, 40, 9) is not None and kv.num_blocks_of(request) == 7  # (a 4th attention block)
    kv.free(request, 49, finished=True)
    assert kv.block_pool.free_block_queue.num_free_blocks == 99 and kv.num_blocks_of(request) == 0
    with pytest.raises(ValueError, match="without prefix caching"):
        KVCacheManager(100, 16, 256, enable_caching=True, num_state_blocks=3)


def test_admission_counts_the_state_blocks():
    """A pool of 9 usable blocks: a 96-token prompt needs 6 attention blocks and 3 state blocks
    (fits exactly); a second request waits even though its attention blocks alone would fit."""
    kv = KVCacheManager(10, 16, 256, enable_caching=False, num_state_blocks=3)
    assert kv.allocate_slots(make_request(0, 96, 1), 0, 96) is not None
    kv2 = KVCacheManager(10, 16, 256, enable_caching=False, num_state_blocks=3)
    assert kv2.allocate_slots(make_request(0, 97, 1), 0, 97) is None  # (7 + 3 > 9)


@pytest.mark.parametrize("options, message", [
    ({"enable_prefix_caching": True, "enable_chunked_prefill": False, "max_model_len": 4096}, "Chunked prefill is required for Mamba prefix caching."),
    ({"enable_prefix_caching": True, "prefix_caching_hash_bits": 32},
     "mamba_cache_mode 'align'.* not modelled with prefix_caching_hash_bits < 63 yet; pass --no-enable-prefix-caching"),
    ({"speculative_method": "eagle", "num_speculative_tokens": 2}, "not modelled with speculative_method 'eagle' "
                                                                   r"\(ngram, suffix and mtp are\)"),
    ({"tensor_parallel_size": 8, "decode_context_parallel_size": 2}, "DCP not support mamba now."),
    ({"sliding_window": 128}, "not modelled with sliding-window or chunked-attention overrides"),
    ({"disable_hybrid_kv_cache_manager": True}, "not modelled with disable_hybrid_kv_cache_manager"),
    ({"preemption_mode": "swap"}, "not modelled with preemption_mode 'swap'"),
    ({"tensor_parallel_size": 3}, "must be divisible by tensor parallel size"),
])
def test_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        _config(**({"tensor_parallel_size": 4} | options))


def test_spec_of_qwen3_next():
    """79.7B parameters (published: 80B), 3.9B active per token (3.3B without the embeddings and LM
    head: published "A3B"); only the 12 attention layers hold K/V."""
    spec = get_model_spec(QWEN3_NEXT)
    assert round(spec.num_params / 1e9, 1) == 79.7
    assert round((spec.num_active_params - spec.embedding_params) / 1e9, 1) == 3.3
    assert spec.num_attention_layers == 12 and spec.num_linear_attention_layers == 36
    assert spec.linear_attention_layers()[:4] == [True, True, True, False]
    assert spec.kv_bytes_per_token(2) == 12 * 2 * 2 * 256 * 2
    assert spec.simulated_only == "linear-attention layers"


def test_config_json_import():
    """Qwen3-Next's published config.json gives the shipped spec; a Mamba2 hybrid (Granite 4.0-H's
    fields) reads its mamba_* fields; Nemotron-H's MLP-only layers and an attention layer first are
    refused with the field named."""
    cfg = json.loads((DATA / "qwen3_next_80b_a3b_config.json").read_text())  # (its published config.json's fields)
    path = DATA / "tiny_mamba2_10x5.json"

    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp, "qwen3next.json")
        file.write_text(json.dumps(cfg))
        ours = dataclasses.replace(get_model_spec(str(file)), name=QWEN3_NEXT)
        assert ours == get_model_spec(QWEN3_NEXT)
        mamba = get_model_spec(str(path))
        assert (mamba.linear_attention, mamba.full_attention_interval, mamba.num_attention_layers) == ("mamba2", 5, 2)
        assert mamba.linear_state_bytes(1) == (4 * 8 + 2 * 1 * 8) * 3 * 2 + 4 * 8 * 8 * 2
        # Mamba2 replicates its one group to the TP size: 2 groups at TP 2
        assert mamba.linear_conv_dim(2) == (4 * 8 + 2 * 2 * 8) // 2
        bad = Path(tmp, "nemotron.json")
        bad.write_text(json.dumps(cfg | {"hybrid_override_pattern": "M-M*-"}))
        with pytest.raises(ModelConfigError, match="hybrid_override_pattern"):
            get_model_spec(str(bad))
        first = Path(tmp, "first.json")
        first.write_text(json.dumps(cfg | {"layer_types": ["full_attention"] + ["linear_attention"] * 3
                                           + ["linear_attention", "linear_attention", "linear_attention",
                                              "full_attention"] * 11}))
        with pytest.raises(ModelConfigError, match="layer_types': simkv models one attention layer in every k"):
            get_model_spec(str(first))


def test_roofline_counts_the_state_traffic():
    """A decode step reads and writes every sequence's 36 states (2 x 36 x 274,432 B per sequence at
    TP 4) and runs no attention in the linear layers: its memory time grows by that per sequence."""
    spec = get_model_spec(QWEN3_NEXT)
    flops, state, per_draft = linear_attention_work(spec, 4)
    assert state == 2 * 36 * 274432 and per_draft == 0
    assert flops == 36 * 8 * (4 * 128 * 128 + 2 * 64 * 256)
    backend = make_backend("roofline", _config(tensor_parallel_size=4))
    _, _, b0_1, b1 = backend.decode_step_line(1)
    _, _, b0_2, _ = backend.decode_step_line(2)
    weights_2 = backend.expert_bytes * backend.moe.experts_touched(2) - backend.expert_bytes * backend.moe.experts_touched(1)
    per_seq = (backend.kv_bytes_per_token + state + weights_2) / backend.byte_rate
    assert (b0_2 - b0_1) / TICKS_PER_SECOND == pytest.approx(per_seq + backend.seq_overhead_s + backend.comm_per_token, rel=1e-3)
    assert backend.flops_per_pair == 4.0 * 12 * 16 * 256 / 4  # (the attention layers' pairs only)


def test_replay_with_and_without_decode_runs_agree():
    """A replay that jumps over decode runs equals one that steps every decode (state blocks are
    taken at admission, attention blocks at boundaries)."""
    rng = np.random.default_rng(5)
    n = 60
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 3, n)), "prompt_tokens": rng.integers(10, 3000, n),
                          "output_tokens": rng.integers(1, 400, n)})
    config = _config(tensor_parallel_size=4, max_model_len=4096, num_gpu_blocks=80, max_num_seqs=32)
    a = assert_decode_runs_change_nothing(trace_from_frame(frame), config)
    assert a.summary["num_finished"] == n and a.summary["num_preemptions"] > 0
    groups = a.summary["kv_cache_groups"]
    assert groups["summary"] == "3 x mamba + 1 x full_attention" and groups["hybrid_kv_cache_manager"]
    assert groups["linear_attention"] == {"kind": "gated_deltanet", "state_bytes_per_layer": 274432,
                                          "state_blocks_per_request": 3, "page_bytes_per_layer": 272 * 1024,
                                          "mamba_cache_mode": "none"}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_parallel_sampling_fans_out(prefix_caching):
    """Rows for n sequences, fanned out as vLLM v1 does (checked step by step against vLLM:
    scripts/oracle_linear.py --parallel [--align]): every member holds its own state blocks, the
    replay that jumps over decode runs equals the stepped one, and with Mamba prefix caching
    ("align") the later members hit their first's prompt."""
    rng = np.random.default_rng(6)
    n = 40
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 3, n)), "prompt_tokens": rng.integers(10, 3000, n),
                          "output_tokens": rng.integers(1, 300, n), "n": rng.choice([1, 1, 2, 4], n)})
    config = _config(tensor_parallel_size=4, max_model_len=4096, num_gpu_blocks=120, max_num_seqs=32,
                     enable_prefix_caching=prefix_caching)
    a = assert_decode_runs_change_nothing(trace_from_frame(frame), config)
    assert a.summary["num_finished"] == n and a.summary["num_preemptions"] > 0
    assert a.requests["output_tokens"].tolist() == (frame.output_tokens * frame.n).tolist()
    hits = a.requests["prefix_hit_tokens"]
    assert (hits[frame.n > 1].sum() > 0) == prefix_caching


def test_speculative_decoding_adds_a_state_block_per_draft_token():
    """MTP with K = 2 on Qwen3-Next at TP 4: the convolution state keeps 3 + 2 inputs (282,624 B a
    layer: 288-token blocks), each Mamba group holds 1 + 2 blocks a request (vLLM's
    num_speculative_blocks), and the MTP layer, which attends, joins the attention group: 13 layers
    a block."""
    config = _config(tensor_parallel_size=4, max_model_len=32768, speculative_method="mtp", num_speculative_tokens=2)
    spec = get_model_spec(QWEN3_NEXT)
    assert spec.linear_state_bytes(4, 2) == 2048 * 5 * 2 + 8 * 128 * 128 * 2 == 282624
    assert config.cache.block_size == 288 and config.state_blocks_per_group == 3
    groups = config.kv_cache_groups
    assert groups.summary() == "3 x mamba + 1 x full_attention" and groups.layers_per_block == 13
    assert groups.num_padding_layers == 3  # (the Mamba groups: 12 layers each)
    cap = compute_capacity(config)
    assert cap.blocks_per_request == -(-32768 // 288) + 3 * 3
    assert cap.block_bytes == 13 * 288 * 1024
    assert config.draft_network.linear_attention == "" and config.draft_network.num_attention_layers == 1
    from simkv.core.scheduler import Scheduler

    assert Scheduler(config, 1000).kv_cache_manager.num_state_blocks == 9
    _, state, per_draft = linear_attention_work(spec, 4, 2)
    assert state == 2 * 36 * 282624 and per_draft == 36 * 282624  # (a read and a write, and one per draft)


@pytest.mark.parametrize("method, k", [("mtp", 2), ("suffix", 24)])
def test_roofline_writes_a_state_per_draft_verified(method, k):
    """A step's state traffic is a read and a write per sequence plus a write per draft it
    verifies, not per draft it could have had: a suffix proposal of 3 drafts costs 3 writes
    whatever K is; the same step with no drafts costs none more."""
    config = _config(tensor_parallel_size=4, speculative_method=method, num_speculative_tokens=k,
                     **({"spec_mean_draft_tokens": 4.0} if method == "suffix" else {}))
    backend = make_backend("roofline", config)
    target = getattr(backend, "inner", backend)
    state = get_model_spec(QWEN3_NEXT).linear_state_bytes(4, k) * 36
    assert (target.state_bytes_per_seq, target.state_bytes_per_draft) == (2 * state, state)
    seqs = 8
    base = target._time(seqs, seqs, 1000, 1000, max)
    for drafts in (3, 3 * seqs):
        extra = target._time(seqs + drafts, seqs, 1000, 1000, max, draft_tokens=drafts) - target._time(
            seqs + drafts, seqs, 1000, 1000, max)
        assert extra == pytest.approx(drafts * state / target.byte_rate, rel=1e-9)
    assert target._time(seqs, seqs, 1000, 1000, max, draft_tokens=0) == base


def test_data_parallel_ranks_read_their_states():
    """Qwen3-Next as 2 data-parallel ranks of TP 2: each rank's pool holds its own requests' state
    blocks, and a lockstep step's memory time counts each sequence's state read and written."""
    from tests.core.helpers import make_step

    config = _config(tensor_parallel_size=2, data_parallel_size=2)
    backend = make_backend("roofline", config)
    decode = make_step(decodes=64, context=64 * 2000)
    with_states = backend.dp_step_seconds([decode, decode])
    states = backend.state_bytes_per_seq
    assert states == 2 * 36 * get_model_spec(QWEN3_NEXT).linear_state_bytes(2)
    backend.state_bytes_per_seq = 0.0
    without = backend.dp_step_seconds([decode, decode])
    assert with_states - without == pytest.approx(64 * states / backend.byte_rate, rel=1e-6)


def test_data_parallel_ranks_write_a_state_per_draft_they_verify():
    """Under MTP a lockstep step's slowest rank pays a state write per draft it verifies: 64
    drafts on one rank lengthen the step by their writes, whichever rank has them."""
    from dataclasses import replace

    from tests.core.helpers import make_step

    config = _config(tensor_parallel_size=2, data_parallel_size=2, speculative_method="mtp", num_speculative_tokens=2)
    target = make_backend("roofline", config).inner
    decode = make_step(decodes=64, context=64 * 2000)
    verifying = replace(decode, num_draft_tokens=64)
    per_draft = 36 * get_model_spec(QWEN3_NEXT).linear_state_bytes(2, 2)
    assert target.state_bytes_per_draft == per_draft
    base = target.dp_step_seconds([decode, decode])
    for ranks in ([verifying, decode], [decode, verifying]):
        assert target.dp_step_seconds(ranks) - base == pytest.approx(64 * per_draft / target.byte_rate, rel=1e-6)


def test_pd_disaggregation_leaves_the_last_prompt_token_to_the_decode_side():
    """Qwen3-Next under P/D (vLLM's NIXL prefill backoff for Mamba layers): the prefill replica
    computes the prompt less its last token, the decode replica pulls the attention blocks of
    those tokens and each linear-attention group's state, then computes the last token itself
    (the first token) and decodes."""
    from simkv.replay.api import replay
    from simkv.replay.disaggregated import DisaggregationSpec

    config = _config(tensor_parallel_size=4)
    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [1000], "output_tokens": [3]}))
    res = replay(trace, config, "linear", {"step_base_s": 0.01, "step_per_token_s": 0.0},
                 disaggregation=DisaggregationSpec(1, 1))
    steps = pd.DataFrame(res.steps)
    assert list(steps["pool"]) == ["prefill", "decode", "decode", "decode"]
    assert list(steps["num_prefill_tokens"]) == [999, 1, 0, 0]
    capacity = compute_capacity(config)
    bs = config.cache.block_size
    groups = config.kv_cache_groups
    pulled_blocks = -(-999 // bs) + groups.num_linear_groups  # (attention blocks and one state per group)
    assert res.requests.iloc[0]["kv_pull_bytes"] == pulled_blocks * capacity.block_bytes
    assert res.requests.iloc[0]["output_tokens"] == 3


def test_pd_disaggregation_with_prefix_caching_pulls_past_the_local_hit():
    """With prefix caching (mode "align") the decode side's attention blocks of a first request
    serve a second one with the same prompt: it pulls only the blocks past them and the states
    (its lookup is the attention group's, as NIXL asks it: the pull brings the state)."""
    from simkv.replay.api import replay
    from simkv.replay.disaggregated import DisaggregationSpec

    config = _config(tensor_parallel_size=4, enable_prefix_caching=True)
    assert config.mamba_align
    frame = pd.DataFrame({"arrival_time_s": [0.0, 5.0], "prompt_tokens": [1000, 1000], "output_tokens": [3, 3]})
    frame["block_hashes"] = [list(range(63)), list(range(63))]
    frame["hash_block_tokens"] = 16
    res = replay(trace_from_frame(frame), config, "linear", {"step_base_s": 0.01, "step_per_token_s": 0.0},
                 disaggregation=DisaggregationSpec(1, 1))
    bs = config.cache.block_size
    groups = config.kv_cache_groups.num_linear_groups
    block_bytes = compute_capacity(config).block_bytes
    pulled = list(res.requests["kv_pull_bytes"])
    assert pulled[0] == (-(-999 // bs) + groups) * block_bytes
    assert pulled[1] == (-(-999 // bs) - 999 // bs + groups) * block_bytes
    assert res.summary["disaggregation"]["decode"]["prefix_cache_hits_tokens"] == 999 // bs * bs


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_pd_disaggregation_with_mtp(prefix_caching):
    """Qwen3-Next with its MTP layer under P/D, with and without prefix caching: every request
    is served, the prefill replica computes each prompt less its last token, and the decode
    replica accepts drafts."""
    from simkv.replay.api import replay
    from simkv.replay.disaggregated import DisaggregationSpec

    config = _config(tensor_parallel_size=4, enable_prefix_caching=prefix_caching, speculative_method="mtp",
                     num_speculative_tokens=2, spec_acceptance_rate=0.7)
    rng = np.random.default_rng(3)
    n = 40
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 2, n)), "prompt_tokens": rng.integers(2, 3000, n),
                          "output_tokens": rng.integers(1, 60, n)})
    res = replay(trace_from_frame(frame), config, "roofline", disaggregation=DisaggregationSpec(1, 1))
    assert (res.requests["output_tokens"] == frame["output_tokens"]).all()
    steps = pd.DataFrame(res.steps)
    assert steps.loc[steps["pool"] == "prefill", "num_prefill_tokens"].sum() == (frame["prompt_tokens"] - 1).sum()
    assert res.summary["speculative_decoding"]["num_accepted_tokens"] > 0


NEMOTRON_H_8B = {  # nvidia/Nemotron-H-8B-Base-8K's config.json, the fields read
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", "hidden_size": 4096,
    "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 21504, "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
    "conv_kernel": 4, "vocab_size": 131072, "max_position_embeddings": 8192, "tie_word_embeddings": False}


def test_nemotron_h_layout(tmp_path):
    """Nemotron-H-8B: 24 Mamba2 blocks, 4 attention blocks and 24 squared-ReLU MLP blocks, one per
    layer: 8.1B parameters (published: 8B); only the Mamba2 and attention layers are grouped (6
    Mamba groups and 1 attention group of 4 layers); vLLM keeps its recurrent state in float32 (128
    heads x 64 x 128 x 4 B), so an attention block of 1,040 tokens holds one layer's state."""
    path = tmp_path / "nemotron_h_8b.json"
    path.write_text(json.dumps(NEMOTRON_H_8B))
    spec = get_model_spec(str(path))
    assert round(spec.num_params / 1e9, 1) == 8.1
    assert (spec.num_linear_attention_layers, spec.num_attention_layers, spec.num_dense_mlp_layers) == (24, 4, 24)
    assert spec.linear_state_bytes(1) == (128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4
    assert spec.expert_params == 2 * 4096 * 21504 and spec.num_tp_allreduces == 52
    config = EngineConfig.from_flat({"model": str(path), "enable_prefix_caching": False})
    assert config.cache.block_size == 1040
    groups = config.kv_cache_groups
    assert groups.summary() == "6 x mamba + 1 x full_attention" and groups.layers_per_block == 4
    assert compute_capacity(config).block_bytes == 4 * 1040 * 2 * 8 * 128 * 2
    backend = make_backend("roofline", config)
    assert backend.comm_per_token == 0.0  # (TP 1)
    tp2 = make_backend("roofline", EngineConfig.from_flat({"model": str(path), "enable_prefix_caching": False,
                                                           "tensor_parallel_size": 2}))
    assert tp2.comm_fixed == pytest.approx(52 * 8.0e-6)  # (one all-reduce a block, not two a layer)
    # its variants: latent experts and per-layer MLP widths are refused
    for change, field in (({"moe_latent_size": 1024}, "moe_latent_size"),
                          ({"intermediate_size": [21504] * 24}, "intermediate_size"),
                          ({"hybrid_override_pattern": "M-M"}, "hybrid_override_pattern")):
        bad = tmp_path / f"{field}.json"
        bad.write_text(json.dumps(NEMOTRON_H_8B | change))
        with pytest.raises(ModelConfigError, match=f"field '{field}'"):
            get_model_spec(str(bad))


def test_nemotron_h_moe_layout():
    """A Nemotron 3-style pattern with expert blocks (E) beside MLP blocks: experts of
    moe_intermediate_size with a shared one, two projections each; the recorded tiny config's
    groups hold only its M and * layers."""
    spec = get_model_spec(str(DATA / "tiny_nemotron_h.json"))
    assert (spec.num_moe_layers, spec.num_dense_mlp_layers, spec.num_experts) == (2, 4, 4)
    assert spec.expert_params == 2 * 64 * 32 and spec.shared_expert_intermediate_size == 32
    assert spec.dense_intermediate_size == 128
    mlps = 4 * 2 * 64 * 128 + 2 * (64 * 4 + 2 * 64 * 32)
    assert spec.num_linear_params == 2 * spec.attention_params + 6 * spec.linear_attention_params + mlps
    config = EngineConfig.from_flat({"model": str(DATA / "tiny_nemotron_h.json"), "enable_prefix_caching": False})
    assert config.kv_cache_layer_windows == [-1, -1, 0, -1, -1, -1, 0, -1]


def test_config_json_fields_as_vllm_reads_them(tmp_path):
    """A Qwen3.5 config (in text_config) with only full_attention_interval is a linear hybrid; its
    mamba_ssm_dtype float32 doubles the recurrent state, which vLLM honours for Qwen3.5 only; the
    gated query is on unless attn_output_gate says false; a dense Granite 4.0-H's one MLP is its
    shared_mlp of shared_intermediate_size."""
    text = {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "full_attention_interval": 4, "hidden_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
            "vocab_size": 1000, "max_position_embeddings": 4096, "linear_num_key_heads": 1,
            "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32"}

    def spec_of(name: str, cfg: dict):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        return get_model_spec(str(path))

    qwen35 = spec_of("qwen35", {"model_type": "qwen3_5", "text_config": text})
    assert (qwen35.linear_attention, qwen35.num_attention_layers) == ("gated_deltanet", 2)
    assert qwen35.linear_state_dtype_bytes == 4 and qwen35.attention_output_gate
    assert spec_of("ungated", {"model_type": "qwen3_5", "text_config": text | {"attn_output_gate": False}}
                   ).attention_output_gate is False
    assert spec_of("next", text | {"model_type": "qwen3_next"}).linear_state_dtype_bytes == 2
    granite = json.loads((DATA / "tiny_mamba2_10x5.json").read_text())
    dense = spec_of("granite", granite | {"shared_intermediate_size": 96, "num_local_experts": 0})
    assert dense.intermediate_size == 96 and not dense.is_moe
