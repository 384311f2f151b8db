"""Where a GPU-backend step's time goes: eager kernel launches against decode CUDA graphs.

    python bench/gpu_step.py --model llama-3-8b --out DIR        # on a CUDA host
    python bench/gpu_step.py --model tiny-llama --device cpu --out DIR   # checks the script

For decode batches (batch size x context), a few prefill chunks and one mixed step, runs the model runner's
step (`ModelRunner.run`, exactly what a replay times) eagerly and, for decodes, from the
captured graphs, and reports per shape the median step time (CUDA events around the whole
step, as `GpuBackend` measures it), the host time spent inside the forward call (on CUDA the
time to enqueue its kernels), and the ratio eager / graphs. A step whose forward-call host
time is close to its duration is bound by kernel launches, not by the GPU. With the Triton
kernels, the eager steps are timed a second time with the layers' element-wise work done by
torch operators instead of the fused kernels of `kernels/triton_layer_ops.py` (column
"unfused"), and the GPU kernels one step launches are counted both ways (CUDA profiler). With a
kernel tuning in force (`SIMKV_KERNEL_TUNING`), the eager steps are timed again on the launcher's
heuristic tiles (column "heuristic").
Writes DIR/gpu_step.json and DIR/gpu_step.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--budget-s", type=float, default=90.0)
    p.add_argument("--kernel-backend", choices=["torch", "triton"], default=None,
                   help="default: triton on CUDA, torch on CPU (triton on CPU needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)

    import torch

    from gpu_backend.backend import StepTimer
    from gpu_backend.runner import ModelRunner
    from gpu_backend.synthetic import run_synthetic, synthetic_output, warm_up

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    batches = [1, 8, 32, 64, 128] if cuda else [1, 4, 8]
    contexts = [1024, 4096] if cuda else [64]
    prefills = [512, 2048] if cuda else [32]
    block = 16
    need = max(batches) * (-(-(max(contexts) + 1) // block)) + 2 * (-(-max(prefills) // block)) + 2
    runner = ModelRunner(args.model, need, block, device, seed=0, kernel_backend=args.kernel_backend)
    warm_up(runner, 1)
    timer = StepTimer(runner.device)
    t_start = time.perf_counter()  # the budget is for measuring: building the model and warming up come first
    out = Path(args.out)
    result = {"model": args.model, "layer_ops": runner.ops.name, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "torch": torch.__version__, "cuda_graphs": "not reached", "piecewise_graphs": "not reached",
              "repeats": args.repeats, "rows": []}

    def measure(prefill, decodes) -> dict:
        out = synthetic_output(prefill, decodes, block, need)
        for _ in range(2):
            run_synthetic(runner, out)
        times, hosts = [], []
        for _ in range(args.repeats):
            times.append(timer.time(run_synthetic, runner, out)[1])
            hosts.append(sum(runner.last_host_times))
        return {"step_ms": 1e3 * statistics.median(times), "host_ms": 1e3 * statistics.median(hosts)}

    rows = result["rows"]
    shapes = [("decode", [], [c] * b, f"B{b}@{c}") for c in contexts for b in batches]
    shapes += [("prefill", [(0, n)], [], f"chunk {n}") for n in prefills]
    # a small chunk riding with decodes: eager unless piecewise graphs are on (vLLM's default runs
    # it from them), so its eager host time is what a calibration's eager-step term cE measures
    mixed_chunk, mixed_batch = (64, 32) if cuda else (16, 4)
    shapes += [("mixed", [(0, mixed_chunk)], [contexts[0]] * mixed_batch, f"chunk {mixed_chunk} + B{mixed_batch}@{contexts[0]}")]
    for kind, prefill, decodes, label in shapes:  # eager first, every shape
        if time.perf_counter() - t_start > args.budget_s * 0.5:
            break
        rows.append({"kind": kind, "shape": label, "eager": measure(prefill, decodes)})
        print(label, rows[-1], flush=True)
    write_report(out, result)  # after each phase: a step killed by its time limit keeps what it measured

    @contextmanager
    def ops_swapped(ops):
        """The runner's steps on another op set, meanwhile."""
        saved, runner.ops = runner.ops, ops
        try:
            yield
        finally:
            runner.ops = saved

    if runner.kernel_backend == "triton":  # what the fused element-wise kernels save, eager steps
        from kernels.layer_ops import layer_ops

        for row, (kind, prefill, decodes, label) in zip(rows, shapes):
            if time.perf_counter() - t_start > args.budget_s * 0.6:
                break
            if kind == "decode" and decodes[0] != contexts[0]:
                continue
            row["launches"] = kernel_launches(runner, synthetic_output(prefill, decodes, block, need))
            with ops_swapped(layer_ops("triton", fused=False, tuning=runner.kernel_tuning)):
                row["unfused"] = measure(prefill, decodes)
                row["launches_unfused"] = kernel_launches(runner, synthetic_output(prefill, decodes, block, need))
            row["unfused_over_fused"] = row["unfused"]["step_ms"] / row["eager"]["step_ms"]
            print(label, row, flush=True)
        if runner.kernel_tuning is not None:  # what the tuned attention tiles save on whole eager steps
            for row, (kind, prefill, decodes, label) in zip(rows, shapes):
                if time.perf_counter() - t_start > args.budget_s * 0.7:
                    break
                with ops_swapped(layer_ops("triton", fused=True)):
                    row["heuristic"] = measure(prefill, decodes)
                row["heuristic_over_tuned"] = row["heuristic"]["step_ms"] / row["eager"]["step_ms"]
                print(label, row, flush=True)
    write_report(out, result)

    def time_from_graphs(takes) -> None:
        """The "graphs" columns of the measured rows whose shape `takes(kind, tokens)` accepts."""
        for row, (kind, prefill, decodes, label) in zip(rows, shapes):
            if not takes(kind, sum(n for _, n in prefill) + len(decodes)) or time.perf_counter() - t_start > args.budget_s:
                continue
            row["graphs"] = measure(prefill, decodes)
            row["eager_over_graphs"] = row["eager"]["step_ms"] / row["graphs"]["step_ms"]
            print(label, row, flush=True)

    graphs_status = runner.enable_decode_graphs(max(batches)) if cuda else "off: not on CUDA"
    result["cuda_graphs"] = graphs_status
    if runner.decode_graphs is not None:
        time_from_graphs(lambda kind, tokens: kind == "decode")
    write_report(out, result)
    # steps with prefill chunks from piecewise graphs (vLLM's FULL_AND_PIECEWISE), captured only for
    # the token counts these shapes need (on CPU: the same pieces on static buffers, run eagerly)
    from gpu_backend.piecewise_graphs import piecewise_sizes
    from simkv.calibration.costmodel import padded_size

    ladder = piecewise_sizes(512)
    wanted = sorted({padded_size(ladder, sum(n for _, n in prefill) + len(decodes))
                     for kind, prefill, decodes, _ in shapes[:len(rows)] if kind != "decode"} - {0})
    pieces_status = "off: no step with prefill chunks of at most 512 tokens"
    if wanted and time.perf_counter() - t_start < args.budget_s:
        pieces_status = runner.enable_piecewise_graphs(wanted[-1], capture=cuda, sizes=wanted)
    if runner.piecewise_graphs is not None:
        time_from_graphs(lambda kind, tokens: kind != "decode" and tokens <= wanted[-1])
    result["piecewise_graphs"] = pieces_status
    print(write_report(out, result))
    return 0


def write_report(out: Path, result: dict) -> str:
    """gpu_step.json and gpu_step.md from what has been measured so far; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"## GPU-backend step time ({result['device']}, {result['model']}, torch {result['torch']})", "",
             f"Decode CUDA graphs: {result['cuda_graphs']}. Piecewise graphs: {result['piecewise_graphs']}. Median of "
             f"{result['repeats']} steps; host = time inside input preparation and the forward call (on CUDA: "
             "enqueueing). The graphs columns are the full decode graphs for decode rows and the piecewise graphs for "
             "the others.", "",
             f"Kernels: {result['layer_ops']}. Unfused: the same eager step with torch operators for the "
             "element-wise work; launches: GPU operations (kernels and copies) one step issues, fused / unfused. "
             "Heuristic: with a kernel tuning in force (kernels/tuning.py), the same eager step on the launcher's "
             "heuristic tiles.", "",
             "| step | eager ms | eager host ms | unfused ms | unfused / fused | launches | heuristic ms | heuristic / tuned "
             "| graphs ms | graphs host ms | eager / graphs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(value, fmt) -> str:
        return "-" if value is None else format(value, fmt)

    for r in result["rows"]:
        g, u, h = r.get("graphs") or {}, r.get("unfused") or {}, r.get("heuristic") or {}
        launches = (f"{r['launches']} / {r['launches_unfused']}"
                    if r.get("launches") is not None and r.get("launches_unfused") is not None else "-")
        lines.append(f"| {r['kind']} {r['shape']} | {r['eager']['step_ms']:.2f} | {r['eager']['host_ms']:.2f} | "
                     f"{cell(u.get('step_ms'), '.2f')} | {cell(r.get('unfused_over_fused'), '.2f')} | {launches} | "
                     f"{cell(h.get('step_ms'), '.2f')} | {cell(r.get('heuristic_over_tuned'), '.2f')} | "
                     f"{cell(g.get('step_ms'), '.2f')} | {cell(g.get('host_ms'), '.2f')} | "
                     f"{cell(r.get('eager_over_graphs'), '.2f')} |")
    text = "\n".join(lines) + "\n"
    (out / "gpu_step.md").write_text(text)
    return text


def kernel_launches(runner, output) -> int | None:
    """GPU kernels one step launches (CUDA profiler); None off CUDA or where profiling fails."""
    import torch

    from gpu_backend.synthetic import run_synthetic

    if runner.device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_synthetic(runner, output)
            torch.cuda.synchronize(runner.device)
        kinds = [getattr(e, "device_type", None) for e in prof.events()]
        return sum(1 for k in kinds if k is not None and "CUDA" in str(k))
    except Exception as exc:  # noqa: BLE001 - a diagnostic
        print(f"kernel count failed: {type(exc).__name__}: {exc}", flush=True)
        return None


if __name__ == "__main__":
    sys.exit(main())
