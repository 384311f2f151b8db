"""The vision encoder, measured against simkv's roofline of it (simkv/backends/vision_encoder.py).

Builds a model spec's ViT (gpu_backend/vision_tower.py: Qwen2.5-VL's, random weights) and times
one forward pass over square dummy images of the given embeddings, then prints each time beside
the roofline's for the GPU and their ratio (measured / roofline), and on a GPU the pass's
activation peak (what vLLM's start-up profile of the encoder takes from the KV cache) beside
simkv's estimate of it (simkv/capacity.py, vit_activation_bytes). On a GPU (scripts/gpu_check.sh
runs it) that says how far the images' time in every replay and the start-up profile are off; on
a CPU, `--tiny` runs a small tower to check the script.

    .venv/bin/python bench/vision_encoder.py --device cuda [--gpu H100-SXM] [--embeds 256,1024,4096] [--out FILE]
    .venv/bin/python bench/vision_encoder.py --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_GPU_NAMES = (("H200", "H200"), ("H100", "H100-SXM"), ("B200", "B200"), ("A100", "A100-80GB"), ("L40S", "L40S"))


def detect_gpu(name: str) -> str | None:
    """simkv's GPU spec for a CUDA device name (None if it has none)."""
    return next((spec for key, spec in _GPU_NAMES if key in name), None)


def main() -> None:
    import torch

    from gpu_backend.vision_tower import build_tower, dummy_image, time_tower
    from simkv.backends.vision_encoder import VisionEncoderCost
    from simkv.capacity import vit_activation_bytes
    from simkv.specs import get_gpu_spec, get_model_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-vl-7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu", default=None, help="simkv's GPU spec for the roofline [default: the device's]")
    ap.add_argument("--embeds", default="256,1024,4096,16384",
                    help="images' embeddings (square numbers; 16,384: Qwen2.5-VL's largest, which vLLM profiles)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer tower of 64 (CPU smoke run)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    a = ap.parse_args()
    spec = get_model_spec(a.model)
    sizes = [int(x) for x in a.embeds.split(",")]
    if a.tiny:
        spec = dataclasses.replace(spec, vision_num_layers=2, vision_hidden_size=64, vision_intermediate_size=96,
                                   vision_full_attention_layers=1)
        sizes = [16, 64]
    device_name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    gpu = a.gpu or detect_gpu(device_name) or "H100-SXM"
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = build_tower(spec, a.device, dtype, num_heads=4 if a.tiny else 16)
    cost = VisionEncoderCost(spec, get_gpu_spec(gpu))
    rows = []
    print(f"{a.model}'s vision encoder on {device_name} ({dtype}), roofline for {gpu}:")
    print("| embeddings | patches | measured ms | roofline ms | measured / roofline | activation peak GiB "
          "| simkv's estimate GiB |\n|---:|---:|---:|---:|---:|---:|---:|")
    cuda = a.device.startswith("cuda")
    for embeds in sizes:
        pixels, grid = dummy_image(model.config, embeds, a.device, dtype)
        if cuda:  # (the pass's activations beyond the weights: what vLLM's start-up profile of it would see)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        seconds = time_tower(model, pixels, grid, repeats=a.repeats)
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        roof = cost.seconds((embeds,))
        estimate = vit_activation_bytes(spec, int(pixels.shape[0]))
        rows.append({"embeds": embeds, "patches": int(pixels.shape[0]), "measured_s": seconds, "roofline_s": roof,
                     "ratio": seconds / roof, "activation_peak_bytes": peak, "estimated_activation_bytes": estimate})
        print(f"| {embeds:,} | {pixels.shape[0]:,} | {1e3 * seconds:.2f} | {1e3 * roof:.2f} | {seconds / roof:.2f} | "
              + (f"{peak / 2**30:.2f} |" if peak is not None else "- |") + f" {estimate / 2**30:.2f} |", flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps({"model": a.model, "device": device_name, "gpu_spec": gpu, "dtype": str(dtype),
                                     "tiny": a.tiny, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
