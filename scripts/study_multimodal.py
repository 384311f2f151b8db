"""Study: images on a vision model (docs/studies.md, "Images: the encoder's share and its cache").

The bundled Azure conversation slice with images added (`simkv trace transform --images`) on
Qwen2.5-VL-7B, one H100: against the same prompts as text (the images' tokens as text tokens,
so only the encoder differs), with every image a new one or drawn from a few popular ones, at
growing load; then the encoder cache's size (`--mm-max-tokens-per-item`, which sizes it) under
images that repeat; then two H100s shared four ways (two replicas, TP 2, PP 2, 1 P + 1 D), and
four H100s colocated or split into P/D pools (`simkv goodput --pd-splits 4`), as text and with
images; then four H100s as four engines or as one encode instance in front of three
(`--encode-replicas 1`, encoder disaggregation), with images of 1,024 and 4,096 tokens; then
chat sessions with images on a small KV pool, with and without a CPU tier.

    .venv/bin/python scripts/study_multimodal.py
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from study_runs import AZURE, SIMKV, replay_summary, scaled_trace  # (scripts/ is on sys.path when run as a script)

MODEL = ["--model", "qwen2.5-vl-7b", "--gpu", "H100-SXM"]


def with_images(trace: Path, tmp: Path, name: str, options: list[str]) -> Path:
    out = tmp / f"{name}.parquet"
    subprocess.run(SIMKV + ["trace", "transform", str(trace), "--out", str(out), "--seed", "1"] + options,
                   check=True, capture_output=True)
    return out


def chats_with_images(tmp: Path) -> Path:
    """400 chat sessions of 4 turns (`simkv trace synth multi-turn`), 30 % of the turns given a new
    image of 1,024 tokens; made once under `tmp`."""
    shown = tmp / "chats_img.parquet"
    if not shown.exists():
        chats = tmp / "chats.parquet"
        subprocess.run(SIMKV + ["trace", "synth", "multi-turn", "--sessions", "400", "--turns", "4", "--out",
                                str(chats)], check=True, capture_output=True)
        with_images(chats, tmp, "chats_img", ["--images", "0.3", "--image-tokens", "1024"])
    return shown


def as_text(trace: Path, tmp: Path) -> Path:
    """The same requests with their images' tokens as plain text (no encoder, no items)."""
    frame = pd.read_parquet(trace).drop(columns=["mm_offsets", "mm_lengths", "mm_hashes"])
    out = tmp / f"{trace.stem}_text.parquet"
    frame.to_parquet(out)
    return out


def row(label: str, s: dict) -> str:
    mm = s.get("multimodal", {})
    busy = s["duration_s"]
    share = f"{100 * mm['encoder_seconds'] / busy:.1f} %" if mm else "-"
    items = f"{mm['items_encoded']:,} / {mm['items']:,}" if mm else "-"
    return (f"| {label} | {s['output_throughput_tok_s']:,.0f} | {1e3 * s['ttft_s']['p50']:,.0f} | "
            f"{1e3 * s['ttft_s']['p99']:,.0f} | {1e3 * s['itl_s']['p50']:.1f} | {items} | {share} |")


def main() -> None:
    header = ("| load, images | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | images encoded / sent "
              "| encoder time / duration |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        print(header)
        for load in ("1", "4", "8"):
            scaled = scaled_trace(tmp, load)
            new = with_images(scaled, tmp, f"new{load}", ["--images", "0.5", "--image-tokens", "1024"])
            popular = with_images(scaled, tmp, f"pop{load}", ["--images", "0.5", "--image-tokens", "1024",
                                                              "--distinct-images", "20"])
            for label, trace in ((f"{load}x, as text", as_text(new, tmp)), (f"{load}x, new images", new),
                                 (f"{load}x, 20 popular images", popular)):
                print(row(label, replay_summary(trace, MODEL, tmp)), flush=True)
        print("\n| 400 chat sessions of 4 turns | output tok/s | TTFT p50 ms | TTFT p99 ms | prefix hit rate | "
              "images encoded / shown | encoder time / duration |\n|---|---|---|---|---|---|---|")
        shown = chats_with_images(tmp)
        for label, trace in (("as text", as_text(shown, tmp)), ("with images", shown)):
            s = replay_summary(trace, MODEL, tmp)
            mm = s.get("multimodal")
            print(f"| {label} | {s['output_throughput_tok_s']:,.0f} | {1e3 * s['ttft_s']['p50']:,.0f} | "
                  f"{1e3 * s['ttft_s']['p99']:,.0f} | {100 * s['prefix_cache_hit_rate']:.1f} % | "
                  + (f"{mm['items_encoded']:,} / {mm['items']:,} | {100 * mm['encoder_seconds'] / s['duration_s']:.1f} % |"
                     if mm else "- | - |"), flush=True)
        print("\n| encoder cache (embeddings) | TTFT p50 ms | images encoded / sent | evictions | chunks stopped before an image |"
              "\n|---|---|---|---|---|")
        scaled = scaled_trace(tmp, "4")
        popular = with_images(scaled, tmp, "pop_cache", ["--images", "0.5", "--image-tokens", "1024",
                                                         "--distinct-images", "200"])
        for cache in ("1024", "4096", "16384"):
            s = replay_summary(popular, MODEL + ["--mm-max-tokens-per-item", cache, "--max-num-batched-tokens",
                                                 "1024"], tmp)
            mm = s["multimodal"]
            print(f"| {mm['encoder_cache_size']:,} | {1e3 * s['ttft_s']['p50']:,.0f} | {mm['items_encoded']:,} / "
                  f"{mm['items']:,} | {mm['encoder_cache_evictions']:,} | {mm['chunks_stopped_before_item']:,} |",
                  flush=True)

        two_gpus(tmp)
        pd_splits(tmp)
        encode_pool(tmp)
        cpu_tier(tmp)


TWO_GPUS = [("2 replicas", ["--replicas", "2"], 2), ("TP 2", ["-tp", "2"], 1),
            ("TP 2, encoder by data", ["-tp", "2", "--mm-encoder-tp-mode", "data"], 1), ("PP 2", ["-pp", "2"], 1),
            ("1 P + 1 D", ["--prefill-replicas", "1", "--decode-replicas", "1"], 1)]


def two_gpus(tmp: Path) -> None:
    """Two H100s at 6x and 8x the Azure rate, the images as in the first table: each setup as
    text and with images, and the encoder's share of the time of an engine that encodes (a
    replica's; TP 2's engine's; PP 2's first stage's; P/D's prefill engine's)."""
    print("\n| load, two H100s | TTFT p50 / p99 ms, as text | TTFT p50 / p99 ms, images | output tok/s, images | "
          "ITL p50 ms, images | encoder's share of an encoding engine's time |\n|---|---|---|---|---|---|")
    for load in ("6", "8"):
        images = with_images(scaled_trace(tmp, load), tmp, f"two{load}", ["--images", "0.5", "--image-tokens", "1024"])
        text = as_text(images, tmp)
        for label, options, encoders in TWO_GPUS:
            t = replay_summary(text, MODEL + options, tmp)
            s = replay_summary(images, MODEL + options, tmp)
            share = s["multimodal"]["encoder_seconds"] / s["duration_s"] / encoders
            print(f"| {load}x, {label} | {1e3 * t['ttft_s']['p50']:,.0f} / {1e3 * t['ttft_s']['p99']:,.0f} | "
                  f"{1e3 * s['ttft_s']['p50']:,.0f} / {1e3 * s['ttft_s']['p99']:,.0f} | "
                  f"{s['output_throughput_tok_s']:,.0f} | {1e3 * s['itl_s']['p50']:.1f} | {100 * share:.1f} % |",
                  flush=True)


def pd_splits(tmp: Path) -> None:
    """`simkv goodput --pd-splits 4` (SLOs TTFT 2 s, TPOT 50 ms for 99 % of the requests) on the
    Azure slice with half its prompts showing an image, and on the same prompts as text."""
    images = with_images(AZURE, tmp, "splits", ["--images", "0.5", "--image-tokens", "1024"])
    rates = {}
    for label, trace in (("as text", as_text(images, tmp)), ("images", images)):
        out = tmp / f"goodput_{label.replace(' ', '_')}"
        subprocess.run(SIMKV + ["goodput", str(trace), "--goodput", "ttft:2000", "--goodput", "tpot:50",
                                "--pd-splits", "4", "--out", str(out), "--quiet"] + MODEL, check=True)
        rates[label] = {s["setup"]: s["max_rate_req_s"] for s in json.loads((out / "goodput.json").read_text())["setups"]}
    print("\n| four H100s | goodput req/s, as text | goodput req/s, images | images / text |\n|---|---|---|---|")
    for setup, text in rates["as text"].items():
        shown = rates["images"][setup]
        print(f"| {setup} | {text:.1f} | {shown:.1f} | {shown / text:.2f} |", flush=True)


def encode_pool(tmp: Path) -> None:
    """Four H100s, half the prompts with an image of 1,024 or 4,096 tokens, at 8x and 16x the
    Azure rate: four engines behind the default router, or one encode instance in front of three."""
    print("\n| image tokens, load | setup | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s | encode "
          "instance busy |\n|---|---|---|---|---|---|")
    for tokens in ("1024", "4096"):
        for load in ("8", "16"):
            trace = with_images(scaled_trace(tmp, load), tmp, f"epd{tokens}_{load}",
                                ["--images", "0.5", "--image-tokens", tokens])
            for label, options in (("4 engines", ["--replicas", "4"]),
                                   ("1 encode + 3 engines", ["--replicas", "3", "--encode-replicas", "1"])):
                s = replay_summary(trace, MODEL + options, tmp)
                pool = s.get("encode_pool")
                busy = f"{100 * pool['encoder_busy_fraction']:.0f} %" if pool else "-"
                print(f"| {int(tokens):,}, {load}x | {label} | {1e3 * s['ttft_s']['p50']:,.0f} / "
                      f"{1e3 * s['ttft_s']['p99']:,.0f} | {1e3 * s['itl_s']['p50']:.1f} / "
                      f"{1e3 * s['itl_s']['p99']:.1f} | {s['output_throughput_tok_s']:,.0f} | {busy} |", flush=True)


def cpu_tier(tmp: Path) -> None:
    """The 400 chat sessions of the second table (30 % of the turns with a new image, later turns
    showing them again) on a pool of 6,000 or 10,000 blocks, without and with a 32 GiB CPU tier."""
    shown = chats_with_images(tmp)
    print("\n| KV pool (blocks), CPU tier | TTFT p50 / p99 ms | images encoded / shown | encoder s | prompts loaded "
          "from the tier | preemptions |\n|---|---|---|---|---|---|")
    for blocks in ("6000", "10000"):
        for tier in ([], ["--kv-offloading-size", "32"]):
            s = replay_summary(shown, MODEL + ["--max-model-len", "32768", "--num-gpu-blocks", blocks] + tier, tmp)
            mm, off = s["multimodal"], s.get("kv_offloading")
            loads = f"{off['loads']:,}" if off else "-"
            print(f"| {int(blocks):,}, {'32 GiB' if tier else 'none'} | {1e3 * s['ttft_s']['p50']:,.0f} / "
                  f"{1e3 * s['ttft_s']['p99']:,.0f} | {mm['items_encoded']:,} / {mm['items']:,} | "
                  f"{mm['encoder_seconds']:.1f} | {loads} | {s['num_preemptions']:,} |", flush=True)


if __name__ == "__main__":
    main()
