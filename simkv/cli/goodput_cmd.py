"""`simkv goodput TRACE --goodput ttft:MS ...`: the highest request rate one engine sustains
within latency SLOs, and the replicas a target rate needs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from simkv.backends.factory import COST_MODELS
from simkv.calibration.cli_support import CostModelChoice
from simkv.cli.replay_cmd import DEFAULT_TRACE, engine_options, read_inputs
from simkv.config import ConfigError


def to_markdown(record: dict) -> str:
    from simkv.replay.goodput import describe_slo

    slo = describe_slo(record["slo_ms"])
    lines = [f"# simkv goodput: {record['trace']}", "",
             f"SLOs: {slo}; target: {100 * record['target_attainment']:g} % of requests meet all of them. "
             f"The trace's own rate: {record['trace_rate_req_s']:.3f} req/s; cost model: {record['cost_model']}.", "",
             "| probe | rate req/s | x trace | met | attainment | goodput req/s | TTFT p99 s | TPOT p99 ms | preemptions | peak running |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for i, p in enumerate(record["probes"], 1):
        lines.append(f"| {i} | {p['rate_req_s']:.3f} | {p['factor']:.4g} | {'yes' if p['met'] else 'no'} | "
                     f"{100 * p['slo_attainment']:.1f} % | {p['request_goodput_req_s']:.3f} | {num(p['ttft_p99_s'], '.3f')} | "
                     f"{num(p['tpot_p99_s'] and p['tpot_p99_s'] * 1e3, '.1f')} | {p['num_preemptions']} | {p['peak_running']} |")
    lines.append("")
    lo, hi = record["bracket_factors"]
    base = record["trace_rate_req_s"]
    if record["status"] == "found":
        lines.append(f"**Highest rate meeting the target: {record['max_rate_req_s']:.3f} req/s** "
                     f"({lo:.4g} x the trace's rate; {hi * base:.3f} req/s missed it).")
    elif record["status"] == "unbounded":
        lines.append(f"The target was met at every probed rate up to {lo * base:.3f} req/s ({lo:g} x the trace's): "
                     "the trace has too few requests to load the engine past its SLOs; use a longer trace.")
    else:
        lines.append(f"The target was missed even at {hi * base:.4g} req/s (1/{1 / hi:g} of the trace's rate): "
                     "the SLOs cannot be met on this engine for this request mix, whatever the load.")
    if record.get("target_rate_req_s") and record.get("replicas"):
        lines.append(f"For {record['target_rate_req_s']:g} req/s: **{record['replicas']} replicas** of this engine, "
                     "if requests are spread evenly over them.")
    return "\n".join(lines) + "\n"


@click.command("goodput")
@click.argument("trace", required=False, default=DEFAULT_TRACE)
@click.option("--goodput", "goodput", multiple=True, required=True, metavar="KEY:MS",
              help="Latency SLO (vLLM's --goodput): ttft, tpot or e2el and a limit in ms; repeat for each.")
@click.option("--attainment", type=float, default=0.99, show_default=True,
              help="Share of the trace's requests that must meet every SLO.")
@click.option("--tolerance", type=float, default=0.02, show_default=True,
              help="Stop when the highest rate that met the target and the lowest that missed it are this close (relative).")
@click.option("--target-rate", type=float, default=None, help="Also say how many replicas this rate (req/s) needs.")
@click.option("--config", "config_file", default=None, help="YAML or JSON file of engine options.")
@click.option("--cost-model", default="roofline", show_default=True, type=CostModelChoice(COST_MODELS),
              help="A cost model name, or a calib.json fitted by `simkv calibrate`.")
@click.option("--step-base-s", type=float, default=0.015, show_default=True, help="linear cost model")
@click.option("--step-per-token-s", type=float, default=2e-5, show_default=True, help="linear cost model")
@engine_options
@click.option("--out", "out_dir", default=None, help="Also write goodput.json and goodput.md into this folder.")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def goodput_cmd(trace: str, goodput: tuple[str, ...], attainment: float, tolerance: float, target_rate: float | None,
                config_file: str | None, cost_model: str, step_base_s: float, step_per_token_s: float,
                out_dir: str | None, quiet: bool, **flags) -> None:
    """Replay TRACE at scaled arrival rates to find the highest request rate at which the engine
    still meets the --goodput SLOs for --attainment of the requests (and, with --target-rate,
    the replicas that rate needs)."""
    from simkv.studies.goodput_search import replicas_for, search_max_rate

    if target_rate is not None and not target_rate > 0:
        raise click.UsageError(f"--target-rate must be > 0 req/s, got {target_rate}")
    slo, config, data = read_inputs(trace, flags, config_file, goodput)

    def show(p) -> None:
        if not quiet:
            click.echo(f"  {p.rate_req_s:10.3f} req/s: {100 * p.slo_attainment:5.1f} % met the SLOs "
                       f"({'meets' if p.met else 'misses'} the target)", err=True)

    try:
        record = search_max_rate(data, config, slo, target=attainment, tolerance=tolerance, cost_model=cost_model,
                                 cost_options={"step_base_s": step_base_s, "step_per_token_s": step_per_token_s},
                                 on_probe=show)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    record = {"trace": trace, "cost_model": cost_model, "config": config.to_dict(), **record}
    if target_rate is not None:
        record["target_rate_req_s"] = target_rate
        record["replicas"] = replicas_for(target_rate, record["max_rate_req_s"]) if record["status"] == "found" else None
    text = to_markdown(record)
    if out_dir is not None:
        from simkv.sweep.store import atomic_write_text

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "goodput.json", json.dumps(record, indent=2) + "\n")
        atomic_write_text(out / "goodput.md", text)
    if not quiet:
        click.echo(text)
        if out_dir is not None:
            click.echo(f"wrote {out_dir}/goodput.json, goodput.md")
