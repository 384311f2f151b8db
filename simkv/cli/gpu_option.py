"""`--gpu NAME|FILE.yaml`: a catalogue GPU, or one described by a YAML or JSON file."""

from __future__ import annotations

import click

from simkv.specs import get_gpu_spec, gpu_names
from simkv.specs.gpu_file import is_gpu_file


class GPUName(click.ParamType):
    """A GPU of simkv/specs/gpus.yaml, or the path of a GPU file (simkv/specs/gpu_file.py; read
    here, so that a bad file is reported as this option's error)."""

    name = "gpu"

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(gpu_names()) + "|GPU.yaml]"

    def convert(self, value, param, ctx):
        if value in gpu_names():
            return value
        if is_gpu_file(str(value)):
            try:
                get_gpu_spec(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
            return str(value)
        self.fail(f"{value!r} is not one of {', '.join(gpu_names())}, nor a GPU file (.yaml or .json with "
                  "a catalogue entry's fields)", param, ctx)
