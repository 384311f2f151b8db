"""`simkv catalogue`: the models and GPUs simkv knows, with the numbers it uses, and what it
reads from a model's config.json or a GPU file of your own."""

from __future__ import annotations

import dataclasses
import json

import click

from simkv.cli.model_option import GPUName, ModelName
from simkv.specs import GPUSpec, ModelSpec, get_gpu_spec, get_model_spec, gpu_names, model_names


def attention_kind(spec: ModelSpec) -> str:
    """A model's attention in a few words."""
    if spec.is_sparse:
        return f"MLA, sparse top {spec.index_topk:,}"
    if spec.is_mla:
        return "MLA"
    kinds = [f"{spec.num_heads}/{spec.num_kv_heads} heads x {spec.head_dim}"]
    every = f" (1 full in {spec.full_attention_interval})" if spec.full_attention_interval else ""
    if spec.linear_attention:
        kinds.append(f"{spec.linear_attention}{every}")
    elif spec.sliding_window:
        kinds.append(f"window {spec.sliding_window:,}{every}")
    elif spec.attention_chunk_size:
        kinds.append(f"chunks {spec.attention_chunk_size:,}{every}")
    return ", ".join(kinds)


def model_row(spec: ModelSpec) -> dict:
    """The figures `simkv catalogue` shows for a model."""
    row = {"model": spec.name, "params": spec.num_params, "active_params": spec.num_active_params,
           "layers": spec.num_layers,
           "attention": attention_kind(spec), "max_position_embeddings": spec.max_position_embeddings,
           "kv_bytes_per_token_bf16": spec.kv_bytes_per_token(2)}
    if spec.is_moe:
        row["experts"] = f"{spec.num_experts_per_tok} of {spec.num_experts}"
    return row


def gpu_row(gpu: GPUSpec) -> dict:
    return {"gpu": gpu.name} | {k: v for k, v in dataclasses.asdict(gpu).items() if k != "name"}


def spec_fields(spec: ModelSpec) -> dict:
    """Every field of a model's spec that differs from the default: what simkv read."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
            if f.name == "name" or getattr(spec, f.name) != f.default}


@click.command("catalogue")
@click.option("--model", "model", type=ModelName(), default=None,
              help="One model (of the catalogue, or a Hugging Face config.json): every field simkv read, and "
                   "its figures")
@click.option("--gpu", "gpu", type=GPUName(), default=None,
              help="One GPU (of the catalogue, or a GPU file): its fields")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def catalogue_cmd(model, gpu, as_json):
    """The models and GPUs simkv knows (simkv/specs/models.yaml and gpus.yaml) with the numbers it
    uses; with --model or --gpu, one of them, or what simkv reads from your config.json or GPU
    file."""
    if model is not None or gpu is not None:
        out = {}
        if model is not None:
            spec = get_model_spec(model)
            out["model"] = model_row(spec) | {"fields": spec_fields(spec)}
        if gpu is not None:
            out["gpu"] = gpu_row(get_gpu_spec(gpu))
    else:
        out = {"models": [model_row(get_model_spec(n)) for n in model_names()],
               "gpus": [gpu_row(get_gpu_spec(n)) for n in gpu_names()]}
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    _print(out)


def _count(n: int) -> str:
    """A parameter count: 8.03B, 494M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _print(out: dict) -> None:
    from rich.table import Table

    from simkv.terminal import console as terminal_console

    console = terminal_console()
    if "models" in out:
        table = Table(title="Models (simkv/specs/models.yaml; --model also takes a Hugging Face config.json)")
        for name, justify in (("model", "left"), ("params (active)", "right"), ("layers", "right"),
                              ("attention", "left"), ("experts", "right"), ("context", "right"),
                              ("KV B/token (bf16)", "right")):
            table.add_column(name, justify=justify)
        for row in out["models"]:
            table.add_row(row["model"], f"{_count(row['params'])} ({_count(row['active_params'])})", str(row["layers"]),
                          row["attention"], row.get("experts", ""), f"{row['max_position_embeddings']:,}",
                          f"{row['kv_bytes_per_token_bf16']:,}")
        console.print(table)
    if "gpus" in out:
        table = Table(title="GPUs (simkv/specs/gpus.yaml; --gpu also takes a GPU file: simkv/specs/gpu_file.py)")
        for name in ("gpu", "memory GiB", "memory GB/s", "bf16 TFLOP/s", "fp8 TFLOP/s", "fp4 TFLOP/s", "link GB/s",
                     "capability"):
            table.add_column(name, justify="left" if name == "gpu" else "right")
        for row in out["gpus"]:
            table.add_row(row["gpu"], f"{row['memory_gib']:g}", f"{row['mem_bandwidth_gbs']:,.0f}",
                          f"{row['bf16_tflops']:,.0f}", f"{row['fp8_tflops']:,.0f}", f"{row['fp4_tflops']:,.0f}",
                          f"{row['interconnect_gbs']:g}",
                          f"{row['compute_capability']:.1f}" + (" (rocm)" if row["platform"] == "rocm" else ""))
        console.print(table)
    for key in ("model", "gpu"):
        if key in out:
            one = dict(out[key])
            fields = one.pop("fields", {})
            table = Table(title=f"{key}: {one.pop(key)}", show_header=False)
            table.add_column("field")
            table.add_column("value", justify="right")
            for name, value in {**one, **{k: v for k, v in fields.items() if k != "name"}}.items():
                table.add_row(name, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
            console.print(table)
