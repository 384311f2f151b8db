"""The sample traces shipped in traces/: small, valid, attributed and reproducible."""
from __future__ import annotations

from pathlib import Path

import pytest

from simkv.traces import read_trace, write_trace
from simkv.traces.stats import trace_stats
from simkv.traces.synth import lognormal
from simkv.traces.synth_prefix import PrefixGroups, shared_prefix

TRACES = Path(__file__).resolve().parents[2] / "traces"
BUNDLED = {
    "azure_conv_slice.parquet": ("azure_LICENSE", 2000),
    "azure_code_slice.parquet": ("azure_LICENSE", 911),
    "mooncake_synthetic_slice.parquet": ("mooncake_LICENSE-APACHE", 1000),
    "kvcache_coding_sample.parquet": ("kvcache_tester_LICENSE", 115),
    "kvcache_coding_sessions.parquet": ("kvcache_tester_LICENSE", 115),
    "req400.parquet": (None, 400),
    "req400_prefix10.parquet": (None, 400),
}


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_trace_is_small_valid_and_licensed(name: str) -> None:
    license_file, rows = BUNDLED[name]
    path = TRACES / name
    assert path.stat().st_size < 1_000_000
    assert len(read_trace(path)) == rows
    readme = (TRACES / "README.md").read_text()
    assert f"`{name}`" in readme
    if license_file:
        assert (TRACES / "licenses" / license_file).is_file() and f"licenses/{license_file}" in readme


def test_bundled_generated_traces_are_byte_reproducible(tmp_path: Path) -> None:
    write_trace(lognormal(), tmp_path / "req400.parquet")
    assert (tmp_path / "req400.parquet").read_bytes() == (TRACES / "req400.parquet").read_bytes()
    write_trace(shared_prefix(PrefixGroups(groups=10, prefix_tokens=(1000,))), tmp_path / "p.parquet")
    assert (tmp_path / "p.parquet").read_bytes() == (TRACES / "req400_prefix10.parquet").read_bytes()


def test_azure_slice_is_the_start_of_the_conversation_trace() -> None:
    stats = trace_stats(read_trace(TRACES / "azure_conv_slice.parquet"))
    assert stats.first_arrival_s == 0.0 and 300 < stats.time_span_s < 480


def test_bundled_code_slice_is_the_code_trace_on_the_conversation_trace_s_clock(shared_traces: Path,
                                                                                tmp_path: Path) -> None:
    from simkv.traces.importers import import_trace
    from simkv.traces.transform import Edits, transform

    code, _ = import_trace("azure", [shared_traces / "azure" / "AzureLLMInferenceTrace_code.csv"])
    moved = transform(code, Edits(time_offset=77.29937))  # (18:17:03.97996 less 18:15:46.68059)
    write_trace(transform(moved, Edits(window=(0.0, 424.26))), tmp_path / "c.parquet")
    assert (tmp_path / "c.parquet").read_bytes() == (TRACES / "azure_code_slice.parquet").read_bytes()


def test_bundled_sessions_trace_is_the_sample_with_sessions_and_replies(shared_traces: Path, tmp_path: Path) -> None:
    from simkv.traces.importers import import_trace
    from simkv.traces.importers.kvcache_tester import ConversationStarts
    from simkv.traces.replies import link_replies

    trace, _ = import_trace("kvcache-tester", [shared_traces / "kvcache_tester"], starts=ConversationStarts(gap_s=60))
    linked, count = link_replies(trace)
    assert count == 89
    write_trace(linked, tmp_path / "s.parquet")
    assert (tmp_path / "s.parquet").read_bytes() == (TRACES / "kvcache_coding_sessions.parquet").read_bytes()
