"""Replay speed and memory on this machine (issue: >= 8,000 simulated requests per wall-second
on the Azure 2023 conversation trace with the roofline model; 1,000,000 synthetic requests
within 3 minutes at <= 2 GB peak memory).

    .venv/bin/python bench/replay_speed.py azure        # full Azure conv trace (19,366 requests)
    .venv/bin/python bench/replay_speed.py synth-1m     # 1,000,000 lognormal requests, Poisson arrivals
    .venv/bin/python bench/replay_speed.py azure-fleet4 # the Azure trace at 4x its rate on 4 replicas
                                                        # (least_outstanding router): a fleet's cost
    .venv/bin/python bench/replay_speed.py azure-async  # the Azure trace with --async-scheduling
    .venv/bin/python bench/replay_speed.py chat-paced chat-open  # 120,000 multi-turn chat requests (20,000
                                                        # sessions), sessions paced on their replies / open loop
    .venv/bin/python bench/replay_speed.py chat-clients # the same chat turns from 1,024 clients, one conversation
                                                        # each (client limits: Budget per send and release)
    .venv/bin/python bench/replay_speed.py chat-rotation # the same from 1,024 rotating clients of 4 conversations
                                                        # each (vLLM's multi-turn benchmark's clients)
    .venv/bin/python bench/replay_speed.py azure-tokens # the Azure trace behind a KV-footprint gateway of 233,280
                                                        # tokens (--client-max-inflight-tokens)
    .venv/bin/python bench/replay_speed.py azure-pd4    # the Azure trace at 4x its rate on 2 prefill + 2 decode
                                                        # replicas (P/D disaggregation)
    .venv/bin/python bench/replay_speed.py azure-pd4-async  # the same with --async-scheduling in both pools
    .venv/bin/python bench/replay_speed.py azure-70b-tp4 azure-70b-pp2  # the Azure trace on llama-3-70b, 4 H100s as
                                                        # TP 4, or TP 2 x PP 2 (pipeline stages: every request stepped)
    .venv/bin/python bench/replay_speed.py azure-spec   # the Azure trace with EAGLE-3 speculative decoding (K=3):
                                                        # decodes are chunks, no decode runs (-async: under
                                                        # async scheduling, vLLM's serving default)
    .venv/bin/python bench/replay_speed.py azure-gemma3 # the Azure trace on gemma-3-12b (5 of 6 layers slide over
                                                        # 1,024 tokens): hybrid KV-cache manager, 6 KV-cache groups
    .venv/bin/python bench/replay_speed.py azure-llama4 # the Azure trace on llama-4-scout, 4 H100s at TP 4 (3 of 4
                                                        # layers chunked over 8,192 tokens: chunk starts are events)
    .venv/bin/python bench/replay_speed.py azure-qwen3next # the Azure trace on qwen3-next-80b-a3b, 4 H200s at TP 4
                                                        # (3 of 4 layers linear attention: a state block per
                                                        # request and Mamba group; prefix caching off)
    .venv/bin/python bench/replay_speed.py azure-qwen3next-pc  # the same with prefix caching (mamba_cache_mode "align")
    .venv/bin/python bench/replay_speed.py azure-oss-spec  # the Azure trace on gpt-oss-120b (H100) with EAGLE-3:
                                                        # hybrid manager, the EAGLE layer in the full groups
    .venv/bin/python bench/replay_speed.py azure-dsv3   # the Azure trace on deepseek-v3, 8 H200s at TP 8 (latent
                                                        # attention: the roofline's two MLA paths)
    .venv/bin/python bench/replay_speed.py azure-dsv3-dp8  # the same on 8 data-parallel ranks in lockstep (every
                                                        # step of every rank stepped)
    .venv/bin/python bench/replay_speed.py azure-dsv32  # the Azure trace on deepseek-v3.2, 8 H200s at TP 8 (sparse
                                                        # attention: every step stepped, its decodes' contexts listed)
    .venv/bin/python bench/replay_speed.py azure-lora4  # the Azure trace naming 16 LoRA adapters (Zipf), max_loras 4:
                                                        # every step passes over the requests without a slot
    .venv/bin/python bench/replay_speed.py azure-vl azure-images  # the Azure trace on qwen2.5-vl-7b as text, and
                                                        # with half its prompts showing a 1,024-token image
                                                        # (encoder inputs; decode runs stop at images)
    .venv/bin/python bench/replay_speed.py azure-clients  # the Azure trace at 2x its rate, clients that give up
                                                        # on a first token after 10 s and retry twice
                                                        # (-async: the same with --async-scheduling)
    .venv/bin/python bench/replay_speed.py azure-pd2-clients  # the Azure trace at 4x its rate on 1 prefill + 1 decode
                                                        # replica, clients that give up after 10 s and retry twice
    .venv/bin/python bench/replay_speed.py rollout      # 5,000 prompts x 8 samples (parallel sampling fanned out,
                                                        # 40,000 sequences) arriving over 10 minutes
    .venv/bin/python bench/replay_speed.py rollout-dp8  # the same on deepseek-v3, 8 data-parallel ranks on H200s
                                                        # (each sample routed on its own)
    .venv/bin/python bench/replay_speed.py all
    .venv/bin/python bench/replay_speed.py azure --repeat 5

Each case runs in a fresh subprocess so that its peak RSS (ru_maxrss) is its own.
Prints wall time of the replay itself (trace loading excluded, shown apart; `with_outputs_s`
adds building the request and step tables and the summary), simulated
requests per wall-second, simulated steps, and peak RSS. This VM's speed drifts by 25 % and
more between runs: with `--repeat N` (default 3 for azure, 1 for synth-1m) every run is printed,
then a line with the best and the median.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AZURE = ROOT.parent / "shared" / "traces" / "azure" / "AzureLLMInferenceTrace_conv.csv"


def load(case: str):
    from simkv.traces.arrivals import ArrivalProcess
    from simkv.traces.importers import import_trace
    from simkv.traces.synth import lognormal

    if case == "azure-lora4":
        from simkv.traces.lora import assign_adapters

        return assign_adapters(import_trace("azure", [AZURE])[0], 16, 1.0, seed=0)
    if case in ("azure", "azure-tokens", "azure-async", "azure-spec", "azure-spec-async", "azure-70b-tp4", "azure-70b-pp2", "azure-70b-pp2-async",
                "azure-gemma3", "azure-llama4", "azure-qwen3next",
                "azure-qwen3next-pc",
                "azure-oss-spec", "azure-dsv3", "azure-dsv3-dp8", "azure-dsv32"):
        return import_trace("azure", [AZURE])[0]
    if case in ("azure-vl", "azure-images"):
        from simkv.traces.images import add_images

        trace = import_trace("azure", [AZURE])[0]
        return add_images(trace, 0.5, 1024, seed=1)[0] if case == "azure-images" else trace
    if case in ("azure-clients", "azure-clients-async"):
        from dataclasses import replace

        trace = import_trace("azure", [AZURE])[0]
        return replace(trace, arrival_time_s=trace.arrival_time_s / 2.0)
    if case in ("azure-fleet4", "azure-pd4", "azure-pd4-async", "azure-pd2-clients"):
        from dataclasses import replace

        trace = import_trace("azure", [AZURE])[0]
        return replace(trace, arrival_time_s=trace.arrival_time_s / 4.0)
    if case in ("chat-paced", "chat-open", "chat-clients", "chat-rotation"):
        from simkv.traces.synth_sessions import SessionShape, multi_turn

        return multi_turn(SessionShape(sessions=20_000, turns=6), seed=1, arrival=ArrivalProcess(kind="poisson", rate=20.0))
    if case in ("rollout", "rollout-dp8"):
        import numpy as np
        import pandas as pd

        from simkv.traces.schema import trace_from_frame

        rng = np.random.default_rng(0)
        n = 5000
        return trace_from_frame(pd.DataFrame({
            "arrival_time_s": np.sort(rng.uniform(0, 600, n)), "prompt_tokens": rng.integers(500, 3000, n),
            "output_tokens": rng.integers(100, 1200, n), "n": np.full(n, 8)}), "rollout")
    if case == "synth-1m":
        # ~1M requests at 60 req/s: a saturated H100 serving llama-3-8b.
        return lognormal(1_000_000, seed=1, arrival=ArrivalProcess(kind="poisson", rate=60.0), fast=True)
    raise SystemExit(f"unknown case {case}")


def run_case(case: str) -> dict:
    from simkv.config import EngineConfig
    from simkv.replay.api import FleetSpec, replay
    from simkv.replay.disaggregated import DisaggregationSpec

    name = case
    t0 = time.perf_counter()
    trace = load(case.removesuffix("-vllm"))
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    fleet = FleetSpec(4, "least_outstanding") if case.endswith("-fleet4") else None
    # (256 sequences and 8,192 tokens on every GPU, simkv's batch defaults before 2026-12-06: the
    # workload docs/performance.md's figures were measured on, kept so that versions compare)
    # (a case ending in -vllm takes today's defaults, vLLM's: 1,024 sequences on an H100)
    options = {"async_scheduling": case.endswith("-async"), "session_pacing": case != "chat-open",
               "vllm_batch_defaults": case.endswith("-vllm")}
    case = case.removesuffix("-vllm")
    case_setup = case.removesuffix("-async")
    if case_setup.endswith("-spec"):
        options |= {"speculative_method": "eagle3", "num_speculative_tokens": 3,
                    "spec_position_acceptance_rates": "0.8,0.6,0.45"}
    if case.endswith("-gemma3"):
        options |= {"model": "gemma-3-12b"}
    if case == "azure-llama4":
        options |= {"model": "llama-4-scout", "gpu": "H100-SXM", "tensor_parallel_size": 4, "max_model_len": 131072}
    if case.startswith("azure-qwen3next"):
        options |= {"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 4,
                    "enable_prefix_caching": case.endswith("-pc")}
    if case == "azure-oss-spec":
        options |= {"model": "gpt-oss-120b", "gpu": "H100-SXM"}
    if case_setup.startswith("azure-70b"):
        options |= {"model": "llama-3-70b", "tensor_parallel_size": 4 if case_setup.endswith("tp4") else 2,
                    "pipeline_parallel_size": 2 if case_setup.endswith("pp2") else 1}
    if case == "azure-lora4":
        options |= {"enable_lora": True, "max_loras": 4}
    if case in ("azure-vl", "azure-images"):
        options |= {"model": "qwen2.5-vl-7b", "max_model_len": 32768}
    if case == "chat-clients":  # (1,024 clients, one conversation each: vLLM's multi-turn benchmark's way)
        options |= {"client_max_concurrency": 1024, "client_max_active_sessions": 1024}
    if case == "chat-rotation":  # (1,024 clients of 4 conversations each, each rotating over its own)
        options |= {"client_max_concurrency": 1024, "client_max_active_sessions": 4096, "client_rotation": True}
    if case == "azure-tokens":  # (a gateway admitting by KV footprint, half the cache's tokens)
        options |= {"client_max_inflight_tokens": 233_280}
    if case_setup in ("azure-clients", "azure-pd2-clients"):
        options |= {"client_ttft_timeout_s": 10.0, "client_max_retries": 2}
    if case == "rollout-dp8":
        options |= {"model": "deepseek-v3", "gpu": "H200", "data_parallel_size": 8}
    if case == "azure-dsv32":
        options |= {"model": "deepseek-v3.2", "gpu": "H200", "tensor_parallel_size": 8}
    elif case.startswith("azure-dsv3"):
        options |= {"model": "deepseek-v3", "gpu": "H200"}
        options |= {"data_parallel_size": 8} if case.endswith("-dp8") else {"tensor_parallel_size": 8}
    config = EngineConfig.from_flat(options)
    disaggregation = (DisaggregationSpec(2, 2) if case_setup.endswith("-pd4")
                      else DisaggregationSpec(1, 1) if case == "azure-pd2-clients" else None)
    res = replay(trace, config, fleet=fleet, disaggregation=disaggregation)
    t_call = time.perf_counter() - t1
    s = res.summary
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"case": name, "requests": s["num_requests"], "steps": s["num_steps"], "load_s": round(t_load, 2),
            "replay_wall_s": round(s["wall_time_s"], 2), "with_outputs_s": round(t_call, 2),
            "requests_per_wall_s": round(s["num_requests"] / s["wall_time_s"]),
            "simulated_duration_s": round(s["duration_s"], 1), "peak_rss_mb": round(rss_mb)}


def run_child(case: str) -> dict:
    out = subprocess.run([sys.executable, __file__, f"--child={case}"], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        print(out.stderr, file=sys.stderr)
        raise SystemExit(out.returncode)
    return json.loads(out.stdout)


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 1 and args[0].startswith("--child="):
        print(json.dumps(run_case(args[0].split("=", 1)[1])))
        return
    repeat = None
    if "--repeat" in args:
        i = args.index("--repeat")
        repeat = int(args[i + 1])
        del args[i:i + 2]
    cases = args or ["all"]
    if cases == ["all"]:
        cases = ["azure", "synth-1m"]
    for case in cases:
        runs = [run_child(case) for _ in range(repeat or (3 if case == "azure" else 1))]
        for r in runs:
            print(json.dumps(r))
        if len(runs) > 1:
            walls = sorted(r["replay_wall_s"] for r in runs)
            best, median = walls[0], walls[len(walls) // 2]
            n = runs[0]["requests"]
            print(json.dumps({"case": case, "runs": len(runs), "best_wall_s": best, "median_wall_s": median,
                              "best_requests_per_wall_s": round(n / best),
                              "median_requests_per_wall_s": round(n / median)}))


if __name__ == "__main__":
    main()
