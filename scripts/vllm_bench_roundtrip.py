"""Check `simkv trace export` and `simkv compare ... bench.json` with vLLM's own benchmark client.

A development aid (not a test dependency), run with the vLLM oracle's Python (vLLM 0.33 and its
benchmark client; no GPU, no model):

    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    /tmp/vllm-oracle-venv/bin/python scripts/vllm_bench_roundtrip.py --out out/vllm_roundtrip

Two checks:
1. prompts: vLLM's timed-trace dataset (`vllm.benchmarks.datasets.TimedTrace`) builds the prompts
   of exported traces; each prompt must have its row's length and share with earlier prompts
   exactly the blocks simkv's served trace says it shares (an unbounded prefix cache's hits,
   token by token against hash id by hash id).
2. round trip: a simulated replay of the exported trace, then a stand-in server that streams each
   request's tokens at the simulated times (first token, then one per step the request decoded
   in), `vllm bench serve` run against it with the exported trace, and `simkv compare` of the
   simulation against the benchmark's result. What remains is the measurement floor: the
   client's send lag, HTTP and asyncio timing on this host. The server also serves the
   simulation's prefix-cache and preemption counters as Prometheus /metrics, read before and after.
3. fit: the same with a server whose timing is hidden from simkv (a roofline with other
   efficiencies and overheads): `simkv calibrate --from-bench` on the benchmark of the trace's
   first rows, then a later window benchmarked and compared with a replay on the fit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIMKV = str(ROOT / ".venv" / "bin" / "simkv")


def simkv(*args: str) -> str:
    done = subprocess.run([SIMKV, *args], check=True, capture_output=True, text=True)
    return done.stdout


def make_tokenizer(path: Path, vocab_size: int = 4000) -> None:
    """A word-level tokenizer saved locally (nothing can be downloaded); the client samples
    prompt token ids from its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)} | {"<s>": vocab_size, "</s>": vocab_size + 1,
                                                        "<unk>": vocab_size + 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)


# -- check 1: prompts ---------------------------------------------------------------------------

def unbounded_cache_hits(blocks_per_request) -> list[int]:
    """Per request (in order), its leading full blocks already seen in an earlier request."""
    seen, hits = set(), []
    for blocks in blocks_per_request:
        parent, n, hitting = None, 0, True
        for block in blocks:
            parent = hash((parent, block))
            if hitting and parent in seen:
                n += 1
            else:
                hitting = False
            seen.add(parent)
        hits.append(n)
    return hits


def check_prompts(jsonl: Path, served: Path, chunk: int, block_size: int, tokenizer_dir: Path) -> dict:
    import pandas as pd
    from vllm.benchmarks.datasets.datasets import TimedTrace
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(tokenizer_dir))
    rows = pd.read_parquet(served)
    dataset = TimedTrace(dataset_path=str(jsonl), random_seed=0, timed_trace_chunk_hash_size=chunk,
                         timed_trace_sec_multiplier=1.0, timed_trace_label_timestamp="timestamp",
                         timed_trace_label_input_length="input_length",
                         timed_trace_label_output_length="output_length", timed_trace_label_hash_ids="hash_ids")
    samples = dataset.sample(tokenizer=tokenizer, num_requests=len(rows))
    assert len(samples) == len(rows), (len(samples), len(rows))
    lengths_ok = all(s.prompt_len == p and len(s.prompt) == p and s.expected_output_len == o
                     for s, p, o in zip(samples, rows["prompt_tokens"], rows["output_tokens"]))
    per = block_size // chunk
    token_blocks = [[tuple(s.prompt[b * block_size:(b + 1) * block_size]) for b in range(len(s.prompt) // block_size)]
                    for s in samples]
    id_blocks = [[tuple(ids[b * per:(b + 1) * per]) for b in range(p // block_size)]
                 for ids, p in zip(rows["block_hashes"], rows["prompt_tokens"])]
    by_tokens, by_ids = unbounded_cache_hits(token_blocks), unbounded_cache_hits(id_blocks)
    differ = [i for i, (a, b) in enumerate(zip(by_tokens, by_ids)) if a != b]
    return {"trace": str(served), "requests": len(rows), "chunk_tokens": chunk, "block_size": block_size,
            "lengths_equal": lengths_ok, "hit_blocks_tokens": sum(by_tokens), "hit_blocks_ids": sum(by_ids),
            "requests_differing": len(differ), "first_differing": differ[:5]}


# -- check 2: round trip ------------------------------------------------------------------------

def token_schedules(sim_dir: Path) -> tuple[list[dict], int]:
    """Per request (trace order): prompt/output lengths, arrival, and the times of its tokens in
    the simulation (simkv/compare/token_times.py); and how many came from the replay's steps."""
    sys.path.insert(0, str(ROOT))  # (simkv's numpy/pandas-only module; this Python has no simpy)
    from simkv.compare.token_times import simulated_token_times

    requests, times, from_steps = simulated_token_times(sim_dir)
    return [{"prompt": int(r.prompt_tokens), "output": int(r.output_tokens), "arrival": float(r.arrival_time_s),
             "times": t} for r, t in zip(requests.itertuples(), times)], from_steps


def serve(schedule_file: Path, port: int, counters: dict) -> None:
    """The stand-in server: /v1/completions streams each request's tokens at its simulated times
    (the clock's origin: the first request's receipt minus its arrival), /metrics the counters."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    schedules = json.loads(schedule_file.read_text())
    unclaimed: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(schedules):
        unclaimed.setdefault((s["prompt"], s["output"]), []).append(i)
    state = {"t0": None, "after": False}
    registry = CollectorRegistry()
    labels = {"model_name": "simkv-standin", "engine": "0"}
    made = {key: Counter(f"vllm:{key}", key, list(labels), registry=registry).labels(**labels) for key in counters}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        now = time.perf_counter()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        queue = unclaimed.get((len(prompt), max_tokens))
        if not queue:
            return web.json_response({"error": f"no request of {len(prompt)} + {max_tokens} tokens left"}, status=400)
        s = schedules[queue.pop(0)]
        if state["t0"] is None:
            state["t0"] = now - s["arrival"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for t in s["times"]:
            delay = state["t0"] + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await response.write(b'data: {"choices": [{"text": " t1"}]}\n\n')
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(s["times"])}
        await response.write(f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'.encode())
        await response.write(b"data: [DONE]\n\n")
        if not any(unclaimed.values()) and not state["after"]:
            state["after"] = True
            for key, value in counters.items():
                made[key].inc(value)
        return response

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def run_bench(jsonl: Path, n: int, chunk: int, port: int, tokenizer_dir: Path, result: Path) -> float:
    command = [sys.executable, "-c",
               "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
               "add_cli_args(p); main(p.parse_args(sys.argv[1:]))",
               "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", "simkv-standin",
               "--tokenizer", str(tokenizer_dir), "--dataset-name", "timed_trace", "--dataset-path", str(jsonl),
               "--timed-trace-chunk-hash-size", str(chunk), "--num-prompts", str(n), "--ready-check-timeout-sec", "0",
               "--save-result", "--save-detailed", "--result-filename", str(result), "--disable-tqdm"]
    started = time.perf_counter()
    subprocess.run(command, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def fetch(url: str, path: Path) -> None:
    with urllib.request.urlopen(url) as response:
        path.write_bytes(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/vllm_roundtrip")
    parser.add_argument("--trace", default=str(ROOT / "traces/azure_conv_slice.parquet"))
    parser.add_argument("--head", type=int, default=150)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--port", type=int, default=18123)
    parser.add_argument("--prompt-traces", nargs="*", default=[
        str(ROOT / "traces/mooncake_synthetic_slice.parquet"), str(ROOT / "traces/kvcache_coding_sessions.parquet"),
        str(ROOT / "traces/req400_prefix10.parquet")])
    parser.add_argument("--fit-head", type=int, default=300,
                        help="Rows benchmarked for the fit through the client (0: skip the fit check).")
    parser.add_argument("--holdout-window", type=float, nargs=2, default=(100.0, 160.0))
    parser.add_argument("--serve", nargs=2, metavar=("SCHEDULES", "COUNTERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), args.port, json.loads(Path(args.serve[1]).read_text()))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = out / "tokenizer"
    make_tokenizer(tokenizer_dir)
    report: dict = {"vllm": __import__("vllm").__version__, "prompts": []}

    for trace in args.prompt_traces:
        for block_size in (16, 64):
            stem = out / f"{Path(trace).stem}_b{block_size}"
            printed = simkv("trace", "export", trace, "--out", f"{stem}.jsonl", "--block-size", str(block_size))
            chunk = int(printed.split("(", 1)[1].split("-token chunks", 1)[0])  # "wrote N requests to F (G-token chunks) ..."
            check = check_prompts(Path(f"{stem}.jsonl"), Path(f"{stem}.parquet"), chunk, block_size, tokenizer_dir)
            print(json.dumps(check))
            report["prompts"].append(check)

    head = out / "trace.parquet"
    simkv("trace", "transform", args.trace, "--head", str(args.head), "--out", str(head))
    plumbing = measure(out / "round_trip", head, "roofline", args, tokenizer_dir)
    report["round_trip"] = compare_report(plumbing["sim"], plumbing, out / "round_trip" / "compare")
    print((out / "round_trip" / "compare" / "compare.md").read_text())

    if args.fit_head:
        report["fit"] = fit_through_the_client(out / "fit", args, tokenizer_dir)
        print(json.dumps(report["fit"], indent=2))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def measure(folder: Path, trace: Path, server_cost_model: str, args, tokenizer_dir: Path) -> dict:
    """Export `trace`, simulate the served trace with `server_cost_model` (the stand-in server's
    timing), stream it through vLLM's benchmark client; returns the files."""
    folder.mkdir(parents=True, exist_ok=True)
    jsonl, served = folder / "export.jsonl", folder / "export.parquet"
    simkv("trace", "export", str(trace), "--out", str(jsonl), "--block-size", str(args.block_size))
    server_sim = folder / "server_sim"
    simkv("replay", str(served), "--block-size", str(args.block_size), "--cost-model", server_cost_model,
          "--out", str(server_sim), "--quiet")
    schedules, exact = token_schedules(server_sim)
    (folder / "schedules.json").write_text(json.dumps(schedules))
    summary = json.loads((server_sim / "summary.json").read_text())
    counters = {"prefix_cache_queries": summary["prefix_cache_queries_tokens"],
                "prefix_cache_hits": summary["prefix_cache_hits_tokens"], "num_preemptions": summary["num_preemptions"]}
    (folder / "counters.json").write_text(json.dumps(counters))
    server = subprocess.Popen([sys.executable, __file__, "--port", str(args.port), "--serve",
                               str(folder / "schedules.json"), str(folder / "counters.json")])
    try:
        for _ in range(100):
            try:
                fetch(f"http://127.0.0.1:{args.port}/metrics", folder / "metrics_before.prom")
                break
            except OSError:
                time.sleep(0.1)
        wall = run_bench(jsonl, len(schedules), args.block_size, args.port, tokenizer_dir, folder / "bench.json")
        fetch(f"http://127.0.0.1:{args.port}/metrics", folder / "metrics_after.prom")
    finally:
        server.terminate()
        server.wait()
    return {"served": served, "sim": server_sim, "bench": folder / "bench.json", "requests": len(schedules),
            "token_times_from_steps": exact, "bench_wall_s": wall,
            "metrics": (folder / "metrics_before.prom", folder / "metrics_after.prom")}


def compare_report(sim_dir: Path, run: dict, out: Path) -> dict:
    compared = subprocess.run([SIMKV, "compare", str(sim_dir), str(run["bench"]), "--server-metrics",
                               *map(str, run["metrics"]), "--out", str(out), "--quiet"], capture_output=True, text=True)
    if compared.returncode:
        raise SystemExit(compared.stderr)
    result = json.loads((out / "compare.json").read_text())
    return {"requests": run["requests"], "token_times_from_steps": run["token_times_from_steps"],
            "bench_wall_s": run["bench_wall_s"], "metrics": {r["metric"]: r["rel_error"] for r in result["metrics"]},
            "requests_compared": result["requests"], "vllm_bench": result["vllm_bench"]}


HIDDEN = {"compute_efficiency": 0.40, "memory_efficiency": 0.55, "step_overhead_s": 0.0025, "seq_overhead_s": 1.5e-5}


def fit_through_the_client(folder: Path, args, tokenizer_dir: Path) -> dict:
    """The user's loop on a server whose timing simkv does not know (the stand-in streams a
    roofline with HIDDEN numbers): benchmark the first rows, simulate them with the roofline's
    defaults, `simkv calibrate --from-bench`, then benchmark a later window and compare it with
    a replay on the fit (and, for contrast, on the defaults)."""
    folder.mkdir(parents=True, exist_ok=True)
    hidden = folder / "hidden.json"
    hidden.write_text(json.dumps({"format": "simkv-roofline-fit", "format_version": 1, "model": "llama-3-8b",
                                  "gpu": "H100-SXM", "tensor_parallel_size": 1, "params": HIDDEN, "fit": {},
                                  "source": {"note": "the stand-in server's hidden timing"}}))
    fit_rows, window = folder / "fit_rows.parquet", folder / "window.parquet"
    simkv("trace", "transform", args.trace, "--head", str(args.fit_head), "--out", str(fit_rows))
    simkv("trace", "transform", args.trace, "--window", *map(str, args.holdout_window), "--out", str(window))
    on_fit_rows = measure(folder / "fit_rows", fit_rows, str(hidden), args, tokenizer_dir)
    user_sim = folder / "fit_rows" / "sim_defaults"
    simkv("replay", str(on_fit_rows["served"]), "--block-size", str(args.block_size), "--out", str(user_sim), "--quiet")
    printed = simkv("calibrate", "--from-bench", str(on_fit_rows["bench"]), "--sim", str(user_sim),
                    "--out", str(folder / "fit.json"))
    held_out = measure(folder / "held_out", window, str(hidden), args, tokenizer_dir)
    out = {"hidden": HIDDEN, "fitted": json.loads((folder / "fit.json").read_text())["params"],
           "calibrate_printed": printed.splitlines(), "fit_rows": args.fit_head,
           "held_out_window_s": list(args.holdout_window)}
    for name, cost_model in (("fit", str(folder / "fit.json")), ("defaults", "roofline")):
        sim = folder / "held_out" / f"sim_{name}"
        simkv("replay", str(held_out["served"]), "--block-size", str(args.block_size), "--cost-model", cost_model,
              "--out", str(sim), "--quiet")
        out[f"held_out_{name}"] = compare_report(sim, held_out, folder / "held_out" / f"compare_{name}")
    return out


if __name__ == "__main__":
    main()
