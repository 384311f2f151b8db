"""`simkv compare SIM_DIR MEASURED --out DIR`: a simulated replay against a measured run."""

from __future__ import annotations

import click


@click.command("compare")
@click.argument("sim_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("measured", type=click.Path(exists=True))
@click.option("--out", "out_dir", default="out/compare", show_default=True, help="Output folder.")
@click.option("--targets", type=click.Choice(["gpu", "cpu"]), default=None,
              help="Also check the issue's error targets (gpu: 3/5/10 %, cpu: 15 %).")
@click.option("--server-metrics", type=(click.Path(exists=True, dir_okay=False), click.Path(exists=True, dir_okay=False)),
              default=None, metavar="BEFORE AFTER",
              help="With a `vllm bench serve` result: the server's /metrics saved before and after the run "
                   "(prefix cache hits and preemptions).")
@click.option("--quiet", is_flag=True)
def compare_cmd(sim_dir: str, measured: str, out_dir: str, targets: str | None,
                server_metrics: tuple[str, str] | None, quiet: bool) -> None:
    """Per-metric simulated value, measured value and relative error, per-request and per-step
    comparisons; writes compare.json, compare.md and a self-contained report.html into --out.

    MEASURED is a replay's folder (`simkv replay --backend gpu`) or the result file of vLLM's own
    benchmark client run on the trace `simkv trace export` wrote (`vllm bench serve --dataset-name
    timed_trace --save-result --save-detailed`; docs/validate_vllm.md)."""
    from simkv.compare.compare import to_markdown, write_comparison

    try:
        result = write_comparison(sim_dir, measured, out_dir, targets, server_metrics)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise click.ClickException(str(exc)) from None
    if not quiet:
        click.echo(to_markdown(result))
        click.echo(f"wrote {out_dir}/compare.json, compare.md, report.html")
