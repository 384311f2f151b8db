"""vllm bench serve's random-mm dataset (simkv/traces/vllm_random_mm.py) and the image sizes of
the Qwen VL processors (ModelSpec.image_embeddings)."""

import numpy as np
import pytest

from simkv.specs import get_model_spec
from simkv.traces.errors import TraceError
from simkv.traces.vllm_random import RandomDataset, Schedule
from simkv.traces.vllm_random_mm import RandomMultiModalDataset, parse_buckets, parse_limits

QWEN25_VL, QWEN3_VL = get_model_spec("qwen2.5-vl-7b"), get_model_spec("qwen3-vl-30b-a3b")


@pytest.mark.parametrize("height, width, qwen25, qwen3", [
    (256, 256, 81, 64),  # 256 / 28 rounds to 9; 256 / 32 is 8
    (720, 1280, 1196, 880),  # 26 x 46 and 22 x 40 (720 / 32 = 22.5 rounds to even 22)
    (896, 896, 1024, 784),
    (10, 10, 4, 64),  # below the smallest: scaled up to 56 x 56 (2 x 2) and 256 x 256 (8 x 8) pixels
    (8000, 8000, 16384, 16384),  # above the largest: scaled down to 16,384 embeddings
    (100, 5000, 716, 468),  # 4 x 179 and 3 x 156
])
def test_an_image_is_as_many_embeddings_as_the_processor_makes(height, width, qwen25, qwen3):
    assert QWEN25_VL.image_embeddings(height, width) == qwen25
    assert QWEN3_VL.image_embeddings(height, width) == qwen3


def test_images_past_the_processors_aspect_ratio_and_models_without_vision_are_refused():
    with pytest.raises(ValueError, match="aspect ratio must be below 200"):
        QWEN25_VL.image_embeddings(10, 2500)
    with pytest.raises(ValueError, match="no vision encoder"):
        get_model_spec("llama-3-8b").image_embeddings(256, 256)


def dataset(n=2000, seed=0, **mm) -> RandomMultiModalDataset:
    text = RandomDataset(num_prompts=n, random_input_len=200, random_output_len=50, seed=seed,
                         num_special_tokens=0, schedule=Schedule(request_rate=10.0))
    return RandomMultiModalDataset(text, **mm)


def test_each_request_gets_its_images_as_the_client_picks_them():
    mm = dataset(base_items_per_request=2, num_mm_items_range_ratio=0.5,
                 limit_mm_per_prompt=(("image", 3), ("video", 0)),
                 bucket_config=(((256, 256, 1), 0.25), ((720, 1280, 1), 0.75), ((720, 1280, 16), 0.0)))
    items = mm.items()
    counts = np.array([len(row) for row in items])
    assert set(counts) == {1, 2, 3} and abs(counts.mean() - 2) < 0.1  # uniform over [floor(1), ceil(3)]
    big = sum(b == (720, 1280, 1) for row in items for b in row) / counts.sum()
    assert abs(big - 0.75) < 0.03
    assert mm.items() == items  # (the same seed, the same draws)
    assert dataset(base_items_per_request=2, seed=1).items() != dataset(base_items_per_request=2).items()
    # the cap: at most 2 images, whatever the base asks for
    capped = dataset(base_items_per_request=3, num_mm_items_range_ratio=1.0, limit_mm_per_prompt=(("image", 2),),
                     bucket_config=(((256, 256, 1), 1.0),)).items()
    assert {len(row) for row in capped} == {0, 1, 2}


def test_the_trace_is_the_random_text_then_its_images():
    mm = dataset(n=300, base_items_per_request=1, num_mm_items_range_ratio=1.0)
    text = mm.text.trace(16)
    trace = mm.trace(QWEN25_VL.image_embeddings, 16)
    np.testing.assert_array_equal(trace.arrival_time_s, text.arrival_time_s)  # (vLLM's send times, its lengths)
    np.testing.assert_array_equal(trace.output_tokens, text.output_tokens)
    items = mm.items()
    for i in range(len(trace)):
        rows = trace.multimodal_items(i)
        sizes = [QWEN25_VL.image_embeddings(h, w) for h, w, _ in items[i]]
        assert [tokens for _, tokens, _ in rows] == sizes
        assert trace.prompt_tokens[i] == text.prompt_tokens[i] + sum(sizes)
        if rows:  # the images follow the text; the hash list keeps the text's full blocks only
            assert rows[0][0] == text.prompt_tokens[i]
            assert len(trace.block_hashes(i)) == text.prompt_tokens[i] // 16
        else:
            np.testing.assert_array_equal(trace.block_hashes(i), text.block_hashes(i))
    hashes = trace.mm_items[:, 2]
    assert len(set(hashes.tolist())) == len(hashes)  # every image new (random pixels)


@pytest.mark.parametrize("mm, message", [
    ({"bucket_config": (((720, 1280, 16), 1.0),)}, "videos .* are not modelled"),
    ({"bucket_config": (((256, 256, 1), -1.0),)}, "non-negative"),
    ({"bucket_config": (((256, 256, 1), 0.0),)}, "every probability is zero"),
    ({"limit_mm_per_prompt": (("video", 1),)}, "modality image of .* is not in --random-mm-limit-mm-per-prompt"),
    ({"num_mm_items_range_ratio": 1.5}, "must be in \\[0, 1\\]"),
    ({"base_items_per_request": 4, "limit_mm_per_prompt": (("image", 2),), "bucket_config": (((256, 256, 1), 1.0),)},
     "fewest items .* \\(4\\) exceed the most"),
    # (as vLLM's client: every bucket's modality needs a cap, a zero-probability video's too)
    ({"limit_mm_per_prompt": (("image", 2),)}, "modality video of \\(720, 1280, 16\\) is not in"),
])
def test_bad_random_mm_options_are_named(mm, message):
    with pytest.raises(TraceError, match=message):
        dataset(n=5, **mm).items()


def test_the_flags_parse_as_vllms_client_parses_them():
    assert parse_buckets("{(256, 256, 1): 0.5, (720, 1280, 16): 0}") == (((256, 256, 1), 0.5), ((720, 1280, 16), 0.0))
    assert parse_buckets("{'(256, 256, 1)': 1}") == (((256, 256, 1), 1.0),)
    assert parse_limits('{"image": 3, "video": 0}') == (("image", 3), ("video", 0))
    for bad, message in (("[1, 2]", "must be a dict"), ("{(256, 256): 1}", "expected \\(height, width, frames\\)"),
                         ("{(1, 2, 1): 'x'}", "is not a number"), ("{(", "not a Python dict literal")):
        with pytest.raises(TraceError, match=message):
            parse_buckets(bad)
    with pytest.raises(TraceError, match="whole numbers >= 0"):
        parse_limits('{"image": -1}')
