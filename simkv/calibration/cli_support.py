"""Small CLI helpers shared by `simkv replay` and `simkv calibrate` (click only, no torch)."""

from __future__ import annotations

import click


class CostModelChoice(click.ParamType):
    """A cost-model name, or the path of a calib.json written by `simkv calibrate`."""

    name = "cost-model"

    def __init__(self, names) -> None:
        self.names = tuple(names)

    def get_metavar(self, param, ctx=None) -> str:  # click 8.1 / 8.2 signatures
        return "[" + "|".join(self.names) + "|CALIB.json]"

    def convert(self, value, param, ctx):
        if value in self.names:
            return value
        if isinstance(value, str) and value.endswith(".json"):
            import os

            if not os.path.isfile(value):
                self.fail(f"calibration file '{value}' does not exist", param, ctx)
            return value
        self.fail(f"'{value}' is neither one of {', '.join(self.names)} nor a calib.json path", param, ctx)
