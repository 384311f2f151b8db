"""``simkv trace``: import, synth, inspect, transform, merge. Parses options; the work is in simkv.traces."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import click

from simkv.traces.arrivals import ARRIVAL_KINDS, ArrivalProcess
from simkv.traces.errors import TraceError
from simkv.traces.importers import FORMATS, ColumnMap, ConversationStarts, import_to_file
from simkv.traces.importers.tabular import TIME_UNITS
from simkv.traces import replies
from simkv.traces.schema import read_trace, write_trace
from simkv.traces.stats import class_counts, format_stats, trace_stats
from simkv.traces.synth import ClippedLognormal, REQ400_REQUESTS, REQ400_SEED
from simkv.traces.synth_cli import KINDS, SynthOptions, generate, parse_int_list
from simkv.traces.transform import Edits, parse_class_bins, parse_rate_profile, transform


def clean_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every failure into click's one-line ``Error: ...`` and a non-zero exit, no traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except click.ClickException:
            raise
        except (TraceError, OSError) as exc:
            raise click.ClickException(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        except MemoryError:
            raise click.ClickException("out of memory") from None
        except Exception as exc:  # noqa: BLE001 - the CLI promises no tracebacks
            raise click.ClickException(f"unexpected {type(exc).__name__}: {str(exc)[:200]}") from None

    return wrapper


@click.group()
def trace() -> None:
    """Import, generate, inspect and edit request traces (canonical schema: docs/traces.md)."""


@trace.command("import")
@click.argument("fmt", metavar="FORMAT", type=click.Choice(FORMATS))
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@click.option("--out", required=True, help="Output trace (.parquet, or .csv / .csv.gz).")
@click.option("--block-tokens", default=512, show_default=True, help="mooncake: tokens per hash block.")
@click.option("--time-col", help="csv: column with the request time.")
@click.option("--prompt-col", help="csv: column with prompt tokens.")
@click.option("--output-col", help="csv: column with output tokens.")
@click.option("--id-col", help="csv: optional column with request ids.")
@click.option("--session-col", help="csv: optional column naming each row's conversation (session_id; "
                                    "then `trace transform --session-history` can give the turns their history).")
@click.option("--time-unit", type=click.Choice(list(TIME_UNITS)), default="s", show_default=True,
              help="csv: unit of the time column ('datetime' = wall-clock strings).")
@click.option("--time-origin", type=click.Choice(["first", "zero"]), default="first", show_default=True,
              help="csv: arrival = time - first row's time, or the time itself.")
@click.option("--conversation-gap", default=0.0, show_default=True,
              help="kvcache-tester: seconds between conversation starts.")
@click.option("--conversation-rate", type=float, help="kvcache-tester: Poisson conversation starts per second.")
@click.option("--seed", default=0, show_default=True, help="kvcache-tester: seed of the Poisson starts.")
@click.option("--model-name", "models", multiple=True,
              help="burstgpt: keep this model's rows (ChatGPT, GPT-4); repeatable [default: all].")
@click.option("--log-type", type=click.Choice(["conversation", "api"]),
              help="burstgpt: keep the conversation log's rows or the API log's [default: both].")
@clean_errors
def import_cmd(fmt: str, sources: tuple[str, ...], out: str, block_tokens: int, time_col: str | None,
               prompt_col: str | None, output_col: str | None, id_col: str | None, session_col: str | None,
               time_unit: str,
               time_origin: str, conversation_gap: float, conversation_rate: float | None, seed: int,
               models: tuple[str, ...], log_type: str | None) -> None:
    """Import a raw public trace (FORMAT: mooncake, azure, burstgpt, kvcache-tester, csv), or the
    requests a `vllm bench serve --save-detailed` result sent (vllm-bench), into OUT."""
    mapping = None
    if fmt == "csv":
        if not (time_col and prompt_col and output_col):
            raise TraceError("format csv needs --time-col, --prompt-col and --output-col")
        mapping = ColumnMap(time_col, prompt_col, output_col, id_col, time_unit, time_origin, session=session_col)
    elif session_col:
        raise TraceError("--session-col names a column of a csv import")
    starts = ConversationStarts(conversation_gap, conversation_rate, seed)
    report = import_to_file(fmt, list(sources), out, block_tokens=block_tokens, mapping=mapping, starts=starts,
                            models=models, log_type=log_type)
    click.echo(f"{report.summary()}; wrote {out}")


def _lognormal_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for name, default in reversed(
        [("prompt-mu", 6.0), ("prompt-sigma", 0.7), ("prompt-min", 8), ("prompt-max", 1800),
         ("output-mu", 4.8), ("output-sigma", 0.9), ("output-min", 8), ("output-max", 900),
         ("user-mu", 4.0), ("user-sigma", 0.8), ("user-min", 4), ("user-max", 1024)]
    ):
        command = click.option(f"--{name}", default=default, show_default=True)(command)
    return command


@trace.command("synth")
@click.argument("kind", type=click.Choice(KINDS))
@click.option("--out", required=True, help="Output trace (.parquet, or .csv / .csv.gz).")
@click.option("--n-requests", default=REQ400_REQUESTS, show_default=True)
@click.option("--seed", default=REQ400_SEED, show_default=True)
@click.option("--fast", is_flag=True, help="numpy draws (vectorised; not bit-identical to Python random).")
@click.option("--arrival", type=click.Choice(ARRIVAL_KINDS), default="all-at-once", show_default=True)
@click.option("--rate", type=float, help="Requests (multi-turn: sessions) per second for poisson/gamma.")
@click.option("--cv", default=1.0, show_default=True, help="gamma: coefficient of variation of the gaps.")
@click.option("--groups", default=10, show_default=True, help="shared-prefix: number of groups/tenants.")
@click.option("--prefix-tokens", default="1000", show_default=True, help="shared-prefix: one length or one per group.")
@click.option("--hash-block-tokens", type=int, help="Tokens per hash block (shared-prefix default: 16/8/4/2/1 dividing all prefixes; multi-turn 16).")
@click.option("--assign", type=click.Choice(["round-robin", "random"]), default="round-robin", show_default=True)
@click.option("--salt-per-group", is_flag=True, help="shared-prefix: cache_salt 'group-<g>' per group.")
@click.option("--base", default="lognormal", show_default=True, help="shared-prefix: how own tokens are drawn.")
@click.option("--sessions", default=100, show_default=True, help="multi-turn: number of chat sessions.")
@click.option("--turns", default=4, show_default=True, help="multi-turn: turns per session.")
@click.option("--think-time", default=10.0, show_default=True, help="multi-turn: mean seconds between turns.")
@click.option("--max-prompt-tokens", default=32768, show_default=True, help="multi-turn: end a session beyond this.")
@click.option("--reply-hashes/--no-reply-hashes", default=True, show_default=True,
              help="multi-turn: hash lists go on over each reply, so the next turn hits the reply's cached blocks "
                   "(--no-reply-hashes: replies are unique content, as traces without output content are read).")
@_lognormal_options
@clean_errors
def synth_cmd(kind: str, out: str, n_requests: int, seed: int, fast: bool, arrival: str, rate: float | None,
              cv: float, groups: int, prefix_tokens: str, hash_block_tokens: int | None, assign: str,
              salt_per_group: bool, base: str, sessions: int, turns: int, think_time: float,
              max_prompt_tokens: int, reply_hashes: bool, **sizes: float) -> None:
    """Generate a seeded, deterministic trace (KIND: lognormal, shared-prefix, multi-turn)."""
    options = SynthOptions(
        kind=kind, n_requests=n_requests, seed=seed, fast=fast,
        prompt=_dist(sizes, "prompt"), output=_dist(sizes, "output"),
        arrival=ArrivalProcess(arrival, rate, cv), groups=groups, prefix_tokens=parse_int_list(prefix_tokens),
        hash_block_tokens=hash_block_tokens, assign=assign, salt_per_group=salt_per_group, base=base,
        sessions=sessions, turns=turns, user_tokens=_dist(sizes, "user"), think_time_s=think_time,
        max_prompt_tokens=max_prompt_tokens, reply_hashes=reply_hashes,
    )
    result = generate(options)
    write_trace(result, out)
    click.echo(f"wrote {len(result):,} requests ({kind}) to {out}")


def _dist(sizes: dict[str, float], prefix: str) -> ClippedLognormal:
    return ClippedLognormal(
        float(sizes[f"{prefix}_mu"]), float(sizes[f"{prefix}_sigma"]), int(sizes[f"{prefix}_min"]), int(sizes[f"{prefix}_max"])
    )


@trace.command("inspect")
@click.argument("path")
@click.option("--block-size", default=16, show_default=True, help="KV block size for the prefix reuse ratio.")
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@clean_errors
def inspect_cmd(path: str, block_size: int, as_json: bool) -> None:
    """Rows, rates, length percentiles, token totals and prefix reuse of a trace."""
    stats = trace_stats(read_trace(path), block_size)
    if as_json:
        click.echo(json.dumps({"path": path, **stats.to_dict()}, indent=2))
    else:
        click.echo(format_stats(stats, path))


@trace.command("transform")
@click.argument("path")
@click.option("--out", required=True, help="Output trace (.parquet, or .csv / .csv.gz).")
@click.option("--head", type=int, help="Keep the first N requests.")
@click.option("--window", type=(float, float), help="Keep arrivals in [T0, T1), shifted to start at 0.")
@click.option("--time-scale", type=float, help="Multiply arrival times by F.")
@click.option("--rate", type=float, help="Re-time to Poisson arrivals at R req/s (order kept).")
@click.option("--rate-profile", default=None, metavar="T0=R0,T1=R1,...",
              help="Re-time to Poisson arrivals whose rate is R0 req/s from T0 (0), R1 from T1, ... "
                   "(a day's load, a burst: e.g. 0=2,600=10,1200=2), order kept.")
@click.option("--time-offset", type=float, default=None, metavar="S",
              help="Add S seconds to every arrival (a trace that started S s after one it is merged with).")
@click.option("--sample", type=float, help="Keep each request with probability FRACTION.")
@click.option("--max-prompt-tokens", type=int, help="Keep the requests whose prompt has at most N tokens.")
@click.option("--seed", default=0, show_default=True, help="Seed of --sample and --rate.")
@click.option("--samples", type=int, default=None, metavar="N",
              help="Every request asks for N sequences (parallel sampling, the n column: best-of-N, RL rollouts).")
@click.option("--priority", type=int, default=None, metavar="P",
              help="Give every request priority P (vLLM's: lower first under --scheduling-policy priority).")
@click.option("--request-class", default=None, metavar="NAME",
              help="Label every request with this class (the request_class column: a replay gives each class's "
                   "latencies and takes SLOs per class, --goodput NAME:ttft:MS).")
@click.option("--class-by-prompt-tokens", default=None, metavar="BINS",
              help="Label each request by its prompt's size instead: short<2048,medium<8192,long (a class below "
                   "each bound, the last for the rest).")
@click.option("--class-by-output-tokens", default=None, metavar="BINS",
              help="... by its reply's size: short<128,long.")
@click.option("--lora-adapters", type=int, default=None, metavar="N",
              help="Name a LoRA adapter for every request (lora-0 .. lora-N-1, a session's turns one adapter), "
                   "drawn with Zipf popularity (--lora-zipf); replay with --enable-lora --max-loras K.")
@click.option("--lora-zipf", type=float, default=1.0, show_default=True,
              help="With --lora-adapters: adapter k is drawn with weight 1 / (k + 1)^S (0: uniform).")
@click.option("--images", type=float, default=None, metavar="SHARE",
              help="Give this share of the requests images (multimodal items, for a vision model such as "
                   "qwen2.5-vl-7b), inserted before the prompt's last --image-text-after tokens.")
@click.option("--image-tokens", type=int, default=1024, show_default=True,
              help="With --images: each image's tokens (Qwen2.5-VL: about W/28 x H/28 for W x H pixels).")
@click.option("--images-per-request", type=int, default=1, show_default=True, help="With --images.")
@click.option("--distinct-images", type=int, default=None, metavar="N",
              help="With --images: draw the images from N (Zipf popularity, --image-zipf), so some repeat and "
                   "find the encoder's cache [default: every image a new one].")
@click.option("--image-zipf", type=float, default=1.0, show_default=True,
              help="With --distinct-images: image k is drawn with weight 1 / (k + 1)^S.")
@click.option("--image-text-after", type=int, default=16, show_default=True,
              help="With --images: the prompt's tokens after its images (the rest of the user message).")
@click.option("--session-history", is_flag=True,
              help="A trace with session_id but no content ids: take a turn whose prompt holds its session's "
                   "previous prompt and reply (is at least as long) to repeat them, and write content ids that say "
                   "so, so a replay finds them in the prefix cache; applied before lora-adapters and images.")
@click.option("--system-prompt-tokens", type=int, default=None, metavar="N",
              help="Every prompt of at least N tokens starts with the same N-token system prompt (an "
                   "application's instructions), shared in the prefix cache; the rest as the trace says. "
                   "Applied after --session-history.")
@click.option("--history-block-tokens", type=int, default=16, show_default=True,
              help="With --session-history or --system-prompt-tokens: tokens per content id of rows without.")
@click.option("--link-replies", is_flag=True,
              help="Lengthen a request's hash list over its reply where a later prompt repeats prompt and reply "
                   "(a chat's next turn), so the replay's next turn hits the reply's cached blocks; applied last.")
@clean_errors
def transform_cmd(path: str, out: str, head: int | None, window: tuple[float, float] | None,
                  time_scale: float | None, rate: float | None, rate_profile: str | None, time_offset: float | None,
                  sample: float | None,
                  max_prompt_tokens: int | None, seed: int, samples: int | None, priority: int | None, request_class: str | None,
                  class_by_prompt_tokens: str | None, class_by_output_tokens: str | None, lora_adapters: int | None, lora_zipf: float, images: float | None, image_tokens: int, images_per_request: int, distinct_images: int | None,
                  image_zipf: float, image_text_after: int, session_history: bool, system_prompt_tokens: int | None,
                  history_block_tokens: int, link_replies: bool) -> None:
    """Edit a trace before a replay (order: window, head, sample, max-prompt-tokens, time-scale, rate,
    time-offset, samples, priority, request-class or class-by-*, session-history, system-prompt-tokens,
    lora-adapters, images, link-replies)."""
    if session_history and link_replies:
        raise click.UsageError("--session-history links each turn to its previous reply itself; drop --link-replies")
    if class_by_prompt_tokens is not None and class_by_output_tokens is not None:
        raise click.UsageError("give --class-by-prompt-tokens or --class-by-output-tokens, not both")
    class_by = None
    for column, text in (("prompt_tokens", class_by_prompt_tokens), ("output_tokens", class_by_output_tokens)):
        if text is not None:
            class_by = (column, *parse_class_bins(text, f"--class-by-{column.replace('_', '-')}"))
    edits = Edits(window=window, head=head, sample=sample, max_prompt_tokens=max_prompt_tokens,
                  time_scale=time_scale, rate=rate, time_offset=time_offset, samples=samples, priority=priority,
                  rate_profile=parse_rate_profile(rate_profile) if rate_profile is not None else None,
                  request_class=request_class, class_by=class_by, seed=seed)
    result = transform(read_trace(path), edits)
    note = ""
    if session_history:
        from simkv.traces.history import session_history as with_history

        result, linked, prompt_only, later = with_history(result, history_block_tokens)
        note = (f"; {linked:,} of {later:,} later turns hold their session's previous prompt and reply, "
                f"{prompt_only:,} more its prompt only (the rest, and first turns, are content of their own)")
    if system_prompt_tokens is not None:
        from simkv.traces.history import with_system_prompt

        result, given = with_system_prompt(result, system_prompt_tokens, history_block_tokens)
        note += (f"; {given:,} of {len(result):,} prompts start with the {system_prompt_tokens:,}-token system "
                 "prompt (the shorter ones are left as they are)")
    if lora_adapters is not None:
        from simkv.traces.lora import assign_adapters

        result = assign_adapters(result, lora_adapters, lora_zipf, seed)
        note = f"; requests name {len(set(result.lora_name)):,} of {lora_adapters:,} LoRA adapters"
    if images is not None:
        from simkv.traces.images import add_images

        result, with_images = add_images(result, images, image_tokens, images_per_request, distinct_images,
                                         image_zipf, image_text_after, seed)
        note += f"; {with_images:,} requests carry {images_per_request} image(s) of {image_tokens:,} tokens"
    if link_replies:
        had_sessions = result.session_id is not None
        result, linked = replies.link_replies(result)
        note += f"; {linked:,} replies linked to the prompts that repeat them"
        if not had_sessions and result.session_id is not None:
            chains = len({s for s in result.session_id.tolist() if s is not None})
            note += f", in {chains:,} sessions (chains of linked requests, paced in replays)"
    write_trace(result, out)
    click.echo(f"wrote {len(result):,} requests to {out}{note}")


@trace.command("merge")
@click.argument("inputs", nargs=-1, required=True, metavar="[NAME=]TRACE...")
@click.option("--out", required=True, help="Output trace (.parquet, or .csv / .csv.gz).")
@click.option("--shared-content", is_flag=True,
              help="Keep the inputs' block hashes and image ids as they are (slices of one source whose prompts "
                   "are shared); by default each input's content is its own.")
@clean_errors
def merge_cmd(inputs: tuple[str, ...], out: str, shared_content: bool) -> None:
    """Merge traces onto one clock, each row's request_class naming its kind of traffic: NAME=TRACE labels an
    input, a TRACE alone keeps its own request_class column or takes its file name. Ids are prefixed with the
    label (chat/17); arrival times are kept (set each input's load with `trace transform` first)."""
    from pathlib import Path

    from simkv.traces.merge import merge_traces

    parts = []
    for item in inputs:
        name, path = item.split("=", 1) if "=" in item and not Path(item).exists() else (None, item)
        trace_in = read_trace(path)
        if name is None and trace_in.request_class is None:
            name = _stem(path)
        parts.append((name, trace_in))
    result = merge_traces(parts, shared_content=shared_content)
    write_trace(result, out)
    mix = ", ".join(f"{label} {n:,}" for label, n in class_counts(result).items())
    click.echo(f"wrote {len(result):,} requests to {out} (request classes: {mix})")


def _stem(path: str) -> str:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    for suffix in (".csv.gz", ".parquet", ".pq", ".csv"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


@trace.command("export")
@click.argument("path")
@click.option("--out", required=True, help="The timed trace for vLLM's benchmark client (*.jsonl).")
@click.option("--block-size", default=16, show_default=True,
              help="The server's KV block size (the ids' chunk size divides it, so shared blocks stay shared).")
@click.option("--trace-out", default=None,
              help="Where to write the simkv trace of the same requests [default: --out with .parquet].")
@click.option("--model", default="MODEL", show_default=True, help="The served model, for the printed vllm command.")
@clean_errors
def export_cmd(path: str, out: str, block_size: int, trace_out: str | None, model: str) -> None:
    """Write TRACE as vLLM's timed-trace JSON Lines, for `vllm bench serve --dataset-name
    timed_trace`, and the simkv trace the server will see beside it; then `simkv compare` puts a
    simulated replay of that trace beside the benchmark's result (docs/validate_vllm.md)."""
    from simkv.traces.vllm_bench import (bench_command, check_jsonl_path, export_timed_trace, served_trace_path,
                                         write_timed_trace)

    check_jsonl_path(out)
    export = export_timed_trace(read_trace(path), block_size)
    trace_out = trace_out or str(served_trace_path(out))
    write_timed_trace(export, out, trace_out)
    n = len(export.lines)
    click.echo(f"wrote {n:,} requests to {out} ({export.chunk_tokens}-token chunks) and {trace_out}")
    for note in export.notes:
        click.echo(f"note: {note}")
    click.echo("next, with the server up:\n  " + bench_command(out, n, export.chunk_tokens, model))
    click.echo(f"  simkv replay {trace_out} --block-size {block_size} --out sim   # + the server's options "
               f"(--model, --gpu, -tp, --async-scheduling as vLLM serves by default, ...)")
    click.echo("  simkv compare sim bench.json --out compare   # + --server-metrics BEFORE AFTER (/metrics snapshots)")
    click.echo("  simkv calibrate --from-bench bench.json --sim sim --out fit.json   # then --cost-model fit.json")


@trace.command("from-vllm-multi-turn")
@click.argument("config_path", metavar="CONFIG.json")
@click.option("--out", required=True, help="Output trace (.parquet, or .csv / .csv.gz).")
@click.option("--seed", default=0, show_default=True, help="The benchmark's --seed.")
@click.option("--max-turns", type=int, default=None, help="The benchmark's --max-turns: messages (user and answer) "
                                                          "per conversation at most.")
@click.option("--hash-block-tokens", default=16, show_default=True, help="Tokens per hash block.")
@clean_errors
def from_vllm_multi_turn_cmd(config_path: str, out: str, seed: int, max_turns: int | None,
                             hash_block_tokens: int) -> None:
    """Write the conversations vLLM's multi-turn benchmark generates from CONFIG.json (its
    generate_multi_turn.json) as a trace of paced sessions: the generator's draws, with Llama 3's
    token counts for its fixed texts and chat template (simkv/traces/vllm_multi_turn.py)."""
    from simkv.traces.vllm_multi_turn import multi_turn_trace, read_config

    if max_turns is not None and max_turns < 2:
        raise click.BadParameter("must be >= 2 (a user message and its answer)", param_hint="--max-turns")
    trace = multi_turn_trace(read_config(config_path), seed, max_turns, hash_block_tokens,
                             source=f"vllm-multi-turn:{config_path}")
    write_trace(trace, out)
    sessions = len(set(trace.session_id.tolist()))
    click.echo(f"wrote {len(trace):,} turns of {sessions:,} conversations to {out}")
    click.echo(f"replay it as --num-clients N --max-active-conversations M: simkv replay {out} "
               "--client-max-concurrency N --client-max-active-sessions M (M defaults to N there)")


@trace.command("from-vllm-bench")
@click.argument("command")
@click.option("--out", required=True, help="Output trace (.parquet, or .csv / .csv.gz).")
@click.option("--model", default="llama-3-8b", show_default=True,
              help="The served model: whether its tokenizer puts a BOS token in front of every prompt (Qwen's and "
                   "gpt-oss's do not), and with random-mm how many tokens its processor makes of an image.")
@clean_errors
def from_vllm_bench_cmd(command: str, out: str, model: str) -> None:
    """Write the traffic of a `vllm bench serve` COMMAND (or @FILE) as a trace: its random
    dataset and schedule, drawn as vLLM's client draws them (`simkv replay --vllm-bench` replays
    it directly)."""
    from simkv.cli.vllm_bench_command import bench_command
    from simkv.config import ConfigError

    try:
        bench = bench_command(command, model, source="COMMAND")
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    write_trace(bench.trace, out)
    click.echo(f"wrote {len(bench.trace):,} requests to {out}")
    if bench.note():
        click.echo(f"note: {bench.note()}")
    flags = ([f"--client-max-concurrency {bench.max_concurrency}"] if bench.max_concurrency else []) + [
        f"--goodput {slo}" for slo in bench.goodput]
    if flags:
        click.echo(f"replay it as the client sends it: simkv replay {out} {' '.join(flags)} ...")
