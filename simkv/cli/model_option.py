"""`--model NAME|CONFIG.json` and `--gpu NAME|GPU.yaml`: an entry of simkv's catalogue, or a file
that describes one (a Hugging Face config.json; a GPU's datasheet fields)."""

from __future__ import annotations

from collections.abc import Callable

import click

from simkv.specs import get_gpu_spec, get_model_spec, gpu_names, model_names
from simkv.specs.gpu_file import is_gpu_file
from simkv.specs.hf_config import is_config_path


class CatalogueOrFile(click.ParamType):
    """A name of the catalogue `names` lists, or the path of a file `is_file` recognises, read
    here by `load` so that a bad file is reported as this option's error."""

    def __init__(self, kind: str, names: Callable[[], list[str]], is_file: Callable[[str], bool],
                 load: Callable[[str], object], file_metavar: str, file_words: str) -> None:
        self.name = kind
        self._names, self._is_file, self._load = names, is_file, load
        self._file_metavar, self._file_words = file_metavar, file_words

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self._names()) + f"|{self._file_metavar}]"

    def convert(self, value, param, ctx):
        if value in self._names():
            return value
        if self._is_file(str(value)):
            try:
                self._load(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
            return str(value)
        self.fail(f"{value!r} is not one of {', '.join(self._names())}, nor {self._file_words}", param, ctx)


def ModelName() -> CatalogueOrFile:  # noqa: N802 (a click type, named as one)
    """A model of simkv/specs/models.yaml, or the path of a Hugging Face config.json."""
    return CatalogueOrFile("model", model_names, is_config_path, get_model_spec, "CONFIG.json",
                           "a Hugging Face config.json")


def GPUName() -> CatalogueOrFile:  # noqa: N802
    """A GPU of simkv/specs/gpus.yaml, or the path of a GPU file (simkv/specs/gpu_file.py)."""
    return CatalogueOrFile("gpu", gpu_names, is_gpu_file, get_gpu_spec, "GPU.yaml",
                           "a GPU file (.yaml or .json with a catalogue entry's fields)")
