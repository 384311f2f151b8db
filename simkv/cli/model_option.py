"""`--model NAME|CONFIG.json`: a shipped model spec, or a Hugging Face config.json."""

from __future__ import annotations

import click

from simkv.specs import get_model_spec, model_names
from simkv.specs.hf_config import is_config_path


class ModelName(click.ParamType):
    """A model of simkv/specs/models.yaml, or the path of a Hugging Face config.json (read here,
    so that a bad file is reported as this option's error)."""

    name = "model"

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(model_names()) + "|CONFIG.json]"

    def convert(self, value, param, ctx):
        if value in model_names():
            return value
        if is_config_path(str(value)):
            try:
                get_model_spec(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
            return str(value)
        self.fail(f"{value!r} is not one of {', '.join(model_names())}, nor a Hugging Face config.json", param, ctx)
