"""--vllm-bench: the traffic of a `vllm bench serve` command (simkv/cli/vllm_bench_command.py)."""

import json

import numpy as np
import pandas as pd
import pytest

from simkv.cli.vllm_bench_command import bench_command, bench_flags, sorted_flags, special_tokens
from simkv.cli.vllm_command_line import CommandLineError
from simkv.traces.schema import read_trace
from simkv.traces.vllm_random import PrefixRepetitionDataset, RandomDataset, Schedule
from tests.cli_runs import cli_fails, cli_ok

BENCH = ("vllm bench serve --model meta-llama/Llama-3.1-8B-Instruct --dataset-name random --random-input-len 512 "
         "--random-output-len 64 --random-range-ratio 0.25 --random-prefix-len 100 --num-prompts 300 "
         "--request-rate 12 --burstiness 0.8 --seed 3 --max-concurrency 16 --goodput ttft:400 tpot:40 "
         "--ignore-eos --ready-check-timeout-sec 0 --save-result --result-filename b.json")


def test_every_bench_flag_is_sorted_once():
    classes = sorted_flags()
    assert len(bench_flags()) == 101
    assert set().union(*classes) == set(bench_flags()) and sum(len(c) for c in classes) == 101


def test_a_typical_command():
    bench = bench_command(BENCH, "llama-3.1-8b")
    expected = RandomDataset(num_prompts=300, random_input_len=512, random_output_len=64, input_range_ratio=0.25,
                             output_range_ratio=0.25, random_prefix_len=100, seed=3,
                             schedule=Schedule(request_rate=12.0, burstiness=0.8)).trace()
    assert np.array_equal(bench.trace.arrival_time_s, expected.arrival_time_s)
    assert np.array_equal(bench.trace.prompt_tokens, expected.prompt_tokens)
    assert np.array_equal(bench.trace.output_tokens, expected.output_tokens)
    assert (bench.max_concurrency, bench.goodput) == (16, ("ttft:400", "tpot:40"))
    assert bench.unmodelled == [] and bench.ignored == ["--model", "--save-result", "--result-filename"]


def test_defaults_and_what_is_noted():
    bench = bench_command("vllm bench serve", "qwen2.5-7b")
    assert len(bench.trace) == 1000 and (bench.trace.arrival_time_s == 0).all()  # (--request-rate inf)
    assert (bench.trace.prompt_tokens == 1024).all() and (bench.trace.output_tokens == 128).all()
    assert bench.note() is None  # (the client forces --ignore-eos for random prompts, skips the ready check)
    assert "ready check" in bench_command("vllm bench serve --ready-check-timeout-sec 600", "llama-3-8b").note()
    assert "warm-up" in bench_command("vllm bench serve --num-warmups 3", "llama-3-8b").note()
    assert "--ignore-eos" in bench_command("vllm bench serve --dataset-name prefix_repetition", "llama-3-8b").note()
    assert "chat template" in bench_command("vllm bench serve --backend openai-chat", "llama-3-8b").note()


@pytest.mark.parametrize("command, match", [
    ("vllm bench serve --backend openai-embeddings", "text generation"),
    ("vllm bench serve --self-timed", "only supported with --dataset-name=timed_trace"),
    ("vllm bench serve --dataset-name timed_trace --dataset-path x.jsonl --backend openai-chat",
     "requires a completions backend"),
])
def test_what_vllms_client_refuses_too(command, match):
    with pytest.raises(CommandLineError, match=match):
        bench_command(command, "llama-3-8b")


def test_the_general_lengths_win_and_ratios_may_differ():
    bench = bench_command("vllm bench serve --random-input-len 100 --input-len 200 --output-len 7 "
                          "--random-range-ratio '{\"input\": 0.0, \"output\": 0.5}' --num-prompts 50", "llama-3-8b")
    assert (bench.trace.prompt_tokens == 200).all()
    assert bench.trace.output_tokens.min() >= 3 and bench.trace.output_tokens.max() <= 11
    assert len(set(bench.trace.output_tokens.tolist())) > 1


@pytest.mark.parametrize("model, tokens", [("llama-3-8b", 1), ("qwen3-8b", 0), ("gpt-oss-20b", 0),
                                           ("deepseek-v3", 1), ("gemma-3-12b", 1)])
def test_special_tokens_by_model(model, tokens):
    assert special_tokens(model) == tokens


@pytest.mark.parametrize("command, match", [
    ("vllm bench serve --dataset-name sharegpt", "random, random-mm, prefix_repetition and timed_trace datasets"),
    ("vllm bench serve --probe-request-rate 2", "--probe-request-rate"),
    ("vllm bench serve --lora-modules a b", "LoRA"),
    ("vllm bench serve --num-prompts x", "not a whole number"),
    ("vllm bench serve --random-range-ratio 1.5", "ratio must be in"),
    ("vllm bench serve --max-concurrency 0", "greater than 0"),
    ("vllm bench serve --no-such-flag", "not a flag of vLLM 0.33"),
    ("vllm bench serve stray", "'stray' is neither"),
])
def test_bad_commands_name_what_is_wrong(command, match):
    with pytest.raises(CommandLineError, match=match):
        bench_command(command, "llama-3-8b")


def test_a_replay_of_the_command_is_the_replay_of_its_trace(tmp_path):
    """--vllm-bench replays what `simkv trace from-vllm-bench` writes, with the client's limit
    and SLOs: byte for byte the same as giving those by hand."""
    (tmp_path / "bench.sh").write_text(BENCH + "\n")
    cli_ok(["replay", "--vllm-bench", f"@{tmp_path / 'bench.sh'}", "--model", "llama-3.1-8b", "--out",
            str(tmp_path / "a"), "--quiet"])
    out = cli_ok(["trace", "from-vllm-bench", BENCH, "--model", "llama-3.1-8b", "--out", str(tmp_path / "t.parquet")])
    assert "--client-max-concurrency 16 --goodput ttft:400 --goodput tpot:40" in out
    cli_ok(["replay", str(tmp_path / "t.parquet"), "--model", "llama-3.1-8b", "--client-max-concurrency", "16",
            "--goodput", "ttft:400", "--goodput", "tpot:40", "--out", str(tmp_path / "b"), "--quiet"])
    for name in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    a, b = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("a", "b"))
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert a.pop("trace") != b.pop("trace")  # (only where the trace came from differs)
    assert a == b and a["client_concurrency"]["max_concurrency"] == 16 and "goodput" in a
    assert a["prefix_cache_hits_tokens"] > 0  # (the shared 100-token prefix, BOS included)
    assert len(read_trace(str(tmp_path / "t.parquet"))) == 300


def test_simkvs_own_flags_win_and_a_trace_is_not_given_twice(tmp_path):
    cli_ok(["replay", "--vllm-bench", BENCH, "--client-max-concurrency", "4", "--goodput", "ttft:100",
            "--out", str(tmp_path), "--quiet"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["client_concurrency"]["max_concurrency"] == 4
    assert summary["goodput"]["slo_ms"] == {"ttft": 100.0}
    assert "not both" in cli_fails(["replay", "traces/req400.parquet", "--vllm-bench", BENCH, "--out",
                                    str(tmp_path / "x")])


def test_a_prefix_repetition_command():
    bench = bench_command("vllm bench serve --dataset-name prefix_repetition --num-prompts 45 --seed 2 "
                          "--prefix-repetition-num-prefixes 4 --prefix-repetition-prefix-len 1000 "
                          "--prefix-repetition-suffix-len 100 --output-len 20 --request-rate 5 "
                          "--random-input-len 7", "qwen2.5-7b")
    expected = PrefixRepetitionDataset(num_prompts=45, seed=2, num_prefixes=4, prefix_len=1000, suffix_len=100,
                                       output_len=20, num_special_tokens=0, schedule=Schedule(request_rate=5.0))
    assert len(bench.trace) == 44 and (bench.trace.prompt_tokens == 1100).all()  # (45 // 4 = 11 per prefix)
    assert np.array_equal(bench.trace.arrival_time_s, expected.trace().arrival_time_s)
    assert bench.ignored == []  # (--random-input-len: another dataset's flag, dropped as vLLM drops it)


@pytest.mark.parametrize("name", sorted(bench_flags()))
def test_each_bench_flag_alone_is_taken_or_refused_cleanly(name):
    """Every client flag, alone with vLLM's default value (or 1): a trace, or a CommandLineError."""
    flag = bench_flags()[name]
    option = max(flag["options"] or flag["negative"], key=len)
    default = flag["default"]
    value = [] if flag["nargs"] == "0" else ["1" if default is None or isinstance(default, bool) else str(default)]
    try:
        bench = bench_command(" ".join(["vllm bench serve --num-prompts 20", option, *value]), "llama-3-8b")
    except CommandLineError:
        return
    assert len(bench.trace) > 0


def test_a_timed_trace_reads_back_as_simkv_exported_it(tmp_path):
    """`simkv trace export` writes a timed trace and the trace the server sees beside it; the
    bench command that replays the first gives the second, and the same replay."""
    out = cli_ok(["trace", "export", "traces/req400_prefix10.parquet", "--out", str(tmp_path / "t.jsonl")])
    chunk = int(out.split("(")[1].split("-token")[0])
    command = (f"vllm bench serve --dataset-name timed_trace --dataset-path {tmp_path / 't.jsonl'} "
               f"--timed-trace-chunk-hash-size {chunk} --num-prompts 400 --ignore-eos --ready-check-timeout-sec 0")
    served = read_trace(str(tmp_path / "t.parquet"))
    trace = bench_command(command, "llama-3-8b").trace
    assert np.array_equal(trace.prompt_tokens, served.prompt_tokens)
    assert all(np.array_equal(trace.block_hashes(i), served.block_hashes(i)) for i in range(len(trace)))
    cli_ok(["replay", "--vllm-bench", command, "--out", str(tmp_path / "a"), "--quiet"])
    cli_ok(["replay", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "b"), "--quiet"])
    assert (tmp_path / "a" / "steps.parquet").read_bytes() == (tmp_path / "b" / "steps.parquet").read_bytes()
    few = bench_command(command.replace("--num-prompts 400", "--num-prompts 10 --no-self-timed --request-rate 2"),
                        "llama-3-8b").trace
    assert len(few) == 10 and few.arrival_time_s[-1] == pytest.approx(5.0)


@pytest.mark.parametrize("lines, match", [
    (['{"timestamp": 0, "input_length": 20, "output_length": 5}'], "at least one token"),
    (['{"timestamp": 0, "input_length": 20}'], "field 'output_length'"),
    (["{not json"], "line 1: not JSON"),
    (['{"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": ["a"]}'], "list of integers"),
])
def test_a_bad_timed_trace_names_its_line(tmp_path, lines, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CommandLineError, match=match):
        bench_command(f"vllm bench serve --dataset-name timed_trace --dataset-path {path}", "llama-3-8b")
    with pytest.raises(CommandLineError, match="needs --dataset-path"):
        bench_command("vllm bench serve --dataset-name timed_trace", "llama-3-8b")


def test_a_sweep_over_a_bench_commands_traffic(tmp_path):
    """`simkv sweep --vllm-bench`: the traffic written into the sweep folder, the client's limit
    and SLOs held in every cell."""
    cli_ok(["sweep", "--vllm-bench", "vllm bench serve --num-prompts 60 --random-input-len 256 --random-output-len 32 "
            "--max-concurrency 8 --goodput ttft:500", "--grid", "block_size=16,32", "--out", str(tmp_path),
            "--quiet", "--workers", "1"])
    import pandas as pd

    table = pd.read_parquet(tmp_path / "sweep.parquet")
    assert len(table) == 2 and (table["status"] == "ok").all() and "slo_attainment" in table
    assert (table["peak_running"] == 8).all()
    assert len(read_trace(str(tmp_path / "vllm_bench_trace.parquet"))) == 60
    assert "give one or more traces" in cli_fails(["sweep", "--grid", "block_size=16", "--out", str(tmp_path / "x")])


def test_the_replay_prints_the_benchmarks_own_layout(tmp_path):
    """With --vllm-bench the replay also prints its figures as `vllm bench serve` prints its
    result: the same keys, the summary's values."""
    out = cli_ok(["replay", "--vllm-bench", "vllm bench serve --num-prompts 80 --random-input-len 300 "
                  "--random-output-len 40 --request-rate 20 --max-concurrency 6 --goodput ttft:300",
                  "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    block = out[out.index(" Serving Benchmark Result"):]
    values = {line[:40].strip(): line[40:].strip() for line in block.splitlines() if line[:40].strip().endswith(":")}
    assert values["Successful requests:"] == "80" and values["Maximum request concurrency:"] == "6"
    assert values["Peak concurrent requests:"] == "6.00"
    assert values["Median TTFT (ms):"] == f"{1e3 * summary['ttft_s']['p50']:.2f}"
    assert values["P99 ITL (ms):"] == f"{1e3 * summary['itl_s']['p99']:.2f}"
    assert values["Request goodput (req/s):"] == f"{summary['goodput']['request_goodput_req_s']:.2f}"
    assert values["Total input tokens:"] == str(80 * 300)  # (BOS + 299 sampled: the server's count)


def test_goodput_searches_a_bench_commands_rate(tmp_path):
    """`simkv goodput --vllm-bench`: the benchmark's traffic, its schedule scaled by the search;
    a probe at the command's own rate is the replay of that command."""
    command = ("vllm bench serve --dataset-name random --random-input-len 1024 --random-output-len 128 "
               "--num-prompts 300 --request-rate 10")
    cli_ok(["goodput", "--vllm-bench", command, "--goodput", "ttft:200", "--goodput", "tpot:20",
            "--model", "llama-3.1-8b", "--out", str(tmp_path / "g")])
    record = json.loads((tmp_path / "g" / "goodput.json").read_text())
    assert record["trace"].startswith("vllm bench serve") and record["status"] == "found"
    first = record["probes"][0]
    assert first["factor"] == 1.0
    cli_ok(["replay", "--vllm-bench", command, "--model", "llama-3.1-8b", "--goodput", "ttft:200", "--goodput",
            "tpot:20", "--out", str(tmp_path / "r")])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["goodput"]["slo_attainment"] == first["slo_attainment"]
    assert "not both" in cli_fails(["goodput", "traces/req400.parquet", "--vllm-bench", command, "--goodput",
                                    "ttft:200"])


RANDOM_MM = ("vllm bench serve --backend openai-chat --dataset-name random-mm --random-input-len 300 "
             "--random-output-len 80 --num-prompts 200 --request-rate 6 --seed 5 "
             "--random-mm-base-items-per-request 2 --random-mm-num-mm-items-range-ratio 0.5 "
             "--random-mm-limit-mm-per-prompt '{\"image\": 3, \"video\": 0}' "
             "--random-mm-bucket-config '{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}'")


def test_a_random_mm_command_sends_the_random_text_and_its_images(tmp_path):
    from simkv.specs import get_model_spec
    from simkv.traces.vllm_random_mm import RandomMultiModalDataset

    bench = bench_command(RANDOM_MM, "qwen2.5-vl-7b")
    text = RandomDataset(num_prompts=200, random_input_len=300, random_output_len=80, seed=5, num_special_tokens=0,
                         schedule=Schedule(request_rate=6.0))
    expected = RandomMultiModalDataset(text, 2, 0.5, (("image", 3), ("video", 0)),
                                       (((256, 256, 1), 0.5), ((720, 1280, 1), 0.5), ((720, 1280, 16), 0.0)))
    want = expected.trace(get_model_spec("qwen2.5-vl-7b").image_embeddings)
    np.testing.assert_array_equal(bench.trace.prompt_tokens, want.prompt_tokens)
    np.testing.assert_array_equal(bench.trace.mm_items, want.mm_items)
    np.testing.assert_array_equal(bench.trace.arrival_time_s, text.trace().arrival_time_s)
    assert set(bench.trace.mm_items[:, 1].tolist()) == {81, 1196}  # (Qwen2.5-VL's 256 x 256 and 720 x 1280 images)
    # the replay encodes every image (each new: random pixels)
    text_out = cli_ok(["replay", "--model", "qwen2.5-vl-7b", "--vllm-bench", RANDOM_MM, "--out", str(tmp_path / "r")])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["multimodal"]["items"] == summary["multimodal"]["items_encoded"] == len(bench.trace.mm_items)
    assert "Serving Benchmark Result" in text_out
    # requests.parquet counts each prompt's image tokens; the benchmark's report, as vLLM's
    # client, counts the text alone, and a result of the client's compares with the replay
    requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    np.testing.assert_array_equal(requests["prompt_tokens"] - requests["mm_tokens"], text.trace().prompt_tokens)
    assert requests["mm_tokens"].min() >= 81
    done = requests["status"] == "finished"
    client_count = int((requests["prompt_tokens"] - requests["mm_tokens"])[done].sum())
    assert f"Total input tokens:                      {client_count} " in text_out
    from tests.compare.bench_synth import write_bench_result

    measured = write_bench_result(tmp_path / "r", tmp_path / "bench.json")
    cli_ok(["compare", str(tmp_path / "r"), str(measured), "--out", str(tmp_path / "c"), "--quiet"])
    result = json.loads(measured.read_text())
    result["input_lens"][3] += 1
    measured.write_text(json.dumps(result))
    failed = cli_fails(["compare", str(tmp_path / "r"), str(measured), "--out", str(tmp_path / "c2")])
    assert "request 3 has" in failed and "of them the images'" in failed
    # as vLLM's client: images only on the chat backend; and the model must see images
    with pytest.raises(CommandLineError, match="Multi-modal content is not supported on backend 'openai'"):
        bench_command(RANDOM_MM.replace("--backend openai-chat", "--backend openai"), "qwen2.5-vl-7b")
    with pytest.raises(CommandLineError, match="model llama-3-8b has no vision encoder"):
        bench_command(RANDOM_MM, "llama-3-8b")
    with pytest.raises(CommandLineError, match="videos .* are not modelled"):
        bench_command(RANDOM_MM.replace("16): 0.0", "16): 0.2"), "qwen2.5-vl-7b")
    # with another dataset its flags are ignored, as vLLM ignores them
    plain = bench_command(RANDOM_MM.replace("--dataset-name random-mm", "--dataset-name random"), "qwen2.5-vl-7b")
    assert plain.trace.mm_items is None and "--random-mm-bucket-config" in plain.ignored
