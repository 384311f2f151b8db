"""`simkv compare SIM_DIR MEASURED_DIR --out DIR`: simulated vs measured replay."""

from __future__ import annotations

import click


@click.command("compare")
@click.argument("sim_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("measured_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", default="out/compare", show_default=True, help="Output folder.")
@click.option("--targets", type=click.Choice(["gpu", "cpu"]), default=None,
              help="Also check the issue's error targets (gpu: 3/5/10 %, cpu: 15 %).")
@click.option("--quiet", is_flag=True)
def compare_cmd(sim_dir: str, measured_dir: str, out_dir: str, targets: str | None, quiet: bool) -> None:
    """Per-metric simulated value, measured value and relative error, per-request and per-step
    comparisons; writes compare.json, compare.md and a self-contained report.html into --out."""
    from simkv.compare.compare import to_markdown, write_comparison

    try:
        result = write_comparison(sim_dir, measured_dir, out_dir, targets)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise click.ClickException(str(exc)) from None
    if not quiet:
        click.echo(to_markdown(result))
        click.echo(f"wrote {out_dir}/compare.json, compare.md, report.html")
