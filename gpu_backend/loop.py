"""The full calibrate -> measure -> simulate -> compare loop as one bounded command.

    python -m gpu_backend.loop OUTDIR [--model llama-3-8b] [--device cuda] [--total-s 540]

Stages (each a `simkv` CLI call in a subprocess with its own time limit, logged to OUTDIR):
  1. slice the trace (first --requests requests of --trace)
  2. simkv calibrate   (grid measured within --calib-budget-s)
  3. simkv replay --backend gpu          -> OUTDIR/measured
  4. simkv replay --cost-model calib.json -> OUTDIR/sim
  5. simkv compare --targets gpu|cpu     -> OUTDIR/compare
With --train-requests M (and time left), also:
  6. simkv replay --backend gpu on the NEXT M requests -> OUTDIR/measured_train
  7. simkv calibrate --from-steps measured_train --with-grid calib.json -> OUTDIR/calib_steps.json
  8. replay + compare of the first slice with it -> OUTDIR/sim_steps, OUTDIR/compare_steps
After stage 5, two more simulations of the same slice are compared (seconds, no device time):
the grid refitted on each point's mean (`simkv calibrate --refit`), and the fit with step-time
variation drawn from the calibration's repeats (`--step-noise empirical`).
With --interleaved, stages 2 and 3 are one: the replay times the calibration grid between its
steps (`simkv replay --calibrate-alongside`), so both see the same phases of a host whose
speed drifts (this project's CPU machine); the grid is still synthetic shapes only.
A stage that fails or times out is recorded in OUTDIR/loop_summary.md; later stages that need
its output are skipped. Nothing here needs the network.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SIMKV = [sys.executable, "-c", "import sys; from simkv.cli.main import main; sys.exit(main())"]


def _run(name: str, cmd: list[str], limit_s: float, out: Path, status: dict) -> bool:
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(limit_s, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    took = time.perf_counter() - t0
    status[name] = {"rc": rc, "seconds": round(took, 1), "limit_s": round(limit_s, 1),
                    "timed_out": rc == 124}
    print(f"== {name}: exit {rc} after {took:.0f}s (limit {limit_s:.0f}s)", flush=True)
    return rc == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--model", default=None, help="[default: llama-3-8b on cuda, tiny-llama on cpu]")
    p.add_argument("--device", default=None, help="cuda or cpu [default: cuda if present]")
    p.add_argument("--trace", default="traces/azure_conv_slice.parquet")
    p.add_argument("--requests", type=int, default=400, help="trace slice: the first N requests")
    p.add_argument("--train-requests", type=int, default=0,
                   help="also replay the next M requests on the real backend and fit a second calibration on "
                        "those steps (plus the grid): `simkv calibrate --from-steps`; the first N stay unseen")
    p.add_argument("--total-s", type=float, default=520.0, help="wall-clock limit of the whole loop")
    p.add_argument("--calib-budget-s", type=float, default=150.0)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV pool of both replays [default: 16384 on cuda, 512 on cpu]")
    p.add_argument("--engine", nargs="*", default=[], help="extra engine flags for both replays")
    p.add_argument("--interleaved", action="store_true",
                   help="calibrate during the measured replay, between its steps (for hosts whose speed drifts)")
    p.add_argument("--cudagraph-mode", choices=["full_decode_only", "full_and_piecewise"], default="full_decode_only",
                   help="CUDA graphs of the calibration and the measured replays (simkv replay --cudagraph-mode)")
    args = p.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.model = args.model or ("llama-3-8b" if device == "cuda" else "tiny-llama")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def left() -> float:
        return args.total_s - (time.perf_counter() - t_start)

    status: dict = {}
    gpu_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    from gpu_backend.env import canonical_gpu

    gpu_spec = canonical_gpu(gpu_name) if device == "cuda" else None
    blocks = args.num_gpu_blocks or (16384 if device == "cuda" else 512)
    engine = ["--model", args.model, "--num-gpu-blocks", str(blocks), *args.engine]
    if gpu_spec:
        engine += ["--gpu", gpu_spec]
    # the largest step calibrate measures (its defaults on CUDA; vLLM's 1,024 sequences on an H200
    # would capture decode graphs for batches the calibration never ran)
    batch = ("256", "32") if device == "cpu" else ("8192", "256")
    engine += ["--max-num-batched-tokens", batch[0], "--max-num-seqs", batch[1]]

    # 1. the trace slice
    from simkv.traces.schema import read_trace, take_rows, write_trace
    import numpy as np

    trace = read_trace(args.trace)
    n = min(args.requests, len(trace))
    slice_path = out / f"trace_head{n}.parquet"
    write_trace(take_rows(trace, np.arange(n)), slice_path)
    status["slice"] = {"rc": 0, "requests": n, "source": args.trace}
    m = max(0, min(args.train_requests, len(trace) - n))
    train_path = out / f"trace_train{m}.parquet"
    if m:
        import dataclasses

        train = take_rows(trace, np.arange(n, n + m))
        train = dataclasses.replace(train, arrival_time_s=train.arrival_time_s - train.arrival_time_s[0])
        write_trace(train, train_path)
        status["train_slice"] = {"rc": 0, "requests": m, "rows": [n, n + m]}

    calib = out / "calib.json"
    graphs = ["--cudagraph-mode", args.cudagraph_mode]
    # the grid's measuring budget, within what the stage's time limit leaves after building the model,
    # warming up and capturing graphs (about a minute): the measured replay needs the rest
    calib_budget = round(min(args.calib_budget_s, max(30.0, 0.35 * (left() - 60))))
    cal_cmd = [*SIMKV, "calibrate", "--model", args.model, "--device", device, "--out", str(calib), "--quiet",
               "--budget-s", str(calib_budget), *graphs, "--max-num-batched-tokens", batch[0], "--max-num-seqs", batch[1]]
    if args.interleaved:
        ok_meas = ok_cal = _run("replay_gpu", [*SIMKV, "replay", str(slice_path), "--backend", "gpu", "--device", device,
                                               *engine, *graphs, "--out", str(out / "measured"), "--calibrate-alongside",
                                               str(calib), "--quiet"], left() - 30, out, status)
    else:
        ok_cal = _run("calibrate", cal_cmd, min(calib_budget + 120, left() - 60), out, status)
        ok_meas = _run("replay_gpu", [*SIMKV, "replay", str(slice_path), "--backend", "gpu", "--device", device,
                                      *engine, *graphs, "--out", str(out / "measured"), "--quiet"], left() - 30, out, status)
    targets = "gpu" if device == "cuda" else "cpu"

    def simulate_and_compare(suffix: str, cost_model: list[str], sim_limit, cmp_limit, measured_ok: bool = True) -> bool:
        """Stage replay_sim{suffix}: the slice simulated with `cost_model` flags into OUTDIR/sim{suffix};
        then, if it and the measured replay succeeded, stage compare{suffix} into OUTDIR/compare{suffix}.
        The limits are callables: each is evaluated when its stage starts."""
        ok_sim = _run(f"replay_sim{suffix}", [*SIMKV, "replay", str(slice_path), *cost_model, *engine,
                                              "--out", str(out / f"sim{suffix}"), "--quiet"], sim_limit(), out, status)
        return ok_sim and measured_ok and _run(
            f"compare{suffix}", [*SIMKV, "compare", str(out / f"sim{suffix}"), str(out / "measured"),
                                 "--out", str(out / f"compare{suffix}"), "--quiet", "--targets", targets],
            cmp_limit(), out, status)

    def short_sim_limit() -> float:
        return max(min(120, left() - 8), 5)

    ok_cmp = ok_cal and simulate_and_compare("", ["--cost-model", str(calib)], lambda: min(120, left() - 15),
                                             lambda: max(left(), 10), measured_ok=ok_meas)
    # the same grid fitted on the mean of each point's samples (no measuring: seconds), checked on
    # the same slice: a replay sums every step, so a skewed step time favours the mean
    calib_mean = out / "calib_mean.json"
    ok_mean_cmp = ok_cal and ok_meas and left() > 20 and _run(
        "calibrate_mean", [*SIMKV, "calibrate", "--refit", str(calib), "--statistic", "mean", "--out", str(calib_mean),
                           "--quiet"], max(min(30, left() - 10), 5), out, status)
    ok_mean_cmp = ok_mean_cmp and simulate_and_compare("_mean", ["--cost-model", str(calib_mean)], short_sim_limit,
                                                       lambda: max(min(60, left() - 5), 5))
    # the same fit with step-time variation drawn from the calibration's repeats (seconds)
    ok_noise_cmp = ok_cal and ok_meas and left() > 15 and simulate_and_compare(
        "_noise", ["--cost-model", str(calib), "--step-noise", "empirical"], short_sim_limit,
        lambda: max(min(60, left() - 5), 5))
    ok_steps_cmp = False
    calib_steps = out / "calib_steps.json"
    if m and ok_cal and ok_meas and left() > 60:
        # a second calibration: the grid plus the steps of a replay of OTHER requests (the next m)
        ok_train = _run("replay_gpu_train", [*SIMKV, "replay", str(train_path), "--backend", "gpu", "--device", device,
                                             *engine, *graphs, "--out", str(out / "measured_train"), "--quiet"],
                        left() - 25, out, status)
        ok_fit = ok_train and _run("calibrate_steps", [*SIMKV, "calibrate", "--from-steps", str(out / "measured_train"),
                                                       "--with-grid", str(calib), "--out", str(calib_steps), "--quiet"],
                                   max(min(60, left() - 15), 5), out, status)
        ok_steps_cmp = ok_fit and simulate_and_compare("_steps", ["--cost-model", str(calib_steps)], short_sim_limit,
                                                       lambda: max(left(), 8))
    lines = [f"# simkv GPU backend loop ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"- device: {device} ({gpu_name}); model {args.model}; trace slice: first {n} requests of {args.trace}",
             f"- engine flags of both replays: `{' '.join(engine)}`; CUDA graphs of the measured ones: `{args.cudagraph_mode}`",
             f"- torch {torch.__version__}, cuda {torch.version.cuda}", "", "## Stages", ""]
    lines += [f"- **{k}**: {json.dumps(v)}" for k, v in status.items()]
    if calib.is_file():
        rec = json.loads(calib.read_text())
        fit = rec.get("fit") or {}
        lines += ["", "## Calibration", "",
                  f"- {len(rec['grid']['measured'])} of {rec['grid']['num_points']} grid points measured"
                  f"{' (stopped by the time budget)' if rec.get('stopped_by_budget') else ''}; OOM: {len(rec.get('oom') or [])}",
                  f"- protocol: {(rec.get('settings') or {}).get('protocol', 'simkv calibrate, before the replay')}",
                  f"- kernels: {rec.get('layer_ops')}",
                  f"- fit: {fit.get('form')}", f"- coefficients: {fit.get('coefficients')} knee {fit.get('knee')}",
                  f"- held-out: {fit.get('holdout')}"]
    if ok_cmp:
        lines += ["", (out / "compare" / "compare.md").read_text().replace("# simkv compare", "## Comparison", 1)]

    def comparison_section(suffix: str, title: str, facts: list[str]) -> list[str]:
        """A further simulation's section: its facts, then its compare.md one heading level down."""
        md = (out / f"compare{suffix}" / "compare.md").read_text()
        return ["", f"## {title}", "", *facts, "",
                md.replace("# simkv compare", "### Comparison (same test slice)", 1).replace("\n## ", "\n#### ")]

    if ok_mean_cmp:
        fit = json.loads(calib_mean.read_text())["fit"]
        lines += comparison_section("_mean", "The same grid fitted on the mean of each point's samples",
                                    [f"- coefficients: {fit['coefficients']} knee {fit['knee']}",
                                     f"- held-out: {fit['holdout']}"])
    if ok_noise_cmp:
        noise = json.loads((out / "sim_noise" / "summary.json").read_text())["cost_model"].get("step_noise")
        lines += comparison_section("_noise", "The same fit with step-time variation (`--step-noise empirical`)",
                                    [f"- drawn from the calibration's repeats: {noise}"])
    if ok_steps_cmp:
        rec = json.loads(calib_steps.read_text())
        fit = rec["fit"]
        lines += comparison_section("_steps", f"Second calibration: grid + the measured steps of requests {n}..{n + m - 1}",
                                    [f"- {rec['source']}", f"- coefficients: {fit['coefficients']} knee {fit['knee']}",
                                     f"- held-out: {fit['holdout']}"])
    lines += ["", f"Total loop time: {time.perf_counter() - t_start:.0f}s"]
    (out / "loop_summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/loop_summary.md", flush=True)
    return 0 if ok_cmp else 1


if __name__ == "__main__":
    sys.exit(main())
