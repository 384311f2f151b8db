"""The trace's multimodal items: mm_offsets, mm_lengths, mm_hashes (simkv/traces/schema.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkv.traces import TraceError, read_trace, trace_from_frame, write_trace
from simkv.traces.schema import take_rows


def _frame(**change) -> pd.DataFrame:
    frame = pd.DataFrame({
        "arrival_time_s": [0.2, 0.1, 0.3],
        "prompt_tokens": [100, 50, 80],
        "output_tokens": [5, 5, 5],
        "mm_offsets": [[0, 40], [], [10]],
        "mm_lengths": [[30, 60], [], [64]],
        "mm_hashes": [[7, 8], [], [7 + 100]],
    })
    for name, value in change.items():
        frame[name] = value
    return frame


def test_items_follow_their_rows_through_sorting_and_files(tmp_path: Path) -> None:
    trace = trace_from_frame(_frame())
    assert trace.multimodal_items(0) == ()  # (the row that arrived first has none)
    assert trace.multimodal_items(1) == ((0, 30, 7), (40, 60, 8))
    assert trace.max_mm_item_tokens() == 64
    for suffix in (".parquet", ".csv"):
        path = tmp_path / f"t{suffix}"
        write_trace(trace, path)
        assert read_trace(path) == trace
    picked = take_rows(trace, np.array([2, 1]))
    assert [picked.multimodal_items(i) for i in range(2)] == [((10, 64, 107),), ((0, 30, 7), (40, 60, 8))]


def test_a_text_trace_has_no_items() -> None:
    trace = trace_from_frame(_frame().drop(columns=["mm_offsets", "mm_lengths", "mm_hashes"]))
    assert trace.mm_items is None and trace.max_mm_item_tokens() == 0 and trace.multimodal_items(0) == ()


@pytest.mark.parametrize("change, expected", [
    ({"mm_lengths": [[30], [], [64]]}, "column 'mm_lengths', row 0: 1 entries, but mm_offsets has 2"),
    ({"mm_lengths": [[30, 61], [], [64]]}, "column 'mm_lengths', row 0: item at 40 of 61 tokens ends past the prompt"),
    ({"mm_offsets": [[0, 20], [], [10]]}, "column 'mm_offsets', row 0: item at 20 starts before the previous one ends"),
    ({"mm_offsets": [[-1, 40], [], [10]]}, "column 'mm_offsets', row 0: offset -1 is negative"),
    ({"mm_lengths": [[0, 60], [], [64]]}, "column 'mm_lengths', row 0: length 0 must be >= 1"),
    ({"mm_hashes": [[7, 8], [], [7]]}, "column 'mm_hashes', row 2: mm_hash 7 has 64 tokens here and another length"),
    ({"mm_hashes": [[7, "x"], [], [107]]}, "column 'mm_hashes', row 0: hash id 'x' is not an integer"),
])
def test_bad_items_name_column_and_row(change: dict, expected: str) -> None:
    with pytest.raises(TraceError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        trace_from_frame(_frame(**change))


def test_the_three_columns_come_together() -> None:
    with pytest.raises(TraceError, match="need the columns mm_offsets, mm_lengths, mm_hashes; missing mm_hashes"):
        trace_from_frame(_frame().drop(columns=["mm_hashes"]))


def test_transform_adds_images_before_the_prompts_last_tokens(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from simkv.cli.main import main
    from simkv.traces.images import FIRST_IMAGE_HASH, add_images, image_block_ids

    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [100, 10], "output_tokens": [5, 5],
                          "block_hashes": [list(range(7)), [9]], "hash_block_tokens": [16, 16]})
    trace = trace_from_frame(frame)
    changed, count = add_images(trace, 1.0, 64, images_per_request=2)
    assert count == 2
    assert changed.prompt_tokens.tolist() == [228, 138]
    # row 0: 16 tokens before its end is 84, at the block boundary 80 its images (5 text blocks, two
    # images of 4 blocks, the 2 text blocks after); row 1 (10 tokens): its images first
    first, second, third, fourth = (FIRST_IMAGE_HASH + k for k in range(4))
    assert changed.multimodal_items(0) == ((80, 64, first), (144, 64, second))
    assert changed.multimodal_items(1) == ((0, 64, third), (64, 64, fourth))
    assert changed.block_hashes(0).tolist() == [0, 1, 2, 3, 4] + image_block_ids(first, 4) + \
        image_block_ids(second, 4) + [5, 6]
    assert changed.block_hashes(1).tolist() == image_block_ids(third, 4) + image_block_ids(fourth, 4) + [9]
    # images whose tokens the hash block does not divide: the list is cut before them
    odd, _ = add_images(trace, 1.0, 50)
    assert odd.multimodal_items(0) == ((84, 50, first),) and odd.block_hashes(0).tolist() == [0, 1, 2, 3, 4]
    assert odd.block_hashes(1).tolist() == [] and odd.hash_block_tokens.tolist() == [16, 0]
    few, _ = add_images(trace_from_frame(frame.loc[[0, 0, 0, 0]].reset_index(drop=True)), 1.0, 8,
                        distinct_images=1)
    assert len(np.unique(few.mm_items[:, 2])) == 1
    with pytest.raises(TraceError, match="has multimodal items already"):
        add_images(changed, 0.5, 64)
    with pytest.raises(TraceError, match=r"--images must be in \(0, 1\], got 1.5"):
        add_images(trace, 1.5, 64)
    path, out = tmp_path / "t.parquet", tmp_path / "img.parquet"
    write_trace(trace, path)
    result = CliRunner().invoke(main, ["trace", "transform", str(path), "--out", str(out), "--images", "1",
                                       "--image-tokens", "64", "--images-per-request", "2"])
    assert result.exit_code == 0, result.output
    assert read_trace(out) == changed
    inspect = CliRunner().invoke(main, ["trace", "inspect", str(out)])
    assert "images         4 in 2 rows (4 distinct), 256 tokens" in inspect.output
    assert "at most 2 in one prompt" in inspect.output  # (what --limit-mm-per-prompt must allow)


def test_a_conversations_later_turns_show_its_earlier_images(tmp_path: Path) -> None:
    """Turn 2 repeats turn 1's prompt and reply, turn 3 turn 2's: turn 1's image stands in both at
    its place, with its blocks, and turn 3's own image goes after it; a turn of another session,
    and a turn that does not repeat the history, do not show it."""
    from simkv.traces.images import FIRST_IMAGE_HASH, add_images, image_block_ids

    frame = pd.DataFrame({
        "arrival_time_s": [0.0, 1.0, 2.0, 3.0, 4.0], "prompt_tokens": [64, 128, 192, 64, 128],
        "output_tokens": [16, 16, 16, 16, 16], "session_id": ["a", "a", "a", "b", "a"],
        "block_hashes": [[0, 1, 2, 3, 4], list(range(8)) + [20], list(range(12)) + [21], [30, 31, 32, 33],
                         [40, 41, 42, 43, 44, 45, 46, 47]],
        "hash_block_tokens": [16] * 5})
    trace = trace_from_frame(frame)
    chosen = np.random.default_rng(8).random(5) < 0.5  # (the draws add_images makes with this seed)
    changed, count = add_images(trace, 0.5, 32, seed=8)
    assert chosen.tolist() == [True, False, True, False, False] and count == 2
    first, second = FIRST_IMAGE_HASH, FIRST_IMAGE_HASH + 1
    image = image_block_ids(first, 2)
    assert changed.multimodal_items(0) == ((48, 32, first),)
    assert changed.multimodal_items(1) == ((48, 32, first),)
    assert changed.multimodal_items(2) == ((48, 32, first), (208, 32, second))
    assert changed.multimodal_items(3) == () and changed.multimodal_items(4) == ()
    assert changed.prompt_tokens.tolist() == [96, 160, 256, 64, 128]
    assert changed.block_hashes(0).tolist() == [0, 1, 2] + image + [3, 4]
    assert changed.block_hashes(1).tolist() == [0, 1, 2] + image + [3, 4, 5, 6, 7, 20]
    assert changed.block_hashes(2).tolist() == [0, 1, 2] + image + list(range(3, 11)) + \
        image_block_ids(second, 2) + [11, 21]


def test_vllms_benchmark_client_cannot_send_images() -> None:
    from simkv.traces.vllm_bench import export_timed_trace

    with pytest.raises(TraceError, match="columns mm_\\*: the trace has images"):
        export_timed_trace(trace_from_frame(_frame()))
