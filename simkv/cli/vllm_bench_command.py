"""`--vllm-bench`: the traffic of a `vllm bench serve` command line, so that a replay predicts
what that benchmark would measure against the server simulated.

The client's 101 flags (vLLM 0.33: vllm_bench_flags.json) are sorted as the server's are
(cli/vllm_serve.py): the random, random-mm, prefix_repetition and timed_trace datasets' and the schedule's
flags make the trace (simkv/traces/vllm_random.py, vllm_random_mm.py and vllm_bench.py, as the client draws or
reads it), --max-concurrency becomes `client_max_concurrency`, --goodput becomes simkv's
--goodput; flags with no bearing on the traffic are ignored; what changes it in ways simkv does
not model is named in a note (warm-up requests, the ready check's request, replies that may
stop at EOS, a chat template's tokens); the other datasets, which need their data, are refused
(import a finished benchmark's result with `simkv trace import vllm-bench` instead).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from simkv.cli.vllm_command_line import CommandLineError, flag_table, read_command
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace
from simkv.traces.vllm_random import PrefixRepetitionDataset, RandomDataset, Schedule

DATASETS = ("random", "random-mm", "prefix_repetition", "timed_trace")
# random-mm's own flags (simkv/traces/vllm_random_mm.py); vLLM ignores them with the other datasets, as simkv does
RANDOM_MM_FLAGS = ("random_mm_base_items_per_request", "random_mm_num_mm_items_range_ratio",
                   "random_mm_limit_mm_per_prompt", "random_mm_bucket_config")
MULTIMODAL_BACKENDS = ("openai-chat",)  # (vLLM's client also takes openai-audio, whose audio simkv does not model)
SCHEDULE = {"request_rate": float, "burstiness": float, "ramp_up_strategy": str, "ramp_up_start_rps": float,
            "ramp_up_end_rps": float}
# the datasets' own flags (the general --input-len / --output-len win over the dataset's)
DATASET_FLAGS = {"num_prompts": int, "seed": int, "input_len": int, "output_len": int, "random_input_len": int,
                 "random_output_len": int, "random_prefix_len": int, "prefix_repetition_prefix_len": int,
                 "prefix_repetition_suffix_len": int, "prefix_repetition_num_prefixes": int,
                 "prefix_repetition_output_len": int, "disable_shuffle": bool, "dataset_path": str,
                 "timed_trace_chunk_hash_size": int, "timed_trace_sec_multiplier": float,
                 "timed_trace_label_timestamp": str, "timed_trace_label_input_length": str,
                 "timed_trace_label_output_length": str, "timed_trace_label_hash_ids": str, "self_timed": bool}
SPECIAL = frozenset({"dataset_name", "max_concurrency", "goodput", "random_range_ratio", "ignore_eos",
                     "ready_check_timeout_sec", "num_warmups", "backend"})
COMPLETIONS = ("openai", "vllm")  # (the backends that send the prompt as it is)
CHAT = ("openai-chat", "openai-responses")  # (... and those that wrap it in the model's chat template)
IGNORED = frozenset("""
    label base_url host port endpoint header insecure model tokenizer tokenizer_mode trust_remote_code
    served_model_name skip_tokenizer_init request_id_prefix save_result save_detailed append_result metadata
    result_dir result_filename percentile_metrics metric_percentiles disable_tqdm profile plot_timeline
    plot_dataset_stats timeline_itl_thresholds extra_body chat_template_kwargs skip_chat_template
    enable_multimodal_chat no_oversample no_stream
""".split())  # (no_stream: the client loads a Hugging Face dataset without streaming it; the replies still stream)
UNMODELLED = frozenset("temperature top_p top_k min_p frequency_penalty presence_penalty repetition_penalty "
                       "logprobs".split())
# flags of the client's other datasets: vLLM ignores them with the random dataset, as simkv does
OTHER_DATASETS = frozenset("""
    sharegpt_output_len hf_name hf_split hf_subset hf_output_len custom_output_len custom_ensure_client_side_data
    asr_max_audio_len_sec asr_min_audio_len_sec blazedit_min_distance blazedit_max_distance bfcl_categories
    spec_bench_category spec_bench_output_len speed_bench_category speed_bench_dataset_subset speed_bench_output_len
    no_reranker
""".split())
REFUSED = {"probe_request_rate": "probe requests on a connection of their own are not modelled",
           "random_batch_size": "batched prompts are an embeddings benchmark's",
           "use_beam_search": "beam search is not modelled",
           "lora_modules": "requests spread over LoRA adapters: give the trace a LoRA column "
                           "(`simkv trace transform --lora-adapters`)",
           "lora_assignment": "requests spread over LoRA adapters are not modelled from the bench command"}


@dataclass
class BenchCommand:
    """What a `vllm bench serve` command sends: its trace, the client's concurrency limit, its
    goodput SLOs (vLLM's KEY:MS), and the flags simkv did not carry over."""

    trace: Trace
    max_concurrency: int | None = None
    goodput: tuple[str, ...] = ()
    unmodelled: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def note(self) -> str | None:
        parts = []
        if self.unmodelled:
            parts.append(f"not modelled: {'; '.join(self.unmodelled)}")
        if self.ignored:
            parts.append(f"ignored (client, output, other datasets): {', '.join(self.ignored)}")
        return "vllm bench serve: " + "; ".join(parts) if parts else None


def _table():
    return flag_table("vllm_bench_flags.json", ("bench", "serve"))


def bench_flags() -> dict:
    """vLLM's bench client flags by name (its `dest`)."""
    return _table().flags


def sorted_flags() -> list[frozenset]:
    """The classes the client's flags are sorted into (every flag in exactly one: tested)."""
    return [frozenset(SCHEDULE), frozenset(DATASET_FLAGS), SPECIAL, IGNORED, UNMODELLED, OTHER_DATASETS,
            frozenset(RANDOM_MM_FLAGS),
            frozenset(REFUSED)]


def special_tokens(model: str) -> int:
    """The special tokens the model's tokenizer puts in front of a prompt: Qwen's and gpt-oss's
    none, the others' (Llama, Mistral, Gemma, DeepSeek) a BOS token."""
    name = model.lower()
    if name.endswith(".json"):
        try:
            with open(model) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return 1  # (the model option reports a bad file itself)
        name = str(config.get("model_type", "")) + str((config.get("text_config") or {}).get("model_type", ""))
    return 0 if "qwen" in name or "gpt-oss" in name or "gpt_oss" in name else 1


def bench_command(command: str, model: str, source: str = "--vllm-bench") -> BenchCommand:
    """The traffic of a `vllm bench serve` command line (a @FILE holds one) against `model`
    (whose tokenizer's special tokens count in every prompt); a flag simkv cannot honour raises
    CommandLineError naming it."""
    positional, flags = read_command(command, _table(), source)
    if positional is not None and not any(f.name == "model" for f in flags):  # (--model's value is one)
        raise CommandLineError(f"{source}: '{positional}' is neither a flag nor a flag's value")
    schedule: dict = {}
    given: dict = {}
    dataset_name = "random"
    out_flags = {"unmodelled": [], "ignored": []}
    max_concurrency, goodput, refused = None, (), []
    ratio = (0.0, 0.0)
    ignore_eos = False
    ready_check = float(_table().default("ready_check_timeout_sec")) > 0  # (the client's initial test run)
    warmups = 0
    backend = "openai"
    mm_flags: dict = {}
    for flag in flags:
        name, word = flag.name, flag.word
        if name in SCHEDULE:
            schedule[name] = _number(flag, SCHEDULE[name], source)
        elif name in DATASET_FLAGS:
            given[name] = (not flag.negative) if DATASET_FLAGS[name] is bool else _number(flag, DATASET_FLAGS[name],
                                                                                          source)
        elif name == "dataset_name":
            if flag.value not in DATASETS:
                raise CommandLineError(
                    f"{source}: --dataset-name {flag.value}: simkv takes the random, random-mm, prefix_repetition "
                    "and timed_trace datasets (the others need their data); replay such a benchmark from its result "
                    "(`simkv trace import vllm-bench bench.json`)")
            dataset_name = flag.value
        elif name == "max_concurrency":
            max_concurrency = int(_number(flag, int, source))
        elif name == "goodput":
            goodput = flag.values
        elif name == "random_range_ratio":
            ratio = _range_ratio(flag.value, source)
        elif name == "ignore_eos":
            ignore_eos = not flag.negative
        elif name == "backend":
            backend = flag.value
        elif name == "ready_check_timeout_sec":
            ready_check = float(flag.value) > 0
        elif name == "num_warmups":
            warmups = int(_number(flag, int, source))
        elif name in RANDOM_MM_FLAGS:
            mm_flags[name] = flag
        elif name in IGNORED or name in OTHER_DATASETS:
            out_flags["ignored"].append(word)
        elif name in UNMODELLED:
            out_flags["unmodelled"].append(f"{word} (its cost)")
        elif name in REFUSED:
            default = _table().default(name)
            if (not flag.negative) if _table().nargs(name) == "0" else str(flag.value) != str(default):
                refused.append(f"{word} ({REFUSED[name]})")
        else:  # (a flag of a newer vLLM, not sorted yet)
            raise CommandLineError(f"{source}: {word} is not sorted by simkv/cli/vllm_bench_command.py")
    if refused:
        raise CommandLineError(f"{source}: simkv cannot honour " + "; ".join(refused))
    if backend not in COMPLETIONS + CHAT:
        raise CommandLineError(f"{source}: --backend {backend}: simkv models text generation (backends "
                               f"{', '.join(COMPLETIONS + CHAT)})")
    if any(f.name == "self_timed" for f in flags) and dataset_name != "timed_trace":  # (vLLM's check, its words)
        raise CommandLineError(f"{source}: --self-timed/--no-self-timed is only supported with "
                               "--dataset-name=timed_trace")
    if dataset_name == "timed_trace" and backend not in COMPLETIONS:
        raise CommandLineError(f"{source}: timed_trace dataset passes pre-tokenized prompts (list[int]) and requires "
                               "a completions backend ('vllm' or 'openai').")
    if dataset_name == "random-mm" and backend not in MULTIMODAL_BACKENDS:  # (vLLM's check, its words)
        raise CommandLineError(f"{source}: Multi-modal content is not supported on backend {backend!r}; use one of "
                               f"{sorted(MULTIMODAL_BACKENDS)}.")
    if dataset_name != "random-mm":
        out_flags["ignored"] += [f.word for f in mm_flags.values()]
    if backend in CHAT:
        out_flags["unmodelled"].append(f"--backend {backend} wraps every prompt in the model's chat template, whose "
                                       "tokens are not counted")
    # (the client forces --ignore-eos for random prompts and timed traces, so replies run to their length)
    if not ignore_eos and dataset_name == "prefix_repetition":
        out_flags["unmodelled"].append("replies end at their drawn length, as with --ignore-eos (without it the "
                                       "model may stop one early)")
    if ready_check:
        out_flags["unmodelled"].append("the ready check's request (the first prompt, sent once before the run, "
                                       "which leaves it cached; vLLM's client skips it at its default, 0)")
    if warmups:
        out_flags["unmodelled"].append(f"{warmups} warm-up requests of the first prompt")
    try:
        if dataset_name == "timed_trace":
            trace = _timed_trace(given, Schedule(**schedule), source)
        elif dataset_name == "random-mm":
            text = _dataset("random", given, ratio, Schedule(**schedule), special_tokens(model))
            trace = _random_mm(text, mm_flags, model, source)
        else:
            trace = _dataset(dataset_name, given, ratio, Schedule(**schedule), special_tokens(model)).trace()
    except TraceError as exc:
        raise CommandLineError(f"{source}: {exc}") from None
    if max_concurrency is not None and max_concurrency < 1:
        raise CommandLineError(f"{source}: --max-concurrency must be greater than 0")
    return BenchCommand(trace, max_concurrency, tuple(goodput), **out_flags)


def _dataset(name: str, given: dict, ratio: tuple[float, float], schedule: Schedule, special: int):
    """The dataset of `name` from its flags (those of the other dataset are ignored, as vLLM does)."""
    common = {"num_prompts": given.get("num_prompts", 1000), "seed": given.get("seed", 0),
              "num_special_tokens": special, "schedule": schedule}
    if name == "random":
        return RandomDataset(**common, random_input_len=given.get("input_len", given.get("random_input_len", 1024)),
                             random_output_len=given.get("output_len", given.get("random_output_len", 128)),
                             random_prefix_len=given.get("random_prefix_len", 0),
                             input_range_ratio=ratio[0], output_range_ratio=ratio[1])
    return PrefixRepetitionDataset(**common, prefix_len=given.get("prefix_repetition_prefix_len", 256),
                                   suffix_len=given.get("prefix_repetition_suffix_len", 256),
                                   num_prefixes=given.get("prefix_repetition_num_prefixes", 10),
                                   output_len=given.get("output_len", given.get("prefix_repetition_output_len", 128)),
                                   disable_shuffle=given.get("disable_shuffle", False))


def _random_mm(text: RandomDataset, mm_flags: dict, model: str, source: str) -> Trace:
    """random-mm's traffic: the random dataset's prompts, each followed by its images, of as many
    tokens as the served model's processor makes of them."""
    from simkv.specs import get_model_spec
    from simkv.traces.vllm_random_mm import RandomMultiModalDataset, parse_buckets, parse_limits

    spec = get_model_spec(model)
    if not spec.vision_num_layers:
        raise CommandLineError(f"{source}: --dataset-name random-mm sends images, and model {model} has no vision "
                               "encoder in its spec (qwen2.5-vl-7b, qwen3-vl-30b-a3b, or a Qwen VL config.json)")
    options: dict = {}
    if "random_mm_base_items_per_request" in mm_flags:
        options["base_items_per_request"] = int(_number(mm_flags["random_mm_base_items_per_request"], int, source))
    if "random_mm_num_mm_items_range_ratio" in mm_flags:
        options["num_mm_items_range_ratio"] = float(_number(mm_flags["random_mm_num_mm_items_range_ratio"], float,
                                                            source))
    if "random_mm_limit_mm_per_prompt" in mm_flags:
        options["limit_mm_per_prompt"] = parse_limits(mm_flags["random_mm_limit_mm_per_prompt"].value)
    if "random_mm_bucket_config" in mm_flags:
        options["bucket_config"] = parse_buckets(mm_flags["random_mm_bucket_config"].value)
    try:
        return RandomMultiModalDataset(text, **options).trace(spec.image_embeddings)
    except ValueError as exc:  # (an image's aspect ratio past the processor's limit)
        raise CommandLineError(f"{source}: {exc}") from None


def _timed_trace(given: dict, schedule: Schedule, source: str) -> Trace:
    """A timed trace (JSON Lines), read as the client reads it: sent at its timestamps (unless
    --no-self-timed: at the schedule's times), its prompts as token ids (no BOS added)."""
    from simkv.traces.vllm_bench import TimedTraceLabels, read_timed_trace

    if "dataset_path" not in given:
        raise CommandLineError(f"{source}: --dataset-name timed_trace needs --dataset-path")
    labels = TimedTraceLabels(**{field: given[f"timed_trace_label_{field}"] for field in
                                 ("timestamp", "input_length", "output_length", "hash_ids")
                                 if f"timed_trace_label_{field}" in given})
    trace = read_timed_trace(given["dataset_path"], given.get("timed_trace_chunk_hash_size", 16),
                             given.get("timed_trace_sec_multiplier", 1.0), given.get("num_prompts", 1000), labels)
    if given.get("self_timed", True):
        return trace
    schedule.check()
    return dataclasses.replace(trace, arrival_time_s=schedule.send_times(len(trace), given.get("seed", 0)))


def _number(flag, kind, source: str):
    try:
        return kind(flag.value)
    except (TypeError, ValueError):
        what = {int: "a whole number", float: "a number", str: "a word"}[kind]
        raise CommandLineError(f"{source}: {flag.word} {flag.value!r} is not {what}") from None


def _range_ratio(text: str, source: str) -> tuple[float, float]:
    """A float for both lengths, or vLLM's JSON {"input": a, "output": b}."""
    try:
        value = json.loads(text)
    except ValueError:
        raise CommandLineError(f"{source}: --random-range-ratio {text!r} is neither a number nor JSON") from None
    if isinstance(value, dict):
        try:
            return float(value["input"]), float(value["output"])
        except (KeyError, TypeError, ValueError):
            raise CommandLineError(f"{source}: --random-range-ratio as JSON needs 'input' and 'output' numbers, "
                                   f"got {text}") from None
    if isinstance(value, (int, float)):
        return float(value), float(value)
    raise CommandLineError(f"{source}: --random-range-ratio {text!r} is neither a number nor JSON")


def bench_report(summary: dict, requests) -> str:
    """The replay's figures in the layout `vllm bench serve` prints its result in, for reading
    side by side with a real run's (tokens as the server counts them, BOS included). The input
    tokens are the client's count, the prompts' text: the images' placeholder tokens
    (`mm_tokens`) are left out, as vLLM's client leaves them out (its throughput too)."""
    finished = requests[requests["status"] == "finished"]
    times = sorted([(t, 1) for t in requests["arrival_time_s"]]
                   + [(t, -1) for t in requests["finish_time_s"].fillna(requests["arrival_time_s"])])
    level = peak = 0
    for _, step in times:
        level += step
        peak = max(peak, level)
    duration = summary["duration_s"]
    prompt, output = int(finished["prompt_tokens"].sum()), int(finished["output_tokens"].sum())
    if "mm_tokens" in finished:
        prompt -= int(finished["mm_tokens"].sum())

    def line(name: str, value) -> str:
        return f"{name:<40} {value:<10.2f}" if isinstance(value, float) else f"{name:<40} {value:<10}"

    lines = [f"{' Serving Benchmark Result (simkv, simulated) ':=^50}",
             line("Successful requests:", len(finished)), line("Failed requests:", len(requests) - len(finished))]
    if summary.get("client_concurrency"):
        lines.append(line("Maximum request concurrency:", summary["client_concurrency"]["max_concurrency"]))
    lines += [line("Benchmark duration (s):", float(duration)), line("Total input tokens:", prompt),
              line("Total generated tokens:", output),
              line("Request throughput (req/s):", float(summary["request_throughput_req_s"]))]
    if summary.get("goodput"):
        lines.append(line("Request goodput (req/s):", float(summary["goodput"]["request_goodput_req_s"])))
    lines += [line("Output token throughput (tok/s):", float(summary["output_throughput_tok_s"])),
              line("Peak concurrent requests:", float(peak)),
              line("Total token throughput (tok/s):", (prompt + output) / duration if duration else 0.0)]
    for key, name, header in (("ttft_s", "TTFT", "Time to First Token"),
                              ("tpot_s", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl_s", "ITL", "Inter-token Latency"), ("e2e_s", "E2EL", "End-to-end Latency")):
        d = summary.get(key) or {}
        if d.get("mean") is None:
            continue
        lines += [f"{header:-^50}", line(f"Mean {name} (ms):", 1e3 * d["mean"]),
                  line(f"Median {name} (ms):", 1e3 * d["p50"]), line(f"P99 {name} (ms):", 1e3 * d["p99"])]
    return "\n".join(lines + ["=" * 50])
