"""The mixed-traffic study's tables (docs/studies.md, "Chat beside long documents: one engine,
two kinds of traffic"), regenerated.

Two kinds of traffic on one engine (llama-3.1-8b on one H100, vLLM 0.33's defaults): the bundled
Azure conversation slice as "chat" (2,000 turns over 7 minutes, prompts of 1,105 tokens on
average) and the Mooncake slice slowed tenfold as "docs" (141 requests in those 7 minutes,
prompts of 13,571 tokens on average: long documents, agents' contexts), merged with `simkv trace
merge` and cut to the chat's 7 minutes. Replayed as vLLM serves them first come, first served; with
the docs at a lower priority (`--scheduling-policy priority`); with long prefills held to
2,048 tokens a step (`--long-prefill-token-threshold`); with both; and with every step held to
2,048 tokens (`--max-num-batched-tokens`). For each, each class's TTFT / TPOT and
its attainment of its SLOs (chat: TTFT 500 ms, TPOT 50 ms; docs: TTFT 20 s, TPOT 100 ms), then
the highest load (both kinds scaled together) at which 99 % of each class meet them.

    .venv/bin/python scripts/study_request_classes.py
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config import EngineConfig  # noqa: E402
from simkv.replay.api import FleetSpec, replay  # noqa: E402
from simkv.studies.goodput_search import search_max_rate  # noqa: E402
from simkv.traces.merge import merge_traces  # noqa: E402
from simkv.traces.schema import read_trace, take_rows  # noqa: E402
from simkv.traces.transform import Edits, transform  # noqa: E402

SLO = {"chat:ttft": 500.0, "chat:tpot": 50.0, "docs:ttft": 20000.0, "docs:tpot": 100.0}
BASE = {"model": "llama-3.1-8b"}  # (128k context: the documents fit; llama-3-8b holds 8,192)
POLICIES = [("first come, first served", {}),
            ("docs at priority 1", {"scheduling_policy": "priority"}),
            ("long prefills 2,048 a step", {"long_prefill_token_threshold": 2048}),
            ("both", {"scheduling_policy": "priority", "long_prefill_token_threshold": 2048}),
            ("2,048-token steps", {"max_num_batched_tokens": 2048})]


FLEETS = [("4 mixed", {}, ()),
          ("4 mixed, long prefills 2,048", {"long_prefill_token_threshold": 2048}, ()),
          ("3 chat + 1 docs", {}, (("docs", (3,)),)),
          ("2 chat + 2 docs", {}, (("docs", (2, 3)),)),
          ("3 chat + 1 docs, long prefills 2,048", {"long_prefill_token_threshold": 2048}, (("docs", (3,)),))]
FLEET_LOAD = 4.0


def mixed_trace():
    chat = transform(read_trace(ROOT / "traces" / "azure_conv_slice.parquet"), Edits(priority=0))
    docs = transform(read_trace(ROOT / "traces" / "mooncake_synthetic_slice.parquet"),
                     Edits(time_scale=10.0, priority=1))
    merged = merge_traces([("chat", chat), ("docs", docs)])
    keep = np.flatnonzero(merged.arrival_time_s <= chat.arrival_time_s[-1])
    return take_rows(merged, keep)


def main() -> None:
    trace = mixed_trace()
    counts = {c: int((trace.request_class == c).sum()) for c in ("chat", "docs")}
    print(f"trace: {len(trace):,} requests ({counts['chat']:,} chat, {counts['docs']:,} docs) over "
          f"{trace.arrival_time_s[-1]:.0f} s")
    print()
    print("| engine | class | TTFT p50 / p99 s | TPOT p50 / p99 ms | ITL p50 / p99 ms | preemptions | SLOs met |")
    print("|---|---|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for name, options in POLICIES:
        s = replay(trace, EngineConfig.from_flat(BASE | options), goodput=SLO).summary
        for cls, c in s["classes"]["classes"].items():
            print(f"| {name} | {cls} | {c['ttft_s']['p50']:.2f} / {c['ttft_s']['p99']:.2f} | "
                  f"{1e3 * c['tpot_s']['p50']:.1f} / {1e3 * c['tpot_s']['p99']:.1f} | "
                  f"{1e3 * c['itl_s']['p50']:.1f} / {1e3 * c['itl_s']['p99']:.1f} | {c['num_preemptions']:,} | "
                  f"{100 * c['slo_attainment']:.1f} % |")
    print()
    print("| engine | highest load meeting 99 % of each class's SLOs (x the trace's) | req/s |")
    print("|---|---:|---:|")
    for name, options in POLICIES:
        r = search_max_rate(trace, EngineConfig.from_flat(BASE | options), SLO, target=0.99, tolerance=0.02)
        factor = r["bracket_factors"][0]
        rate = "-" if r["max_rate_req_s"] is None else f"{r['max_rate_req_s']:.2f}"
        print(f"| {name} | {'-' if factor is None else f'{factor:.3g}'} ({r['status']}) | {rate} |")
    print()
    print(f"Four replicas behind a least-outstanding router, the trace at {FLEET_LOAD:g}x:")
    print()
    print("| fleet | class | TTFT p50 / p99 s | TPOT p50 / p99 ms | SLOs met | highest load (x the trace's) |")
    print("|---|---|---:|---:|---:|---:|")
    fast = replace(trace, arrival_time_s=trace.arrival_time_s / FLEET_LOAD)
    for name, options, classes in FLEETS:
        setup_rows(name, trace, fast, EngineConfig.from_flat(BASE | options), SLO,
                   FleetSpec(4, "least_outstanding", class_replicas=classes))
    azure_mix()
    print(f"\n({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


AZURE_SLO = {"ttft": 1000.0, "tpot": 100.0, "code:ttft": 500.0}
AZURE_SETUPS = [("1 engine", {}, 1, ()),
                ("1 engine, code first (priority)", {"scheduling_policy": "priority"}, 1, ()),
                ("2 replicas, mixed", {}, 2, ()),
                ("2 replicas: 1 conv + 1 code", {}, 2, (("code", (1,)),))]


def azure_mix() -> None:
    """Azure's own mix: its conversation and code traces over the same 7 minutes, llama-3-8b on H100s."""
    conv = transform(read_trace(ROOT / "traces" / "azure_conv_slice.parquet"), Edits(priority=1))
    code = transform(read_trace(ROOT / "traces" / "azure_code_slice.parquet"), Edits(priority=0))
    trace = merge_traces([("conv", conv), ("code", code)])
    print()
    print("Azure's conversation and code traces over the same 7 minutes, llama-3-8b on H100s:")
    print()
    print("| setup | class | queue p50 / p99 s | TTFT p50 / p99 s | TPOT p50 / p99 ms | SLOs met | "
          "highest load (x the trace's) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, options, replicas, classes in AZURE_SETUPS:
        fleet = FleetSpec(replicas, "least_outstanding", class_replicas=classes) if replicas > 1 else None
        setup_rows(name, trace, trace, EngineConfig.from_flat(options), AZURE_SLO, fleet, queue=True)


def setup_rows(name: str, trace, replayed, config, slo: dict, fleet, queue: bool = False) -> None:
    """One setup's table rows, a row per class: `replayed` (the trace at the load shown) replayed,
    and the highest load, both classes scaled together, at which 99 % of each meet `slo`."""
    s = replay(replayed, config, goodput=slo, fleet=fleet).summary
    r = search_max_rate(trace, config, slo, target=0.99, tolerance=0.02, fleet=fleet)
    best = "-" if r["max_rate_req_s"] is None else f"{r['bracket_factors'][0]:.3g}"
    for k, (cls, c) in enumerate(s["classes"]["classes"].items()):
        waits = f"{c['queue_s']['p50']:.2f} / {c['queue_s']['p99']:.2f} | " if queue else ""
        print(f"| {name if k == 0 else ''} | {cls} | {waits}{c['ttft_s']['p50']:.2f} / {c['ttft_s']['p99']:.2f} | "
              f"{1e3 * c['tpot_s']['p50']:.1f} / {1e3 * c['tpot_s']['p99']:.1f} | "
              f"{100 * c['slo_attainment']:.1f} % | {best if k == 0 else ''} |")


if __name__ == "__main__":
    main()
