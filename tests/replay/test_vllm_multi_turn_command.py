"""`simkv replay --vllm-multi-turn "python benchmark_serving_multi_turn.py ..."`
(simkv/cli/vllm_multi_turn_command.py)."""

import json

import numpy as np
import pandas as pd
import pytest

from simkv.cli.vllm_command_line import CommandLineError
from simkv.cli.vllm_multi_turn_command import multi_turn_command
from simkv.traces.schema import read_trace
from tests.cli_runs import cli_fails, cli_ok
from tests.traces.test_vllm_multi_turn import EXAMPLE


@pytest.fixture
def generator(tmp_path):
    path = tmp_path / "generate_multi_turn.json"
    path.write_text(json.dumps(EXAMPLE))
    return path


def test_a_command_replays_as_the_trace_and_limits_it_names(generator, tmp_path):
    command = (f"python benchmark_serving_multi_turn.py --model meta-llama/Llama-3.1-8B-Instruct --served-model-name "
               f"Llama --input-file {generator} --num-clients 2 --max-active-conversations 6 --no-early-stop")
    out = cli_ok(["replay", "--vllm-multi-turn", command, "--out", str(tmp_path / "a")])
    cli_ok(["trace", "from-vllm-multi-turn", str(generator), "--out", str(tmp_path / "t.parquet")])
    cli_ok(["replay", str(tmp_path / "t.parquet"), "--model", "llama-3.1-8b", "--client-max-concurrency", "2",
            "--client-max-active-sessions", "6", "--client-rotation", "--client-timeout", "120",
            "--out", str(tmp_path / "b")])
    a, b = (pd.read_parquet(tmp_path / d / "requests.parquet") for d in "ab")
    pd.testing.assert_frame_equal(a, b)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["config"]["client_max_concurrency"] == 2 and summary["config"]["client_max_active_sessions"] == 6
    assert summary["config"]["client_rotation"] is True
    assert summary["config"]["model"] == "llama-3.1-8b"
    # the script's statistics, from the same replay
    assert "Statistics summary (simkv, simulated):" in out and f"runtime_sec = {summary['duration_s']:.3f}" in out
    row = next(line for line in out.splitlines() if line.startswith("output_num_tokens"))
    done = a[a["status"] == "finished"]  # (without an early stop a client still leaves its conversations when
    assert 0 < (a["status"] == "not_sent").sum() == len(a) - len(done)  # it finds the queue empty)
    assert float(row.split()[1]) == len(done) and float(row.split()[2]) == pytest.approx(done["output_tokens"].mean(),
                                                                                         abs=0.005)
    turns = next(line for line in out.splitlines() if line.startswith("input_num_turns")).split()
    assert float(turns[4]) == 1 and float(turns[-1]) == 17  # (min: a first turn; max: the ninth user turn)


def test_flags_the_script_has_and_simkv_does_not_model_are_named(generator):
    bench = multi_turn_command(f"--input-file {generator} -p 2 --request-rate 1 --warmup-step -k 4")
    assert bench.num_clients == 2 and bench.max_active_conversations == 4
    assert bench.note() == "" and bench.client_options["client_warmup"]
    taken = multi_turn_command(f"-i {generator} --max-num-requests 40 --conversation-sampling random -p 2")
    assert taken.client_options["client_max_requests"] == 40 and taken.note() == ""
    assert taken.client_options["client_conversation_sampling"] == "random"
    retrying = multi_turn_command(f"-i {generator} --max-retries 2 --request-timeout-sec 30")
    assert "jitter of its back-off" in retrying.note()
    assert (retrying.client_options["client_max_retries"], retrying.client_options["client_timeout_s"]) == (2, 30.0)
    long_answers = multi_turn_command(f"-i {generator} --limit-min-tokens 1000 --limit-max-tokens 1000")
    assert long_answers.client_options["client_timeout_s"] == 200.0  # (max_tokens x 0.2 s, past 120 s)
    assert bench.client_options["client_early_stop"] and multi_turn_command(f"-i {generator}").note() == ""
    assert not multi_turn_command(f"-i {generator} --no-early-stop").client_options["client_early_stop"]
    paced = multi_turn_command(f"-i {generator} -p 3 --request-rate 0.5 --seed 7")
    assert paced.client_options["client_request_rate"] == 0.5 and paced.client_options["client_seed"] == 7
    assert paced.note() == ""
    assert "answers end where the model ends them" in multi_turn_command(f"-i {generator} --limit-max-tokens -1").note()


@pytest.mark.parametrize("limits, output", [("--limit-min-tokens 64 --limit-max-tokens 64", 64),
                                            ("--limit-min-tokens 16 --limit-max-tokens 96", 96)])
def test_the_token_limits_set_max_tokens_only(generator, limits, output):
    """The script sends max_tokens and leaves min_tokens out of its requests: every answer is
    --limit-max-tokens long."""
    fixed = multi_turn_command(f"-i {generator} {limits}")
    assert set(fixed.trace.output_tokens.tolist()) == {output} and fixed.note() == ""


def test_each_client_keeps_its_share_of_the_active_conversations(generator):
    """The script gives each client --max-active-conversations // --num-clients: 5 over 2 clients
    are 4 in progress."""
    assert multi_turn_command(f"-i {generator} -p 2 -k 5").max_active_conversations == 4
    assert multi_turn_command(f"-i {generator} -p 3 -k 9").max_active_conversations == 9


@pytest.mark.parametrize("flags, message", [
    ("--num-clients 2 --frobnicate 3", "unrecognized arguments: --frobnicate"),
    ("--num-clients 4 --max-active-conversations 2", "must be at least --num-clients"),
    ("--num-clients 2 --max-active-conversations 30", "more than the file's 24 conversations"),
    ("--max-turns 1", "--max-turns must be 2 or more"),
    ("--num-clients 30", "--num-clients 30 is more than the file's 24 conversations"),
    ("--limit-max-tokens 64", "give both, min at most max"),
    ("--limit-min-tokens 96 --limit-max-tokens 64", "give both, min at most max"),
    ("--request-rate -1", "--request-rate -1.0 must be 0"),
    ("--num-clients 4 --max-num-requests 3", "less than one request per client"),
    ("--request-timeout-sec 0", "--request-timeout-sec 0 must be positive"),
])
def test_commands_the_script_would_refuse_are_refused(generator, flags, message):
    with pytest.raises(CommandLineError, match=message):
        multi_turn_command(f"python benchmark_serving_multi_turn.py -i {generator} {flags}")


def test_conversation_files_and_a_trace_beside_it_are_refused(generator, tmp_path):
    listed = tmp_path / "conversations.json"
    listed.write_text(json.dumps([{"id": "a", "messages": [{"role": "user", "content": "hi"}]}]))
    with pytest.raises(CommandLineError, match="simkv runs no tokenizer"):
        multi_turn_command(f"-i {listed}")
    assert "not both" in cli_fails(["replay", "traces/req400.parquet", "--vllm-multi-turn", f"-i {generator}",
                                    "--out", str(tmp_path / "x")])
    command_file = tmp_path / "bench.sh"
    command_file.write_text(f"python benchmark_serving_multi_turn.py \\\n  --input-file {generator} \\\n  -p 3\n")
    assert multi_turn_command(f"@{command_file}").num_clients == 3
    assert np.array_equal(multi_turn_command(f"@{command_file}").trace.prompt_tokens,
                          read_trace(_written(generator, tmp_path)).prompt_tokens)


def _written(generator, tmp_path):
    out = tmp_path / "w.parquet"
    cli_ok(["trace", "from-vllm-multi-turn", str(generator), "--out", str(out)])
    return out


def test_goodput_searches_the_benchmarks_clients(generator, tmp_path):
    command = f"python benchmark_serving_multi_turn.py -i {generator} --num-clients 2 --no-early-stop"
    cli_ok(["goodput", "--vllm-multi-turn", command, "--goodput", "ttft:60",
            "--attainment", "0.9", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "goodput.json").read_text())
    assert record["trace"].startswith("vllm-multi-turn:") and record["session_paced"]
    assert record["status"] == "found" and record["probes"][0]["clients"] == 1
    assert 1 < record["max_clients"] < 24  # (the file's 24 conversations: a client each at most)
    assert record["conversations_per_client"] == 1
    assert "one conversation in progress each" in (tmp_path / "goodput.md").read_text()
    assert "not both" in cli_fails(["goodput", "traces/req400.parquet", "--vllm-multi-turn", command,
                                    "--goodput", "ttft:40"])


def test_the_early_stop_stops_the_replays_client_as_the_script_stops(generator, tmp_path):
    """By default the script ends when the first client wants a conversation after the queue is
    empty; no client sends after that. The replay stops there too (client_early_stop): the
    requests sent by then are sent as the whole replay sends them, the rest never are, and the
    statistics are over those that finished."""
    command = f"python benchmark_serving_multi_turn.py -i {generator} --num-clients 2 --max-active-conversations 6"
    out = cli_ok(["replay", "--vllm-multi-turn", command, "--out", str(tmp_path / "stop")])
    cli_ok(["replay", "--vllm-multi-turn", command + " --no-early-stop", "--out", str(tmp_path / "all")])
    stopped, whole = (pd.read_parquet(tmp_path / d / "requests.parquet") for d in ("stop", "all"))
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text())
    assert summary["config"]["client_early_stop"] is True
    stop = summary["session_pacing"]["early_stop_s"]
    # the first 18 conversation ends start the 18 waiting conversations; at the 19th its client
    # finds the queue empty and leaves (whole: with the conversations it had, never finished)
    conversation = whole["request_id"].str.rsplit("/turn", n=1).str[0]
    complete = ~conversation.isin(set(conversation[whole["status"] == "not_sent"]))
    ends = np.sort(whole[complete].groupby(conversation[complete])["finish_time_s"].max().to_numpy())
    assert stop == pytest.approx(ends[24 - 6], abs=1e-9)
    sent = stopped["status"] != "not_sent"
    assert 0 < (~sent).sum() == summary["session_pacing"]["turns_not_sent"]
    sent_by_then = (whole["status"] != "not_sent") & (whole["arrival_time_s"] <= stop)
    assert np.array_equal(sent, sent_by_then) and (stopped.loc[sent, "status"] == "finished").all()
    done = stopped[sent]
    assert f"early stop at {stop:.3f} s: {(~sent).sum():,} turns not sent" in out
    runtime = done["finish_time_s"].max() - done["arrival_time_s"].min()
    assert f"runtime_sec = {runtime:.3f}" in out
    assert f"requests_per_sec = {len(done) / runtime:.3f}" in out
    count = next(line for line in out.splitlines() if line.startswith("ttft_ms")).split()[1]
    assert float(count) == len(done) < len(whole)


def test_compare_reads_the_benchmarks_per_request_stats(generator, tmp_path):
    """`simkv compare SIM_DIR stats.json`: the benchmark's --stats-json-output, matched by
    conversation and turn; both sides over the requests it counted. Here the "measured" file is
    the simulated run itself with every latency 10 % longer, its last requests left out (as an
    early stop leaves them)."""
    command = f"python benchmark_serving_multi_turn.py -i {generator} --num-clients 2 --no-early-stop"
    cli_ok(["replay", "--vllm-multi-turn", command, "--out", str(tmp_path / "sim")])
    req = pd.read_parquet(tmp_path / "sim" / "requests.parquet").sort_values("arrival_time_s").iloc[:150]
    parts = req["request_id"].str.rsplit("/turn", n=1, expand=True)
    conv, turn = parts[0].tolist(), parts[1].tolist()
    records = [{"ttft_ms": 1.1e3 * r.ttft_s, "tpot_ms": 1.1e3 * r.mean_itl_s, "latency_ms": 1.1e3 * r.e2e_s,
                "start_time_ms": 1e3 * r.arrival_time_s, "input_num_turns": 2 * int(t) + 1,
                "input_num_tokens": int(r.prompt_tokens) - 20, "output_num_tokens": int(r.output_tokens),
                "output_num_chunks": int(r.output_tokens) - 1, "output_num_first_chunk_tokens": 1,
                "approx_cached_percent": 0.0, "conversation_id": c, "client_id": i % 2}
               for i, (r, c, t) in enumerate(zip(req.itertuples(), conv, turn))]
    (tmp_path / "stats.json").write_text(json.dumps(records))
    cli_ok(["compare", str(tmp_path / "sim"), str(tmp_path / "stats.json"), "--out", str(tmp_path / "cmp")])
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    rows = {r["metric"]: r for r in result["metrics"]}
    for metric in ("ttft_s.p50", "e2e_s.mean", "e2e_s.p99", "tpot_s.p90"):
        assert rows[metric]["rel_error"] == pytest.approx(1 / 1.1 - 1, abs=1e-9), metric
    assert result["requests"]["matched_requests"] == 150
    assert "Measured by vLLM's multi-turn benchmark" in (tmp_path / "cmp" / "compare.md").read_text()
    (tmp_path / "bad.json").write_text(json.dumps([records[0] | {"conversation_id": "CONV_ID_99"}]))
    assert "CONV_ID_99/turn" in cli_fails(["compare", str(tmp_path / "sim"), str(tmp_path / "bad.json"), "--out",
                                           str(tmp_path / "cmp2")])


def test_a_request_rate_replays_as_the_clients_pauses(generator, tmp_path):
    """--request-rate R --seed S: each of the clients pauses as `--client-request-rate R
    --client-seed S` pauses it."""
    command = f"python benchmark_serving_multi_turn.py -i {generator} --num-clients 3 --request-rate 0.5 --seed 4"
    cli_ok(["replay", "--vllm-multi-turn", command, "--out", str(tmp_path / "a")])
    cli_ok(["trace", "from-vllm-multi-turn", str(generator), "--seed", "4", "--out", str(tmp_path / "w.parquet")])
    cli_ok(["replay", str(tmp_path / "w.parquet"), "--model", "llama-3-8b", "--client-max-concurrency", "3",
            "--client-max-active-sessions", "3", "--client-rotation", "--client-early-stop", "--client-request-rate", "0.5",
            "--client-seed", "4", "--client-timeout", "120", "--out", str(tmp_path / "b")])
    a, b = (pd.read_parquet(tmp_path / d / "requests.parquet") for d in "ab")
    pd.testing.assert_frame_equal(a, b)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["config"]["client_request_rate"] == 0.5 and summary["config"]["client_seed"] == 4
    assert summary["session_pacing"]["clients"] == 3 and summary["session_pacing"]["mean_pause_s"] > 0


def test_vllms_readme_example_sends_the_requests_it_counted(generator, tmp_path):
    """vLLM's benchmarks/multi_turn/README.md prints the statistics of `--num-clients 2
    --max-active-conversations 6` on this generator file: 166 requests, and rows of turns and
    answer lengths that depend only on which requests its clients sent before the early stop.
    The replay sends the same: both rows equal the README's to the printed digit (latencies and
    prompt lengths differ: its hardware, and its tokenizer's text)."""
    command = (f"python benchmark_serving_multi_turn.py --model meta-llama/Llama-3.1-8B-Instruct "
               f"--served-model-name Llama --input-file {generator} --num-clients 2 --max-active-conversations 6")
    out = cli_ok(["replay", "--vllm-multi-turn", command, "--out", str(tmp_path)])
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("input_num_turns", "output_num_tokens"))}
    assert rows["input_num_turns"] == ["166.0", "7.43", "4.57", "1.00", "3.00", "7.00", "11.00", "13.00", "17.00",
                                       "17.00"]
    assert rows["output_num_tokens"] == ["166.0", "100.01", "11.80", "80.00", "91.00", "99.00", "109.75", "116.00",
                                         "120.00", "120.00"]


def test_goodput_keeps_the_commands_conversations_per_client(generator):
    """A command whose clients keep 3 conversations each (-p 2 -k 6) is searched with 3 a client:
    5 clients keep 15, and more than 24 // 3 = 8 clients change nothing."""
    from simkv.config import EngineConfig
    from simkv.studies.goodput_search import client_options, max_clients_bound

    bench = multi_turn_command(f"-i {generator} -p 2 -k 6 --max-num-requests 40")
    config = EngineConfig.from_flat(bench.client_options)
    five = client_options(bench.trace, config, 5).scheduler
    assert (five.client_max_concurrency, five.client_max_active_sessions, five.client_max_requests) == (5, 15, 100)
    assert max_clients_bound(bench.trace, config) == 8
    one_each = EngineConfig.from_flat({"client_max_concurrency": 2})
    assert client_options(bench.trace, one_each, 5).scheduler.client_max_active_sessions == 5


def test_without_streaming_the_script_takes_the_whole_answer_as_ttft(generator, tmp_path):
    command = f"python benchmark_serving_multi_turn.py -i {generator} --num-clients 2 --no-stream"
    out = cli_ok(["replay", "--vllm-multi-turn", command, "--out", str(tmp_path)])
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("ttft_ms", "tpot_ms", "latency_ms"))}
    assert rows["ttft_ms"] == rows["latency_ms"] and set(rows["tpot_ms"][1:]) == {"0.00"}


def test_compare_takes_a_run_without_streaming(generator, tmp_path):
    """A --no-stream run's records (no chunks; TTFT = the whole answer's time, TPOT 0): the
    simulated TTFT is compared as the whole answer's time, and TPOT is left out."""
    command = f"python benchmark_serving_multi_turn.py -i {generator} --num-clients 2 --no-stream"
    cli_ok(["replay", "--vllm-multi-turn", command, "--out", str(tmp_path / "sim")])
    req = pd.read_parquet(tmp_path / "sim" / "requests.parquet")
    req = req[req["status"] == "finished"]
    parts = req["request_id"].str.rsplit("/turn", n=1, expand=True)
    records = [{"ttft_ms": 1e3 * r.e2e_s, "tpot_ms": 0.0, "latency_ms": 1e3 * r.e2e_s,
                "start_time_ms": 1e3 * r.arrival_time_s, "input_num_turns": 2 * int(t) + 1,
                "output_num_tokens": int(r.output_tokens), "output_num_chunks": 0, "conversation_id": c}
               for r, c, t in zip(req.itertuples(), parts[0], parts[1])]
    (tmp_path / "stats.json").write_text(json.dumps(records))
    cli_ok(["compare", str(tmp_path / "sim"), str(tmp_path / "stats.json"), "--out", str(tmp_path / "cmp")])
    rows = {r["metric"]: r for r in json.loads((tmp_path / "cmp" / "compare.json").read_text())["metrics"]}
    assert rows["ttft_s.p50"]["rel_error"] == pytest.approx(0, abs=1e-9)
    assert rows["tpot_s.p50"]["measured"] is None and rows["tpot_s.p50"]["simulated"] is None


def test_a_sweep_over_a_multi_turn_command(generator, tmp_path):
    """`simkv sweep --vllm-multi-turn`: its conversations written into the sweep folder, its
    clients held in every cell (each cell is the replay of the command under that cell's options)."""
    command = f"python benchmark_serving_multi_turn.py -i {generator} --num-clients 2 --max-active-conversations 6"
    cli_ok(["sweep", "--vllm-multi-turn", command, "--grid", "block_size=16,32", "--out", str(tmp_path / "sw"),
            "--quiet", "--workers", "1"])
    table = pd.read_parquet(tmp_path / "sw" / "sweep.parquet")
    assert len(table) == 2 and (table["status"] == "ok").all() and (table["peak_running"] <= 2).all()
    cli_ok(["replay", "--vllm-multi-turn", command, "--block-size", "32", "--out", str(tmp_path / "one")])
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    cell = table[table["block_size"] == 32].iloc[0]
    assert cell["num_finished"] == one["num_finished"] and cell["duration_s"] == pytest.approx(one["duration_s"])
    assert "--vllm-multi-turn" in cli_fails(["sweep", "--grid", "block_size=16", "--out", str(tmp_path / "x")])
