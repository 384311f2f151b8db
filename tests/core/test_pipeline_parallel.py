"""Pipeline parallelism (`pipeline_parallel_size`): vLLM 0.33's batch queue in the engine core,
the stages' timing and memory (docs/semantics.md#pipeline-parallelism).

The recorded cases come from the real vLLM 0.33 scheduler driven as its batch queue drives it
(`scripts/oracle_pp.py --save`)."""

import json
from pathlib import Path

import numpy as np
import pytest

from simkv.capacity import compute_capacity, pipeline_layers
from simkv.config import ConfigError, EngineConfig
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.core.scheduler import Scheduler
from simkv.clock import to_ticks
from simkv.replay.api import replay
from simkv.replay.pipeline import PipelineStages
from simkv.traces.schema import read_trace, take_rows
from tests.core.helpers import drive_steps_pipeline, make_request

DATA = Path(__file__).parent / "data" / "pp_vllm_cases.json"
ASYNC_DATA = Path(__file__).parent / "data" / "pp_async_vllm_cases.json"
SPEC_DATA = Path(__file__).parent / "data" / "pp_spec_async_vllm_cases.json"
HYBRID_DATA = Path(__file__).parent / "data" / "pp_hybrid_vllm_cases.json"
LINEAR_DATA = Path(__file__).parent / "data" / "pp_linear_vllm_cases.json"
NGRAM_DATA = Path(__file__).parent / "data" / "pp_ngram_async_vllm_cases.json"
REQ400 = Path(__file__).parents[2] / "traces" / "req400.parquet"


def _recorded(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cases"]


def _same_as_vllm(recorded: dict) -> bool:
    ours = drive_steps_pipeline(recorded["case"])
    theirs = recorded["vllm"]
    sched = ours["scheduler"]
    stats = sched.kv_cache_manager.prefix_cache_stats
    return (ours["steps"] == theirs["steps"] and ours["requests"] == theirs["requests"]
            and [stats.queries, stats.hits] == theirs["prefix"] and ours.get("error") == theirs.get("error")
            and sched.spec_stats["num_accepted_tokens"] == theirs["accepted"])


@pytest.mark.parametrize("index", range(12))
def test_same_steps_as_vllm(index: int) -> None:
    """vLLM's Scheduler behind a batch queue P deep (P = 2 to 4), half the cases with a front
    end's aborts: every step's tokens, running, waiting and blocks, every request's first-token
    and finish step, the prefix-cache counts."""
    assert _same_as_vllm(_recorded(DATA)[index])


@pytest.mark.parametrize("index", range(12))
def test_same_steps_as_vllm_async(index: int) -> None:
    """The same under vLLM's AsyncScheduler, P + 1 deep with its decode stagger."""
    assert _same_as_vllm(_recorded(ASYNC_DATA)[index])


@pytest.mark.parametrize("index", range(len(_recorded(NGRAM_DATA))))
def test_same_steps_as_vllm_ngram(index: int) -> None:
    """ngram under async scheduling and pipeline stages (vLLM's V2 runner drafts it on the device:
    placeholders as for EAGLE), lookups matching at 0, 0.3 or 0.7: a miss's drafts are verified
    and rejected."""
    assert _same_as_vllm(_recorded(NGRAM_DATA)[index])


def test_ngram_cases_need_a_misses_drafts_rejected(monkeypatch) -> None:
    """Accepting the drafts of lookups that found no match breaks every recorded ngram case."""
    from simkv.core.spec_decode import AcceptanceModel

    monkeypatch.setattr(AcceptanceModel, "proposes", lambda self, index, position: True)
    cases = _recorded(NGRAM_DATA)
    assert not any(_same_as_vllm(case) for case in cases)


@pytest.mark.parametrize("index", range(8))
def test_same_steps_as_vllm_speculative(index: int) -> None:
    """EAGLE or a draft model under async scheduling (vLLM's drafts stay on the device: the
    scheduler sees placeholders), P from 2 to 4, with a front end's aborts: the steps, requests,
    prefix-cache counts and drafts accepted."""
    assert _same_as_vllm(_recorded(SPEC_DATA)[index])


@pytest.mark.parametrize("index", range(10))
def test_same_steps_as_vllm_hybrid(index: int) -> None:
    """KV-cache groups of sliding-window models (async, EAGLE in some, with aborts) and of
    chunked local attention (sync): window releases go by the processed tokens, and the
    admission cap counts every batch in flight (max_num_batched_tokens x (P + async))."""
    assert _same_as_vllm(_recorded(HYBRID_DATA)[index])


@pytest.mark.parametrize("index", range(8))
def test_same_steps_as_vllm_linear(index: int) -> None:
    """Mamba (Gated DeltaNet) groups beside full attention: with prefix caching (vLLM's align
    mode, async, with aborts) and without it under MTP drafts (async)."""
    assert _same_as_vllm(_recorded(LINEAR_DATA)[index])


def test_hybrid_cases_need_releases_by_the_processed_tokens(monkeypatch) -> None:
    """A window's blocks go back by the tokens whose output was processed (those of batches in
    flight may still be read): releasing by the computed tokens breaks the hybrid cases."""
    init = Scheduler.__init__

    def by_computed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._async_releases = False

    monkeypatch.setattr(Scheduler, "__init__", by_computed)
    assert _broken(HYBRID_DATA) >= 6


def test_admission_caps_count_every_batch_in_flight() -> None:
    """vLLM's max_in_flight_tokens: max_num_batched_tokens per batch in flight, P of them under
    pipeline parallelism (P + 1 under async scheduling): a sliding-window group's admission cap."""
    base = {"model": "gemma-3-12b", "max_num_batched_tokens": 2048}
    assert EngineConfig.from_flat(base).max_in_flight_tokens == 2048
    assert EngineConfig.from_flat(base | {"async_scheduling": True}).max_in_flight_tokens == 4096
    assert EngineConfig.from_flat(base | {"pipeline_parallel_size": 4}).max_in_flight_tokens == 8192
    assert EngineConfig.from_flat(base | {"pipeline_parallel_size": 4,
                                          "async_scheduling": True}).max_in_flight_tokens == 10240


def _broken(path: Path) -> int:
    broken = 0
    for recorded in _recorded(path):
        try:
            broken += not _same_as_vllm(recorded)
        except Exception:  # (a mutated engine may trip over its own state)
            broken += 1
    return broken


def test_async_cases_need_the_decode_stagger(monkeypatch) -> None:
    """Without vLLM's decode stagger a request decodes in every batch the queue has room for."""
    init = Scheduler.__init__

    def no_stagger(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._decode_stagger = 0

    monkeypatch.setattr(Scheduler, "__init__", no_stagger)
    assert _broken(ASYNC_DATA) >= 10


def test_sync_cases_need_a_decode_to_wait_for_its_output(monkeypatch) -> None:
    """Without async scheduling there are no placeholders: with them a decode would run again
    before its token came back."""
    init = Scheduler.__init__

    def with_placeholders(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.async_scheduling = True  # (the counters' placeholders; the batch queue stays P deep)

    monkeypatch.setattr(Scheduler, "__init__", with_placeholders)
    assert _broken(DATA) >= 10


def test_cases_need_stale_outputs_to_hold_a_preempted_request_back(monkeypatch) -> None:
    """A preempted request whose step is still in flight waits for that output (vLLM's stale
    output); resuming it at once changes cases with preemptions."""
    from simkv.core.spec_decode import SpecDecode

    preempt = SpecDecode._spec_async_preempt

    def no_stale(self, request):
        cache_end = preempt(self, request)
        request.num_stale_tokens = 0
        return cache_end

    monkeypatch.setattr(SpecDecode, "_spec_async_preempt", no_stale)
    assert _broken(DATA) + _broken(ASYNC_DATA) >= 5


def test_pipeline_layers_split_as_vllm() -> None:
    """vLLM's get_pp_indices: even, the remainder one each to the stages before the last (the
    splits vLLM 0.33 gives)."""
    assert pipeline_layers(80, 2) == [40, 40]
    assert pipeline_layers(80, 3) == [27, 27, 26]
    assert pipeline_layers(32, 5) == [6, 6, 7, 7, 6]
    assert pipeline_layers(61, 4) == [15, 15, 16, 15]
    assert pipeline_layers(61, 8) == [7, 7, 8, 8, 8, 8, 8, 7]


def test_capacity_per_stage() -> None:
    """Each stage holds its layers' weights and KV; the stages with an embedding bind. Two stages
    of TP 2 hold about as many blocks as TP 4 (the same weights per GPU), each block half the
    layers of TP 2's."""
    tp4 = compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 4}))
    pp = compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2,
                                                  "pipeline_parallel_size": 2}))
    tp2 = compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2}))
    assert pp.pipeline_layers == (40, 40)
    assert pp.kv_bytes_per_token * 2 == tp2.kv_bytes_per_token == tp4.kv_bytes_per_token * 2
    assert 0.98 < pp.num_gpu_blocks / tp4.num_gpu_blocks < 1.0  # (each end holds a vocabulary matrix)
    assert pp.num_gpu_blocks > 10 * tp2.num_gpu_blocks
    # three stages: 27, 27 and 26 layers; the first binds (27 layers and the embedding)
    three = compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2,
                                                     "pipeline_parallel_size": 3}))
    assert three.pipeline_layers == (27, 27, 26) and three.pipeline_binding_stage == 0
    assert three.kv_bytes_per_token == tp2.kv_bytes_per_token * 27 // 80


@pytest.mark.parametrize("opts, what", [
    ({"speculative_method": "eagle", "num_speculative_tokens": 2}, "speculative decoding without async scheduling"),
    ({"preemption_mode": "swap"}, "preemption_mode 'swap'"),
    ({"prefill_schedule_interval": 2}, "prefill_schedule_interval"),
])
def test_refused_combinations(opts: dict, what: str) -> None:
    with pytest.raises(ConfigError, match=f"pipeline_parallel_size > 1 is not modelled with.*{what}"):
        EngineConfig.from_flat({"pipeline_parallel_size": 2} | opts)
    with pytest.raises(ConfigError, match="has 2 layers, fewer than the stages"):
        EngineConfig.from_flat({"model": "tiny-llama", "pipeline_parallel_size": 3})


class _FixedCost:
    """A step costs `seconds`, of which `host` on the host."""

    name = "fixed"
    needs_request_detail = False

    def __init__(self, seconds: float, host: float) -> None:
        self.seconds, self.host = seconds, host

    def execute(self, out) -> float:
        return self.seconds

    def host_seconds(self, num_seqs: int) -> float:
        return self.host


def _output(step: int, chunks) -> SchedulerOutput:
    return SchedulerOutput(step=step, chunks=chunks, num_decode_reqs=0, decode_context_tokens=0, decodes=None,
                           preempted=[], num_running=0, num_waiting=0, num_blocks_used=0,
                           prefix_query_tokens=0, prefix_hit_tokens=0)


def test_the_drafter_runs_on_the_last_stage() -> None:
    """Under speculative decoding the drafter's passes follow the target's layers on the last
    stage: they lengthen the batch by their own time, not by it over the stages."""
    from simkv.backends.drafting import SpeculativeBackend

    config = EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                     "async_scheduling": True, "speculative_method": "eagle3",
                                     "num_speculative_tokens": 2})
    backend = SpeculativeBackend(_FixedCost(0.030, 0.002), config)
    backend.drafter.seconds = lambda out: 0.004
    stages = PipelineStages(config, backend)
    out = _output(0, [ScheduledChunk(make_request(0, 100, 10), 0, 100, False)])
    out.num_spec_tokens_to_schedule = 2
    start, end = stages.launch(out, 0)
    link = to_ticks(100 * 2 * 8192 * 2 / 2 / 450e9)
    assert end - start == 2 * to_ticks(0.014) + link + to_ticks(0.004)
    assert backend.draft_seconds == 0.004


def test_stage_timing() -> None:
    """Two stages: the host's share once per batch, one batch after another; the device's split
    over the stages, which a batch crosses over the link; a decode waits for its token from a
    batch still in flight."""
    config = EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                     "pipeline_link_gbs": 10.0})
    stages = PipelineStages(config, _FixedCost(0.030, 0.002))
    a, b = make_request(0, 100, 10), make_request(1, 100, 10)
    first = _output(0, [ScheduledChunk(a, 0, 100, False)])
    first.chunks[0].samples = True
    link = to_ticks(100 * 2 * 8192 * 2 / 2 / 10e9)
    stage = to_ticks(0.028 / 2)
    start, end = stages.launch(first, 0)
    assert start == to_ticks(0.002) and end == start + 2 * stage + link
    # a second batch (another request) enters the first stage as the first leaves it
    second = _output(1, [ScheduledChunk(b, 0, 100, False)])
    start2, end2 = stages.launch(second, 0)
    assert start2 == start + stage and end2 == end + stage
    # a decode of `a` waits for the token its first batch sampled
    third = _output(2, [ScheduledChunk(a, 100, 1, True)])
    start3, _ = stages.launch(third, 0)
    assert start3 == end


def _req400_rows(n: int = 120):
    return take_rows(read_trace(REQ400), np.arange(n))


@pytest.mark.parametrize("opts", [{}, {"async_scheduling": True},
                                  {"async_scheduling": True, "speculative_method": "eagle3",
                                   "num_speculative_tokens": 2}])
def test_replay_is_whole_and_deterministic(tmp_path, opts: dict) -> None:
    """A pipelined replay finishes every request with its trace's output tokens, twice the same;
    a token's gap is timed between the ends of the steps that sampled it and the one before."""
    trace = _req400_rows()
    config = EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                     "max_num_seqs": 32} | opts)
    runs = [replay(trace, config) for _ in range(2)]
    for res in runs:
        res.summary["wall_time_s"] = 0.0
    assert runs[0].summary == runs[1].summary
    req = runs[0].requests
    assert (req["status"] == "finished").all()
    assert (req["output_tokens"].to_numpy() == trace.output_tokens).all()
    # each request's mean ITL spans its decodes: (finish - first token) / (tokens - 1)
    assert runs[0].summary["itl_s"]["p50"] > 0
    pipe = runs[0].summary["pipeline"]
    assert pipe["batches"] == runs[0].summary["num_steps"] and 0 < pipe["stage_busy_fraction"] < 1
    steps = runs[0].steps
    ends = steps["start_time_s"] + steps["duration_s"]
    assert (np.diff(ends) >= 0).all()  # outputs are processed in step order


@pytest.mark.parametrize("opts", [{}, {"async_scheduling": True}])
def test_pd_pools_with_stages(opts: dict) -> None:
    """P/D with pipeline stages in both pools (and a CPU tier on the prefill pool): every request
    finishes with its output tokens, twice the same; each pool says how busy its stages were; a
    pull moves each GPU's share, half the blocks' bytes at two stages."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = _req400_rows(80)
    base = {"model": "llama-3-70b", "tensor_parallel_size": 2, "max_num_seqs": 32} | opts
    spec = DisaggregationSpec(1, 1, prefill_options=(("kv_offloading_size", 4.0),))
    runs = [replay(trace, EngineConfig.from_flat(base | {"pipeline_parallel_size": 2}), disaggregation=spec)
            for _ in range(2)]
    for res in runs:
        res.summary["wall_time_s"] = 0.0
    assert json.dumps(runs[0].summary, sort_keys=True, default=str) == json.dumps(runs[1].summary, sort_keys=True,
                                                                                  default=str)
    req = runs[0].requests
    assert (req["status"] == "finished").all()
    assert (req["output_tokens"].to_numpy() == trace.output_tokens).all()
    pools = runs[0].summary["disaggregation"]
    for name in ("prefill", "decode"):
        stages = pools[name]["pipeline"]
        assert stages["pipeline_parallel_size"] == 2 and 0 < stages["stage_busy_fraction"] < 1
        assert pools[name]["config"]["pipeline_parallel_size"] == 2
    assert "kv_offloading" in pools["prefill"]
    one = replay(trace, EngineConfig.from_flat(base), disaggregation=spec).summary["disaggregation"]
    assert pools["kv_transfer"]["pulled_bytes"] * 2 == one["kv_transfer"]["pulled_bytes"]


def test_one_request_gains_nothing_from_stages() -> None:
    """A request alone crosses every stage for each token: its inter-token latency under two
    stages of TP 2 is TP 2's (its step, split over the stages) plus the link between them."""
    from dataclasses import replace

    trace = _req400_rows(1)
    trace = replace(trace, output_tokens=np.array([100]))
    base = {"model": "llama-3-70b", "tensor_parallel_size": 2, "num_gpu_blocks": 4000}
    one = replay(trace, EngineConfig.from_flat(base)).requests["mean_itl_s"].iloc[0]
    two = replay(trace, EngineConfig.from_flat(base | {"pipeline_parallel_size": 2})).requests["mean_itl_s"].iloc[0]
    assert 1.0 < two / one < 1.05


def test_cli(tmp_path) -> None:
    """`simkv replay -pp` writes the stages into its config; `simkv capacity -pp` prints each
    stage's layers; speculative decoding without async scheduling is refused with a clear message."""
    from tests.cli_runs import cli_fails, cli_ok

    trace = tmp_path / "t.parquet"
    from simkv.traces.schema import write_trace

    write_trace(_req400_rows(40), trace)
    out = tmp_path / "run"
    cli_ok(["replay", str(trace), "--model", "llama-3-70b", "-tp", "2", "-pp", "2", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["pipeline_parallel_size"] == 2 and summary["num_finished"] == 40
    text = cli_ok(["capacity", "--model", "llama-3-70b", "-tp", "2", "-pp", "3"])
    assert "27, 27, 26 (0)" in text
    layouts = json.loads(cli_ok(["capacity", "--model", "llama-3-70b", "--layouts", "4", "--json"]))["layouts"]
    assert {"1 x TP 2 x PP 2", "1 x TP 1 x PP 4", "2 x TP 1 x PP 2"} <= {row["layout"] for row in layouts}
    assert "not modelled with speculative decoding" in cli_fails(
        ["replay", str(trace), "-pp", "2", "--speculative-method", "eagle", "--num-speculative-tokens", "2",
         "--out", str(tmp_path / "x")])


def test_links_between_nodes() -> None:
    """Nodes of gpus_per_node GPUs: a stage boundary between nodes, and a TP group larger than a
    node, go over the network (inter_node_gbs); within a node over the GPU's interconnect."""
    hw = EngineConfig.from_flat({"model": "llama-3.1-405b", "tensor_parallel_size": 4, "pipeline_parallel_size": 4,
                                 "gpu": "H100-SXM"}).hardware
    assert [hw.stage_link_gbs(k) for k in range(3)] == [450, 50.0, 450]  # (stages 0-1 on node 0, 2-3 on node 1)
    assert hw.link_gbs(8) == 450 and hw.link_gbs(16) == 50.0
    set_link = EngineConfig.from_flat({"model": "llama-3.1-405b", "tensor_parallel_size": 4,
                                       "pipeline_parallel_size": 4, "pipeline_link_gbs": 25.0}).hardware
    assert [set_link.stage_link_gbs(k) for k in range(3)] == [25.0] * 3
    from simkv.backends.factory import make_roofline

    def comm(**opts) -> float:
        return make_roofline(EngineConfig.from_flat({"model": "llama-3.1-405b"} | opts)).comm_per_token

    # TP 16 over two nodes all-reduces at 50 GB/s, nine times slower than NVLink's 450
    assert comm(tensor_parallel_size=16) == pytest.approx(9 * comm(tensor_parallel_size=16, gpus_per_node=16))
    with pytest.raises(ConfigError, match="inter_node_gbs must be > 0"):
        EngineConfig.from_flat({"inter_node_gbs": 0.0})
