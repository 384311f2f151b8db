"""Multimodal traces in a replay: the encoder budget and cache as vLLM sizes them, the vision
encoder's time in the steps that encode, the options and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.backends.vision_encoder import VisionEncoderCost
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.specs import get_gpu_spec, get_model_spec
from simkv.traces import trace_from_frame


def _image_trace(n: int = 40, image_tokens: int = 1024, same_image: bool = False, with_items: bool = True):
    """`n` requests, 0.1 s apart: 200 text tokens, an image, 100 more; 64 output tokens."""
    prompt = 300 + image_tokens
    frame = pd.DataFrame({"arrival_time_s": np.arange(n) * 0.1, "prompt_tokens": [prompt] * n,
                          "output_tokens": [64] * n})
    if with_items:
        frame["mm_offsets"] = [[200]] * n
        frame["mm_lengths"] = [[image_tokens]] * n
        frame["mm_hashes"] = [[1 if same_image else i + 1] for i in range(n)]
    return trace_from_frame(frame)


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "qwen2.5-vl-7b", "gpu": "H100-SXM", "max_model_len": 8192} | options)


def test_the_encoder_budget_and_cache_are_vllms():
    """max(max_num_batched_tokens, the model's largest item): 16,384 embeddings for Qwen2.5-VL with
    8,192 tokens a step; the trace's largest item for a model without a vision encoder."""
    result = replay(_image_trace(4), _config())
    mm = result.summary["multimodal"]
    assert result.summary["config"]["mm_max_tokens_per_item"] == 16384
    assert mm["encoder_budget_per_step"] == mm["encoder_cache_size"] == 16384
    plain = replay(_image_trace(4), EngineConfig.from_flat({"model": "llama-3-8b", "max_model_len": 8192}))
    assert plain.summary["multimodal"]["encoder_budget_per_step"] == 8192  # (max_num_batched_tokens)
    assert plain.summary["config"]["mm_max_tokens_per_item"] == 1024
    assert plain.summary["multimodal"]["encoder_cost"].startswith("not priced")


def test_steps_that_encode_take_the_encoders_time():
    """Every image encoded once: the encoder's seconds are its roofline's for those items, and the
    replay lasts longer than the same prompts as text by about that much."""
    images, text = replay(_image_trace(), _config()), replay(_image_trace(with_items=False), _config())
    mm = images.summary["multimodal"]
    assert mm["items_encoded"] == mm["items"] == 40 and mm["chunks_stopped_before_item"] == 0
    assert images.steps["num_encoder_embeds"].sum() == mm["embeds_encoded"] == 40 * 1024  # (steps.parquet's column)
    assert "num_encoder_embeds" not in text.steps
    cost = VisionEncoderCost(get_model_spec("qwen2.5-vl-7b"), get_gpu_spec("H100-SXM"))
    assert mm["encoder_seconds"] == pytest.approx(40 * cost.seconds((1024,)), rel=1e-6)
    assert 0.004 < cost.seconds((1024,)) < 0.03  # (5.1 GFLOP an embedding and attention at 60 % of 989 TFLOP/s: 9.5 ms)
    ttft = images.requests["ttft_s"].mean() - text.requests["ttft_s"].mean()
    assert ttft == pytest.approx(cost.seconds((1024,)), rel=0.3)


def test_an_image_shown_again_is_encoded_once():
    mm = replay(_image_trace(same_image=True), _config()).summary["multimodal"]
    assert mm["items_encoded"] == 1 and mm["embeds_encoded"] == 1024


def test_the_encoder_cost_counts_the_vit_and_its_merger():
    """Qwen2.5-VL-7B, by hand: 32 layers of 4 x 1280^2 + 3 x 1280 x 3420 parameters over 4 patches
    an embedding, and a merger of 5120^2 + 5120 x 3584: 5.129 GFLOP an embedding."""
    cost = VisionEncoderCost(get_model_spec("qwen2.5-vl-7b"), get_gpu_spec("H100-SXM"))
    assert cost.describe()["gflops_per_embed"] == 5.129
    # a full-attention layer of an image of 4,096 patches attends 4,096^2 pairs; a windowed one 4,096 x 64
    assert cost.attention_pairs(4096) == 28 * 4096 * 64 + 4 * 4096 * 4096


def test_under_tensor_parallelism_the_encoder_pays_its_all_reduces():
    """TP 2 on H100s (NVLink 450 GB/s): half the FLOPs per GPU, plus the sharded layers' 64
    all-reduces over 4,096 patches x 1,280 and the merger's over 1,024 x 3,584, bf16 (a ring of
    two sends half of each twice: all of it once), each with its 8 us latency."""
    spec, gpu = get_model_spec("qwen2.5-vl-7b"), get_gpu_spec("H100-SXM")
    one, two = VisionEncoderCost(spec, gpu), VisionEncoderCost(spec, gpu, tensor_parallel_size=2)
    comm = (64 * 4096 * 1280 * 2 + 1024 * 3584 * 2) / 450e9 + 65 * 8e-6
    assert two.seconds((1024,)) == pytest.approx(one.seconds((1024,)) / 2 + comm, rel=1e-9)
    assert 1.9e-3 < comm < 2.1e-3


def test_under_mm_encoder_tp_mode_data_each_gpu_encodes_its_share_whole():
    """vLLM's --mm-encoder-tp-mode data at TP 2: no all-reduces; items dealt out by size (vLLM's
    get_load_balance_assignment), each GPU runs the whole encoder on its own, then the embeddings
    are all-gathered (the largest share padded, half of it crossing the link). One image takes a
    whole GPU's time; two equal ones take no longer; the encoder's weights sit whole on each GPU."""
    from simkv.backends.vision_encoder import _deal_out
    from simkv.capacity import compute_capacity

    spec, gpu = get_model_spec("qwen2.5-vl-7b"), get_gpu_spec("H100-SXM")
    one_gpu, data = VisionEncoderCost(spec, gpu), VisionEncoderCost(spec, gpu, 2, data_parallel=True)
    gather = 1024 * 3584 * 2 / 450e9 + 8e-6
    assert data.seconds((1024,)) == pytest.approx(one_gpu.seconds((1024,)) + gather, rel=1e-9)
    assert data.seconds((1024, 1024)) == pytest.approx(data.seconds((1024,)), rel=1e-9)
    assert _deal_out((1000, 100, 200, 50), 2) == [[1000], [200, 100, 50]]  # (vLLM's docstring example)
    weights, whole = (compute_capacity(_config(tensor_parallel_size=2, **mode))
                      for mode in ({}, {"mm_encoder_tp_mode": "data"}))
    assert whole.num_gpu_blocks < weights.num_gpu_blocks
    with pytest.raises(ConfigError, match="mm_encoder_tp_mode must be weights or data"):
        _config(mm_encoder_tp_mode="pipeline")


def _write(tmp_path: Path, trace) -> str:
    from simkv.traces import write_trace

    path = tmp_path / "mm.parquet"
    write_trace(trace, path)
    return str(path)


def test_the_cli_replays_a_multimodal_trace(tmp_path: Path):
    path = _write(tmp_path, _image_trace(8))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["replay", path, "--model", "qwen2.5-vl-7b", "--max-model-len", "8192",
                                       "--mm-max-tokens-per-item", "2048", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["multimodal"]["encoder_budget_per_step"] == 8192
    assert summary["config"]["mm_max_tokens_per_item"] == 2048


@pytest.mark.parametrize("args, expected", [
    (["--mm-max-tokens-per-item", "512"], "column 'mm_lengths', request 0: an item of 1024 tokens exceeds "
                                          "mm_max_tokens_per_item (512)"),
    (["--disable-chunked-mm-input", "--max-num-batched-tokens", "512"], "Chunked MM input disabled but "
                                                                        "max_tokens_per_mm_item (16384)"),
    (["--mm-max-tokens-per-item", "0"], "mm_max_tokens_per_item must be >= 1"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--disable-chunked-mm-input", "--mm-max-tokens-per-item",
      "1024", "--prefill-set", "long_prefill_token_threshold=512"],
     "more than long_prefill_token_threshold (512) while other requests are around"),
    (["--disable-chunked-mm-input", "--max-num-batched-tokens", "1024", "--mm-max-tokens-per-item", "1024",
      "--speculative-method", "eagle3", "--num-speculative-tokens", "3"],
     "an item of 1024 tokens and the drafter's read-ahead of 1: a chunk must hold them whole, more than a "
     "request's share of a step (1024)"),
    (["--disable-chunked-mm-input", "--long-prefill-token-threshold", "512", "--mm-max-tokens-per-item", "1024"],
     "more than long_prefill_token_threshold (512) while other requests are around"),
])
def test_bad_options_are_refused_and_nothing_is_written(tmp_path: Path, args, expected):
    path = _write(tmp_path, _image_trace(4))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["replay", path, "--model", "qwen2.5-vl-7b", "--max-model-len", "8192",
                                       "--out", str(out)] + args)
    assert result.exit_code != 0
    assert expected in result.output
    assert not out.exists()


def test_a_linear_attention_model_under_prefix_caching_needs_chunked_items():
    with pytest.raises(ConfigError, match="Chunked MM input is required"):
        EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2,
                                "disable_chunked_mm_input": True})


def test_the_vision_encoders_weights_take_gpu_memory():
    """Qwen2.5-VL-7B's checkpoint: 8.29 B parameters in bf16, the ViT and merger 0.67 B of them."""
    vl, text = get_model_spec("qwen2.5-vl-7b"), get_model_spec("qwen2.5-7b")
    assert vl.weight_bytes - text.weight_bytes == 2 * (32 * vl.vision_layer_params + vl.vision_merger_params)
    assert vl.weight_bytes / 2e9 == pytest.approx(8.29, abs=0.01)


def test_a_fleet_sums_its_replicas_images():
    from simkv.replay.api import FleetSpec

    one = replay(_image_trace(), _config()).summary["multimodal"]
    fleet = replay(_image_trace(), _config(), fleet=FleetSpec(2)).summary["multimodal"]
    assert fleet["items"] == fleet["items_encoded"] == one["items_encoded"] == 40
    assert fleet["encoder_seconds"] == pytest.approx(one["encoder_seconds"])


def _ending_in_the_image(n: int = 40, image_tokens: int = 1024):
    """`n` requests whose prompts end with their image (200 text tokens, then the image)."""
    frame = pd.DataFrame({"arrival_time_s": np.arange(n) * 0.1, "prompt_tokens": [200 + image_tokens] * n,
                          "output_tokens": [64] * n, "mm_offsets": [[200]] * n, "mm_lengths": [[image_tokens]] * n,
                          "mm_hashes": [[i + 1] for i in range(n)]})
    return trace_from_frame(frame)


def test_a_prompt_loaded_from_the_cpu_tier_does_not_encode_its_image_again():
    """KV offloading (scripts/oracle_offload.py --images checks the engine core): 40 prompts with
    40 images, then the first 10 again. A pool of 400 blocks and an encoder cache of 16 images
    keep neither, so without a tier the 10 are encoded again; with one their KV, images
    included, comes back from host memory and only the prompts' last token is computed."""
    n, tokens = 50, 1324
    rows = [i % 40 for i in range(n)]
    frame = pd.DataFrame({"arrival_time_s": np.arange(n) * 0.5, "prompt_tokens": [tokens] * n,
                          "output_tokens": [16] * n, "mm_offsets": [[200]] * n, "mm_lengths": [[1024]] * n,
                          "mm_hashes": [[r + 1] for r in rows],
                          "block_hashes": [[1000 * r + b for b in range(-(-tokens // 16))] for r in rows]})
    trace = trace_from_frame(frame, hash_block_tokens=16)
    small = {"num_gpu_blocks": 400, "max_model_len": 4096}
    without = replay(trace, _config(**small)).summary
    tiered = replay(trace, _config(kv_offloading_size=8, **small)).summary
    assert without["multimodal"]["items_encoded"] == 50 and without["multimodal"]["encoder_cache_evictions"] > 0
    assert tiered["kv_offloading"]["loads"] == 10
    assert tiered["multimodal"]["items_encoded"] == 40
    assert tiered["multimodal"]["encoder_seconds"] == pytest.approx(0.8 * without["multimodal"]["encoder_seconds"])


def test_under_pd_each_pool_reports_the_images_it_encoded():
    """The prefill pool encodes every image. The decode pool recomputes each pulled prompt's last
    token (vLLM's _update_waiting_for_remote_kv), so a prompt that ends with its image is encoded
    again there; one that ends in text is not."""
    from simkv.replay.disaggregated import DisaggregationSpec

    spec = DisaggregationSpec(1, 1)
    text_after = replay(_image_trace(), _config(), disaggregation=spec).summary
    pools = text_after["disaggregation"]
    assert pools["prefill"]["multimodal"]["items_encoded"] == 40
    assert pools["decode"]["multimodal"]["items_encoded"] == 0
    assert text_after["multimodal"]["items_encoded"] == 40 and text_after["multimodal"]["items"] == 40
    ending = replay(_ending_in_the_image(), _config(), disaggregation=spec).summary
    assert ending["disaggregation"]["decode"]["multimodal"]["items_encoded"] == 40
    assert ending["multimodal"]["items_encoded"] == 80  # (both pools', summed)
    assert ending["multimodal"]["encoder_seconds"] == pytest.approx(2 * text_after["multimodal"]["encoder_seconds"])


def test_the_first_pipeline_stage_runs_the_encoder_and_holds_its_weights():
    """-pp 2: a lone request's first token comes later than as text by the encoder's whole time
    (the first stage runs it; it is not split over the stages), and the first stage's GPU holds
    the ViT's weights, so every stage gets fewer blocks than the text-only model's."""
    from simkv.capacity import compute_capacity

    cost = VisionEncoderCost(get_model_spec("qwen2.5-vl-7b"), get_gpu_spec("H100-SXM"))
    one = replay(_image_trace(1), _config(pipeline_parallel_size=2)).requests["ttft_s"][0]
    text = replay(_image_trace(1, with_items=False), _config(pipeline_parallel_size=2)).requests["ttft_s"][0]
    assert one - text == pytest.approx(cost.seconds((1024,)), abs=2e-6)
    vl = compute_capacity(_config(pipeline_parallel_size=2))
    plain = compute_capacity(_config(pipeline_parallel_size=2, model="qwen2.5-7b"))
    assert vl.pipeline_binding_stage == 0
    vision = get_model_spec("qwen2.5-vl-7b").vision_weight_bytes
    assert vl.pipeline_stage_weight_bytes - plain.pipeline_stage_weight_bytes == pytest.approx(vision, abs=1)
    # (and the encoder's start-up profile: only the first stage's activation reserve holds it)
    from simkv.capacity import activation_reserve_bytes

    profile = activation_reserve_bytes(_config(pipeline_parallel_size=2)) - activation_reserve_bytes(
        _config(pipeline_parallel_size=2), encoder=False)
    assert profile > 0
    assert (plain.num_gpu_blocks - vl.num_gpu_blocks) * vl.block_bytes == pytest.approx(vision + profile,
                                                                                        abs=vl.block_bytes)


def test_data_parallel_ranks_wait_for_the_slowest_ranks_encoder():
    """Qwen3-VL-30B-A3B as two DP ranks: a rank encodes its own requests' images before its
    forward pass, so two requests that arrive together, one on each rank, each with an image,
    take their first tokens one encoder time later than as text, not two."""
    config = EngineConfig.from_flat({"model": "qwen3-vl-30b-a3b", "gpu": "H100-SXM", "data_parallel_size": 2,
                                     "max_model_len": 8192})
    frame = pd.DataFrame({"arrival_time_s": [0.0, 0.0], "prompt_tokens": [1324, 1324], "output_tokens": [8, 8],
                          "mm_offsets": [[200], [200]], "mm_lengths": [[1024], [1024]], "mm_hashes": [[1], [2]]})
    images = replay(trace_from_frame(frame), config)
    text = replay(trace_from_frame(frame.drop(columns=["mm_offsets", "mm_lengths", "mm_hashes"])), config)
    cost = VisionEncoderCost(get_model_spec("qwen3-vl-30b-a3b"), get_gpu_spec("H100-SXM"))
    assert sorted(images.requests["replica"]) == [0, 1]
    assert images.summary["multimodal"]["items_encoded"] == 2
    assert images.summary["multimodal"]["encoder_seconds"] == pytest.approx(2 * cost.seconds((1024,)))
    later = images.requests["ttft_s"].to_numpy() - text.requests["ttft_s"].to_numpy()
    assert later == pytest.approx([cost.seconds((1024,))] * 2, abs=2e-6)


# Recorded cases of scripts/oracle_offload.py --images (vLLM 0.33's Scheduler with its
# OffloadingConnector, NIXL's pulls and sends under P/D, pipeline stages): chosen where simkv
# steps otherwise without the items.
OFFLOAD_IMAGES = json.loads((Path(__file__).resolve().parents[1] / "core" / "data" /
                             "images_offload_vllm_cases.json").read_text())


@pytest.mark.parametrize("recorded", OFFLOAD_IMAGES["cases"], ids=OFFLOAD_IMAGES["ids"])
def test_images_beside_a_tier_under_pd_and_stages_step_as_vllm(recorded):
    import copy

    from tests.core.helpers import offload_as_recorded

    assert offload_as_recorded(recorded) is not None
    stripped = copy.deepcopy(recorded)
    for r in stripped["case"]["requests"]:
        r.pop("mm")
    assert offload_as_recorded(stripped) is None  # (the items are what makes it step as vLLM)


# Recorded cases of scripts/oracle_mm.py: random traces with images through vLLM 0.33's scheduler
# (its encoder budget and cache as vLLM sizes them for a multimodal model), replayed with 1 s steps.
MM_COLUMNS = ("mm_offsets", "mm_lengths", "mm_hashes")
CASES = json.loads((Path(__file__).resolve().parents[1] / "core" / "data" / "mm_vllm_cases.json").read_text())["cases"]


def _flags(case: dict) -> str:
    return ("async" if case["async_scheduling"] else "sync") + ("-unchunked" * bool(case["opts"].get(
        "disable_chunked_mm_input")))


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{_flags(c)}" for i, c in enumerate(CASES)])
def test_recorded_cases_step_as_vllm(case):
    from tests.core.helpers import assert_as_recorded, observed_as_recorded, replay_recorded

    assert_as_recorded(observed_as_recorded(replay_recorded(case)), case["vllm"])


def test_the_recorded_cases_need_their_images():
    """The cases step otherwise without their items (all but one: seed 1's case 15, recorded for
    the decode-run mutant below, whose images constrain nothing in vLLM but did in an earlier
    simkv), the unchunked ones otherwise without the flag too, and they cover sync and async
    scheduling, with and without disable_chunked_mm_input."""
    from tests.core.helpers import observed_as_recorded, replay_recorded

    text_differs = 0
    for case in CASES:
        text = {k: v for k, v in case["trace"].items() if k not in MM_COLUMNS}
        opts = {"mm_max_tokens_per_item": None, "disable_chunked_mm_input": False}
        text_differs += observed_as_recorded(replay_recorded(case, text, opts))["steps"] != case["vllm"]["steps"]
        if case["opts"].get("disable_chunked_mm_input"):
            chunked = observed_as_recorded(replay_recorded(case, opts={"disable_chunked_mm_input": False}))
            assert chunked["steps"] != case["vllm"]["steps"]
    assert text_differs == len(CASES) - 1
    assert {_flags(c) for c in CASES} == {"sync", "async", "sync-unchunked", "async-unchunked"}


def _steps_otherwise(case: dict) -> bool:
    from simkv.replay.engine import ReplayError
    from tests.core.helpers import observed_as_recorded, replay_recorded

    try:
        return observed_as_recorded(replay_recorded(case))["steps"] != case["vllm"]["steps"]
    except ReplayError:  # (a stall: nothing schedulable)
        return True


@pytest.mark.parametrize("mutant", ["references kept", "decode runs over images"])
def test_the_recorded_cases_catch_these_mistakes(monkeypatch, mutant):
    """An engine that never drops an image's reference once computed past (the cache fills with
    entries nobody needs), or that jumps decode runs over a decoder still holding an image or a
    waiting head with images: some recorded case steps otherwise."""
    from simkv.core.encoder_cache import EncoderCacheManager
    from simkv.core.scheduler import Scheduler

    if mutant == "references kept":
        monkeypatch.setattr(EncoderCacheManager, "free_computed", lambda self, request, num_computed: None)
    else:
        monkeypatch.setattr(Scheduler, "_images_pending", lambda self: False)
    assert sum(_steps_otherwise(c) for c in CASES) >= (8 if mutant == "references kept" else 3)


def test_vllms_start_up_profile_runs_the_encoder_on_its_largest_items():
    """vLLM profiles a vision model's encoder on a dummy batch of its largest items, as many as
    the encoder budget holds (at most max_num_seqs prompts' worth, at least one), before the
    language model's dummy forward pass, which runs with their embeddings cached: the activation
    reserve is the larger of the two peaks, and --skip-mm-profiling leaves the encoder out."""
    from simkv.capacity import GIB, activation_reserve_bytes, compute_capacity, encoder_profile, encoder_profile_bytes

    assert encoder_profile(_config()) == (1, 16384)  # (budget max(8,192, 16,384): one item)
    assert encoder_profile(_config(mm_max_tokens_per_item=1024)) == (8, 1024)
    assert encoder_profile(_config(mm_max_tokens_per_item=1024, max_num_seqs=1, max_model_len=2048)) == (2, 1024)
    assert encoder_profile(_config(skip_mm_profiling=True)) is None
    assert encoder_profile(_config(model="qwen2.5-7b")) is None
    vit, embeddings = encoder_profile_bytes(_config())
    assert vit == 16384 * 4 * 2 * (2 * 3420 + 4 * 1280)  # (4 patches an embedding; the ViT's MLP and width)
    assert embeddings == 16384 * 3584 * 2
    forward = 8192 * 2 * (2 * 18944 + 4 * 3584)
    assert vit > forward + embeddings  # (here the encoder's peak is the larger)
    assert activation_reserve_bytes(_config()) == vit + GIB
    assert activation_reserve_bytes(_config(skip_mm_profiling=True)) == forward + GIB
    small = _config(mm_max_tokens_per_item=256, max_num_batched_tokens=8192)
    assert activation_reserve_bytes(small) == forward + 8192 * 3584 * 2 + GIB  # (the forward pass's, embeddings held)
    profiled, skipped = (compute_capacity(_config(skip_mm_profiling=skip)) for skip in (False, True))
    assert (skipped.num_gpu_blocks - profiled.num_gpu_blocks) * profiled.block_bytes == pytest.approx(
        vit - forward, abs=profiled.block_bytes)
    split, whole = (encoder_profile_bytes(_config(tensor_parallel_size=2, **mode))[0]
                    for mode in ({}, {"mm_encoder_tp_mode": "data"}))
    assert split == 16384 * 4 * 2 * (3420 + 4 * 1280) and whole == vit  # (data mode: one GPU runs the one item whole)


def test_a_vision_model_served_as_text_only_is_its_language_model():
    """vLLM's --language-model-only: no vision encoder on the GPUs and none in the start-up
    profile, so Qwen2.5-VL-7B holds what Qwen2.5-7B holds; a trace with images is refused, one
    without replays as the text model's does."""
    from simkv.capacity import compute_capacity, encoder_profile

    text_only, text_model = _config(language_model_only=True), _config(model="qwen2.5-7b")
    assert encoder_profile(text_only) is None and text_only.hardware.vision_weight_bytes_per_gpu() == 0
    assert compute_capacity(text_only).num_gpu_blocks == compute_capacity(text_model).num_gpu_blocks
    assert compute_capacity(text_only).num_gpu_blocks > compute_capacity(_config()).num_gpu_blocks
    with pytest.raises(ValueError, match="--language-model-only serves qwen2.5-vl-7b as text only"):
        replay(_image_trace(4), text_only)
    plain = _image_trace(20, with_items=False)
    assert replay(plain, text_only).summary["duration_s"] == replay(plain, text_model).summary["duration_s"]


def test_the_image_limit_per_prompt_caps_the_profile_and_refuses_more():
    """vLLM's --limit-mm-per-prompt: the start-up profile takes at most that many items a prompt
    (here 2 prompts of at most 2, where the budget holds 8), and a trace row with more images is
    refused with vLLM's text; the CLI takes vLLM's JSON, image=N or N."""
    from simkv.capacity import encoder_profile
    from simkv.cli.replay_cmd import ImageLimit

    small = dict(mm_max_tokens_per_item=1024, max_num_seqs=2, max_model_len=8192)
    assert encoder_profile(_config(**small)) == (8, 1024)
    assert encoder_profile(_config(**small, limit_mm_per_prompt=2)) == (4, 1024)
    two = trace_from_frame(pd.DataFrame({"arrival_time_s": [0.0, 0.1], "prompt_tokens": [2500, 1400],
                                         "output_tokens": [8, 8], "mm_offsets": [[100, 1300], [100]],
                                         "mm_lengths": [[1024, 1024], [1024]], "mm_hashes": [[1, 2], [3]]}))
    assert replay(two, _config(limit_mm_per_prompt=2)).summary["multimodal"]["items"] == 3
    with pytest.raises(ValueError, match=r"2 images in one prompt.*At most 1 image\(s\) may be provided"):
        replay(two, _config(limit_mm_per_prompt=1))
    with pytest.raises(ConfigError, match="limit_mm_per_prompt must be >= 1"):
        _config(limit_mm_per_prompt=0)
    assert [ImageLimit().convert(v, None, None) for v in ('{"image": 3}', "image=3", "3", '{"image": {"count": 3}}')] \
        == [3, 3, 3, 3]


def test_capacity_shows_the_encoder_budget_and_weights():
    result = CliRunner().invoke(main, ["capacity", "--model", "qwen2.5-vl-7b", "--max-num-batched-tokens", "32768",
                                       "--json"])
    assert result.exit_code == 0, result.output
    vis = json.loads(result.output)["vision_encoder"]
    spec = get_model_spec("qwen2.5-vl-7b")
    assert vis["encoder_budget_and_cache"] == 32768 and vis["mm_max_tokens_per_item"] == 16384
    assert vis["weight_bytes_per_gpu"] == 2 * (32 * spec.vision_layer_params + spec.vision_merger_params)
    cost = VisionEncoderCost(spec, get_gpu_spec("H100-SXM"))
    assert vis["seconds_for_largest_item"] == pytest.approx(cost.seconds((16384,)))
    assert vis["profile_items"] == 2 and vis["profile_embedding_bytes"] == 2 * 16384 * 3584 * 2  # (32,768 // 16,384)
    text = CliRunner().invoke(main, ["capacity", "--model", "qwen2.5-7b", "--json"])
    assert "vision_encoder" not in json.loads(text.output)
    assert json.loads(result.output)["startup_lines"][0] == (  # (vLLM's own log line)
        "Encoder cache will be initialized with a budget of 32768 tokens, and profiled with 2 image items of "
        "the maximum feature size.")
    skipped = CliRunner().invoke(main, ["capacity", "--model", "qwen2.5-vl-7b", "--skip-mm-profiling", "--json"])
    assert "profile_items" not in json.loads(skipped.output)["vision_encoder"]
    assert not json.loads(skipped.output)["startup_lines"][0].startswith("Encoder cache")
    text_only = CliRunner().invoke(main, ["capacity", "--model", "qwen2.5-vl-7b", "--language-model-only", "--json"])
    assert "vision_encoder" not in json.loads(text_only.output)


def test_images_replay_with_eagle_drafts():
    result = replay(_image_trace(), _config(speculative_method="eagle3", num_speculative_tokens=3,
                                            spec_acceptance_rate=0.6))
    mm = result.summary["multimodal"]
    assert mm["items_encoded"] == mm["items"] == 40
    assert result.summary["speculative_decoding"]["num_accepted_tokens"] > 0
