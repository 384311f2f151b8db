"""`simkv replay --vllm-multi-turn "python benchmark_serving_multi_turn.py ..."`: the traffic of
vLLM's multi-turn benchmark (a script of vLLM's repository, benchmarks/multi_turn), read from its
command line: its conversation generator file (`--input-file`) drawn as the script draws it
(simkv/traces/vllm_multi_turn.py), its `--num-clients` and `--max-active-conversations` as the
client's limits (`client_max_concurrency`, `client_max_active_sessions`), and its statistics
printed in the script's layout beside simkv's table.

The script is not part of the vllm package, so its flags are listed here by hand from its
source (2026): each is taken, ignored (it changes what is printed or where requests go, not what
the server sees) or named on stderr as not modelled. A flag it does not have is refused."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simkv.cli.vllm_command_line import CommandLineError
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

@dataclass
class MultiTurnCommand:
    """What a multi-turn benchmark command sends, and the client's limits it sets."""

    trace: Trace
    num_clients: int
    max_active_conversations: int
    model: str | None
    client_options: dict = field(default_factory=dict)  # (the replay's client_* options: its clients)
    not_modelled: list[str] = field(default_factory=list)

    def note(self) -> str:
        return ("not modelled: " + "; ".join(self.not_modelled)) if self.not_modelled else ""


class _Refusal(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # (argparse would exit)
        raise _Refusal(message)


def _parser() -> _Parser:
    """The script's flags (its --help); those that change only what it prints or where it sends
    are read and let be."""
    p = _Parser(prog="benchmark_serving_multi_turn.py", add_help=False, allow_abbrev=False)
    p.add_argument("-i", "--input-file", required=True)
    p.add_argument("-m", "--model")
    p.add_argument("--served-model-name")
    p.add_argument("-u", "--url")
    p.add_argument("--api-key")
    p.add_argument("--header", action="append")
    p.add_argument("-p", "--num-clients", type=int, default=1)
    p.add_argument("-k", "--max-active-conversations", type=int)
    p.add_argument("-n", "--max-num-requests", type=int)
    p.add_argument("--warmup-step", action="store_true")
    p.add_argument("--max-turns", type=int)
    p.add_argument("--no-early-stop", action="store_true")
    p.add_argument("--limit-max-tokens", type=int, default=0)  # (0: the answer's length in the file)
    p.add_argument("--limit-min-tokens", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=0.0)
    p.add_argument("--max-retries", type=int, default=0)
    p.add_argument("--conversation-sampling", default="round_robin", choices=["round_robin", "random"])
    p.add_argument("--verify-output", action="store_true")
    p.add_argument("--request-timeout-sec", type=int, default=120)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--send-conversation-id", action="store_true")
    p.add_argument("-e", "--excel-output", action="store_true")
    p.add_argument("--stats-json-output")
    p.add_argument("-o", "--output-file")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--print-content", action="store_true")
    p.add_argument("--warmup-percentages", default="0%")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def _words(text: str, source: str) -> list[str]:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise CommandLineError(f"{source}: {exc}") from None
    words = shlex.split(text.replace("\\\n", " "))
    while words and (words[0] in ("python", "python3", "uv", "run") or words[0].endswith(".py")):
        words.pop(0)
    return words


def command_args(text: str, source: str = "--vllm-multi-turn") -> argparse.Namespace:
    """The benchmark command's flags, as the script parses them (no file read); CommandLineError
    naming a flag it does not have."""
    try:
        return _parser().parse_args(_words(text, source))
    except _Refusal as exc:
        raise CommandLineError(f"{source}: {exc} (vLLM's benchmarks/multi_turn/benchmark_serving_multi_turn.py "
                               "flags)") from None


def multi_turn_command(text: str, source: str = "--vllm-multi-turn") -> MultiTurnCommand:
    """The benchmark command `text` (or @FILE holding one), read; CommandLineError naming the
    flag it cannot take."""
    from simkv.traces.vllm_multi_turn import multi_turn_trace, read_config

    args = command_args(text, source)
    if args.num_clients < 1:
        raise CommandLineError(f"{source}: --num-clients must be a positive number, got {args.num_clients}")
    active = args.max_active_conversations if args.max_active_conversations is not None else args.num_clients
    if active < args.num_clients:
        raise CommandLineError(f"{source}: --max-active-conversations {active} must be at least --num-clients "
                               f"{args.num_clients} (the script refuses it too)")
    if args.max_turns is not None and args.max_turns < 2:
        raise CommandLineError(f"{source}: --max-turns must be 2 or more here (a user message and its answer)")
    try:
        with open(args.input_file) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CommandLineError(f"{source}: --input-file: {exc}") from None
    if isinstance(data, list):
        raise CommandLineError(f"{source}: --input-file {args.input_file} holds conversations as text; simkv runs "
                               "no tokenizer: give the generator file (\"filetype\": \"generate_conversations\")")
    try:
        trace = multi_turn_trace(read_config(args.input_file), args.seed, args.max_turns,
                                 source=f"vllm-multi-turn:{args.input_file}")
    except TraceError as exc:
        raise CommandLineError(f"{source}: --input-file: {exc}") from None
    conversations = len(set(trace.session_id.tolist()))
    if conversations < args.num_clients:
        raise CommandLineError(f"{source}: --num-clients {args.num_clients} is more than the file's {conversations} "
                               "conversations (the script refuses it too)")
    if active > conversations:
        raise CommandLineError(f"{source}: --max-active-conversations {active} is more than the file's "
                               f"{conversations} conversations (the script refuses it too)")
    active = args.num_clients * (active // args.num_clients)  # (each client keeps M // N of them)
    unmodelled = []
    if (args.limit_max_tokens > 0 or args.limit_min_tokens > 0) and (
            args.limit_max_tokens < 1 or args.limit_min_tokens < 1 or args.limit_min_tokens > args.limit_max_tokens):
        raise CommandLineError(f"{source}: --limit-min-tokens {args.limit_min_tokens} and --limit-max-tokens "
                               f"{args.limit_max_tokens}: give both, min at most max (the script refuses it too)")
    if args.limit_max_tokens > 0:  # (the script sends max_tokens only: min_tokens is left out of its requests)
        from dataclasses import replace

        trace = replace(trace, output_tokens=np.full(len(trace), args.limit_max_tokens, dtype=np.int64))
    elif args.limit_max_tokens < 0:
        unmodelled.append("--limit-max-tokens below 0 (no max_tokens: answers end where the model ends them; "
                          "simkv keeps the file's lengths)")
    if args.request_rate < 0:
        raise CommandLineError(f"{source}: --request-rate {args.request_rate} must be 0 (no pause) or more")
    if args.max_num_requests is not None and args.max_num_requests // args.num_clients < 1:
        raise CommandLineError(f"{source}: --max-num-requests {args.max_num_requests} is less than one request per "
                               "client (the script refuses it too)")
    if args.request_timeout_sec <= 0:
        raise CommandLineError(f"{source}: --request-timeout-sec {args.request_timeout_sec} must be positive (the "
                               "script refuses it too)")
    # its clients give up on a request after --request-timeout-sec (longer where max_tokens x 0.2 s is),
    # retry it --max-retries times after 1, 2, 4 ... s, and leave once one failed for good
    timeout = max(args.request_timeout_sec, int(int(trace.output_tokens.max()) * 0.2))
    if timeout > args.request_timeout_sec and int(int(trace.output_tokens.min()) * 0.2) < timeout:
        unmodelled.append(f"--request-timeout-sec raised per request for long answers (simkv waits the longest, "
                          f"{timeout} s, for every request)")
    if args.max_retries > 0:
        unmodelled.append("the +/-10 % jitter of its back-off (simkv waits its mean, and its --request-rate pauses "
                          "do not skip the jitter's draws)" if args.request_rate > 0
                          else "the +/-10 % jitter of its back-off (simkv waits its mean)")
    options = {"client_max_concurrency": args.num_clients, "client_max_active_sessions": active,
               "client_rotation": True, "client_early_stop": not args.no_early_stop,
               "client_conversation_sampling": args.conversation_sampling, "client_seed": args.seed,
               "client_warmup": args.warmup_step, "client_timeout_s": float(timeout),
               "client_max_retries": args.max_retries, "client_retry_backoff_s": 1.0}
    if args.request_rate > 0:
        options["client_request_rate"] = args.request_rate
    if args.max_num_requests is not None:
        options["client_max_requests"] = args.max_num_requests
    return MultiTurnCommand(trace, args.num_clients, active, args.model, options, unmodelled)


def multi_turn_report(summary: dict, requests, stream: bool = True) -> str:
    """The statistics the script prints, from a replay of its traffic: runtime (its first
    request's send to its last one's end), requests per second, and per request TTFT, TPOT,
    latency, turns and tokens (count, mean, std, min, percentiles, max), over the requests that
    finished (with its early stop, those sent before the client stopped). Its input_num_tokens
    counts the messages' text only: the prompt less the chat template's tokens. After a warm-up
    (--warmup-step) its requests are left out, and its time is printed beside, as the script does.
    Without streaming (`stream` False: its --no-stream) it takes the whole answer's time as TTFT and
    has no TPOT (0), as the script does."""
    from simkv.traces.vllm_multi_turn import chat_template_tokens

    done = requests[requests["status"] == "finished"]
    pacing = summary.get("session_pacing", {})
    warmup = pacing.get("warmup_end_s")
    if warmup is not None:  # (the warm-up's requests are not counted)
        done = done[done["arrival_time_s"] >= warmup]
    runtime = float(done["finish_time_s"].max() - done["arrival_time_s"].min()) if len(done) else 0.0
    stop = pacing.get("early_stop_s")
    out = done["output_tokens"].to_numpy(dtype=np.float64)
    ttft = done["ttft_s"].to_numpy() * 1e3
    latency = done["e2e_s"].to_numpy() * 1e3
    tpot = np.where(out > 1, (latency - ttft) / np.maximum(out - 1, 1), 0.0)
    if not stream:  # (one chunk, at the end)
        ttft, tpot = latency, np.zeros_like(latency)
    turns = np.array([2 * int(rid.rsplit("/turn", 1)[1]) + 1 if "/turn" in rid else 1
                      for rid in done["request_id"].tolist()], dtype=np.float64)
    text_tokens = done["prompt_tokens"].to_numpy(dtype=np.float64) - chat_template_tokens(turns)  # (what it counts)
    columns = {"ttft_ms": ttft, "tpot_ms": tpot, "latency_ms": latency, "input_num_turns": turns,
               "input_num_tokens": text_tokens, "output_num_tokens": out}
    stopped = ([f"(early stop at {stop:.3f} s: {pacing['turns_not_sent']:,} turns not sent)"]
               if stop is not None else [])
    lines = ["-" * 100, "Statistics summary (simkv, simulated):", *stopped,
             f"runtime_sec = {runtime:.3f}", f"requests_per_sec = {len(done) / runtime if runtime else 0.0:.3f}",
             *([f"warmup_runtime_sec = {warmup:.3f}", f"total_runtime_incl_warmup_sec = {runtime + warmup:.3f}"]
               if warmup is not None else []),
             "-" * 100,
             f"{'':<18}{'count':>9}{'mean':>10}{'std':>10}{'min':>10}{'25%':>10}{'50%':>10}{'75%':>10}"
             f"{'90%':>10}{'99%':>10}{'max':>10}"]
    for name, values in columns.items():
        if not len(values):
            continue
        q = np.percentile(values, [25, 50, 75, 90, 99])
        std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        lines.append(f"{name:<18}{len(values):>9.1f}{values.mean():>10.2f}{std:>10.2f}{values.min():>10.2f}"
                     + "".join(f"{v:>10.2f}" for v in q) + f"{values.max():>10.2f}")
    lines.append("-" * 100)
    return "\n".join(lines)
