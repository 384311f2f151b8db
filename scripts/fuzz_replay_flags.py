"""Random combinations of `simkv replay` flags on small traces, looking for crashes: a run must
end with exit 0 or with a one-line error (a ValueError / ConfigError turned into click's
"Error: ..."), never with a traceback. A development aid, not a test: it prints each failing
command and its exception.

    .venv/bin/python scripts/fuzz_replay_flags.py --runs 300 --seed 1 [--refusals] [--workdir /tmp/fz]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from click.testing import CliRunner  # noqa: E402

from simkv.cli.main import main as simkv_main  # noqa: E402

MODELS = [  # (model, extra flags)
    ("llama-3-8b", []), ("qwen3-8b", []), ("mistral-7b", []), ("gemma-3-12b", []),
    ("gpt-oss-20b", []), ("qwen3-30b-a3b", []), ("deepseek-v2-lite", []),
    ("qwen3-next-80b-a3b", ["--gpu", "H200", "-tp", "2"]), ("llama-4-scout", ["--gpu", "H200", "-tp", "4"]),
    ("qwen2.5-vl-7b", []), ("llama-3-70b", ["-tp", "4"]),
]

# (probability, flags or a function of the random source giving flags)
def _node_flags(r: random.Random) -> list[str]:
    """The GPU nodes under replicas that scale (--node-gpus ...)."""
    return ["--node-gpus", r.choice(["1", "2", "8"]), "--node-provision-s", r.choice(["0", "4"]),
            "--node-image-pull-s", r.choice(["0", "3"]),
            "--node-unneeded-s", r.choice(["0", "5"]), "--node-delay-after-add-s", r.choice(["0", "3"]),
            *r.choice([[], ["--min-nodes", "1"], ["--node-placement", "spread"]]),
            *r.choice([[], [], ["--node-mtbf-s", r.choice(["5", "30"]), "--client-max-retries", "1",
                                *r.choice([[], ["--node-reclaim-notice-s", r.choice(["2", "20"])]])]])]


OPTIONS = [
    (0.3, ["--async-scheduling"]),
    (0.15, ["--no-enable-prefix-caching"]),
    (0.1, ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "65536"]),
    (0.15, lambda r: ["--block-size", r.choice(["32", "64"])]),
    (0.2, lambda r: r.choice([["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "turboquant_4bit_nc"],
                              ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0,1"],
                              ["--kv-cache-dtype", "nvfp4", "--gpu", "B200"], ["--kv-cache-dtype", "int8_per_token_head"],
                              ["--kv-cache-dtype", "ultraquant_4bit", "--gpu", "MI300X"],
                              ["--kv-cache-dtype", "octave_k3v4", "--gpu", "MI300X"]])),
    (0.08, lambda r: ["--dp-sync-interval", r.choice(["1", "4"])]),
    (0.2, lambda r: ["--max-num-seqs", r.choice(["4", "16", "64"])]),
    (0.2, lambda r: ["--max-num-batched-tokens", r.choice(["512", "2048"])]),
    (0.25, lambda r: r.choice([["--speculative-method", "ngram", "--num-speculative-tokens", "3"],
                               ["--speculative-method", "eagle3", "--num-speculative-tokens", "3"],
                               ["--speculative-method", "suffix"],
                               ["--speculative-method", "mtp", "--num-speculative-tokens", "2"],
                               ["--speculative-method", "draft_model", "--spec-draft-model", "llama-3.2-1b",
                                "--num-speculative-tokens", "3"],
                               ["--speculative-method", "eagle3", "--num-speculative-tokens", "4",
                                "--spec-parallel-drafting"],
                               ["--speculative-method", "dflash", "--num-speculative-tokens", "8"]])),
    (0.15, lambda r: ["--kv-offloading-size", r.choice(["1", "4"])] + r.choice(
        [[], ["--no-kv-offloading-prompt-only"], ["--kv-offloading-block-size", "256"]])),
    (0.12, lambda r: ["--replicas", r.choice(["2", "3"]), "--router",
                      r.choice(["round_robin", "least_outstanding", "prefix_aware", "session_affinity"])]
     + r.choice([[], ["--replica-set", "1:gpu=H200"], ["--replica-set", "0:max_num_seqs=4,kv_cache_dtype=fp8"]])
     + r.choice([[], [], ["--replica-failure", r.choice(["1:1", "3:0"]), "--restart-s", r.choice(["1", "4"]),
                          *r.choice([[], ["--client-max-retries", "2"]])]])),
    (0.08, lambda r: ["--autoscale", r.choice(["0-2", "1-2", "1-3"]), "--autoscale-interval-s", r.choice(["1", "5"]),
                      "--cold-start-s", r.choice(["0", "3"]), "--scale-down-window-s", r.choice(["0", "5"]),
                      *r.choice([["--autoscale-target", r.choice(["1", "4"])],
                                 ["--autoscale-metric", r.choice(["waiting", "running", "kv_usage", "gpu_util"]),
                                  "--autoscale-target", r.choice(["0.05", "1"])],
                                 ["--autoscale-metric", "waiting=1,kv_usage=0.05,in_flight=2"],
                                 ["--autoscale-metric", r.choice(["ttft_p95=0.05", "e2e_p50=1", "ttft_p99=0.2,waiting=2", "itl_p95=0.02"]),
                                  "--autoscale-latency-window-s", r.choice(["5", "60"]),
                                  *r.choice([[], ["--autoscale-histogram-buckets",
                                                  '{"inter_token_latency": [0.005, 0.01, 0.02], '
                                                  '"time_to_first_token": [0.01, 0.1, 1]}']])]]),
                      *r.choice([[], ["--autoscale-tolerance", r.choice(["0", "0.5"])]]),
                      *r.choice([[], ["--scale-up-window-s", r.choice(["0", "10"])]]),
                      *r.choice([[], [], ["--autoscale-metrics-delay-s", r.choice(["2", "20"])]]),
                      *r.choice([[], [], _node_flags(r)]),
                      *r.choice([[], [], ["--shutdown-timeout", r.choice(["0", "2"]),
                                          *r.choice([[], ["--termination-grace-s", "1", "--prestop-s", "0.5"]])]]),
                      *r.choice([[], ["--scale-up-policy", r.choice(["pods=1/5", "percent=50/10,select=min", "disabled"])],
                                 ["--scale-down-policy", r.choice(["pods=1/5", "percent=10/20;pods=2/5", "disabled"])]])]),
    (0.12, lambda r: r.choice([["--prefill-replicas", r.choice(["1", "2"]), "--decode-replicas", "1"],
                               ["--prefill-autoscale", r.choice(["1-2", "1-2:metric=ttft_p90=0.05"])
                                + ":interval_s=2,cold_start_s=1,scale_down_window_s=4"
                                + r.choice(["", ",metrics_delay_s=3"]),
                                "--decode-autoscale", r.choice(["1-2:target=1", "1-3:metric=kv_usage=0.05;running=2",
                                                                "1-2:metric=itl_p95=0.02"])
                                + ",interval_s=3,cold_start_s=0,scale_down_window_s=0", *r.choice([[], _node_flags(r)])]])
     + r.choice([[], ["--prefill-router", "session_affinity"]])),
    (0.08, ["-pp", "2"]),
    (0.08, ["-dp", "2"]),
    (0.08, ["-pcp", "2"]),
    (0.1, lambda r: ["-ep", "--all2all-backend", r.choice(["deepep_low_latency", "allgather_reducescatter"])]
     + r.choice([[], ["--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8"],
                 ["--ubatch-size", "3", "--dbo-decode-token-threshold", "3", "--dbo-prefill-token-threshold", "8"]])
     + r.choice([[], ["--enable-eplb", "--num-redundant-experts", "8"], ["--expert-placement-strategy", "round_robin"]])),
    (0.15, lambda r: ["--client-ttft-timeout", r.choice(["0.5", "2"]), "--client-max-retries", r.choice(["0", "1"])]),
    (0.08, ["--client-timeout", "5"]),
    (0.2, lambda r: ["--client-max-concurrency", r.choice(["2", "8"])]),
    (0.12, lambda r: ["--client-max-active-sessions", r.choice(["2", "5"])]),
    (0.15, ["--client-early-stop"]),
    (0.12, lambda r: ["--client-request-rate", r.choice(["0.5", "4"])]),
    (0.12, lambda r: ["--client-rotation"] + r.choice([[], ["--client-warmup"], ["--client-max-requests", "40"],
                                                       ["--client-conversation-sampling", "random"]])),
    (0.12, lambda r: ["--client-max-inflight-tokens", r.choice(["3000", "50000"])]),
    (0.12, lambda r: ["--max-num-queued-reqs", r.choice(["4", "16"])]),
    (0.08, ["--max-num-queued-tokens", "8000"]),
    (0.08, ["--max-num-active-seqs", "4"]),
    (0.08, ["--prefill-schedule-interval", "2"]),
    (0.06, ["--performance-mode", "throughput"]),
    (0.06, ["--preemption-mode", "swap"]),
    (0.1, ["--watermark", "0.01"]),
    (0.08, ["--scheduling-policy", "priority"]),
    (0.1, lambda r: ["--cost-model", r.choice(["unit", "linear"])]),
    (0.1, ["--no-session-pacing"]),
    (0.1, lambda r: ["--max-model-len", r.choice(["4096", "32768", "auto"])]),
    (0.06, ["--disable-hybrid-kv-cache-manager"]),
    (0.05, ["--num-lookahead-tokens", "2"]),
    (0.05, ["--goodput", "ttft:500", "--goodput", "tpot:50"]),
]

TRACES = ["azure", "sessions", "mooncake", "images", "lora", "chat", "mixed", "sysprompt"]


def make_traces(workdir: Path) -> None:
    """Small traces, one per feature a replay reads from its trace."""
    simkv = [str(Path(sys.executable).parent / "simkv")]
    runs = {
        "azure": ["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "150", "--time-scale", "0.2"],
        "sessions": ["trace", "transform", "traces/kvcache_coding_sessions.parquet", "--head", "60"],
        "mooncake": ["trace", "transform", "traces/mooncake_synthetic_slice.parquet", "--head", "60"],
        "images": ["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "120", "--time-scale", "0.2",
                   "--images", "0.5", "--image-tokens", "256"],
        "lora": ["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "150", "--time-scale", "0.2",
                 "--lora-adapters", "4"],
        "chat": ["trace", "synth", "multi-turn", "--sessions", "30", "--turns", "4", "--think-time", "1"],
        "sysprompt": ["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "150", "--time-scale", "0.2",
                      "--system-prompt-tokens", "300"],
    }
    for name, args in runs.items():
        out = workdir / f"{name}.parquet"
        if not out.exists():
            subprocess.run(simkv + args + ["--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    out = workdir / "mixed.parquet"  # (request classes: paced sessions beside long prompts at a lower priority)
    if not out.exists():
        docs = workdir / "docs.parquet"
        subprocess.run(simkv + ["trace", "transform", str(workdir / "mooncake.parquet"), "--priority", "1",
                                "--out", str(docs)], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(simkv + ["trace", "merge", f"chat={workdir / 'sessions.parquet'}", f"docs={docs}",
                                "--out", str(out)], cwd=ROOT, check=True, capture_output=True)


def draw(rng: random.Random, workdir: Path, n: int) -> list[str]:
    trace = rng.choice(TRACES)
    model, extra = rng.choice(MODELS)
    args = ["replay", str(workdir / f"{trace}.parquet"), "--out", str(workdir / f"out{n}"), "--quiet",
            "--model", model, *extra]
    for p, flags in OPTIONS:
        if rng.random() < p:
            args += flags(rng) if callable(flags) else flags
    if trace == "mixed":  # (SLOs per class; a replica of the fleet for one class)
        if rng.random() < 0.4:
            args += ["--goodput", "chat:ttft:500", "--goodput", "docs:e2el:60000"]
        if rng.random() < 0.3:
            if "--prefill-replicas" in args:  # (each P/D pool's; a decode pool of DP ranks refuses)
                args += ["--class-replicas", rng.choice(["prefill:docs=0", "decode:chat=0"])]
            elif "-dp" in args:  # (DP ranks: behind an external router only)
                args += ["--class-replicas", "docs=1", "--router", "least_outstanding"]
            else:
                args += ["--class-replicas", "docs=1"] + ([] if "--replicas" in args else ["--replicas", "2"])
    if trace == "lora" and rng.random() < 0.7:
        args += ["--enable-lora", "--max-loras", rng.choice(["1", "2"])]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default="/tmp/simkv-fuzz")
    parser.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--refusals", action="store_true", help="list the refusals' messages, by count")
    a = parser.parse_args()
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    make_traces(workdir)
    rng = random.Random(a.seed)
    runner = CliRunner()
    counts = {"ok": 0, "refused": 0, "crashed": 0}
    refusals: dict[str, int] = {}
    t0 = time.perf_counter()
    for n in range(a.runs):
        if a.time_limit is not None and time.perf_counter() - t0 > a.time_limit:
            break
        args = draw(rng, workdir, n)
        result = runner.invoke(simkv_main, args, catch_exceptions=True)
        if result.exit_code == 0:
            counts["ok"] += 1
        elif isinstance(result.exception, SystemExit) and result.output.strip().splitlines()[-1].startswith("Error"):
            counts["refused"] += 1
            why = result.output.strip().splitlines()[-1][:150]
            refusals[why] = refusals.get(why, 0) + 1
        else:
            counts["crashed"] += 1
            print(f"\nCRASH {n}: simkv {' '.join(args)}")
            if result.exc_info is not None:
                print("".join(traceback.format_exception(*result.exc_info))[-1500:])
            else:
                print(result.output[-800:])
    if a.refusals:
        for why, count in sorted(refusals.items(), key=lambda item: -item[1]):
            print(f"{count:5d}  {why}")
    print(f"\n{counts} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
