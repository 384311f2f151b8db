"""`simkv goodput TRACE --goodput ttft:MS ...`: the highest request rate one engine sustains
within latency SLOs, and the replicas a target rate needs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from simkv.backends.factory import COST_MODELS
from simkv.calibration.cli_support import CostModelChoice
from simkv.cli.disagg_options import (check_pools, disaggregation_options, encode_options, read_disaggregation,
                                       read_encode)
from simkv.cli.help_sections import SectionedCommand
from simkv.cli.replay_cmd import (DEFAULT_TRACE, engine_options, flat_options, fleet_options, pool_class_replicas,
                                  read_autoscale,
                                  read_fleet, read_inputs)
from simkv.config import ConfigError


def _setup(record: dict) -> str:
    encode = record.get("encode_pool")
    front = (f" Encoder disaggregation: {encode['encode_replicas']} encode instance(s) in front, embedding store "
             f"{encode['ec_store_gbs']:g} GB/s." if encode else "")
    pd = record.get("disaggregation")
    if pd:
        return (f" P/D disaggregation: {pd['prefill_replicas']} prefill + {pd['decode_replicas']} decode replicas, "
                f"KV link {pd['kv_link_gbps']:g} GB/s." + front)
    fleet = record.get("fleet") or {}
    scaling = fleet.get("autoscale")
    if scaling:
        from simkv.replay.autoscale import aims

        return (f" An autoscaled fleet of {scaling['min_replicas']}-{scaling['max_replicas']} replicas "
                f"({aims(scaling)}, cold start {scaling['cold_start_s']:g} s) behind "
                f"a {fleet['router']} router." + front)
    if fleet.get("num_replicas", 1) > 1:
        return f" {fleet['num_replicas']} replicas behind a {fleet['router']} router." + front
    return front


PROBE_HEADER = "met | attainment | goodput req/s | TTFT p99 s | TPOT p99 ms | preemptions | peak running | waiting held by |"
PROBE_RULE = "---|---:|---:|---:|---:|---:|---:|---|"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def probe_cells(p: dict) -> str:
    """A search probe's cells under PROBE_HEADER."""
    by_class = p.get("attainment_by_class")
    classes = (" (" + ", ".join(f"{name} {100 * a:.1f}" for name, a in by_class.items()) + ")") if by_class else ""
    return (f"{'yes' if p['met'] else 'no'} | {100 * p['slo_attainment']:.1f} %{classes} | "
            f"{p['request_goodput_req_s']:.3f} | "
            f"{_num(p['ttft_p99_s'], '.3f')} | {_num(p['tpot_p99_s'] and p['tpot_p99_s'] * 1e3, '.1f')} | "
            f"{p['num_preemptions']} | {p['peak_running']} | {p.get('waiting_held_by') or '-'} |")


def to_markdown(record: dict) -> str:
    from simkv.replay.goodput import describe_slo, describe_target

    slo = describe_slo(record["slo_ms"])
    lines = [f"# simkv goodput: {record['trace']}", "",
             f"SLOs: {slo}; target: {describe_target(record['slo_ms'], record['target_attainment'])}. "
             f"The trace's own rate: {record['trace_rate_req_s']:.3f} req/s; cost model: {record['cost_model']}."
             + _setup(record), "",
             "| probe | rate req/s | x trace | " + PROBE_HEADER, "|---:|---:|---:|" + PROBE_RULE]
    for i, p in enumerate(record["probes"], 1):
        lines.append(f"| {i} | {p['rate_req_s']:.3f} | {p['factor']:.4g} | " + probe_cells(p))
    lines.append("")
    lo, hi = record["bracket_factors"]
    base = record["trace_rate_req_s"]
    if record["status"] == "found":
        lines.append(f"**Highest rate meeting the target: {record['max_rate_req_s']:.3f} req/s** "
                     f"({lo:.4g} x the trace's rate; {hi * base:.3f} req/s missed it).")
    elif record["status"] == "unbounded":
        lines.append(f"The target was met at every probed rate up to {lo * base:.3f} req/s ({lo:g} x the trace's): "
                     "the trace has too few requests to load the engine past its SLOs; use a longer trace.")
    elif record.get("reason"):
        lines.append(f"No rate can meet the target: {record['reason']}.")
    else:
        lines.append(f"The target was missed even at {hi * base:.4g} req/s (1/{1 / hi:g} of the trace's rate): "
                     "the SLOs cannot be met on this engine for this request mix, whatever the load.")
    if record.get("session_paced"):
        lines.append("Sessions are paced (the trace's session_id): each rate is the trace's schedule scaled, think "
                     "times included, and a turn waits for its previous reply, so requests arrive more slowly than "
                     "the rate says when replies take longer; the goodput column is what the engine served.")
    if record.get("cost"):
        from simkv.studies.serving_cost import describe

        lines.append(f"Cost: {describe(record['cost'])}.")
    if record.get("target_rate_req_s") and record.get("replicas"):
        lines.append(f"For {record['target_rate_req_s']:g} req/s: {record['replicas']} replicas of this engine "
                     "if requests were spread evenly over them.")
    check = record.get("fleet_check")
    if check:
        lines += ["", f"Fleets replayed at {check['target_rate_req_s']:g} req/s behind a {check['router']} router:", "",
                  "| replicas | attainment | met | TTFT p99 s | TPOT p99 ms | preemptions | peak running (per replica) |",
                  "|---:|---:|---|---:|---:|---:|---:|"]
        for p in check["probes"]:
            lines.append(f"| {p['replicas']} | {100 * p['slo_attainment']:.1f} % | {'yes' if p['met'] else 'no'} | "
                         f"{_num(p['ttft_p99_s'], '.3f')} | {_num(p['tpot_p99_s'] and p['tpot_p99_s'] * 1e3, '.1f')} | "
                         f"{p['num_preemptions']} | {p['peak_running']} |")
        lines.append("")
        lines.append(f"**{check['replicas']} replicas meet the target at {check['target_rate_req_s']:g} req/s"
                     + (f"; {check['replicas'] - 1} did not.**" if any(p["replicas"] == check["replicas"] - 1
                                                                       for p in check["probes"]) else ".**")
                     if check["replicas"] else
                     f"**No fleet of up to {check['max_replicas_tried']} replicas met the target at "
                     f"{check['target_rate_req_s']:g} req/s.**")
    return "\n".join(lines) + "\n"


def clients_markdown(record: dict) -> str:
    """goodput.md of a closed-loop search (--clients)."""
    from simkv.replay.goodput import describe_slo, describe_target

    slo = describe_slo(record["slo_ms"])
    k = record.get("conversations_per_client", 1)
    conversations = "one conversation" if k == 1 else f"{k:,} conversations"
    per = (f"{conversations} in progress each (the trace's sessions, paced on their replies: vLLM's multi-turn "
           "benchmark's clients)" if record.get("session_paced") else "one request in flight each")
    lines = [f"# simkv goodput, closed loop: {record['trace']}", "",
             f"SLOs: {slo}; target: {describe_target(record['slo_ms'], record['target_attainment'])}. Clients "
             f"keep {per}, no sooner than the trace's times; cost model: {record['cost_model']}." + _setup(record), "",
             "| probe | clients | req/s sent | " + PROBE_HEADER, "|---:|---:|---:|" + PROBE_RULE]
    for i, p in enumerate(record["probes"], 1):
        lines.append(f"| {i} | {p['clients']:,} | {p['rate_req_s']:.3f} | " + probe_cells(p))
    lines.append("")
    lo, hi = record["bracket_clients"]
    if record["status"] == "found":
        at = next(p for p in record["probes"] if p["clients"] == lo)
        lines.append(f"**Most clients meeting the target: {lo:,}** ({hi:,} missed it), sending "
                     f"{at['rate_req_s']:.3f} req/s.")
    elif record["status"] == "unbounded":
        unit = ("request" if not record.get("session_paced") else "conversation" if k == 1
                else f"{k:,} conversations")
        lines.append(f"The target was met with {lo:,} clients, one per {unit} of the trace: more change nothing; "
                     "use a longer trace to load the engine past its SLOs.")
    elif record.get("reason"):
        lines.append(f"No number of clients can meet the target: {record['reason']}.")
    else:
        lines.append("The target was missed even with one client: the SLOs cannot be met on this engine for this "
                     "request mix, whatever the load.")
    return "\n".join(lines) + "\n"


def grid_markdown(record: dict) -> str:
    from simkv.replay.goodput import describe_slo, describe_target
    from simkv.studies.serving_cost import gpus_text

    keys = list(record["grid"])
    # the block size the engine ran with, where some combination's is not the one it asked for
    grown = any(c.get("engine_block_size", c.get("asked_block_size")) != c.get("asked_block_size")
                for c in record["cells"])
    head_keys = keys + (["engine block size"] if grown else [])
    priced = "gpu_prices_usd_per_hour" in record
    over = (f"the layouts of {record['num_gpus']} GPUs" if "num_gpus" in record else "a grid")
    lines = [f"# simkv goodput over {over}: {record['trace']}", "",
             f"SLOs: {describe_slo(record['slo_ms'])}; target: "
             f"{describe_target(record['slo_ms'], record['target_attainment'])}; cost model: {record['cost_model']}. Per combination, the highest rate that met the target "
             f"(to {100 * record['tolerance']:g} %)"
             + (f"; independent engines behind a {record['router']} router" if "num_gpus" in record else "") + ".", "",
             "| " + " | ".join(head_keys) + " | max rate req/s | attainment there | TTFT p99 s | TPOT p99 ms | waiting held by | probes |"
             + (" replicas |" if record.get("target_rate_req_s") else "")
             + (" GPUs | USD/h | USD per 1M output tokens |" if priced else ""),
             "|" + "---|" * len(head_keys) + "---:|---:|---:|---:|---|---:|" + ("---:|" if record.get("target_rate_req_s") else "")
             + ("---:|---:|---:|" if priced else "")]
    for c in record["cells"]:
        head = " | ".join([str(c["swept"][k]) for k in keys] + ([str(c.get("engine_block_size", ""))] if grown else []))
        if c["status"] == "failed":
            lines.append(f"| {head} | failed: {c['error'][:80]} | | | | | |" + (" |" if record.get("target_rate_req_s") else ""))
            continue
        p = c.get("at_max") or {}
        rate = "none" if c["max_rate_req_s"] is None else f"{c['max_rate_req_s']:.3f}" + (" (or more)" if c["status"] == "unbounded" else "")
        row = (f"| {head} | {rate} | {100 * p['slo_attainment']:.1f} % | {p['ttft_p99_s']:.3f} | {1e3 * (p['tpot_p99_s'] or 0):.1f} "
               f"| {p.get('waiting_held_by') or '-'} | {c['num_probes']} |" if p
               else f"| {head} | {rate} | - | - | - | - | {c['num_probes']} |")
        if record.get("target_rate_req_s"):
            row += f" {c.get('replicas') or '-'} |"
        if priced:
            cost = c.get("cost")
            row += (f" {gpus_text(cost)} | {cost['usd_per_hour']:,.2f} | "
                    + (f"{cost['usd_per_1m_output_tokens']:,.3f} |" if cost["usd_per_1m_output_tokens"] is not None
                       else "- |") if cost else " - | - | - |")
        lines.append(row)
    lines.append("")
    if record["best_index"] is not None:
        best = record["cells"][record["best_index"]]
        lines.append("**Best: " + ", ".join(f"{k}={best['swept'][k]}" for k in keys)
                     + f"** ({best['max_rate_req_s']:.3f} req/s).")
        if record.get("best_vllm_serve"):
            serve = record["best_vllm_serve"]
            lines += ["", "Served by vLLM as" + (f" ({', '.join(serve['not_vllm_flags'])}: simkv's, not vLLM flags)"
                                                 if serve["not_vllm_flags"] else "") + ":", "",
                      f"    {serve['command']}", ""]
    else:
        lines.append("No combination met the target at any probed rate.")
    if priced:
        if record.get("cheapest_index") is not None:
            cheap = record["cells"][record["cheapest_index"]]
            lines.append("**Cheapest per output token: " + ", ".join(f"{k}={cheap['swept'][k]}" for k in keys)
                         + f"** (${cheap['cost']['usd_per_1m_output_tokens']:,.3f} per 1M output tokens at "
                           f"{cheap['max_rate_req_s']:.3f} req/s on {gpus_text(cheap['cost'])}).")
        if record.get("unpriced_gpus"):
            lines.append(f"No --gpu-price for {', '.join(record['unpriced_gpus'])}: those rows are not costed.")
    return "\n".join(lines) + "\n"


@click.command("goodput", cls=SectionedCommand)
@click.argument("trace", required=False, default=DEFAULT_TRACE)
@click.option("--goodput", "goodput", multiple=True, required=True, metavar="[CLASS:]KEY:MS",
              help="Latency SLO (vLLM's --goodput): ttft, tpot or e2el and a limit in ms; repeat for each. CLASS:KEY:MS "
                   "holds one request class (the trace's request_class) to its own limit.")
@click.option("--attainment", type=float, default=0.99, show_default=True,
              help="Share of the trace's requests that must meet every SLO (with SLOs per class: of each class's).")
@click.option("--tolerance", type=float, default=0.02, show_default=True,
              help="Stop when the highest rate that met the target and the lowest that missed it are this close (relative).")
@click.option("--target-rate", type=float, default=None, help="Also say how many replicas this rate (req/s) needs.")
@click.option("--pd-splits", type=int, default=None, metavar="N",
              help="Compare every way to run N engines: all colocated (behind --router) and each split into P "
                   "prefill + N-P decode replicas (with the P/D options below); the highest rate of each.")
@click.option("--layouts", "layouts", type=int, default=None, metavar="N",
              help="Compare every way to lay the model out over N GPUs (as `simkv capacity --layouts`: TP engines as "
                   "replicas behind --router, least_outstanding unless given; pipelines; for a mixture of experts "
                   "data-parallel ranks, which alone take --enable-dbo; for latent attention PCP copies); the "
                   "highest rate of each.")
@click.option("--grid", "grids", multiple=True, metavar="KEY=V1,V2,...",
              help="Search every combination of these engine options (as `simkv sweep --grid`) and name the one "
                   "that sustains the highest rate; repeatable.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Local processes for --grid searches.")
@click.option("--vllm-bench", "vllm_bench", default=None, metavar="COMMAND|@FILE",
              help="Instead of TRACE: the traffic of a `vllm bench serve` command (its dataset and schedule, "
                   "scaled by the search; its --max-concurrency and --goodput) (docs/vllm_serve.md).")
@click.option("--vllm-multi-turn", "vllm_multi_turn", default=None, metavar="COMMAND|@FILE",
              help="Instead of TRACE: the conversations of a command of vLLM's multi-turn benchmark "
                   "(benchmark_serving_multi_turn.py --input-file GEN.json ...); searches its --num-clients "
                   "(implies --clients).")
@click.option("--clients", "closed_loop", is_flag=True,
              help="Search the most clients of a closed loop instead of the highest rate: each client keeps one "
                   "request in flight (--client-max-concurrency) and, on a trace of paced sessions, one "
                   "conversation in progress (--client-max-active-sessions; vLLM's multi-turn benchmark).")
@click.option("--config", "config_file", default=None, help="YAML or JSON file of engine options.")
@click.option("--cost-model", default="roofline", show_default=True, type=CostModelChoice(COST_MODELS),
              help="A cost model name, or a calib.json fitted by `simkv calibrate`.")
@click.option("--step-base-s", type=float, default=0.015, show_default=True, help="linear cost model")
@click.option("--step-per-token-s", type=float, default=2e-5, show_default=True, help="linear cost model")
@engine_options
@fleet_options
@disaggregation_options
@encode_options
@click.option("--gpu-price", "gpu_prices", multiple=True, metavar="GPU=USD",
              help="A GPU-hour's price (yours: cloud, reserved or amortised), e.g. H100-SXM=2.49; repeat per GPU. "
                   "The result then says what the setup costs an hour, per 1,000 requests and per 1M output tokens "
                   "at its highest rate within the SLOs (and, over a --grid, which combination is cheapest).")
@click.option("--out", "out_dir", default=None, help="Also write goodput.json and goodput.md into this folder.")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def goodput_cmd(trace: str, goodput: tuple[str, ...], attainment: float, tolerance: float, target_rate: float | None,
                pd_splits: int | None, layouts: int | None,
                grids: tuple[str, ...], workers: int, vllm_bench: str | None, vllm_multi_turn: str | None,
                closed_loop: bool,
                config_file: str | None, cost_model: str,
                step_base_s: float,
                step_per_token_s: float, gpu_prices: tuple[str, ...], out_dir: str | None, quiet: bool, replicas: int,
                router: str, router_options: tuple[str, ...], class_replicas: tuple[str, ...],
                replica_sets: tuple[str, ...], **flags) -> None:
    """Replay TRACE at scaled arrival rates to find the highest request rate at which the engine
    (or --replicas of it behind --router) still meets the --goodput SLOs for --attainment of the
    requests. With --target-rate: the replicas that rate needs, checked by replaying the trace at
    that rate on fleets of them. With --clients: the most clients of a closed loop instead."""
    from simkv.studies.goodput_search import check_replicas, replicas_for, search_max_rate

    if (vllm_bench or vllm_multi_turn) and trace != DEFAULT_TRACE:
        raise click.UsageError("give TRACE or --vllm-bench / --vllm-multi-turn (whose traffic is the trace), not both")
    if vllm_bench and vllm_multi_turn:
        raise click.UsageError("give --vllm-bench or --vllm-multi-turn, not both")
    if vllm_multi_turn:
        closed_loop = True
    if closed_loop and (grids or target_rate is not None or pd_splits is not None or gpu_prices
                        or flags.get("encode_replicas") is not None):
        raise click.UsageError("--clients searches one setup's clients: drop --grid/--target-rate/--pd-splits/"
                               "--gpu-price/--encode-replicas")
    if class_replicas and (layouts is not None or pd_splits is not None or grids or target_rate is not None
                           or closed_loop):
        raise click.UsageError("--class-replicas goes with one fleet's or one pair of P/D pools' search: drop "
                               "--layouts/--pd-splits/--grid/--target-rate/--clients")
    if replica_sets and (layouts is not None or pd_splits is not None or closed_loop):
        raise click.UsageError("--replica-set searches one fleet of mixed engines: drop --layouts/--pd-splits/--clients")
    if target_rate is not None and not target_rate > 0:
        raise click.UsageError(f"--target-rate must be > 0 req/s, got {target_rate}")
    prices = _prices(gpu_prices)
    autoscale = read_autoscale(flags, config_file)
    if autoscale is not None and (layouts is not None or pd_splits is not None or grids or target_rate is not None
                                  or closed_loop):
        raise click.UsageError("--autoscale searches one scaling fleet's highest rate: drop --layouts/--pd-splits/"
                               "--grid/--target-rate/--clients")
    cost_options = {"step_base_s": step_base_s, "step_per_token_s": step_per_token_s}
    encode = read_encode(flags, config_file)
    if encode is not None and (grids or target_rate is not None or prices or pd_splits is not None):
        raise click.UsageError("--encode-replicas searches one setup: drop --grid/--target-rate/--gpu-price/--pd-splits")
    if layouts is not None:
        if closed_loop or pd_splits is not None or grids or target_rate is not None or vllm_bench or vllm_multi_turn:
            raise click.UsageError("--layouts compares the layouts of N GPUs on TRACE: drop --clients/--pd-splits/"
                                   "--grid/--target-rate/--vllm-bench/--vllm-multi-turn")
        _search_layouts(trace, layouts, goodput, attainment, tolerance, config_file, cost_model, cost_options,
                        workers, prices, out_dir, quiet, replicas, router, router_options, flags)
        return
    if pd_splits is not None:
        if prices:
            raise click.UsageError("--gpu-price goes with one search or a --grid, not --pd-splits (every split "
                                   "runs the same GPUs)")
        _search_splits(trace, pd_splits, goodput, attainment, tolerance, config_file, cost_model, cost_options,
                       out_dir, quiet, replicas, router, router_options, grids, target_rate, flags)
        return
    disaggregation = read_disaggregation(flags, config_file, router_options)
    _refuse_pools_scaling(disaggregation)
    if disaggregation is not None:
        if replicas is not None or router is not None or grids or target_rate is not None:
            raise click.UsageError("P/D disaggregation (--prefill-replicas/--decode-replicas) searches one setup: "
                                   "drop --replicas/--router/--grid/--target-rate")
        router_options = ()
        disaggregation = pool_class_replicas(disaggregation, class_replicas, config_file)
    router_flag = router
    if replica_sets and (disaggregation is not None or grids or target_rate is not None):
        raise click.UsageError("--replica-set searches one fleet of mixed engines: drop --grid/--target-rate and "
                               "the P/D pools")
    if autoscale is not None and disaggregation is not None:
        raise click.UsageError("--autoscale scales a fleet of replicas, not P/D pools")
    fleet = read_fleet(replicas, router, router_options, config_file, class_replicas, pools=disaggregation is not None,
                       replica_sets=replica_sets, autoscale=autoscale)
    replicas, router = fleet.num_replicas, fleet.policy
    slo, config, data = read_inputs(trace, flags | {"router": router_flag}, config_file, goodput, _first_cell(grids),
                                    vllm_bench=vllm_bench, vllm_multi_turn=vllm_multi_turn)
    if vllm_bench or vllm_multi_turn:
        trace = data.source  # (goodput.md's title)
    if config.hardware.data_parallel_size > 1 and (replicas > 1 or target_rate is not None):
        raise click.UsageError("a data-parallel engine (--data-parallel-size) is searched alone: fleets of them "
                               "are not modelled; drop --replicas/--target-rate")
    if disaggregation is not None:
        check_pools(disaggregation, config)
    if grids:
        record = _grid_search(trace, grids, flat_options(flags, config_file), slo, attainment, tolerance, cost_model,
                              cost_options, workers, target_rate, quiet, fleet)
        if prices:
            _grid_costs(record, prices, float(data.output_tokens.mean()))
        _write(record, grid_markdown(record), out_dir, quiet)
        return
    gpus = None
    if prices:
        from simkv.studies.serving_cost import PriceError, SetupGPUs

        try:
            gpus = SetupGPUs.of(config, fleet, disaggregation)
        except (PriceError, ConfigError) as exc:
            raise click.UsageError(str(exc)) from None
        missing = gpus.unpriced(prices)
        if missing:
            raise click.UsageError(f"--gpu-price: no price for {', '.join(missing)}, "
                                   f"{'a GPU' if gpus.mixed else 'the GPU'} this search runs")

    def show(p) -> None:
        if not quiet:
            who = f"{p.clients:6,d} clients" if p.clients is not None else f"{p.rate_req_s:10.3f} req/s"
            click.echo(f"  {who}: {100 * p.slo_attainment:5.1f} % met the SLOs "
                       f"({'meets' if p.met else 'misses'} the target)", err=True)

    if closed_loop:
        from simkv.studies.goodput_search import search_max_clients

        try:
            record = search_max_clients(data, config, slo, target=attainment, tolerance=tolerance,
                                        cost_model=cost_model, cost_options=cost_options, on_probe=show, fleet=fleet,
                                        disaggregation=disaggregation)
        except (ConfigError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        record = {"trace": trace, "cost_model": cost_model, "config": config.to_dict(), "fleet": fleet.to_dict(),
                  **record}
        if data.session_id is not None and config.scheduler.session_pacing:
            record["session_paced"] = True
        if disaggregation is not None:
            record["disaggregation"] = disaggregation.to_dict()
        _write(record, clients_markdown(record), out_dir, quiet)
        return

    def show_fleet(n, p) -> None:
        if not quiet:
            click.echo(f"  {n:3d} replicas at {target_rate:g} req/s: {100 * p.slo_attainment:5.1f} % met the SLOs "
                       f"({'meets' if p.met else 'misses'} the target)", err=True)

    try:
        record = search_max_rate(data, config, slo, target=attainment, tolerance=tolerance, cost_model=cost_model,
                                 cost_options=cost_options, on_probe=show, fleet=fleet, disaggregation=disaggregation,
                                 encode=encode)
        record = {"trace": trace, "cost_model": cost_model, "config": config.to_dict(),
                  "fleet": fleet.to_dict(), **record}
        if data.session_id is not None and config.scheduler.session_pacing:
            record["session_paced"] = True
        if disaggregation is not None:
            record["disaggregation"] = disaggregation.to_dict()
        if encode is not None:
            record["encode_pool"] = encode.to_dict()
        if target_rate is not None:
            record["target_rate_req_s"] = target_rate
            if record["status"] == "found":
                record["replicas"] = replicas_for(target_rate, record["max_rate_req_s"] / replicas)
                record["fleet_check"] = check_replicas(
                    data, config, slo, target_rate, record["replicas"], target=attainment, router=router,
                    router_options=fleet.options, cost_model=cost_model,
                    cost_options=cost_options, on_probe=show_fleet)
            else:
                record["replicas"] = None
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if gpus is not None and fleet.autoscale is not None:  # (what the fleet paid for at its highest rate)
        from simkv.studies.serving_cost import paid_cost

        best = [p for p in record["probes"] if p["met"] and p["factor"] == record["bracket_factors"][0]]
        record["cost"] = (paid_cost(best[0]["gpu_hours_by_gpu"], best[0]["duration_s"], prices,
                                    record["max_rate_req_s"], float(data.output_tokens.mean())) if best else None)
    elif gpus is not None:
        from simkv.studies.serving_cost import serving_cost

        record["cost"] = serving_cost(gpus, prices, record["max_rate_req_s"], float(data.output_tokens.mean()))
    _write(record, to_markdown(record), out_dir, quiet)


def _prices(items: tuple[str, ...]) -> dict[str, float]:
    from simkv.studies.serving_cost import PriceError, parse_prices

    try:
        return parse_prices(items)
    except PriceError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpu-price") from None


def _grid_costs(record: dict, prices: dict[str, float], mean_output_tokens: float) -> None:
    """Each combination's cost at its highest rate, and the cheapest per output token."""
    from simkv.studies.serving_cost import serving_cost

    record["gpu_prices_usd_per_hour"] = prices
    priced = []
    for cell in record["cells"]:
        if cell["status"] == "failed" or "gpu" not in cell:
            continue
        cell["cost"] = serving_cost(_cell_gpus(cell), prices, cell["max_rate_req_s"], mean_output_tokens)
        if cell["cost"] and cell["cost"]["usd_per_1m_output_tokens"] is not None:
            priced.append(cell)
    record["unpriced_gpus"] = sorted({gpu for c in record["cells"] if "gpu" in c
                                      for gpu in _cell_gpus(c).unpriced(prices)})
    cheapest = min(priced, key=lambda c: (c["cost"]["usd_per_1m_output_tokens"], c["index"])) if priced else None
    record["cheapest_index"] = cheapest["index"] if cheapest else None


def _cell_gpus(cell: dict):
    from simkv.studies.serving_cost import SetupGPUs

    return SetupGPUs(cell["gpu"], cell["gpus"], tuple(tuple(kind) for kind in cell.get("gpu_kinds", ())))


def _search_layouts(trace, num_gpus, goodput, attainment, tolerance, config_file, cost_model, cost_options, workers,
                    prices, out_dir, quiet, replicas, router, router_options, flags) -> None:
    from simkv.config import HardwareConfig
    from simkv.replay.router import RouterError, RouterOptions
    from simkv.specs import get_model_spec
    from simkv.studies.goodput_search import search_layouts
    from simkv.studies.layouts import LAYOUT_KEYS, layouts_of

    if num_gpus < 1:
        raise click.UsageError(f"--layouts must be >= 1 GPUs, got {num_gpus}")
    if replicas is not None:
        raise click.UsageError("--layouts runs each layout's engines as its own replicas: drop --replicas")
    if flags.get("prefill_replicas") is not None or flags.get("decode_replicas") is not None \
            or flags.get("encode_replicas") is not None:
        raise click.UsageError("--layouts compares colocated engines: drop --prefill-replicas/--decode-replicas/"
                               "--encode-replicas")
    base = flat_options(flags, config_file)
    given = [key for key in LAYOUT_KEYS if key in base]
    if given:
        raise click.UsageError(f"--layouts tries every layout itself: drop {', '.join(given)} (a flag, --config or "
                               "--vllm-serve)")
    try:
        spec = get_model_spec(base.get("model", HardwareConfig().model))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    found = layouts_of(num_gpus, spec, base.get("decode_context_parallel_size", 1))
    # (the options are checked on a layout they apply to: dual batch overlap's on data-parallel ranks)
    ranks = [layout for layout in found if layout.data_parallel_size > 1]
    microbatched = base.get("enable_dbo") or (base.get("ubatch_size") or 0) > 1
    checked = ranks[0] if microbatched and ranks else found[0]
    slo, _, data = read_inputs(trace, flags, config_file, goodput, checked.options())
    try:
        options = RouterOptions.parse(list(router_options))
    except RouterError as exc:
        raise click.UsageError(str(exc)) from None
    router = router or "least_outstanding"
    record = search_layouts(trace, base, found, slo, target=attainment, tolerance=tolerance, cost_model=cost_model,
                            cost_options=cost_options, workers=workers, on_cell=_cell_echo(quiet), router=router,
                            router_options=options)
    record = {"trace": trace, "cost_model": cost_model, "base_options": base, "num_gpus": num_gpus,
              "router": router, **record}
    if record["best_index"] is not None:
        record["best_vllm_serve"] = _serve_line(base | found[record["best_index"]].options(), {})
    if prices:
        _grid_costs(record, prices, float(data.output_tokens.mean()))
    _write(record, grid_markdown(record), out_dir, quiet)


def _search_splits(trace, n, goodput, attainment, tolerance, config_file, cost_model, cost_options, out_dir, quiet,
                   replicas, router, router_options, grids, target_rate, flags) -> None:
    from dataclasses import replace

    from simkv.replay.disaggregated import DisaggregationSpec
    from simkv.replay.router import RouterError, RouterOptions
    from simkv.studies.goodput_search import search_splits

    if replicas is not None or grids or target_rate is not None:
        raise click.UsageError("--pd-splits compares setups of N engines: drop --replicas/--grid/--target-rate")
    if flags.get("prefill_replicas") is not None or flags.get("decode_replicas") is not None:
        raise click.UsageError("--pd-splits tries every split itself: drop --prefill-replicas/--decode-replicas")

    spec = read_disaggregation(flags, config_file, ()) or DisaggregationSpec()
    _refuse_pools_scaling(spec)
    router = router or "least_outstanding"
    if router_options and "prefix_aware" not in (router, spec.prefill_router, spec.decode_router):
        raise click.UsageError("--router-option sets prefix_aware's thresholds; no router here is prefix_aware")
    try:
        spec = replace(spec, router_options=RouterOptions.parse(list(router_options)))
    except RouterError as exc:
        raise click.BadParameter(str(exc), param_hint="--router-option") from None
    slo, config, data = read_inputs(trace, flags, config_file, goodput)
    check_pools(spec, config)

    def show(row) -> None:
        if not quiet:
            rate = f"{row['max_rate_req_s']:.3f} req/s" if row["max_rate_req_s"] is not None else row["status"]
            click.echo(f"  {row['setup']}: {rate}", err=True)

    try:
        record = search_splits(data, config, slo, n, spec=spec, router=router, router_options=spec.router_options,
                               target=attainment, tolerance=tolerance, cost_model=cost_model,
                               cost_options=cost_options, on_setup=show)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    record = {"trace": trace, "cost_model": cost_model, "config": config.to_dict(), **record}
    _write(record, splits_markdown(record), out_dir, quiet)


def splits_markdown(record: dict) -> str:
    from simkv.replay.goodput import describe_slo, describe_target

    pd = record["disaggregation"]
    lines = [f"# simkv goodput of {record['num_gpus']} engines, colocated or split: {record['trace']}", "",
             f"SLOs: {describe_slo(record['slo_ms'])}; target: "
             f"{describe_target(record['slo_ms'], record['target_attainment'])}; cost model: {record['cost_model']}. Colocated engines behind a "
             f"{record['colocated_router']} router; split ones with a {pd['prefill_router']} prefill router, a "
             f"{pd['decode_router']} decode router and a {pd['kv_link_gbps']:g} GB/s KV link. Per setup, the highest "
             f"rate that met the target (to {100 * record['tolerance']:g} %).", "",
             "| setup | max rate req/s | attainment there | TTFT p99 s | TPOT p99 ms | probes |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in record["setups"]:
        p = r["at_max"]
        rate = "none" if r["max_rate_req_s"] is None else f"{r['max_rate_req_s']:.3f}" + (
            " (or more)" if r["status"] == "unbounded" else "")
        name = f"**{r['setup']}**" if r["setup"] == record["best"] else r["setup"]
        lines.append(f"| {name} | {rate} | {100 * p['slo_attainment']:.1f} % | {p['ttft_p99_s']:.3f} | "
                     f"{1e3 * (p['tpot_p99_s'] or 0):.1f} | {r['num_probes']} |" if p else
                     f"| {name} | {rate} | - | - | - | {r['num_probes']} |")
    lines += ["", f"**Best: {record['best']}.**" if record["best"] else "**No setup met the target.**"]
    return "\n".join(lines) + "\n"


def _first_cell(grids: tuple[str, ...]) -> dict:
    """The grid's first combination (engine options only): the base options are checked with it,
    as they may need a grid key (e.g. num_speculative_tokens for --speculative-method)."""
    from simkv.sweep import SweepError, parse_grid
    from simkv.sweep.grid import ENGINE_KEYS

    if not grids:
        return {}
    try:
        grid = parse_grid(list(grids))
    except SweepError as exc:
        raise click.UsageError(str(exc)) from None
    return {key: values[0] for key, values in grid.items() if key in ENGINE_KEYS}


def _grid_search(trace: str, grids: tuple[str, ...], base: dict, slo: dict, attainment: float, tolerance: float,
                 cost_model: str, cost_options: dict, workers: int, target_rate: float | None, quiet: bool,
                 fleet) -> dict:
    from simkv.studies.goodput_search import replicas_for, search_grid
    from simkv.sweep import SweepError, parse_grid

    try:
        grid = parse_grid(list(grids))
    except SweepError as exc:
        raise click.UsageError(str(exc)) from None

    record = search_grid(trace, base, grid, slo, target=attainment, tolerance=tolerance, cost_model=cost_model,
                         cost_options=cost_options, workers=workers, on_cell=_cell_echo(quiet), fleet=fleet)
    n = fleet.num_replicas
    record = {"trace": trace, "cost_model": cost_model, "base_options": base,
              "fleet": fleet.to_dict(), **record}
    if record["best_index"] is not None:
        record["best_vllm_serve"] = _serve_line(base, record["cells"][record["best_index"]]["swept"])
    if target_rate is not None:
        record["target_rate_req_s"] = target_rate
        for cell in record["cells"]:
            per_replica = cell["max_rate_req_s"] / cell.get("num_replicas", n) if cell["status"] == "found" else None
            cell["replicas"] = replicas_for(target_rate, per_replica) if per_replica else None
    return record


def _cell_echo(quiet: bool):
    """What a grid or layout search prints as each combination ends (on stderr; nothing if quiet)."""
    def echo(cell: dict) -> None:
        if not quiet:
            what = cell.get("error") or (f"{cell['max_rate_req_s']:.3f} req/s" if cell["max_rate_req_s"] else cell["status"])
            click.echo("  " + ", ".join(f"{k}={v}" for k, v in cell["swept"].items()) + f": {what}", err=True)
    return echo


def _serve_line(base: dict, swept: dict) -> dict:
    """The `vllm serve` command of the base options with a combination's engine options, and
    the options it cannot say (simkv's own, such as the GPU)."""
    from simkv.cli.vllm_serve import serve_command
    from simkv.sweep.grid import ENGINE_KEYS

    command, left = serve_command(base | {k: v for k, v in swept.items() if k in ENGINE_KEYS})
    return {"command": command, "not_vllm_flags": left}


def _write(record: dict, text: str, out_dir: str | None, quiet: bool) -> None:
    if out_dir is not None:
        from simkv.atomic import atomic_write_text

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "goodput.json", json.dumps(record, indent=2) + "\n")
        atomic_write_text(out / "goodput.md", text)
    if not quiet:
        click.echo(text)
        if out_dir is not None:
            click.echo(f"wrote {out_dir}/goodput.json, goodput.md")


def _refuse_pools_scaling(spec) -> None:
    if spec is not None and (spec.prefill_autoscale is not None or spec.decode_autoscale is not None):
        raise click.UsageError("--prefill-autoscale / --decode-autoscale: P/D pools that scale are replayed by "
                               "`simkv replay` and `simkv sweep`; goodput searches fixed pools")
