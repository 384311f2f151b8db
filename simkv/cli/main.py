"""The `simkv` command: each subcommand lives in its own module and only builds library calls."""

import click

from simkv.cli.calibrate_cmd import calibrate_cmd
from simkv.cli.capacity_cmd import capacity_cmd
from simkv.cli.catalogue_cmd import catalogue_cmd
from simkv.cli.compare_cmd import compare_cmd
from simkv.cli.goodput_cmd import goodput_cmd
from simkv.cli.replay_cmd import replay_cmd
from simkv.cli.sweep_cmd import sweep_cmd
from simkv.cli.trace_cmd import trace


@click.group()
@click.version_option(package_name="simkv")
def main() -> None:
    """simkv: replay LLM request traces through a vLLM-v1 engine model."""


main.add_command(replay_cmd)
main.add_command(trace)
main.add_command(calibrate_cmd)
main.add_command(compare_cmd)
main.add_command(capacity_cmd)
main.add_command(sweep_cmd)
main.add_command(goodput_cmd)
main.add_command(catalogue_cmd)
