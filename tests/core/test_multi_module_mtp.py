"""Multi-module MTP (vLLM's use_multi_module_mtp: more than one MTP module and K > 1): prefill
chunks keep K tokens of runway, block keys cover the K tokens after the block, the last K - 1
computed tokens' blocks wait to be cached, every module runs over the whole step, and memory
holds every module."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from simkv.backends.drafting import Drafter
from simkv.capacity import kv_bytes_per_token
from simkv.config import ConfigError, EngineConfig, SpeculativeConfig
from simkv.core.block_hashing import BlockHasher
from simkv.core.scheduler import Scheduler
from simkv.specs import get_model_spec
from simkv.specs.hf_config import spec_fields_from_config
from tests.core.helpers import assert_same_async_spec_steps_as_vllm, assert_same_steps_as_vllm, drive_pd_async, make_request

DATA = Path(__file__).parent / "data"


def _config(k=3, modules=3, **opts) -> EngineConfig:
    flat = dict(num_gpu_blocks=200, block_size=16, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                speculative_method="mtp", num_speculative_tokens=k, spec_mtp_modules=modules) | opts
    return EngineConfig.from_flat(flat)


@pytest.mark.parametrize("method, modules, k, lookahead", [
    ("ngram", None, 3, 0), ("eagle", None, 3, 1), ("dflash", None, 3, 1), ("mtp", None, 3, 1), ("mtp", 1, 3, 1),
    ("mtp", 3, 1, 1), ("mtp", 3, 3, 3), ("mtp", 2, 4, 4), ("mtp", 5, 2, 2)])
def test_prefill_lookahead_by_method(method, modules, k, lookahead):
    """vLLM's num_prefill_lookahead_tokens: 1 for the EAGLE family and dflash, K under
    multi-module MTP (modules and K both above one; fewer modules than K still reads K ahead)."""
    flat = dict(num_gpu_blocks=100, block_size=16, max_model_len=256, speculative_method=method,
                num_speculative_tokens=k)
    if modules is not None:
        flat["spec_mtp_modules"] = modules
    assert EngineConfig.from_flat(flat).num_prefill_lookahead == lookahead


def test_modules_default_to_the_models():
    """The checkpoint's num_nextn_predict_layers (or Qwen's mtp_num_hidden_layers) is the default;
    --spec-mtp-modules overrides it."""
    target = dataclasses.replace(get_model_spec("llama-3-8b"), num_nextn_predict_layers=3)
    assert SpeculativeConfig("mtp", 3).multi_module_mtp(target)
    assert not SpeculativeConfig("mtp", 3, spec_mtp_modules=1).multi_module_mtp(target)
    assert not SpeculativeConfig("mtp", 3).multi_module_mtp(get_model_spec("llama-3-8b"))
    assert SpeculativeConfig("mtp", 3).draft_spec(target).num_layers == 3


@pytest.mark.parametrize("field", ["num_nextn_predict_layers", "mtp_num_hidden_layers"])
def test_imported_config_carries_its_modules(tmp_path, field):
    config = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=1000, max_position_embeddings=4096)
    (tmp_path / "mtp.json").write_text(json.dumps(config | {field: 3}))
    assert spec_fields_from_config(str(tmp_path / "mtp.json"))["num_nextn_predict_layers"] == 3
    (tmp_path / "plain.json").write_text(json.dumps(config))
    assert "num_nextn_predict_layers" not in spec_fields_from_config(str(tmp_path / "plain.json"))


@pytest.mark.parametrize("opts, message", [
    (dict(speculative_method="eagle", spec_mtp_modules=3), "mtp method's"),
    (dict(spec_mtp_modules=0), "must be >= 1"),
    (dict(block_size=4, num_speculative_tokens=5), "scheduler_block_size (=4) >= num_speculative_tokens (=5)"),
    (dict(model="qwen3-next-80b-a3b", enable_prefix_caching=False), "linear-attention layers"),
    (dict(model="gemma-3-12b"), "with prefix caching is not modelled with sliding-window"),
    (dict(model="llama-4-scout"), "with prefix caching is not modelled with sliding-window or chunked local")])
def test_refusals(opts, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(**opts)


@pytest.mark.parametrize("model", ["gemma-3-12b", "llama-4-scout"])
def test_sliding_windows_without_prefix_caching(model):
    """Sliding-window and chunked-local targets run multi-module MTP without prefix caching (checked
    step by step against vLLM's scheduler; with prefix caching refused above)."""
    config = _config(model=model, enable_prefix_caching=False, max_model_len=4096)
    assert config.num_prefill_lookahead == 3 and config.has_sliding_window


def test_small_blocks_without_prefix_caching():
    """vLLM's block-size check is prefix caching's: without it K may exceed the block."""
    assert _config(block_size=4, k=5, enable_prefix_caching=False).num_prefill_lookahead == 5


def test_a_prefill_chunk_keeps_k_tokens_of_runway():
    """A 65-token prompt and a 64-token budget: one module ends the first chunk one token short
    of the end (64 + 1); three modules need 3 tokens of runway, so the chunk is 62 (+ 3)."""
    chunks = []
    for modules in (1, 3):
        sched = Scheduler(_config(modules=modules), 200)
        sched.add_request(make_request(0, 65, 4))
        first = sched.schedule()
        sched.update_from_output(first)
        chunks.append([first.chunks[0].num_new_tokens, sched.schedule().chunks[0].num_new_tokens])
    assert chunks == [[64, 1], [62, 3]]


def test_a_waiting_request_without_a_chunk_is_passed_over():
    """Budget 64: a 63-token prompt, then a 3-token one whose one-token chunk would leave 2 < K
    tokens (no chunk fits: vLLM skips it), then a 1-token prompt, which is admitted."""
    sched = Scheduler(_config(), 200)
    for i, prompt in enumerate((63, 3, 1)):
        sched.add_request(make_request(i, prompt, 4))
    out = sched.schedule()
    assert [(c.request.index, c.num_new_tokens) for c in out.chunks] == [(0, 63), (2, 1)]
    assert sched.num_waiting() == 1


def test_block_keys_cover_k_tokens_after_the_block():
    """Two prompts equal up to two tokens past their first block: with one lookahead token the
    block's keys match, with three (multi-module MTP, K = 3) they differ."""
    a = make_request(0, 12, 4, hashes=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], h=1)
    b = make_request(1, 12, 4, hashes=[1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12], h=1)
    keys = {}
    for lookahead in (1, 3):
        hasher = BlockHasher(4, lookahead=lookahead)
        for r in (a, b):
            r.block_hashes = []
        keys[lookahead] = [hasher.block_key(r, 0) for r in (a, b)]
    assert keys[1][0] == keys[1][1] and keys[3][0] != keys[3][1]


def test_the_last_k_minus_1_computed_tokens_are_not_cached():
    """vLLM's num_reprefillable_tokens: of 12 computed tokens of a 20-token prompt (block 4), the
    last K - 1 = 2 may be prefilled again, so 2 blocks are cacheable, not 3; the block keys need
    the 3 tokens after them known."""
    request = make_request(0, 20, 4, hashes=list(range(20)), h=1)
    assert BlockHasher(4, lookahead=3, reprefillable=2).num_cacheable_blocks(request, 12) == 2
    assert BlockHasher(4, lookahead=1).num_cacheable_blocks(request, 12) == 3
    assert BlockHasher(4, lookahead=3, reprefillable=2).num_cacheable_blocks(request, 20) == 4  # (17 known)
    assert BlockHasher(4, reprefillable=2).num_hashed_blocks(request, 30) == 4  # (the known 20, less 2)


def test_every_module_runs_over_the_whole_step():
    """The drafter's time: one module (K passes, the later ones a token per request) against three
    (every pass over all of the step's tokens): three modules cost K times the first pass."""
    times = {}
    for modules in (1, 3):
        config = _config(modules=modules, model="llama-3-8b", num_gpu_blocks=None, max_num_batched_tokens=512)
        sched = Scheduler(config.for_kv_manager(), 2000)
        for i in range(4):
            sched.add_request(make_request(i, 100, 20))
        out = sched.schedule()
        sched.update_from_output(out)
        drafter = Drafter(config)
        assert drafter.network.model.num_layers == 1
        out = sched.schedule()  # (four 1 + 3 decodes)
        work = drafter._first_work(out, drafter._sampling(out)[0])
        first = drafter.network._time(*work[:4], max, *work[4:])
        times[modules] = drafter.seconds(out), first
    (one, one_first), (three, three_first) = times[1], times[3]
    assert one_first == three_first and three == pytest.approx(3 * three_first) and one < three


def test_memory_holds_every_module():
    """Every module's KV layer: three modules add three layers' K and V per token."""
    layer = get_model_spec("llama-3-8b").kv_bytes_per_layer_token(2)
    base = kv_bytes_per_token(_config(modules=1, model="llama-3-8b", num_gpu_blocks=None), 1)
    assert kv_bytes_per_token(_config(modules=3, model="llama-3-8b", num_gpu_blocks=None), 1) == base + 2 * layer


def _recorded(name: str) -> list[dict]:
    return json.loads((DATA / name).read_text())["cases"]


@pytest.mark.parametrize("index", range(6))
def test_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_spec.py --mtp-modules 3 (vLLM 0.33's scheduler with a
    three-module MTP drafter, K 1 to 3): every step and request equal. Each differs from vLLM's
    without the prefill runway, with one-token block keys, or caching the last K - 1 computed
    tokens' blocks (the file's source line says which)."""
    case = _recorded("spec_mtp_modules_vllm_cases.json")[index]
    assert case["case"]["opts"]["spec_mtp_modules"] == 3
    ours = assert_same_steps_as_vllm(case)
    assert ours["scheduler"].spec_stats["num_accepted_tokens"] == case["vllm"]["accepted"]


@pytest.mark.parametrize("index", range(4))
def test_same_steps_as_vllm_async(index):
    """Recorded cases of scripts/oracle_spec_async.py --mtp-modules 3 (AsyncScheduler two batches
    deep, with preemptions of requests whose step is in flight)."""
    assert_same_async_spec_steps_as_vllm(_recorded("spec_mtp_modules_async_vllm_cases.json")[index])


PD = _recorded("pd_mtp_modules_vllm_cases.json")


@pytest.mark.parametrize("case", PD, ids=[c["name"] for c in PD])
def test_same_steps_as_vllm_under_pd(case):
    """Recorded cases of scripts/oracle_pd.py --speculative --mtp-modules 3 (pulls and sends through
    a KV connector, which keeps vLLM's legacy block keys: the runway and the uncached last K - 1
    tokens still apply, and NIXL leaves the prompt's last K - 1 tokens to the decode side: a send
    computes the prompt less them, a pull loads that much), synchronous and async."""
    from tests.core.test_remote_kv import _assert_same_as_recorded, _trimmed

    if case["case"]["opts"].get("async_scheduling"):
        ours = drive_pd_async(case["case"])
        ours.pop("scheduler")
        assert _trimmed(ours["steps"]) == _trimmed(case["vllm"]["steps"])
        assert ours["requests"] == case["vllm"]["requests"]
    else:
        _assert_same_as_recorded(case)


def test_an_imported_checkpoint_with_modules_is_multi_module(tmp_path):
    """A Hugging Face config with three MTP modules: `--speculative-method mtp` at K = 3 runs vLLM's
    multi-module MTP without --spec-mtp-modules; the option still overrides it."""
    config = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=1000, max_position_embeddings=4096, num_nextn_predict_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    flat = dict(model=str(tmp_path / "config.json"), num_gpu_blocks=100, speculative_method="mtp", num_speculative_tokens=3)
    assert EngineConfig.from_flat(flat).num_prefill_lookahead == 3
    assert EngineConfig.from_flat(flat | dict(spec_mtp_modules=1)).num_prefill_lookahead == 1
    assert EngineConfig.from_flat(flat).draft_network.num_layers == 3


HYBRID = json.loads((DATA / "hybrid_mtp_modules_vllm_cases.json").read_text())


@pytest.mark.parametrize("index", range(2))
def test_sliding_window_models_same_steps_as_vllm(index):
    """Recorded cases of scripts/oracle_hybrid.py --mtp-modules 3 --no-prefix-caching (sliding-window
    models, the modules' layers in the full-attention groups): every step and request equal."""
    case = HYBRID["sync"][index]
    assert not case["case"]["opts"]["enable_prefix_caching"] and case["case"]["group_windows"]
    assert_same_steps_as_vllm(case)


@pytest.mark.parametrize("index", range(2))
def test_sliding_window_models_same_steps_as_vllm_async(index):
    assert_same_async_spec_steps_as_vllm(HYBRID["async"][index])
