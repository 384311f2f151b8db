"""`simkv sweep`: placeholder until the sweep command lands."""
import click


@click.command("sweep")
def sweep_cmd() -> None:
    """Sweep engine options over traces."""
